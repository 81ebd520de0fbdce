"""Elementwise rules, checked against numpy on one device: one equation under ``jshard.jit`` on every kind of
input placement (padding poisoned, Partials from unequal parts), and which pending reductions each family keeps.

The algebra (``jshard.rules.algebra``) says which Partials an elementwise op may carry through: a linear op keeps
``P(sum)`` / ``P(avg)``, a product with a replicated factor keeps them too, a non-decreasing op keeps ``P(max)`` /
``P(min)`` (a non-increasing one swaps them), everything else needs the reduced value first. The values must
equal numpy's whichever strategy the engine takes; the strategy is checked by the program's collectives (none
where the Partial is kept) and the output's placements.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh, mesh_params
from jshard import Partial, Replicate, Shard, StridedShard
from oracle import assert_close
from oracle import poisoned as darray

R = Replicate()
SUM, AVG, MAX, MIN = (Partial(op) for op in ("sum", "avg", "max", "min"))
SHAPE = (6, 10)  # uneven over 4 and 8 devices: padding is read wherever a rule forgets it


def _value(rng, positive=False):
    """Quarters in [-2, 2]: the oracle's parts are integers, so every reduction of them is exact in any order, and
    a result differs from numpy's by the op's own rounding alone."""
    v = (rng.integers(-8, 9, size=SHAPE) / 4).astype(np.float32)
    return np.abs(v) + 0.25 if positive else v


def _collectives(fn, *args) -> int:
    return sum(c for c, _ in jshard.explain(fn, *args).totals.values())


UNARY = {  # name: (function, numpy, positive inputs only)
    "neg": (jnp.negative, np.negative, False), "exp": (jnp.exp, np.exp, False), "tanh": (jnp.tanh, np.tanh, False),
    "log": (jnp.log, np.log, True), "sqrt": (jnp.sqrt, np.sqrt, True), "abs": (jnp.abs, np.abs, False),
    "sin": (jnp.sin, np.sin, False), "square": (jnp.square, np.square, False),
    "logistic": (jax.nn.sigmoid, lambda a: 1 / (1 + np.exp(-a)), False),
}
PLACEMENTS = [Shard(0), Shard(1), StridedShard(1, 2), SUM, AVG, MAX, MIN, R]


@pytest.mark.parametrize("shape", mesh_params(default=((2, 4), (1,))))
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_equals_numpy_on_every_placement(shape, name):
    fn, ref, positive = UNARY[name]
    mesh, rng = make_mesh(shape), np.random.default_rng(0)
    for p in PLACEMENTS:
        placements = [p] + [Shard(0)] * (len(shape) - 1)
        if positive and p.is_partial and p.op == "sum":
            continue  # parts of a positive value need not be positive: the op's domain is the reduced value's
        a = _value(rng, positive)
        out = jshard.jit(fn)(darray(a, mesh, placements, rng))
        assert_close(np.asarray(out.full()), ref(a))


@pytest.mark.parametrize("name", ["add", "sub", "mul", "div", "max", "min", "pow", "atan2"])
def test_binary_equals_numpy_on_mixed_placements(name):
    fn = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide, "max": jnp.maximum,
          "min": jnp.minimum, "pow": jnp.power, "atan2": jnp.arctan2}[name]
    mesh, rng = make_mesh((2, 4)), np.random.default_rng(1)
    for pa, pb in [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (SUM, R), (R, SUM), (SUM, SUM), (MAX, R),
                   (AVG, Shard(1)), (StridedShard(1, 2), Shard(1))]:
        a, b = _value(rng, positive=name == "pow"), _value(rng, positive=name == "div")
        out = jshard.jit(fn)(darray(a, mesh, [pa, Shard(0)], rng), darray(b, mesh, [pb, R], rng))
        assert_close(np.asarray(out.full()), np.asarray(fn(a, b)))


def test_linear_ops_keep_pending_sums():
    mesh, rng = make_mesh((8,)), np.random.default_rng(2)
    a, b = _value(rng), _value(rng)
    x, y = darray(a, mesh, [SUM], rng), darray(b, mesh, [SUM], rng)
    w = darray(b, mesh, [R], rng)
    for fn, ref in [(lambda x, y: x + y, a + b), (lambda x, y: x - 2.0 * y, a - 2 * b), (lambda x, y: -x, -a)]:
        out = jshard.jit(fn)(x, y)
        assert out.placements == (SUM,) and _collectives(fn, x, y) == 0
        assert_close(np.asarray(out.full()), ref)
    out = jshard.jit(lambda x, w: x * w)(x, w)  # a product with a replicated factor is linear in x
    assert out.placements == (SUM,)
    assert_close(np.asarray(out.full()), a * b)
    out = jshard.jit(lambda x, y: x * y)(x, y)  # not bilinear-safe: one factor is reduced first
    assert not out.placements[0].is_partial or _collectives(lambda x, y: x * y, x, y) > 0
    assert_close(np.asarray(out.full()), a * b)


def test_monotone_ops_keep_pending_max_and_min():
    mesh, rng = make_mesh((8,)), np.random.default_rng(3)
    a = _value(rng)
    for p in (MAX, MIN):
        x = darray(a, mesh, [p], rng)
        for fn, ref in [(jnp.exp, np.exp), (jnp.tanh, np.tanh), (jax.nn.relu, lambda v: np.maximum(v, 0))]:
            out = jshard.jit(fn)(x)
            assert out.placements == (p,) and _collectives(fn, x) == 0
            assert_close(np.asarray(out.full()), ref(a))
        out = jshard.jit(jnp.negative)(x)  # non-increasing: max and min swap
        assert out.placements == ((MIN if p == MAX else MAX),)
        assert_close(np.asarray(out.full()), -a)


def test_nonlinear_ops_reduce_first():
    mesh, rng = make_mesh((8,)), np.random.default_rng(4)
    a = _value(rng)
    for p, fn in [(SUM, jnp.exp), (SUM, jnp.tanh), (AVG, jnp.sin), (MAX, jnp.square), (MAX, jnp.sin)]:
        x = darray(a, mesh, [p], rng)
        out = jshard.jit(fn)(x)
        assert not out.placements[0].is_partial and _collectives(fn, x) >= 1
        assert_close(np.asarray(out.full()), np.asarray(fn(a)))


def test_comparisons_and_casts():
    mesh, rng = make_mesh((2, 4)), np.random.default_rng(5)
    a, b = _value(rng), _value(rng)
    x, y = darray(a, mesh, [SUM, Shard(1)], rng), darray(b, mesh, [R, Shard(1)], rng)
    out = jshard.jit(lambda x, y: x > y)(x, y)  # a bool is never pending
    assert not any(p.is_partial for p in out.placements)
    np.testing.assert_array_equal(np.asarray(out.full()), a > b)
    out = jshard.jit(lambda x, y: jnp.where(x > 0, x, y))(x, y)
    assert_close(np.asarray(out.full()), np.where(a > 0, a, b))
    out = jshard.jit(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32))(darray(a, mesh, [SUM, R], rng))
    # float casts are linear up to rounding: the parts round to bfloat16 before they are summed
    np.testing.assert_allclose(np.asarray(out.full()), a, rtol=2 ** -7, atol=2 ** -7 * np.abs(a).max())
    i = darray(np.arange(60, dtype=np.int32).reshape(SHAPE), mesh, [SUM, R], rng)
    out = jshard.jit(lambda i: i.astype(jnp.float32) * 0.5)(i)
    np.testing.assert_array_equal(np.asarray(out.full()), np.arange(60, dtype=np.float32).reshape(SHAPE) * 0.5)
