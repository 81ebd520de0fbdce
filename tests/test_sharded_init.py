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
