"""Redistribution against the single-device oracle: every (src, dst) gives back the original value."""

import collections
import itertools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jshard
from conftest import MESH_SHAPES, make_mesh
from jshard import Partial, Replicate, Shard, StridedShard, lowering
from jshard.darray import DArray
from jshard.lowering import compile_plan, local_programs
from jshard.placements import normalize_placements
from jshard.planner import pricing
from jshard.spec import block_of, block_sharding, local_of
from oracle import assert_close, check_darray, hlo_collectives, local_blocks, placement_st, plan_collectives, valid


def run_pair(mesh_shape, shape, src, dst, rng, *, dtype=np.float32, check_hlo=False):
    mesh = make_mesh(mesh_shape)
    value = rng.integers(-30, 30, size=shape).astype(dtype)
    x = jshard.from_local(local_blocks(value, mesh_shape, src, rng), mesh, src, shape=shape)
    check_darray(x, value)
    y = x.redistribute(dst)
    assert y.placements == normalize_placements(dst, len(mesh_shape), len(shape))
    check_darray(y, value)
    if check_hlo:
        plan = jshard.plan_redistribute(x, dst)
        hlo = compile_plan(plan).lower(x.block).compile().as_text()
        assert hlo_collectives(hlo) == plan_collectives(plan), (str(plan), hlo_collectives(hlo))
    return x, y, value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(list(MESH_SHAPES)),
       st.lists(st.integers(1, 13), min_size=1, max_size=3), st.data())
def test_random_pairs_match_single_device(mesh_shape, shape, data):
    rank = len(shape)
    src = tuple(data.draw(placement_st(rank)) for _ in mesh_shape)
    dst = tuple(data.draw(placement_st(rank)) for _ in mesh_shape)
    assume(valid(src, mesh_shape, rank) and valid(dst, mesh_shape, rank))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    run_pair(mesh_shape, tuple(shape), src, dst, rng, check_hlo=True)


@pytest.mark.parametrize("dtype", [np.int32, np.float16])
@pytest.mark.parametrize("src, dst", [
    ((Partial(), Partial("avg")), (Shard(0), Shard(1))),
    ((Shard(1), Partial("max")), (Partial("max"), Shard(0))),
    ((Partial("min"), Shard(0)), (Replicate(), Partial("min"))),
    ((StridedShard(0, 2), Shard(1)), (Shard(1), StridedShard(0, 3))),
])
def test_other_dtypes(dtype, src, dst):
    run_pair((2, 4), (6, 10), src, dst, np.random.default_rng(1), dtype=dtype, check_hlo=True)


@pytest.mark.parametrize("dst", [[Replicate()], [Shard(1)]])
def test_prng_keys_move_and_gather(dst):
    """A DArray of typed PRNG keys moves like any array: its key data, bit for bit (its dtype is no numpy one)."""
    keys = jax.random.split(jax.random.key(0), 16).reshape(8, 2)
    x = jshard.distribute(keys, make_mesh((8,)), [Shard(0)])
    y = x.redistribute(dst)
    assert y.placements == tuple(dst) and y.dtype == keys.dtype
    for got in (y.full(), x.full()):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(keys)))


def test_rank0_and_empty_shards():
    rng = np.random.default_rng(2)
    run_pair((2, 4), (), (Partial(), Partial("avg")), (Replicate(), Partial()), rng)
    run_pair((2, 2, 2), (1, 3), (Shard(0), Shard(1), Shard(1)), (Shard(1), Shard(0), Partial("max")), rng)


SWEEP_SET = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg"), Partial("max")]


