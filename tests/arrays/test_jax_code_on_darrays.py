"""A DArray is the jax.Array it stands for wherever JAX code meets it: a leaf of ``jax.tree`` utilities, and a value
that ``jnp`` functions, ``jax.jit``, ``jax.grad`` and ``jax.vmap`` take, computing on the global value without
gathering a layout that a ``NamedSharding`` expresses onto one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from conftest import make_mesh, mesh_params
from jshard import DArray, Partial, Replicate, Shard, StridedShard
from jshard.gpt import GPT, cross_entropy, plan
from jshard.parallel import TrainStep, parallelize
from oracle import assert_close

RNG = np.random.default_rng(0)
VALUE = RNG.normal(size=(8, 12)).astype(np.float32)


def _layouts(shape):
    """(placements, the layout plain JAX code sees them in) over the mesh's axes, a few of every kind."""
    n = len(shape)
    out = [((Replicate(),) * n, (Replicate(),) * n)]
    if n == 1:
        return out + [((Shard(0),), (Shard(0),)), ((Shard(1),), (Shard(1),) if 12 % shape[0] == 0 else (Replicate(),)),
                      ((Partial(),), (Replicate(),)), ((Partial("max"),), (Replicate(),))]
    if n == 2:
        return out + [((Shard(0), Shard(1)), (Shard(0), Shard(1) if 12 % shape[1] == 0 else Replicate())),
                      ((Shard(0), Partial()), (Shard(0), Replicate())),
                      ((StridedShard(0, shape[1]), Shard(0)), (StridedShard(0, shape[1]), Shard(0))),
                      ((Partial("avg"), Shard(0)), (Replicate(), Shard(0)))]
    return out + [((Shard(0), Shard(1), Partial()), (Shard(0), Shard(1), Replicate()))]


@pytest.mark.parametrize("shape", mesh_params())
def test_jnp_functions_take_darrays_and_keep_their_layout(shape):
    mesh = make_mesh(shape)
    for placements, seen in _layouts(shape):
        x = jshard.distribute(VALUE, mesh, placements)
        assert x.sharding.spec == x.spec.with_placements(seen).to_partition_spec(), placements
        total, rows, act = jnp.sum(x), jnp.mean(x, axis=1), jax.nn.relu(x)
        for got, want in ((total, VALUE.sum()), (rows, VALUE.mean(1)), (act, np.maximum(VALUE, 0)),
                          (jnp.tanh(x) + x, np.tanh(VALUE) + VALUE), (jnp.zeros_like(x), np.zeros_like(VALUE))):
            assert isinstance(got, jax.Array) and not isinstance(got, DArray)
            assert_close(np.asarray(got), want, n=96)
        # an elementwise function's result stays where the array was: never gathered onto one device
        assert act.sharding.is_equivalent_to(x.sharding, 2) and len(act.sharding.device_set) == mesh.size


def test_the_array_jax_sees_shares_the_blocks_where_jax_expresses_the_layout():
    mesh = make_mesh((2, 4))
    x = jshard.distribute(VALUE, mesh, [Shard(0), Shard(1)])
    seen = x.as_jax()
    assert seen.sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2  # JAX's ops plan it as GSPMD does
    pointers = {s.device: s.data.unsafe_buffer_pointer() for s in x.block.addressable_shards}
    assert all(pointers[s.device] == s.data.unsafe_buffer_pointer() for s in seen.addressable_shards)
    # a pending sum is reduced first (here a reduce over tp), once: the DArray itself is unchanged
    p = jshard.jit(lambda v: v, out_placements=(Shard(0), Partial()))(jshard.distribute(VALUE, mesh, [Shard(0),
                                                                                                      Replicate()]))
    assert p.placements == (Shard(0), Partial())
    assert_close(np.asarray(jnp.sum(p, axis=0)), VALUE.sum(0), n=8)
    assert p.as_jax() is p.as_jax() and p.placements == (Shard(0), Partial())


