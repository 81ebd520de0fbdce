"""Rules whose local computation communicates (``jshard.rules.function``), against numpy on one device.

The example is a column sum over a sharded dim finished by a ring of ``ppermute`` steps instead of an all-reduce:
the values must equal ``a.sum(0)``; the selection must weigh the ring's own collectives against moving the input
(a small input is gathered, a large one summed in a ring); ``explain`` must list and total the ring; on XLA:CPU
the program must count as communicating (its in-flight limit), so many calls queued at once finish; gradients
flow through the body, or through a backward pass that is a unit of its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh, mesh_params
from jshard import Replicate, Shard
from jshard.cost import Communication
from jshard.engine import communicates
from jshard.rules import function
from jshard.rules.registry import ShardPlaceholder

R = Replicate()
CALLS = []  # (in placements, out placements) of every local form built: what the engine chose


def _ring_axes(spec):
    axes = tuple(a for a, p in zip(spec.mesh.axis_names, spec.placements) if p.is_shard)
    return axes, int(np.prod([spec.mesh.shape[a] for a in axes]))


def ring_local(params, ins, outs):
    CALLS.append((ins[0].placements, outs[0].placements))
    axes, n = _ring_axes(ins[0])

    def run(block):
        total = part = block.sum(0)
        for _ in range(n - 1):
            part = jax.lax.ppermute(part, axes, [(i, (i + 1) % n) for i in range(n)])
            total = total + part
        return [total]

    return run


def ring_traffic(params, ins, outs):
    axes, n = _ring_axes(ins[0])
    nbytes = int(np.prod(outs[0].shape)) * outs[0].dtype.itemsize
    return [Communication("permute", axes, nbytes, count=n - 1)] if n > 1 else []


def column_strategies(ins, outs, params):
    return [(R, ShardPlaceholder(0, even=True))]


@function(column_strategies, local=ring_local, communicates=ring_traffic, name="tests.column_sums")
def column_sums(x):
    return x.sum(0)


def _data(rows=4096, cols=64, seed=0):
    return np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)


@pytest.mark.parametrize("shape", mesh_params(default=((8,), (2, 4), (1, 8), (1,))))
def test_ring_sum_equals_one_device(shape):
    mesh = make_mesh(shape)
    a = _data()
    for placements in ([Shard(0)] * len(shape), [Shard(0)] + [R] * (len(shape) - 1)):
        x = jshard.distribute(a, mesh, placements)
        out = jshard.jit(column_sums)(x)
        np.testing.assert_allclose(np.asarray(out.full()), a.sum(0), rtol=1e-4, atol=1e-3)
        assert out.placements == (R,) * len(shape)


def test_explain_lists_and_totals_the_ring():
    x = jshard.distribute(_data(), make_mesh((8,)), [Shard(0)])
    e = jshard.explain(column_sums, x)
    row = next(r for r in e.rows if r["primitive"] == "jshard.tests.column_sums")
    assert row["own"] == [("permute", ("x",), 64 * 4, 7)] and row["moves"] == []
    assert e.totals == {"permute": (7, 7 * 64 * 4)}
    assert "own: permute x7 over (x)" in str(e)
    model = jshard.cost.CostModel()
    assert jshard.jit(column_sums).trace(x).plan.cost == pytest.approx(7 * model.collective("permute", ("x",), 8, 256))
    # on 2 x 4 the model prefers gathering the 2 halves over dp (one hop) and a ring of 3 over tp to a ring of 7
    x = jshard.distribute(_data(), make_mesh((2, 4)), [Shard(0), Shard(0)])
    row = next(r for r in jshard.explain(column_sums, x).rows if r["primitive"] == "jshard.tests.column_sums")
    assert row["ins"][0].placements == (R, Shard(0)) and row["own"] == [("permute", ("tp",), 256, 3)]


def test_selection_weighs_the_ring_against_moving_the_input():
    mesh = make_mesh((8,))
    big = jshard.distribute(_data(4096), mesh, [Shard(0)])
    small = jshard.distribute(_data(64), mesh, [Shard(0)])
    CALLS.clear()
    np.testing.assert_allclose(np.asarray(jshard.jit(column_sums)(big).full()), _data(4096).sum(0), atol=1e-3)
    np.testing.assert_allclose(np.asarray(jshard.jit(column_sums)(small).full()), _data(64).sum(0), atol=1e-4)
    assert CALLS == [((Shard(0),), (R,)), ((R,), (R,))]  # the large one sums in a ring, the small one gathered
    assert jshard.explain(column_sums, small).totals == {"all_gather": (1, 8 * 64 * 4)}
    # pricing the ring higher makes the large input gather too
    costly = function(column_strategies, local=ring_local, name="tests.costly_column_sums",
                      communicates=lambda p, i, o: [c._replace(count=c.count * 1000) for c in ring_traffic(p, i, o)])(
        lambda x: x.sum(0))
    assert set(jshard.explain(costly, big).totals) == {"all_gather"}


def test_communicating_program_is_bounded_on_cpu_and_does_not_deadlock():
    mesh = make_mesh((8,))
    a = _data(1024)
    x = jshard.distribute(a, mesh, [Shard(0)])
    f = jshard.jit(lambda x: column_sums(x * 2.0) + 1.0)
    traced = f.trace(x)
    assert communicates(traced.plan, traced.pins)
    if jax.devices()[0].platform == "cpu":
        f(x)
        assert f._by_specs.get((x.spec,))._bounded
    outs = [f(x) for _ in range(32)]  # queued without waiting: the in-flight limit keeps XLA:CPU from deadlocking
    for o in outs:
        np.testing.assert_allclose(np.asarray(o.full()), (2 * a).sum(0) + 1, rtol=1e-4, atol=1e-3)


def test_gradient_through_the_body():
    mesh = make_mesh((2, 4))
    a, w = _data(512, 16), np.linspace(-1, 1, 16).astype(np.float32)
    x = jshard.distribute(a, mesh, [Shard(0), Shard(0)])

    def loss(x, w):
        return jnp.sum(jnp.tanh(column_sums(x)) * w)

    g = jshard.jit(jax.grad(loss))(x, jshard.distribute(w, mesh, [R, R]))
    np.testing.assert_allclose(np.asarray(g.full()), np.asarray(jax.grad(loss)(a, w)), rtol=1e-4, atol=1e-5)


def _fwd_local(params, ins, outs):
    inner = ring_local(params, ins[:1], outs[:1])
    return lambda block: inner(block) + [block]


def _bwd_local(params, ins, outs):
    return lambda rows, ct: [jnp.broadcast_to(ct, rows.shape)]


@function(lambda ins, outs, params: [(R, ShardPlaceholder(0, even=True), ShardPlaceholder(0, even=True))],
          local=_fwd_local, name="tests.sums_fwd",
          communicates=lambda p, i, o: ring_traffic(p, i[:1], o[:1]))
def sums_fwd(x):
    return x.sum(0), x


@function(lambda ins, outs, params: [(ShardPlaceholder(0, even=True), ShardPlaceholder(0, even=True), R)],
          local=_bwd_local, name="tests.sums_bwd")
def sums_bwd(rows, ct):
    return (jnp.broadcast_to(ct, rows.shape),)


@function(column_strategies, local=ring_local, communicates=ring_traffic, name="tests.sums_with_vjp",
          vjp=(sums_fwd, sums_bwd))
def sums_with_vjp(x):
    return x.sum(0)


def test_backward_pass_as_a_unit_of_its_own():
    mesh = make_mesh((8,))
    a, w = _data(), np.linspace(-1, 1, 64).astype(np.float32)  # large enough that the forward ring pays
    x = jshard.distribute(a, mesh, [Shard(0)])

    def loss(x, w):
        return jnp.sum(jnp.sin(sums_with_vjp(x)) * w)

    wd = jshard.distribute(w, mesh, [R])
    g = jshard.jit(jax.grad(loss))(x, wd)
    expected = jax.grad(lambda x: jnp.sum(jnp.sin(x.sum(0)) * w))(a)
    np.testing.assert_allclose(np.asarray(g.full()), np.asarray(expected), rtol=1e-4, atol=1e-5)
    e = jshard.explain(jax.grad(loss), x, wd)
    prims = [r["primitive"] for r in e.rows]
    assert "jshard.tests.sums_fwd" in prims and "jshard.tests.sums_bwd" in prims
    bwd = next(r for r in e.rows if r["primitive"] == "jshard.tests.sums_bwd")
    assert bwd["outs"][0].placements == (Shard(0),)  # each device's rows of the gradient, nothing gathered


def test_outside_jshard_it_is_its_body():
    a = _data(64, 8)
    np.testing.assert_allclose(np.asarray(column_sums(a)), a.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(column_sums)(a)), a.sum(0), rtol=1e-5, atol=1e-5)
    stacked = np.stack([a, 2 * a])
    np.testing.assert_allclose(np.asarray(jax.vmap(column_sums)(stacked)), stacked.sum(1), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: column_sums(x).sum())(a)), np.ones_like(a))


def test_bad_registration_names_the_argument():
    with pytest.raises(TypeError, match="strategies must be a function"):
        function([(R,)], local=ring_local)
    with pytest.raises(TypeError, match="local must be a function"):
        function(column_strategies, local=None)
    with pytest.raises(TypeError, match="vjp must be a pair"):
        function(column_strategies, local=ring_local, vjp=(sums_fwd,))