def sweep_pairs(every: int = 1):
    """The (src, dst) pairs of the sweep; ``every > 1`` keeps a stratified ``1 / every`` of them: each source
    with ``32 / every`` targets, and (the stride 5 being odd) each target with as many sources."""
    placements = [p for p in itertools.product(SWEEP_SET, repeat=2) if valid(p, (2, 4), 2)]
    assert len(placements) == 32
    n = len(placements)
    return [(placements[s], placements[(5 * s + k * every) % n]) for s in range(n) for k in range(n // every)]


@pytest.mark.parametrize("shape,every", [((6, 10), 8), pytest.param((6, 10), 1, marks=pytest.mark.slow),
                                         pytest.param((16, 24), 1, marks=pytest.mark.slow)],
                         ids=["uneven-6x10-eighth", "uneven-6x10", "even-16x24"])
def test_sweep_all_pairs_on_2x4(shape, every):
    """Every (src, dst) pair of {R, S(0), S(1), P(sum), P(avg), P(max)} per axis on mesh (2, 4) under -m slow;
    by default a stratified eighth of the uneven sweep (every placement as a source and as a target)."""
    mesh_shape = (2, 4)
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(3)
    value = rng.integers(-30, 30, size=shape).astype(np.float32)
    sources = {}
    pairs = sweep_pairs(every)
    assert len(pairs) == 32 * 32 // every and len({d for _, d in pairs}) == 32
    for src, dst in pairs:
        if src not in sources:
            sources[src] = jshard.from_local(local_blocks(value, mesh_shape, src, rng), mesh, src, shape=shape)
        check_darray(sources[src].redistribute(dst), value)


def test_exchange_with_no_rounds_still_reindexes():
    # found by the property test: the intermediate layout of a two-phase plan needed only local copies
    run_pair((2, 4), (2,), (Replicate(), StridedShard(0, 2)), (Shard(0), Replicate()), np.random.default_rng(5),
             check_hlo=True)


def test_reduction_over_two_axes_is_one_collective_with_bitwise_equal_replicas():
    mesh = make_mesh((2, 2, 2))
    rng = np.random.default_rng(7)
    parts = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(4)]  # not exact in float32
    locals_ = [parts[2 * a + c] for a in range(2) for _ in range(2) for c in range(2)]
    x = jshard.from_local(locals_, mesh, [Partial(), Replicate(), Partial()])
    plan = jshard.plan_redistribute(x, [Replicate()] * 3)
    assert [(s.kind, s.axes) for s in plan.steps] == [("all_reduce", ("x", "z"))]
    assert hlo_collectives(compile_plan(plan).lower(x.block).compile().as_text()) == {"all-reduce": 1}
    out = [np.asarray(a) for a in x.redistribute([Replicate()] * 3).to_local()]
    assert all(o.tobytes() == out[0].tobytes() for o in out)
    assert_close(out[0], np.sum(parts, axis=0), n=4, terms=np.sum(np.abs(parts), axis=0))


# FSDP inside TP: the data axis cuts dim 0 inside the tensor axis's block, (SS(0,4), S(0)) on (dp=2, tp=4)
TP_MAJOR = (StridedShard(0, 4), Shard(0))


@pytest.mark.parametrize("shape", [(64, 6), (13, 5)], ids=["even", "uneven"])
@pytest.mark.parametrize("src,dst,steps", [
    (TP_MAJOR, (Replicate(), Shard(0)), [("all_gather", ("dp",))]),  # FSDP's gather: the tp block, contiguous
    ((Partial(), Shard(0)), TP_MAJOR, [("reduce_scatter", ("dp",))]),  # its gradient: one reduce-scatter
    ((Partial("max"), Partial("max")), (Shard(1), Shard(1)), [("reduce_scatter", ("dp", "tp"))]),
    ((Partial("min"), Shard(0)), TP_MAJOR, [("reduce_scatter", ("dp",))]),
], ids=["fsdp-gather", "fsdp-grad", "max-scatter", "min-scatter"])
def test_one_collective_moves_only_the_block_a_device_keeps(shape, src, dst, steps):
    """The innermost cut of a dim, in shard order rather than mesh order, is gathered or scattered by one
    collective; P(max|min) scatter as P(sum) does (an all_to_all and a local max: the bytes of a psum_scatter)."""
    x, _, _ = run_pair((2, 4), shape, src, dst, np.random.default_rng(3), check_hlo=True)
    plan = jshard.plan_redistribute(x, dst)
    assert [(s.kind, s.axes) for s in plan.steps] == steps, str(plan)


def test_an_uneven_strided_shard_that_is_no_shard_order_is_not_gathered_as_one():
    """(SS(0,2), S(0)) cuts 9 rows on (a=4, b=2) so that the rows a b-column holds are not b's torch.chunk:
    gathering a alone would leave device (0, 1) without row 8 (hypothesis found it). Even rows keep the one
    all-gather of the shard order."""
    src, dst = (StridedShard(0, 2), Shard(0)), (Replicate(), Shard(0))
    x, _, _ = run_pair((4, 2), (9,), src, dst, np.random.default_rng(4), check_hlo=True)
    assert [s.kind for s in jshard.plan_redistribute(x, dst).steps] == ["all_gather", "slice"]
    x, _, _ = run_pair((4, 2), (16,), src, dst, np.random.default_rng(4), check_hlo=True)
    assert [(s.kind, s.axes) for s in jshard.plan_redistribute(x, dst).steps] == [("all_gather", ("a",))]


def test_every_uneven_strided_pair_plans_what_each_device_needs():
    """Every pair with a StridedShard on 9 rows of a (4, 2) mesh: building the lowering simulates every step on
    the layouts and raises unless each device ends with exactly the target's rows (the old planner failed 22 of
    the 800 checks, (P(sum), SS(0,2)) -> (SS(0,2), S(0)) among them)."""
    mesh = make_mesh((4, 2))
    opts = [Replicate(), Partial(), Shard(0), StridedShard(0, 2), StridedShard(0, 4)]
    specs = [jshard.spec.Spec.create(mesh, p, (9,), "float32") for p in itertools.product(opts, repeat=2)
             if valid(p, (4, 2), 1)]
    strided = [s for s in specs if any(isinstance(p, StridedShard) for p in s.placements)]
    for src, dst in itertools.chain(itertools.product(strided, specs), itertools.product(specs, strided)):
        lowering.local_program(jshard.plan_redistribute(src, dst.placements))


def test_a_nan_in_any_part_wins_a_max_scatter():
    mesh = make_mesh((2, 4))
    parts = [np.full((8, 4), float(i), np.float32) for i in range(8)]
    parts[5][6, 1] = np.nan
    parts[2][0, 0] = 100.0
    y = jshard.from_local(parts, mesh, [Partial("max")] * 2).redistribute([Shard(0), Shard(0)])
    got = np.asarray(y.full())
    want = np.max(parts, axis=0)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[6, 1]) and got[0, 0] == 100.0


