"""Host values to block storage: ``distribute`` of host arrays and ``from_process_local``.

A host value is cut on the host, each device receiving only its own block. Expected blocks come from the
reference chunk rule in ``oracle`` (not jshard's layout code) and from the device-side path ``distribute``
took before (Replicate, then a compiled plan), which jax.Array inputs still take. Comparisons are exact:
these are copies, not arithmetic.
"""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jshard
from conftest import make_mesh
from jshard import DArray, Partial, PlacementError, Replicate, Shard, StridedShard
from jshard.darray import rows_start, shape_from_rows
from jshard.lowering import compile_plan
from jshard.placements import format_placements
from jshard.planner import plan_redistribute
from jshard.spec import Spec
from oracle import reference_indices

CASES = [  # mesh shape, placements, global shape
    ((8,), (Shard(0),), (16, 3)),
    ((8,), (Shard(0),), (10,)),  # uneven: 2, 2, 2, 2, 2, 0, 0, 0
    ((8,), (Shard(1),), (2, 3)),  # more devices than columns
    ((8,), (StridedShard(0, 2),), (16,)),
    ((8,), (StridedShard(0, 3),), (13, 2)),  # strided and uneven
    ((8,), (Replicate(),), (5, 2)),
    ((8,), (Partial(),), (4,)),
    ((8,), (Partial("avg"),), (4,)),
    ((8,), (Partial("max"),), (3, 2)),
    ((8,), (Partial("min"),), (3, 2)),
    ((2, 4), (Shard(0), Shard(1)), (6, 10)),
    ((2, 4), (Shard(0), Shard(0)), (10, 3)),  # one dim nested over two axes, uneven
    ((2, 4), (Shard(1), Shard(1)), (3, 8)),
    ((2, 4), (StridedShard(0, 4), Shard(0)), (16, 8)),  # shard order tp, dp
    ((2, 4), (Shard(1), StridedShard(1, 3)), (2, 13)),
    ((2, 4), (Partial(), Shard(1)), (4, 9)),
    ((2, 4), (Replicate(), Partial("min")), (5,)),
    ((2, 4), (Partial("avg"), Partial()), (3, 2)),  # sum and avg mixed
    ((2, 4), (Partial("max"), Partial("max")), (2, 2)),
    ((2, 4), (Replicate(), Replicate()), (3, 3)),
    ((2, 2, 2), (Shard(0), Shard(0), Shard(1)), (9, 5)),
    ((2, 2, 2), (Partial(), Shard(1), Partial()), (3, 4)),
    ((2, 2, 2), (StridedShard(0, 2), Replicate(), Shard(0)), (8, 3)),
    ((2, 2, 2), (Shard(2), Partial("max"), Shard(0)), (3, 1, 5)),
    # size-1 axes (a dp x tp configuration on fewer devices) and one device (one GPU)
    ((1,), (Shard(0),), (5, 2)),
    ((1,), (Partial(),), (3,)),
    ((1, 8), (Shard(0), Shard(0)), (10, 3)),
    ((1, 8), (Partial("max"), Shard(1)), (2, 9)),
    ((8, 1), (StridedShard(0, 3), Shard(0)), (13, 2)),
    ((8, 1), (Shard(1), Partial("avg")), (3, 4)),
    ((2, 1, 4), (Shard(0), StridedShard(0, 2), Shard(1)), (9, 5)),
    ((2, 1, 4), (Partial(), Partial(), Shard(0)), (6,)),
]
NON_PARTIAL = [c for c in CASES if not any(p.is_partial for p in c[1])]


def ids(case):
    mesh_shape, placements, shape = case
    return f"{'x'.join(map(str, mesh_shape))}-{format_placements(placements)}-{shape}"


def value_of(shape, dtype=np.float32):
    rng = np.random.default_rng(sum(shape) + len(shape))
    return rng.integers(-20, 20, size=shape).astype(dtype)


def expected_locals(value, mesh_shape, placements):
    """Each device's local array by definition: its shards, the value on coordinate 0 of Partial(sum) axes and
    zeros elsewhere, the value everywhere for the other Partials."""
    sums = [a for a, p in enumerate(placements) if isinstance(p, Partial) and p.op == "sum"]
    out = []
    for coords in itertools.product(*map(range, mesh_shape)):
        idx = reference_indices(value.shape, mesh_shape, placements, coords)
        local = value[np.ix_(*idx)] if idx else value
        out.append(np.zeros_like(local) if any(coords[a] for a in sums) else local)
    return out


