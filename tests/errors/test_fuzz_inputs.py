"""Fuzzing the array entry points: every input gives the right value or a clear error, never a crash.

Two properties, checked with hypothesis over the suite's meshes (``conftest.MESH_SHAPES``, size-1 axes and one
device included):

- **round trip**: a random array (0-size dims included; float32, int32, bool, bfloat16) built with random
  placements (``distribute``, or ``from_local`` from unequal Partial parts) and redistributed to random
  placements holds the value exactly on every device (``oracle.check_darray``). Placements that are invalid
  for the array (a dim out of range, mixed Partial ops, a Partial on bool) must fail with a ValueError or
  TypeError whose message starts with the operation, and valid ones must not fail.
- **junk arguments**: an entry point given a random wrong-typed argument either works or raises a
  ValueError/TypeError naming the operation; an internal error (IndexError, KeyError, AttributeError, a
  JAX/XLA error) is a bug.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jshard
from conftest import MESH_SHAPES, make_mesh
from jshard import Partial, Replicate, Shard, Spec, StridedShard
from oracle import check_darray, local_blocks, placement_st, valid

DTYPES = [np.float32, np.int32, np.bool_, jnp.bfloat16]
SIZES = [0, 1, 2, 3, 5, 8, 9]  # 0-size dims, uneven and even splits
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_clear(error: Exception, *ops: str) -> None:
    """``error`` is a clear error: a ValueError/TypeError whose message starts with one of ``ops``."""
    assert isinstance(error, (ValueError, TypeError)), f"internal error {type(error).__name__}: {error}"
    assert str(error).startswith(ops), f"{type(error).__name__} does not name {ops}: {error}"


def buildable(placements, mesh_shape, rank, dtype) -> bool:
    return valid(placements, mesh_shape, rank) and not (dtype == np.bool_ and any(p.is_partial for p in placements))


def draw_placements(data, mesh_shape, rank):
    """Mostly placements for this rank; sometimes a dim one past the end, which must be refused."""
    return tuple(data.draw(placement_st(rank + data.draw(st.sampled_from([0, 0, 0, 1]))))
                 for _ in mesh_shape)


@FUZZ
@given(st.sampled_from(list(MESH_SHAPES)), st.lists(st.sampled_from(SIZES), max_size=3), st.sampled_from(DTYPES),
       st.data())
def test_round_trip_or_clear_error(mesh_shape, shape, dtype, data):
    rank, shape = len(shape), tuple(shape)
    src, dst = draw_placements(data, mesh_shape, rank), draw_placements(data, mesh_shape, rank)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # bfloat16 holds integers exactly up to 256: small values keep the Partial parts' sums exact
    value = rng.integers(-3, 4, size=shape) if dtype == jnp.bfloat16 else rng.integers(-30, 30, size=shape)
    value = (value > 0) if dtype == np.bool_ else value.astype(dtype)
    mesh = make_mesh(mesh_shape)
    ok = buildable(src, mesh_shape, rank, dtype)
    try:
        if ok and any(p.is_partial for p in src):
            x = jshard.from_local(local_blocks(value, mesh_shape, src, rng), mesh, src, shape=shape)
        else:
            x = jshard.distribute(value, mesh, src)
    except Exception as e:  # noqa: BLE001 - the property is about which errors escape
        assert not ok, f"{src} on {mesh_shape} for {dtype.__name__}{list(shape)} failed: {e!r}"
        assert_clear(e, "distribute")
        return
    assert ok, f"{src} was accepted for {dtype.__name__}{list(shape)}"
    check_darray(x, value)
    try:
        y = x.redistribute(dst)
    except Exception as e:  # noqa: BLE001
        assert not buildable(dst, mesh_shape, rank, dtype), f"{x} -> {dst} failed: {e!r}"
        assert_clear(e, "redistribute")
        return
    check_darray(y, value)
    np.testing.assert_array_equal(np.asarray(y.full()).astype(np.float32), value.astype(np.float32))


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 12), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3), st.lists(st.integers(-2, 6), max_size=3), st.tuples(st.floats(-1, 9)),
    st.just(Replicate), st.just(object()), st.just(np.zeros((2, 2))), st.just((Shard(0), "R")),
)


def _entry_points():
    """(operation prefix, call taking a DArray x, its mesh and one junk value)."""
    return [
        ("Shard", lambda x, mesh, j: Shard(j)),
        ("StridedShard", lambda x, mesh, j: StridedShard(0, j)),
        ("Partial", lambda x, mesh, j: Partial(j)),
        ("Spec", lambda x, mesh, j: Spec.create(mesh, [Replicate()] * 2, j, "float32")),
        ("Spec", lambda x, mesh, j: Spec.create(mesh, [Replicate()] * 2, (2, 3), j)),
        ("Spec", lambda x, mesh, j: Spec.create(j, [Replicate()] * 2, (2, 3), "float32")),
        ("distribute", lambda x, mesh, j: jshard.distribute(j, mesh, [Replicate()] * 2)),
        ("distribute", lambda x, mesh, j: jshard.distribute(np.ones((4, 4)), mesh, j)),
        ("from_local", lambda x, mesh, j: jshard.from_local(j, mesh, [Shard(0), Replicate()])),
        ("from_local", lambda x, mesh, j: jshard.from_local([j] * 8, mesh, [Replicate()] * 2)),
        ("from_local", lambda x, mesh, j: jshard.from_local(x.to_local(), mesh, x.placements, shape=j)),
        ("redistribute", lambda x, mesh, j: x.redistribute(j)),
        ("redistribute", lambda x, mesh, j: x.redistribute([Replicate()] * 2, cost_model=j)),
        ("plan_redistribute", lambda x, mesh, j: jshard.plan_redistribute(x, j)),
        ("plan_redistribute", lambda x, mesh, j: jshard.plan_redistribute(j, [Replicate()] * 2)),
        ("visualize", lambda x, mesh, j: jshard.visualize(j)),
        ("from_jax", lambda x, mesh, j: jshard.from_jax(j)),
    ]


ENTRY_POINTS = _entry_points()


@FUZZ
@given(st.sampled_from(range(len(ENTRY_POINTS))), JUNK)
def test_junk_arguments_get_clear_errors(which, junk):
    mesh = make_mesh((2, 4))
    value = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    x = jshard.distribute(value, mesh, [Shard(0), Replicate()])
    op, call = ENTRY_POINTS[which]
    try:
        call(x, mesh, junk)
    except Exception as e:  # noqa: BLE001
        assert_clear(e, op)
    assert x.placements == (Shard(0), Replicate()) and not x.block.is_deleted()
    np.testing.assert_array_equal(np.asarray(x.full()), value)

