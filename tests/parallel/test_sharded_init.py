"""Sharded initialisation: ``parallelize(constructor, ...)`` and ``jshard.jit(..., mesh=)`` create parameters
directly in their placements, each device drawing only its own blocks, with the values of the eager
single-device construction: the same random bits, and floats as the eager transform of them rounds them (XLA:CPU may
round a transcendental function an ulp apart for another block shape: ``assert_within_ulps``)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jshard
from conftest import make_mesh
from jshard import DArray, Replicate, Shard
from jshard.gpt import GPT, plan, summed_terms
from jshard.parallel import ColwiseParallel, FullyShard, RowwiseParallel, parallelize, placements_of
from jshard.validate.tolerance import assert_close, assert_within_ulps

R = Replicate()


def leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, DArray))


def plain(a):
    """A leaf as numpy (a typed key as its key data, a DArray as its global value)."""
    if isinstance(a, DArray):
        a = a.full()
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


@pytest.mark.parametrize("style,mesh_shape", [("fsdp", (2, 4)), ("tp", (2, 4)), ("sp", (8,))])
def test_constructor_gives_the_eager_values_in_the_plan_placements(style, mesh_shape):
    mesh = make_mesh(mesh_shape)
    names = mesh.axis_names
    styles, default = plan(style, dp=names[0], tp=names[-1])

    def build():
        return GPT(48, 16, 4, 2, 8, rngs=nnx.Rngs(3))

    model = parallelize(build, mesh, styles, default=default)
    built = parallelize(build(), mesh, styles, default=default)  # the small-model path: distributed from host
    assert placements_of(nnx.state(model)) == placements_of(nnx.state(built))
    ours, eager = leaves(nnx.state(model)), jax.tree.leaves(nnx.state(build()))
    assert len(ours) == len(eager) and all(isinstance(a, DArray) for a in ours)
    for a, b in zip(ours, eager):
        assert_within_ulps(plain(a), plain(b))  # keys and counts exactly
    ids = np.random.default_rng(0).integers(0, 48, (4, 8))
    assert_close(np.asarray(model(ids).full()), np.asarray(built(ids).full()), n=summed_terms(48, 16, 2, 8, 4))


def test_other_state_comes_as_eager_construction_leaves_it():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.norm = nnx.BatchNorm(32, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.down(self.drop(self.norm(self.up(x))))

    mesh = make_mesh((2, 4))
    model = parallelize(lambda: Net(nnx.Rngs(5)), mesh, {"up": ColwiseParallel("tp"), "down": RowwiseParallel("tp")},
                        default=FullyShard("dp"))
    eager = Net(nnx.Rngs(5))
    assert model.up.kernel.get_value().placements == (Shard(0), Shard(1))
    ours, theirs = nnx.state(model), nnx.state(eager)
    assert jax.tree.structure(ours, is_leaf=lambda a: isinstance(a, DArray)) == jax.tree.structure(theirs)
    for a, b in zip(leaves(ours), jax.tree.leaves(theirs)):
        assert_within_ulps(plain(a), plain(b))
    assert all(isinstance(a, DArray) for a in leaves(nnx.state(model, nnx.Param)))
    assert not isinstance(model.norm.mean.get_value(), DArray)  # batch statistics stay plain arrays, as eagerly
    x = np.random.default_rng(1).normal(size=(4, 16)).astype(np.float32)
    model.eval(), eager.eval()
    np.testing.assert_allclose(np.asarray(model(x).full()), np.asarray(eager(x)), rtol=1e-5, atol=1e-6)


def test_no_device_computes_a_sharded_parameter_whole():
    """The initialiser's plan: every parameter is produced where it is pinned (no move at the end), and no
    equation gives any device more than its share of the largest parameter."""
    mesh = make_mesh((2, 4))
    styles, default = plan("fsdp", dp="dp", tp="tp")

    def build():
        return GPT(64, 32, 4, 2, 8, rngs=nnx.Rngs(0))

    model = parallelize(build, mesh, styles, default=default)
    pins = [a.placements for a in leaves(nnx.state(model, nnx.Param))]
    init = jshard.jit(lambda: jax.tree.leaves(nnx.state(build(), nnx.Param)), out_placements=pins, mesh=mesh)
    traced = init.trace()
    for spec, pin in zip(traced.plan.out_specs, pins):
        if spec.rank >= 2:  # every matrix is made in place: nothing to slice afterwards (1-D zeros may be)
            assert spec.placements == pin, (spec, pin)

    def per_device(spec):
        return math.prod(spec.local_block_shape) * spec.dtype.itemsize

    share = max(per_device(s) for s in traced.plan.out_specs)
    biggest = max(per_device(s) for eq in traced.plan.equations for s in eq.choice.outs)
    assert biggest <= share, f"an equation holds {biggest} bytes per device, a parameter's share is {share}"



@pytest.mark.parametrize("style,mesh_shape", [("fsdp", (8,)), ("tp", (2, 4))])
def test_the_initialiser_holds_little_beyond_its_parameters(style, mesh_shape):
    """The initialiser's compiled program holds its outputs and at most a tenth more per device: each draw's
    hash fuses with its counters and its conversion to floats. (Binding JAX's threefry primitive, XLA:CPU ran
    every draw's loop first and held both counters of every parameter: 1.8x the parameters more.)"""
    mesh = make_mesh(mesh_shape)
    styles, default = plan(style, dp=mesh.axis_names[0], tp=mesh.axis_names[-1])

    def build():
        return GPT(512, 128, 4, 2, 64, rngs=nnx.Rngs(0))

    pins = [a.placements for a in leaves(nnx.state(parallelize(build, mesh, styles, default=default), nnx.Param))]
    init = jshard.jit(lambda: jax.tree.leaves(nnx.state(build(), nnx.Param)), out_placements=pins, mesh=mesh)
    memory = init.lower().compile().memory_analysis()
    assert memory.temp_size_in_bytes <= 0.1 * memory.output_size_in_bytes, (
        f"the initialiser holds {memory.temp_size_in_bytes} bytes of temporaries per device beside its "
        f"{memory.output_size_in_bytes} bytes of parameters")

def test_jit_with_a_mesh_runs_a_function_of_no_arrays():
    mesh = make_mesh((2, 4))
    def draw():
        k1, k2 = jax.random.split(jax.random.key(7))
        return jax.random.uniform(k1, (12, 8)) + jax.random.bernoulli(k2, 0.3, (12, 8))

    x = jshard.jit(draw, out_placements=(Shard(0), Shard(1)), mesh=mesh)()
    assert x.placements == (Shard(0), Shard(1))
    np.testing.assert_array_equal(np.asarray(x.full()), np.asarray(draw()))  # each device drew its own elements
    y = jshard.jit(lambda a: a.sum(0), mesh=mesh)(x)  # a mesh= that agrees with the arguments is fine
    np.testing.assert_allclose(np.asarray(y.full()), np.asarray(x.full()).sum(0), rtol=1e-5)


def test_mistakes_are_named():
    mesh = make_mesh((2, 4))
    with pytest.raises(ValueError, match="mesh=mesh"):
        jshard.jit(lambda: jnp.zeros(3))()
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        jshard.jit(lambda: jnp.zeros(3), mesh=(2, 4))
    other = make_mesh((8,))
    x = jshard.distribute(np.ones(8, np.float32), other, [Shard(0)])
    with pytest.raises(ValueError, match="different meshes.*mesh="):
        jshard.jit(lambda a: a + 1, mesh=mesh)(x)
    with pytest.raises(TypeError, match="needs some"):
        parallelize(GPT, mesh)

    def broken():
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str' (argument 2)")

    with pytest.raises(TypeError, match="unsupported operand") as raised:  # the constructor's own error, as it is
        parallelize(broken, mesh)
    assert "needs some" not in str(raised.value)
    with pytest.raises(TypeError, match="not a Flax nnx.Module"):
        parallelize(lambda: {"w": jnp.ones(3)}, mesh)
    with pytest.raises(TypeError, match="nnx.Module or a function"):
        parallelize(3, mesh)
    rngs = nnx.Rngs(0)  # made outside the constructor, which is traced: it cannot advance the count
    with pytest.raises(ValueError, match="state made outside it.*rngs=nnx.Rngs"):
        parallelize(lambda: nnx.Linear(4, 8, rngs=rngs), mesh)


# Identical modules share one compiled initialiser (jshard.parallel.initialise): the constructor is traced once,
# each parameter's slice is cut at its PRNG key, and parameters with equal slices and placements are made by one
# program called once per member. The values stay those of the one program that computed every parameter before.

def bits(a):
    return plain(a).tobytes()


def one_program(build, mesh, model):
    """The parameters as the whole constructor computes them in one program, pinned where ``model`` has them:
    how ``parallelize(build, ...)`` made them before its initialisers were shared."""
    pins = [a.placements for a in leaves(nnx.state(model, nnx.Param))]
    return jshard.jit(lambda: jax.tree.leaves(nnx.state(build(), nnx.Param)), out_placements=pins, mesh=mesh)()


def assert_as_before(build, mesh, model, styles=None, default=()):
    """``model`` (parallelized from ``build``) holds the bits the one program makes and the eager construction's
    values, in the placements a built module gets."""
    ours = leaves(nnx.state(model, nnx.Param))
    built = parallelize(build(), mesh, styles, default=default)
    assert [a.placements for a in ours] == [a.placements for a in leaves(nnx.state(built, nnx.Param))]
    before, eager = one_program(build, mesh, model), jax.tree.leaves(nnx.state(build(), nnx.Param))
    assert len(ours) == len(before) == len(eager)
    for a, b, c in zip(ours, before, eager):
        assert plain(a).dtype == plain(b).dtype and bits(a) == bits(b)
        assert_within_ulps(plain(a), plain(c))


@pytest.fixture
def compiled(monkeypatch):
    """The number of outputs of every jshard.jit program compiled meanwhile, in order (from no program: a model
    built by an earlier test would lend its initialisers)."""
    jshard.clear_caches()
    outputs, compile_program = [], jshard.api.compile_program

    def counting(*args, **kwargs):
        program = compile_program(*args, **kwargs)
        outputs.append(len(program.out_specs))
        return program

    monkeypatch.setattr(jshard.api, "compile_program", counting)
    return outputs


@pytest.mark.parametrize("style,mesh_shape", [("fsdp", (8,)), ("tp", (1, 8)),
                                              pytest.param("tp", (2, 4), marks=pytest.mark.slow),
                                              pytest.param("fsdp", (1, 8), marks=pytest.mark.slow),
                                              pytest.param("fsdp", (1,), marks=pytest.mark.slow)])
def test_shared_initialisers_give_the_bits_of_the_one_program(style, mesh_shape):
    mesh = make_mesh(mesh_shape)
    styles, default = plan(style, dp=mesh.axis_names[0], tp=mesh.axis_names[-1])

    def build():
        return GPT(48, 16, 4, 3, 8, rngs=nnx.Rngs(3))

    assert_as_before(build, mesh, parallelize(build, mesh, styles, default=default), styles, default)


@pytest.mark.parametrize("style,mesh_shape", [("fsdp", (8,)), ("tp", (2, 4))])
def test_identical_blocks_share_one_compiled_program(style, mesh_shape, compiled):
    """A deeper GPT compiles the same programs: one per kind of parameter (and placements), called once per
    block, and one for the parameters that occur once (embeddings, head)."""
    mesh = make_mesh(mesh_shape)
    styles, default = plan(style, dp=mesh.axis_names[0], tp=mesh.axis_names[-1])
    programs = {}
    for layers in (2, 4):
        compiled.clear()
        jshard.clear_caches()  # each depth compiles its own, to be compared
        model = parallelize(lambda: GPT(48, 16, 4, layers, 8, rngs=nnx.Rngs(0)), mesh, styles, default=default)
        programs[layers] = sorted(compiled)
    assert programs[2] == programs[4], programs
    assert sum(programs[4]) < len(leaves(nnx.state(model, nnx.Param))) / 4  # most parameters share a program


def test_layers_that_differ_get_their_own_values(compiled):
    """Slices that differ in a shape, an initialiser, a literal (a scale; -0.0 against 0.0) or the placements
    are never made by one program; equal ones are."""
    normal, constant = nnx.initializers.normal, nnx.initializers.constant

    class Mixed(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([
                nnx.Linear(16, 32, rngs=rngs),
                nnx.Linear(32, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs),  # equal: one program
                nnx.Linear(32, 32, kernel_init=normal(0.02), rngs=rngs),
                nnx.Linear(32, 32, kernel_init=normal(0.02), bias_init=constant(-0.0), rngs=rngs),
                nnx.Linear(32, 32, kernel_init=normal(0.03), rngs=rngs),
                nnx.Linear(32, 32, kernel_init=normal(0.03), bias_init=constant(-0.0), rngs=rngs),
                nnx.Linear(32, 32, rngs=rngs),  # as layers 1 and 2, but column parallel
                nnx.Linear(32, 48, rngs=rngs), nnx.Linear(48, 16, rngs=rngs)])
            self.ln = nnx.LayerNorm(16, rngs=rngs)

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return self.ln(x)

    mesh = make_mesh((2, 4))

    def build():
        return Mixed(nnx.Rngs(1))

    styles = {"layers/7": ColwiseParallel("tp")}
    model = parallelize(build, mesh, styles, default=FullyShard("dp"))
    # one program each for: the 32-wide zero biases, layer 1 and 2's kernels, the kernels drawn with scale 0.02,
    # those with 0.03, the -0.0 biases, the 16-wide zero biases (layer 9's and the norm's); one for the rest
    assert sorted(compiled) == [1] * 6 + [7], compiled
    assert_as_before(build, mesh, model, styles, FullyShard("dp"))
    assert np.signbit(plain(model.layers[4].bias.get_value())).all()
    assert not np.signbit(plain(model.layers[3].bias.get_value())).any()
    assert model.layers[7].kernel.get_value().placements != model.layers[1].kernel.get_value().placements
    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(model(x).full()), np.asarray(build()(x)), rtol=1e-5, atol=1e-5)


def test_parameters_whose_slices_cannot_be_shared(compiled):
    """A weight made from another one (their slices share a large value), one whose key is made from a large
    value, a constant, two parameters drawn from one key: each is computed as before, in one program for the
    rest, while the repeated modules beside them still share theirs."""

    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b, self.c = (nnx.Linear(64, 96, rngs=rngs) for _ in range(3))  # larger than SMALL
            self.tied = nnx.Param(self.a.kernel.get_value().T * 2)
            seed = jnp.ones((96, 96), jnp.int32).sum()
            self.seeded = nnx.Param(jax.random.normal(jax.random.key(seed), (16, 8)))
            self.fixed = nnx.Param(np.arange(16.0, dtype=np.float32))
            key = rngs.params()
            self.twice = nnx.Param(jax.random.normal(key, (8, 16)))
            self.again = nnx.Param(jax.random.uniform(key, (8, 16)))

    mesh = make_mesh((8,))

    def build():
        return Odd(nnx.Rngs(2))

    model = parallelize(build, mesh, default=FullyShard("x"))
    assert sorted(compiled) == [1, 1, 6], compiled  # a, b and c's biases; b and c's kernels; the rest
    assert_as_before(build, mesh, model, default=FullyShard("x"))


def test_tracing_a_constructor_never_walks_the_trace_for_an_error_message(monkeypatch):
    """Flax reads ``getattr(value, "sharding", None)`` on every random draw; before jax 0.12 the AttributeError's
    message walked every equation traced so far, making a deep model's constructor quadratic in its depth."""
    from jax.interpreters import partial_eval as pe

    from jshard.parallel.initialise import trace_constructor

    walks = []
    original = pe.DynamicJaxprTracer._origin_msg
    monkeypatch.setattr(pe.DynamicJaxprTracer, "_origin_msg", lambda self: walks.append(1) or original(self))
    trace_constructor(lambda: GPT(64, 16, 2, 4, 8, rngs=nnx.Rngs(0)))
    assert walks == []

    def f(x):  # the class is as JAX made it again: an error outside a constructor still names its origin
        getattr(x, "sharding", None)
        return x

    jax.make_jaxpr(f)(1.0)
    assert "sharding" not in vars(pe.DynamicJaxprTracer)


def test_a_second_parallelize_of_the_same_model_reuses_its_compiled_initialisers(monkeypatch):
    """The initialiser programs are keyed by what they compute (their jaxpr and constants, placements, mesh): the
    same constructor structure on the same mesh makes no new program, and the values are the same."""
    from jshard.parallel import initialise

    mesh = make_mesh((2, 4))
    styles, default = plan("fsdp+tp")
    make = lambda: GPT(vocab=64, dim=32, heads=4, layers=2, seq=16, rngs=nnx.Rngs(7))
    first = parallelize(make, mesh, styles, default=default)
    made = []
    monkeypatch.setattr(initialise, "jit", lambda *a, **k: made.append(1) or jshard.jit(*a, **k))
    again = parallelize(make, mesh, styles, default=default)
    assert made == []
    for a, b in zip(leaves(nnx.state(first, nnx.Param)), leaves(nnx.state(again, nnx.Param)), strict=True):
        assert a.spec == b.spec and np.array_equal(np.asarray(a.full()), np.asarray(b.full()))
    # another seed draws other values, through the same draw programs (the seed is their argument); another plan
    # makes programs of its own
    other = parallelize(lambda: GPT(vocab=64, dim=32, heads=4, layers=2, seq=16, rngs=nnx.Rngs(8)), mesh, styles,
                        default=default)
    assert len(made) <= 1 and not np.array_equal(np.asarray(other.head.kernel.get_value().full()),
                                                 np.asarray(first.head.kernel.get_value().full()))
    made.clear()
    parallelize(make, mesh, plan("tp")[0])
    assert made