def device_path(x, mesh, placements) -> DArray:
    """What distribute did for every input before host values were cut on the host (jax.Arrays still do)."""
    spec = Spec.create(mesh, placements, np.shape(x), jnp.asarray(x).dtype)
    plan = plan_redistribute(spec.with_placements((Replicate(),) * len(spec.placements)), spec.placements)
    x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, PartitionSpec()))
    return DArray(compile_plan(plan, global_in=True)(x), spec)


def assert_same(x: DArray, value, mesh_shape, placements):
    value = np.asarray(value)
    assert x.shape == value.shape and x.dtype == value.dtype and x.placements == tuple(placements)
    got = [np.asarray(a) for a in x.to_local()]
    want = expected_locals(value, mesh_shape, placements)
    assert [a.shape for a in got] == [a.shape for a in want]
    for a, b in zip(got, want):
        assert a.dtype == value.dtype
        np.testing.assert_array_equal(a, b)
    old = device_path(value, x.mesh, placements)
    for a, b in zip(got, old.to_local()):
        np.testing.assert_array_equal(a, np.asarray(b))
    np.testing.assert_array_equal(np.asarray(x.full()), value)


def padding_is_zero(x: DArray) -> bool:
    block = np.asarray(x.block).reshape(x.spec.mesh_shape + x.spec.device_block_shape)
    for coords in np.ndindex(*x.spec.mesh_shape):
        mask = np.ones(x.spec.local_block_shape, bool)
        mask[tuple(slice(0, n) for n in x.spec.local_shape(coords))] = False
        if (block[coords].reshape(x.spec.local_block_shape)[mask] != 0).any():
            return False
    return True


# ---------------------------------------------------------------------------------------------------
# distribute of host values


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_distribute_host_value_matches_definition_and_device_path(case):
    mesh_shape, placements, shape = case
    value = value_of(shape)
    x = jshard.distribute(value, make_mesh(mesh_shape), placements)
    assert_same(x, value, mesh_shape, placements)
    assert padding_is_zero(x)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, ml_dtypes.bfloat16, np.uint8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("case", [c for c in CASES if c[0] != (8,)], ids=ids)
def test_distribute_host_dtypes(case, dtype):
    mesh_shape, placements, shape = case
    if dtype == np.bool_ and any(p.is_partial for p in placements):  # refused, with the reason
        with pytest.raises(jshard.PlacementError, match="Partial on a bool array"):
            jshard.distribute(value_of(shape, dtype), make_mesh(mesh_shape), placements)
        return
    value = value_of(shape, dtype)
    x = jshard.distribute(value, make_mesh(mesh_shape), placements)
    assert_same(x, value, mesh_shape, placements)


def test_distribute_host_casts_like_jax():
    mesh = make_mesh((2, 4))
    value = np.arange(12.0).reshape(3, 4) / 3  # float64, x64 off: stored as float32, as device_put would
    x = jshard.distribute(value, mesh, [Shard(1), Shard(0)])
    assert x.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x.full()), value.astype(np.float32))
    big = np.array([2**40 + 3, -1], np.int64)  # int64 -> int32 wraps as numpy and device_put do
    np.testing.assert_array_equal(np.asarray(jshard.distribute(big, mesh, [Replicate(), Shard(0)]).full()),
                                  np.asarray(jax.device_put(big)))


@pytest.mark.parametrize("placements", [(Replicate(), Replicate()), (Partial(), Replicate()),
                                        (Partial("avg"), Partial()), (Replicate(), Partial("max"))], ids=str)
@pytest.mark.parametrize("scalar", [3.5, 7, True, np.float32(-2.25), np.array(5, np.int32),
                                    np.array(1.5, ml_dtypes.bfloat16)], ids=repr)
def test_distribute_scalars(scalar, placements):
    if isinstance(scalar, bool) and any(p.is_partial for p in placements):  # refused, with the reason
        with pytest.raises(jshard.PlacementError, match="Partial on a bool array"):
            jshard.distribute(scalar, make_mesh((2, 4)), placements)
        return
    x = jshard.distribute(scalar, make_mesh((2, 4)), placements)
    want = np.asarray(jnp.asarray(scalar))  # the dtype JAX gives a Python scalar
    assert_same(x, want, (2, 4), placements)
    assert x.shape == () and x.dtype == want.dtype