@pytest.mark.parametrize("shape", [(2, 4), (1,)], ids=["2x4", "1"])
def test_jax_jit_grad_and_vmap_of_darrays(shape):
    mesh = make_mesh(shape)
    x = jshard.distribute(VALUE, mesh, [Shard(0)] + [Replicate()] * (len(shape) - 1))
    w = jshard.distribute(VALUE.T[:, :5].copy(), mesh, [Replicate()] * len(shape))
    f = lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2)
    want = float(f(VALUE, VALUE.T[:, :5]))
    assert float(jax.jit(f)(x, w)) == pytest.approx(want, rel=1e-5)
    assert float(jax.jit(f)(x, w)) == pytest.approx(want, rel=1e-5)  # the second call, JAX's cache
    g = jax.grad(f, argnums=1)(x, w)
    assert isinstance(g, jax.Array)
    assert_close(np.asarray(g), np.asarray(jax.grad(f, argnums=1)(VALUE, VALUE.T[:, :5])), n=64)
    v = jax.vmap(lambda row: jnp.dot(row, row))(x)
    assert_close(np.asarray(v), (VALUE * VALUE).sum(1), n=12)
    out = jax.jit(lambda t: jax.tree.map(lambda a: a * 2, t))({"x": x, "w": [w]})
    assert set(out) == {"x", "w"} and isinstance(out["w"][0], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["x"]), VALUE * 2)
    assert out["x"].sharding.is_equivalent_to(x.sharding, 2)  # where the DArray was, not on one device


def test_jax_code_on_a_darray_that_holds_no_value_says_what_to_do():
    mesh = make_mesh((2, 4))
    spec = jshard.distribute(VALUE, mesh, [Shard(0), Replicate()]).spec
    with pytest.raises(ValueError, match="holds no value here.*jshard.jit"):
        jnp.sum(jshard.darray.abstract(spec))
    x = jshard.distribute(VALUE, mesh, [Shard(0), Replicate()])
    step = jshard.jit(lambda v: v + 1, donate_argnums=0)
    step(x)
    with pytest.raises(jshard.DeletedArrayError, match="donated"):
        jnp.sum(x)


def _gpt():
    return GPT(vocab=64, dim=32, heads=4, layers=2, seq=16, rngs=nnx.Rngs(0))


def test_jax_tree_over_a_trained_models_state_and_a_plain_jax_loop_over_it():
    mesh = make_mesh((2, 4))
    styles, default = plan("fsdp+tp")
    model = parallelize(_gpt, mesh, styles, default=default)
    step = TrainStep(model, optax.adamw(1e-2), lambda m, ids, labels: cross_entropy(m(ids), labels))
    ids = RNG.integers(0, 64, (4, 16)).astype(np.int32)
    batch = [jshard.distribute(a, mesh, [Shard(0), Replicate()]) for a in (ids, np.roll(ids, -1, 1))]
    for _ in range(2):
        step(*batch)
    trained = step.model
    state = nnx.state(trained, nnx.Param)
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(v, DArray) for v in leaves)
    reference = nnx.state(_gpt(), nnx.Param)
    assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, reference)  # global shapes, as for jax.Array
    assert jax.tree.structure(state) == jax.tree.structure(reference)
    # utilities written for plain JAX: a global norm, an EMA of the parameters, the optimizer state's leaves
    norm = float(optax.tree.norm(state))
    assert norm == pytest.approx(float(np.sqrt(sum(np.sum(np.asarray(v) ** 2) for v in leaves))), rel=1e-5)
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, reference, state)
    for e, r, p in zip(jax.tree.leaves(ema), jax.tree.leaves(reference), leaves, strict=True):
        assert_close(np.asarray(e), 0.9 * np.asarray(r) + 0.1 * np.asarray(p), n=2)
    assert all(isinstance(v, DArray) for v in jax.tree.leaves(step.opt_state) if not isinstance(v, (int, float)))

    # greedy decoding written for plain JAX, jitted over the model's state as Flax's Gemma Sampler does
    graphdef, params, rest = nnx.split(trained, nnx.Param, ...)

    @jax.jit
    def decode(params, rest, prompt):
        m = nnx.merge(graphdef, params, rest)

        def next_token(i, toks):
            logits = m(toks)
            return toks.at[:, i + 1].set(jnp.argmax(logits[:, i], axis=-1).astype(toks.dtype))

        return jax.lax.fori_loop(3, 15, next_token, prompt)

    prompt = jnp.zeros((2, 16), jnp.int32).at[:, :4].set(ids[:2, :4])
    got = decode(params, rest, prompt)
    # one device: the same loop on the parameters' values as host arrays
    want = decode(jax.tree.map(np.asarray, params), rest, prompt)
    assert isinstance(got, jax.Array) and got.sharding.device_set == set(mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
