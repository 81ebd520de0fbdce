"""Integer Partials against one device: casts that do not commute with a pending sum, and exact averages.

An integer ``Partial(sum)`` is the sum of its parts wrapped into the dtype, as one device computes it; an integer
``Partial(avg)`` is ``floor`` of the exact sum of its parts over the size of its avg axes (``jshard.planner``), in
range for every value of the dtype. So:

- a cast to float rounds the parts where the sum would not round (``16777217 - 16777216``), and the int sum that
  wraps on one device does not wrap as floats; a widening integer cast undoes the wrap-around of the narrow
  sum: both reduce first. A narrowing cast agrees modulo ``2**bits`` and stays pending;
- an average reduces without overflow, whatever the value (``1500000000`` averaged over two devices, ``100`` of
  int8 over four), by all-reduce, reduce-scatter, or one collective over a sum axis and an avg axis together.

Each case runs on 2 devices, on 2x2, on a mesh with a size-1 axis and on one device (where nothing is pending:
the boundary the others must agree with).
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from jshard import Partial, Replicate, Shard
from jshard.placements import Placement
from jshard.validate import collect, validate

R, SUM, AVG = Replicate(), Partial(), Partial("avg")
MESHES = {(2,): ("x",), (2, 2): ("a", "b"), (1, 2): ("a", "b"), (1,): ("x",)}
MESH_IDS = ["2", "2x2", "1x2", "1"]


def make(shape) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, MESHES[shape], devices=jax.devices()[:math.prod(shape)])


def pending(parts: list, shape, placements) -> jshard.DArray:
    """A DArray whose devices hold ``parts`` (mesh device order), padded with zeros for devices beyond them: a
    pending sum of exactly those parts. One device holds their sum, wrapped as on one device."""
    dtype = parts[0].dtype
    n = math.prod(shape)
    if n < len(parts):
        parts = [np.sum(parts, axis=0, dtype=dtype)]
    parts = parts + [np.zeros_like(parts[0])] * (n - len(parts))
    return jshard.from_local(parts, make(shape), placements)


def floor_mean(parts: list, n: int, dtype) -> np.ndarray:
    """The single-device value of an integer average of ``parts``: floor of their exact sum over ``n``."""
    return (np.sum(np.stack(parts).astype(np.int64), axis=0) // n).astype(dtype)


# ---------------------------------------------------------------------------------------------------
# casts of a pending sum

# int -> float: the parts round where the sum does not, and an int sum that wraps on one device does not wrap as
# floats
TO_FLOAT = [
    pytest.param(np.int32, np.float32, [16777217, -16777216], id="int32-float32-rounds"),
    pytest.param(np.int32, np.float32, [2**31 - 1, 5], id="int32-float32-wraps"),
    pytest.param(np.uint32, np.float32, [2**32 - 1, 2], id="uint32-float32-wraps"),
    pytest.param(np.uint32, jnp.bfloat16, [2**32 - 1, 2], id="uint32-bfloat16-wraps"),
]
# int -> int: a widening cast reduces first (the parts widen, the sum wrapped); a narrowing one agrees modulo
# 2**bits(target), signed or not, and stays pending
TO_INT = [
    pytest.param(np.int8, np.int32, [100, 100], False, id="int8-int32-widens"),
    pytest.param(np.uint8, np.int32, [200, 100], False, id="uint8-int32-widens"),
    pytest.param(np.int32, np.int8, [300, -44], True, id="int32-int8-narrows"),
    pytest.param(np.int32, np.uint8, [2**31 - 1, 300], True, id="int32-uint8-narrows"),
]


def _cast(x, dst, traced: bool):
    return jshard.jit(lambda a: a.astype(dst))(x) if traced else x.astype(dst)


def _pending(x) -> list[bool]:
    """Per mesh axis of more than one device: is a reduction pending there (a size-1 axis holds the value)."""
    return [p.is_partial for p, n in zip(x.placements, x.mesh.devices.shape) if n > 1]


def _one_device_cast(parts, src, dst) -> np.ndarray:
    """The oracle: the sum as one device has it (wrapped), then the cast."""
    return np.asarray(jnp.asarray(np.sum(parts, axis=0, dtype=src)).astype(dst))


@pytest.mark.parametrize("shape", list(MESHES), ids=MESH_IDS)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("src, dst, values", TO_FLOAT)
def test_a_cast_to_float_reduces_a_pending_sum_first(src, dst, values, traced, shape):
    parts = [np.array([v, 7], src) for v in values]
    got = _cast(pending(parts, shape, [SUM] * len(shape)), dst, traced)
    assert got.dtype == jnp.dtype(dst) and _pending(got) == [False] * len(_pending(got))
    np.testing.assert_array_equal(np.asarray(got.full()), _one_device_cast(parts, src, dst))


@pytest.mark.parametrize("shape", list(MESHES), ids=MESH_IDS)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("src, dst, values, stays", TO_INT)
def test_an_integer_cast_of_a_pending_sum_keeps_it_only_modulo_its_width(src, dst, values, stays, traced, shape):
    """Guards what was already right (the narrow sources): see the 64-bit test below for the widening that was
    not."""
    parts = [np.array([v, 7], src) for v in values]
    got = _cast(pending(parts, shape, [SUM] * len(shape)), dst, traced)
    assert _pending(got) == [stays] * len(_pending(got))
    np.testing.assert_array_equal(np.asarray(got.full()), _one_device_cast(parts, src, dst))


def test_widening_a_32_bit_pending_sum_to_64_bits_reduces_first():
    """int32 -> int64 (x64 on): the int32 sum wrapped on one device; the widened parts would not."""
    with jax.enable_x64(True):
        x = pending([np.array([2**31 - 1, -3], np.int32), np.array([5, 2], np.int32)], (2,), [SUM])
        want = np.array([-2147483644, -1], np.int64)
        np.testing.assert_array_equal(np.asarray(jshard.jit(lambda a: a.astype(jnp.int64))(x).full()), want)
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.uint64).full()), want.astype(np.uint64))


def test_a_narrowing_cast_that_wraps_is_not_order_preserving():
    """A pending max of int32 parts cast to int8: 200 wraps to -56, so the max reduces before the cast (a guard:
    the rule was right)."""
    x = jshard.from_local([np.array([200, -3], np.int32), np.array([5, -300], np.int32)], make((2,)),
                          [Partial("max")])
    got = jshard.jit(lambda a: a.astype(jnp.int8))(x)
    np.testing.assert_array_equal(np.asarray(got.full()), np.array([200, -3], np.int32).astype(np.int8))


# ---------------------------------------------------------------------------------------------------
# exact integer averages


def _bounds(dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.array([info.max, info.min, info.max - 1, info.min + 1, 0, 1, info.max // 2 + 1], dtype)


@pytest.mark.parametrize("shape", list(MESHES), ids=MESH_IDS)
@pytest.mark.parametrize("dtype", [np.int8, np.uint32, np.int32])
def test_a_replicated_value_averages_to_itself(dtype, shape):
    """R -> P(avg) keeps the value on every device; reducing it again is exact for every value of the dtype
    (``n * value`` overflows it)."""
    value = _bounds(dtype)
    x = jshard.distribute(value, make(shape), [R] * len(shape)).redistribute([AVG] * len(shape))
    np.testing.assert_array_equal(np.asarray(x.full()), value)
    np.testing.assert_array_equal(np.asarray(x.redistribute([R] * len(shape)).full()), value)


@pytest.mark.parametrize("shape", list(MESHES), ids=MESH_IDS)
@pytest.mark.parametrize("dtype", [np.int8, np.uint32, np.int32])
def test_an_average_of_parts_near_the_bounds_is_the_floor_of_their_mean(dtype, shape):
    """Parts at and near the bounds, with remainders: ``floor(sum / n)``, negative means rounding down."""
    n = math.prod(shape)
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    parts = [np.concatenate([_bounds(dtype), rng.integers(info.min, info.max, size=9, dtype=dtype, endpoint=True)])
             for _ in range(n)]
    for c, part in enumerate(parts):  # means just inside the bounds, with remainders
        part[:2] = info.max - c, info.min + c
    want = floor_mean(parts, n, dtype)
    x = jshard.from_local(parts, make(shape), [AVG] * len(shape))
    np.testing.assert_array_equal(np.asarray(x.full()), want)
    np.testing.assert_array_equal(np.asarray(jshard.jit(lambda a: a + 0)(x).full()), want)


@pytest.mark.parametrize("shape, src, dst", [
    ((2,), (AVG,), (Shard(0),)),
    ((2, 2), (AVG, AVG), (Shard(0), Shard(0))),
    ((2, 2), (AVG, R), (Shard(0), R)),
    ((1, 2), (AVG, AVG), (Shard(0), Shard(0))),
], ids=["2", "2x2", "2x2-avg-R", "1x2"])
def test_a_reduce_scatter_of_an_integer_average_is_exact(shape, src, dst):
    n = math.prod(s for s, p in zip(shape, src) if p == AVG)
    rng = np.random.default_rng(1)
    info = np.iinfo(np.int32)
    groups = [rng.integers(info.max - 40, info.max, size=(8,), dtype=np.int32, endpoint=True) for _ in range(n)]
    groups[-1][::2] = info.min  # half the elements average the bounds: floor(-1 / 2) = -1
    want = floor_mean(groups, n, np.int32)
    # the parts of mesh device c are those of its coordinates on the avg axes (the same on the others)
    avg_axes = [a for a, p in enumerate(src) if p == AVG]
    locals_ = [groups[int(np.ravel_multi_index([c[a] for a in avg_axes], [shape[a] for a in avg_axes]))]
               for c in np.ndindex(*shape)]
    x = jshard.from_local(locals_, make(shape), src)
    plan = jshard.plan_redistribute(x, dst)
    assert [s.kind for s in plan.collectives] == ["reduce_scatter"], plan
    y = x.redistribute(dst)
    np.testing.assert_array_equal(np.asarray(y.full()), want)
    width = len(want) // math.prod(shape[a] for a, p in enumerate(dst) if p.is_shard)
    for c, local in zip(np.ndindex(*shape), y.to_local()):
        at = int(np.ravel_multi_index([c[a] for a, p in enumerate(dst) if p.is_shard],
                                      [shape[a] for a, p in enumerate(dst) if p.is_shard]))
        np.testing.assert_array_equal(np.asarray(local), want[at * width:(at + 1) * width])


# the parts of (P(sum), P(avg)) on 2x2, in mesh order (a, b): a sum over a wraps in int8 (100 + 100 at b = 0), and
# so does the exact sum of all four (140, -201), but not its floor mean over b (70, -101)
MIXED = [np.array([100, -100, 1], np.int8), np.array([-60, 7, -1], np.int8),
         np.array([100, -100, 3], np.int8), np.array([0, -8, 0], np.int8)]
MIXED_VALUE = floor_mean(MIXED, 2, np.int8)

TARGETS: list[tuple[Placement, ...]] = [(R, R), (R, AVG), (SUM, R), (Shard(0), R), (R, Shard(0)), (SUM, AVG),
                                        (AVG, SUM)]


@pytest.mark.parametrize("dst", TARGETS, ids=lambda d: "-".join(map(str, d)))
def test_a_pending_sum_beside_an_integer_average_reduces_with_it(dst):
    """``(P(sum), P(avg))`` is ``floor`` of the exact sum of all four parts over 2: reducing the sum axis alone
    first would average two sums that wrapped, and one wrapping psum of everything would divide a wrapped sum."""
    x = jshard.from_local(MIXED, make((2, 2)), [SUM, AVG])
    assert MIXED_VALUE.tolist() == [70, -101, 1]
    np.testing.assert_array_equal(np.asarray(x.full()), MIXED_VALUE)
    y = x.redistribute(dst)
    np.testing.assert_array_equal(np.asarray(y.full()), MIXED_VALUE)


@pytest.mark.parametrize("shape", [(2, 2), (1, 2)], ids=["2x2", "1x2"])
def test_a_widening_cast_of_a_sum_beside_an_average(shape):
    """int8 -> int32 keeps P(avg) (every int8 converts exactly) but not P(sum): the sum reduces, with the
    average, before the cast; the result is the int8 value, widened."""
    parts = MIXED if shape == (2, 2) else [MIXED[0] + MIXED[1], MIXED[2] + MIXED[3]]
    x = jshard.from_local(parts, make(shape), [SUM, AVG])
    want = floor_mean(parts, 2, np.int8).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(jshard.jit(lambda a: a.astype(jnp.int32))(x).full()), want)
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32).full()), want.astype(np.float32))


def test_a_float_average_costs_what_it_did():
    """Floats divide the sum directly: one collective of the array itself; an integer average moves a
    (quotient, remainder) pair in its one collective."""
    mesh = make((2, 2))
    f = jshard.plan_redistribute(jshard.from_local([np.ones(8, np.float32)] * 4, mesh, [SUM, AVG]), (R, R))
    i = jshard.plan_redistribute(jshard.from_local([np.ones(8, np.int32)] * 4, mesh, [SUM, AVG]), (R, R))
    assert [(s.kind, s.axes, s.scale, s.bytes) for s in f.steps] == [("all_reduce", ("a", "b"), 2, 32)]
    assert [(s.kind, s.axes, s.scale, s.bytes) for s in i.steps] == [("all_reduce", ("a", "b"), 2, 64)]


# ---------------------------------------------------------------------------------------------------
# the validator sees them


def _uint32(samples):
    return [s for s in samples if any(np.asarray(v).dtype == np.uint32 for v in s.values)]


@pytest.mark.parametrize("name", ["concatenate", "split"])
def test_the_validator_averages_integers_exactly(name):
    """Integer P(avg) parts are in range and their exact mean is the value: a move of elements keeps it (the
    validator used to build uint32 parts that wrapped, and found concatenate and split incorrect)."""
    samples = _uint32(collect([name])[name])
    assert samples
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = validate(name, samples, sizes=(2, 3))
    assert r.incorrect == 0 and r.correct, [k for k, _ in r.incorrect_cases]


def test_the_validator_finds_a_cast_to_float_that_keeps_a_sum_incorrect():
    """Integer sum parts anywhere in the dtype's range: on 3 devices some sums wrap, and their float parts do not
    (float tolerances are relative to the parts, so rounding alone would pass)."""
    from jshard.rules import registry

    samples = [s for s in collect(["convert_element_type"])["convert_element_type"]
               if s.values[0].dtype == np.int32 and s.params["new_dtype"] == np.float32]
    rule = registry.rule_for("convert_element_type")
    keeps_sum = lambda ins, outs, params: rule.strategies(ins, outs, params) + [(SUM, SUM)]
    with registry.override("convert_element_type", registry.Rule("convert_element_type", keeps_sum)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = validate("convert_element_type", samples, sizes=(3,))
    assert [k for k, _ in r.incorrect_cases] == [(("P(sum)",), ("P(sum)",))]