def test_distribute_lists_take_the_host_path():
    x = jshard.distribute([[1, 2, 3], [4, 5, 6]], make_mesh((2, 4)), [Shard(0), Shard(1)])
    assert_same(x, np.array([[1, 2, 3], [4, 5, 6]], np.int32), (2, 4), (Shard(0), Shard(1)))


def test_distribute_host_value_sends_no_replicated_copy(monkeypatch):
    """The old path put the whole value on every device (a replicated device_put, then a compiled plan): a host
    value must reach each device as its own block only."""
    shardings, plans = [], []
    device_put = jax.device_put

    def recording_device_put(x, device=None, *args, **kwargs):
        shardings.append(device)
        return device_put(x, device, *args, **kwargs)

    def recording_compile_plan(plan, **kwargs):
        plans.append(plan)
        return compile_plan(plan, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_device_put)
    monkeypatch.setattr(jshard.darray, "compile_plan", recording_compile_plan)

    def replicated():
        return [s for s in shardings if isinstance(s, jax.sharding.Sharding) and s.is_fully_replicated
                and len(s.device_set) > 1]

    mesh = make_mesh((2, 4))
    for placements in [(Shard(0), Shard(1)), (Replicate(), Replicate()), (Partial(), StridedShard(0, 2))]:
        x = jshard.distribute(np.ones((8, 8), np.float32), mesh, placements)
        assert not replicated() and not plans, (placements, shardings, plans)
        assert all(s.data.shape == x.spec.local_block_shape for s in x.block.addressable_shards)
    jshard.distribute(np.float32(1.0), mesh, [Partial(), Replicate()])
    assert not replicated() and not plans
    # a jax.Array on one device (a model built eagerly, then parallelized) is cut on the host too
    value = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    x = jshard.distribute(jnp.asarray(value), mesh, [Shard(0), Shard(1)])
    assert not replicated() and not plans
    np.testing.assert_array_equal(np.asarray(x.full()), value)
    # one already on the mesh moves by the device-side plan, from its own placements
    on_mesh = jax.device_put(value, NamedSharding(mesh, PartitionSpec("tp")))
    shardings.clear(), plans.clear()
    x = jshard.distribute(on_mesh, mesh, [Shard(0), Shard(1)])
    assert not replicated() and [p.src.placements for p in plans] == [(Replicate(), Shard(0))]
    np.testing.assert_array_equal(np.asarray(x.full()), value)
    # the instrument sees the replicated device path, which PRNG keys (never on the host) still take
    jshard.distribute(jax.random.split(jax.random.key(0), 8), mesh, [Shard(0), Replicate()])
    assert replicated() and plans


def test_distribute_host_value_is_copied():
    """On CPU, JAX may alias a host array it is given: later writes to it must not reach the DArray."""
    value = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    x = jshard.distribute(value, make_mesh((2, 4)), [Replicate(), Shard(0)])
    y = jshard.distribute(value, make_mesh((8,)), [Replicate()])
    value[:] = -1
    np.testing.assert_array_equal(np.asarray(x.full()), np.arange(16.0).reshape(4, 4))
    np.testing.assert_array_equal(np.asarray(y.to_local()[3]), np.arange(16.0).reshape(4, 4))


def test_distribute_jax_array_from_anywhere():
    """A jax.Array on one device, on other devices, or on the mesh in another layout reaches every spec with its
    value intact, and stays usable."""
    mesh = make_mesh((2, 4))
    value = value_of((12, 8))
    sub = jax.make_mesh((4,), ("z",), devices=jax.devices()[4:8])
    sources = [jax.device_put(value, jax.devices()[3]),
               jax.device_put(value, NamedSharding(sub, PartitionSpec(None, "z"))),
               jax.device_put(value, NamedSharding(mesh, PartitionSpec("tp", "dp")))]
    for source in sources:
        for placements in [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (StridedShard(1, 2), Shard(1)),
                           (Partial(), Shard(0)), (Shard(1), Partial("max"))]:
            assert_same(jshard.distribute(source, mesh, placements), value, (2, 4), placements)
        np.testing.assert_array_equal(np.asarray(source), value)