# (shape, dtype, src, dst) moved side by side: even and uneven dims, dims 0 and 1, an avg, two steps, a strided
# target, an int and a bf16 (each dtype its own collective), a max (an all_to_all, never bucketed), and a
# megabyte a device each way (bandwidth-bound: moved alone)
TOGETHER = [
    ((16, 8), np.float32, (Partial(), Replicate()), (Shard(0), Replicate())),
    ((12,), np.float32, (Partial(), Replicate()), (Shard(0), Replicate())),
    ((5, 4), np.float32, (Partial(), Replicate()), (Shard(0), Replicate())),  # uneven: padded chunks
    ((8, 12), np.float32, (Replicate(), Partial()), (Replicate(), Shard(1))),
    ((8, 12), np.float32, (Partial("avg"), Replicate()), (Shard(1), Replicate())),
    ((16, 8), np.float32, (Partial(), Partial()), (Shard(0), Shard(1))),  # two steps, both reduce-scatters
    ((16, 4), np.float32, (Partial(), Shard(0)), (StridedShard(0, 4), Shard(0))),
    ((8, 4), np.int32, (Partial(), Replicate()), (Shard(0), Replicate())),
    ((8, 6), np.int32, (Partial(), Replicate()), (Shard(1), Replicate())),
    ((8, 4), jax.numpy.bfloat16, (Partial(), Replicate()), (Shard(1), Replicate())),
    ((8, 4), np.float32, (Partial("max"), Replicate()), (Shard(0), Replicate())),
    ((256, 1024), np.float32, (Partial(), Replicate()), (Shard(0), Replicate())),
    ((16, 8), np.float32, (Shard(0), Replicate()), (Replicate(), Replicate())),  # and gathers
    ((8, 12), np.float32, (Shard(1), Replicate()), (Replicate(), Replicate())),
    ((5, 4), np.float32, (Shard(0), Replicate()), (Replicate(), Replicate())),  # uneven: padding dropped
    ((16, 4), np.float32, (StridedShard(0, 4), Shard(0)), (Replicate(), Shard(0))),  # FSDP's gather under TP
    ((12,), np.int32, (Shard(0), Replicate()), (Replicate(), Replicate())),
    ((512, 1024), np.float32, (Shard(0), Replicate()), (Replicate(), Replicate())),
]