def test_distribute_traced_array_takes_the_device_path():
    # inside jax.jit a jax.Array is a tracer, with no sharding or host value to cut: it moves on the devices
    mesh = make_mesh((8,))
    value = value_of((16,))
    block = jax.jit(lambda a: jshard.distribute(a, mesh, [Shard(0)]).block)(jnp.asarray(value))
    np.testing.assert_array_equal(np.asarray(block).reshape(-1), value)


def test_distribute_jax_array_unchanged():
    mesh = make_mesh((2, 2, 2))
    value = value_of((9, 5))
    x = jshard.distribute(jnp.asarray(value), mesh, [Shard(0), Shard(0), Shard(1)])
    assert_same(x, value, (2, 2, 2), (Shard(0), Shard(0), Shard(1)))
    keys = jax.random.split(jax.random.key(0), 8)  # PRNG keys cannot go through the host
    k = jshard.distribute(keys, make_mesh((8,)), [Shard(0)])
    assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.extended) and k.to_local()[0].shape == (1,)


# ---------------------------------------------------------------------------------------------------
# from_process_local


@pytest.mark.parametrize("case", NON_PARTIAL, ids=ids)
def test_from_process_local_single_process_equals_distribute(case):
    mesh_shape, placements, shape = case
    mesh = make_mesh(mesh_shape)
    value = value_of(shape)
    x = jshard.from_process_local(value, mesh, placements)
    assert_same(x, value, mesh_shape, placements)
    assert padding_is_zero(x)
    y = jshard.from_process_local(value, mesh, placements, shape=shape)
    for a, b in zip(y.to_local(), jshard.distribute(value, mesh, placements).to_local()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_from_process_local_dtypes_and_inputs(dtype):
    mesh = make_mesh((2, 4))
    value = value_of((5, 6), dtype)
    x = jshard.from_process_local(value, mesh, [Shard(1), StridedShard(1, 2)])
    assert_same(x, value, (2, 4), (Shard(1), StridedShard(1, 2)))
    y = jshard.from_process_local(jnp.asarray(value), mesh, [Shard(0), Replicate()])  # a jax.Array: via the host
    assert_same(y, value, (2, 4), (Shard(0), Replicate()))
    z = jshard.from_process_local(2.5, mesh, [Replicate(), Replicate()])
    assert z.shape == () and z.dtype == np.float32 and float(z) == 2.5
    w = jshard.from_process_local(np.arange(6.0), mesh, [Replicate(), Shard(0)])  # float64 -> float32
    assert w.dtype == np.float32


@pytest.mark.parametrize("placements, match", [
    ((Partial(), Replicate()), r"^from_process_local: mesh\(dp=2, tp=4\) with \(P\(sum\), R\) has a Partial "
                               r"placement.*use from_local"),
    ((Shard(0), Partial("max")), r"^from_process_local: mesh\(dp=2, tp=4\) with \(S\(0\), P\(max\)\) has a Partial"),
])
def test_from_process_local_refuses_partial(placements, match):
    with pytest.raises(ValueError, match=match):
        jshard.from_process_local(np.ones((4, 4), np.float32), make_mesh((2, 4)), placements)


def test_from_process_local_wrong_local_shape():
    mesh = make_mesh((2, 4))
    with pytest.raises(ValueError, match=r"^from_process_local: local_rows has shape \(3, 4\), but under "
                                         r"mesh\(dp=2, tp=4\) with \(S\(0\), S\(1\)\) with global shape \(8, 4\) "
                                         r"process 0 holds \[0:8, 0:4\], of shape \(8, 4\); pass exactly those rows"):
        jshard.from_process_local(np.ones((3, 4), np.float32), mesh, [Shard(0), Shard(1)], shape=(8, 4))
    with pytest.raises(ValueError, match=r"^from_process_local: local_rows has shape \(8,\) but shape=\(8, 4\) has "
                                         r"rank 2"):
        jshard.from_process_local(np.ones(8, np.float32), mesh, [Shard(0), Shard(1)], shape=(8, 4))


def test_from_process_local_other_bad_inputs():
    mesh = make_mesh((2, 4))
    x = jshard.distribute(np.ones((4, 4), np.float32), mesh, [Shard(0), Replicate()])
    with pytest.raises(TypeError, match=r"^from_process_local: local_rows is a DArray"):
        jshard.from_process_local(x, mesh, [Shard(0), Replicate()])
    with pytest.raises(TypeError, match=r"^from_process_local: mesh must be a jax.sharding.Mesh"):
        jshard.from_process_local(np.ones(4), "mesh", [Shard(0)])
    with pytest.raises(TypeError, match=r"^from_process_local: local_rows must be an array .* got str"):
        jshard.from_process_local("abc", mesh, [Replicate(), Replicate()])
    with pytest.raises(PlacementError, match=r"^from_process_local: \(S\(0\)\) has 1 placements"):
        jshard.from_process_local(np.ones(4), mesh, [Shard(0)])
    with pytest.raises(TypeError, match=r"^from_process_local: local_rows is a key<fry> array.*distribute"):
        jshard.from_process_local(jax.random.split(jax.random.key(0), 8), make_mesh((8,)), [Shard(0)])


# A second process cannot be started here: the rows of a process are asked of the public helpers that
# from_process_local uses, given the mesh coordinates such a process's devices would have
# (tests/engine/test_multiprocess.py runs two real processes).

def test_process_rows_of_half_a_mesh():
    mesh = make_mesh((2, 4))
    spec = Spec.create(mesh, [Shard(0), Replicate()], (10, 6), np.float32)
    first, second = [(0, t) for t in range(4)], [(1, t) for t in range(4)]
    assert rows_start(spec, first, (5, 6)) == (0, 0)
    assert rows_start(spec, second, (5, 6)) == (5, 0)
    assert shape_from_rows(spec, first, (5, 6)) == (10, 6)
    assert shape_from_rows(spec, second, (5, 6)) == (10, 6)
    nested = spec.with_placements([Shard(0), Shard(0)])  # rows 0:2, 2:4, 4:5, 5:5 | 5:7, 7:9, 9:10, 10:10
    assert rows_start(nested, [(0, 2), (0, 3), (1, 0)], (3, 6)) == (4, 0)
    with pytest.raises(ValueError, match=r"^from_process_local: this process's devices hold 3 of the 8 shards of "
                                         r"dim 0 under mesh\(dp=2, tp=4\) with \(S\(0\), S\(0\)\).*pass shape="):
        shape_from_rows(nested, [(0, 1), (0, 2), (0, 3)], (5, 6))
    with pytest.raises(ValueError, match=r"^from_process_local: local_rows has shape \(4, 6\), but under "
                                         r"mesh\(dp=2, tp=4\) with \(S\(0\), R\) with global shape \(10, 6\) "
                                         r"\(inferred .*\) process 0 holds \[5:10, 0:6\], of shape \(5, 6\)"):
        rows_start(spec, second, (4, 6), inferred=True)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8), (1,)], ids=["2x4", "1x8", "1-device"])