@pytest.mark.parametrize("bucket_bytes", [None, 600], ids=["one-bucket", "small-buckets"])
def test_moves_made_together_share_collectives(bucket_bytes, monkeypatch):
    """Independent moves run side by side: their latency-bound sum reduce-scatters (all-gathers) over one axes tuple
    and of one dtype are one psum_scatter (all_gather), cut into buckets of at most BUCKET_BYTES, a bandwidth-bound
    one goes alone, and every result is what each move gives alone. Priced with free kernels: by the default model
    these few small arrays over two or four devices do not save enough to pay for their packing (see the next
    test)."""
    if bucket_bytes is not None:
        monkeypatch.setattr(lowering, "BUCKET_BYTES", bucket_bytes)
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(11)
    values = [rng.integers(-30, 30, shape).astype(dtype) for shape, dtype, _, _ in TOGETHER]  # sums are exact
    xs = [jshard.from_local(local_blocks(v, (2, 4), src, rng), mesh, src, shape=v.shape)
          for v, (_, _, src, _) in zip(values, TOGETHER)]
    plans = [jshard.plan_redistribute(x, dst) for x, (_, _, _, dst) in zip(xs, TOGETHER)]
    with pricing(jshard.CostModel(kernel_us=0.0)):
        run = local_programs(plans)

    def body(*blocks):
        return [block_of(b) for b in run([local_of(b, p.src) for b, p in zip(blocks, plans)])]

    blocks = block_sharding(mesh)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(blocks.spec,) * len(xs), out_specs=[blocks.spec] * len(xs),
                               check_vma=False))
    outs = fn(*[x.block for x in xs])
    for x, out, p, v in zip(xs, outs, plans, values):
        check_darray(DArray(out, p.dst), v)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(compile_plan(p)(x.block)))
    text = fn.lower(*[x.block for x in xs]).as_text()
    scatters, gathers = text.count("stablehlo.reduce_scatter"), text.count("stablehlo.all_gather")
    alone = sum((plan_collectives(p) for p in plans), collections.Counter())
    assert (alone["reduce-scatter"], alone["all-gather"]) == (12, 6)
    assert gathers == 3  # float32 (528 bytes a device) and int32 over dp; the megabyte alone
    if bucket_bytes is None:
        # float32 over dp, float32 over tp, bfloat16 over dp, int32 over dp; then the two-step plan's second step;
        # the megabyte alone
        assert scatters == 6
    else:  # the float32s over dp, 512 + 48, 96 + 384, 512 + 64 bytes a device, in three buckets; the megabyte
        assert scatters == 8


@pytest.mark.parametrize("n, count, kernel_us, shared", [
    (2, 2, None, False),  # saves less than its kernels cost
    (8, 2, None, False),  # saves a fifth of the two collectives' cost: within the model's error
    (8, 4, None, True),  # saves half of the four collectives' cost
    (2, 2, 0.0, True),  # free kernels: saves half
], ids=["pair-two-devices", "pair-eight-devices", "four-eight-devices", "pair-two-devices-free-kernels"])
def test_sharing_pays_for_its_packing(n, count, kernel_us, shared):
    """Small all-gathers share one collective only where the latency it saves (launches and n - 1 hops each), less
    what the kernels packing and cutting the shared buffer cost, is at least ``MIN_SAVING`` of what they cost one by
    one. Each result is the global value either way."""
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    rng = np.random.default_rng(3)
    values = [rng.standard_normal(shape).astype(np.float32) for shape in [(16,), (16, 8), (16, 4), (16, 2)][:count]]
    xs = [jshard.distribute(v, mesh, [Shard(0)]) for v in values]
    plans = [jshard.plan_redistribute(x, [Replicate()]) for x in xs]
    with pricing(jshard.CostModel() if kernel_us is None else jshard.CostModel(kernel_us=kernel_us)):
        assert lowering.shared_collectives(plans) == ([[(i, 0) for i in range(count)]] if shared else [])
        run = local_programs(plans)

    def body(*blocks):
        return [block_of(b) for b in run([local_of(b, p.src) for b, p in zip(blocks, plans)])]

    blocks = block_sharding(mesh)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(blocks.spec,) * count, out_specs=[blocks.spec] * count,
                               check_vma=False))
    for out, p, v in zip(fn(*[x.block for x in xs]), plans, values):
        check_darray(DArray(out, p.dst), v)
    assert fn.lower(*[x.block for x in xs]).as_text().count("stablehlo.all_gather") == (1 if shared else count)