def test_every_device_together_holds_the_whole_value(mesh_shape):
    """One process holding every device (this one): its rows are the whole value, as from_process_local takes."""
    mesh = make_mesh(mesh_shape)
    placements = [Shard(0)] + [Shard(1)] * (len(mesh_shape) - 1)
    spec = Spec.create(mesh, placements, (7, 10), np.float32)
    every = list(np.ndindex(*mesh_shape))
    assert shape_from_rows(spec, every, (7, 10)) == (7, 10)
    assert rows_start(spec, every, (7, 10)) == (0, 0)
    assert jshard.process_rows(mesh, placements, (7, 10)) == (slice(0, 7), slice(0, 10))


def test_process_rows_not_contiguous():
    spec = Spec.create(make_mesh((8,)), [StridedShard(0, 2)], (16,), np.float32)
    with pytest.raises(ValueError, match=r"^from_process_local: under mesh\(x=8\) with \(SS\(0,2\)\), the devices of "
                                         r"process 0 hold indices 0:4, 8:12 of dim 0 of \(16,\), not one contiguous "
                                         r"range.*use from_local"):
        rows_start(spec, [(c,) for c in range(4)], (8,))
    assert rows_start(spec.with_placements([Shard(0)]), [(c,) for c in range(4, 8)], (8,)) == (8,)
