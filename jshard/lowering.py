"""Lowering: turning a redistribution plan into one compiled ``shard_map`` program.

Every step of a plan becomes one JAX collective over a mesh-axis tuple (``all_gather``, ``psum`` /
``pmax`` / ``pmin``, ``psum_scatter``, ``all_to_all``) or a local operation, plus, where the layout
needs it, a static re-indexing of one tensor dim on each device. The re-indexing tables are not derived
case by case: the lowering *simulates* which global indices every device holds before the step and in
the collective's buffer, and looks up where each index of the step's target layout sits. That one
mechanism handles uneven shards (padding is dropped, never read as a value), StridedShard permutations
and any axis-tuple order; a table that turns out to be the identity, or a contiguous window, becomes a
no-op or a slice.

Between steps a device always holds the canonical padded block of the current placements, so a program
can stop or start at any step.

Reductions follow single-device semantics: a NaN in any part of a ``Partial(max|min)`` makes the result NaN
(``ordered_reduce``: one collective on order-preserving integer keys), and replicas are bitwise equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from .caches import memo
from .exchange import exchange_schedule
from .local import PerDevice, at_origin, coordinates_read_once, opaque_ints, reduce_identity
from .planner import Plan, Step, mean_carrier, model_in_force
from .spec import Spec, block_of, block_sharding, local_of

__all__ = ["BUCKET_BYTES", "MIN_SAVING", "compile_plan", "local_program", "local_programs", "ordered_reduce",
           "reduce_identity", "shared_collectives"]

# the most a device's buffer of reduce-scatters sharing one collective holds (XLA:GPU's combiners use a few tens of
# MB too): bigger buckets save no latency, and every array in one waits for the last to be ready
BUCKET_BYTES = 32 << 20

# the least share of its collectives' one-by-one cost that a shared collective must save (``_pays_to_share``)
MIN_SAVING = 1 / 3


@memo(4096)
def compile_plan(plan: Plan, *, global_in: bool = False, global_out: bool = False) -> Callable:
    """A jitted function running ``plan`` on block storage.

    ``global_in``: the input is the global value, replicated (the plan must start all-Replicate).
    ``global_out``: the output is the global value (the plan must end all-Replicate, hence unpadded).
    """
    mesh = plan.src.mesh
    run = local_program(plan)

    @coordinates_read_once()
    def body(x):
        x = run(x if global_in else local_of(x, plan.src))
        return x if global_out else block_of(x)

    blocks = block_sharding(mesh)
    fn = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec() if global_in else blocks.spec,
                       out_specs=PartitionSpec() if global_out else blocks.spec, check_vma=False)
    return jax.jit(fn, out_shardings=NamedSharding(mesh, PartitionSpec()) if global_out else blocks)


def local_program(plan: Plan) -> Callable:
    """The per-device function of ``plan``: a padded local block in, the target's padded block out.

    Call it inside ``shard_map`` over all mesh axes (it uses collectives and ``axis_index``).
    """
    run = local_programs([plan])
    return lambda x: run([x])[0]


def local_programs(plans: Sequence[Plan]) -> Callable[[list], list]:
    """The per-device function of independent ``plans`` run side by side: their padded blocks in, a list of
    their targets' blocks out.

    Sum reduce-scatters (and all-gathers) that the plans make at the same step, over the same mesh axes and of
    one dtype, share one ``psum_scatter`` (``all_gather``) of a buffer holding them all (at most ``BUCKET_BYTES``
    a device): one rendezvous of the devices instead of one per array, as XLA's combiner does for all-reduces (it
    has none for these on CPU). Only latency-bound ones share (by the default cost model, up to 0.1-0.6 MB a
    device by kind and group size): a larger array saves little latency and would be copied into and out of the
    buffer; and a bucket shares only where the latency it saves, less the kernels that pack and cut it, is a clear
    share of what its collectives cost one by one (``MIN_SAVING``). A training step's gradients, each
    reduce-scattered to its parameter's shard, go together so, and so do the gathers of a block's sharded
    parameters (a module's two are not worth it); ``shared_collectives`` says which steps share.

        >>> import jax, numpy as np, jshard
        >>> from jshard import Partial, Shard
        >>> mesh = jax.make_mesh((8,), ("dp",))
        >>> grads = [jshard.from_local([np.ones(s, np.float32)] * 8, mesh, [Partial()]) for s in [(8, 4), (16,)]]
        >>> plans = [jshard.plan_redistribute(g, [Shard(0)]) for g in grads]
        >>> run = local_programs(plans)   # inside shard_map: a, b = run([block_a, block_b])
    """
    lowered = [[_lower_step(p.src.mesh, step, p.src) for step in p.steps] for p in plans]
    buckets = _buckets(plans)

    def run(blocks):
        blocks = list(blocks)
        for k, rounds in enumerate(buckets):
            for bucket in rounds:
                step = lowered[bucket[0]][k]
                results = step.together([lowered[i][k] for i in bucket], [blocks[i] for i in bucket])
                for i, r in zip(bucket, results, strict=True):
                    blocks[i] = r
            bucketed = {i for bucket in rounds for i in bucket}
            for i, steps in enumerate(lowered):
                if k < len(steps) and i not in bucketed:
                    blocks[i] = steps[k](blocks[i])
        return blocks

    return run


def shared_collectives(plans: Sequence[Plan]) -> list[list[tuple[int, int]]]:
    """The collectives that ``local_programs(plans)`` shares between plans: per shared one, its ``(plan index,
    step index)`` pairs.

        >>> import jax, numpy as np, jshard
        >>> mesh = jax.make_mesh((8,), ("dp",))
        >>> grads = [jshard.from_local([np.ones(s, np.float32)] * 8, mesh, [jshard.Partial()])
        ...          for s in [(8,), (4, 2), (16,)]]
        >>> shared_collectives([jshard.plan_redistribute(g, [jshard.Shard(0)]) for g in grads])  # one reduce-scatter
        [[(0, 0), (1, 0), (2, 0)]]
        >>> shared_collectives([jshard.plan_redistribute(g, [jshard.Shard(0)]) for g in grads[:2]])  # a pair: no
        []
    """
    return [[(i, k) for i in bucket] for k, rounds in enumerate(_buckets(plans)) for bucket in rounds
            if len(bucket) > 1]


def _buckets(plans: Sequence[Plan]) -> list[list[list[int]]]:
    """Per step index, the plans whose sum reduce-scatters (all-gathers) at that step share a collective: grouped
    by kind, axes and dtype, in order, cut where a bucket would pass ``BUCKET_BYTES`` a device (a larger one goes
    alone); a bucket whose sharing does not pay (``_pays_to_share``) goes one by one."""
    out = []
    for k in range(max((len(p.steps) for p in plans), default=0)):
        groups: dict = {}
        for i, p in enumerate(plans):
            step = p.steps[k] if k < len(p.steps) else None
            if step is not None and _shares(step, p):
                groups.setdefault((step.kind, step.axes, p.src.dtype), []).append(i)
        rounds = []
        for members in groups.values():
            rounds.append([])
            held = 0
            for i in members:
                size = int(plans[i].steps[k].bytes)
                if rounds[-1] and held + size > BUCKET_BYTES:
                    rounds.append([])
                    held = 0
                rounds[-1].append(i)
                held += size
        out.append([r for bucket in rounds for r in
                    ([bucket] if _pays_to_share([plans[i] for i in bucket], k) else [[i] for i in bucket])])
    return out


def _pays_to_share(plans: list[Plan], k: int) -> bool:
    """Do the plans' steps ``k`` (one kind, axes and dtype) cost clearly less in one collective than in one each,
    by the cost model in force: the launches and hops it saves, less the kernels that pack the shared buffer and
    cut it (one, and one per array) and the bytes they copy, must be at least ``MIN_SAVING`` of what the
    collectives cost one by one. A smaller saving is within the model's error, and the kernels are paid for again
    by every compilation of the program. Measured on the toy GPT (XLA:CPU): a module's two parameters gathered
    together made the step 10-20% slower over two devices (by the model: a loss) and no faster over eight (by the
    model: a 19-26% saving), and the program took 0.1-0.2 s longer to compile; the 38 gradients of a step
    reduce-scattered together (by the model: 50% over two devices, 74% over eight) made it ~10% faster."""
    steps = [p.steps[k] for p in plans]
    n, fixed = _group_and_latency(steps[0], plans[0])
    out_per_in = n if steps[0].kind == "all_gather" else 1 / n
    copied = sum(s.bytes for s in steps) * (1 + out_per_in)
    model = model_in_force()
    alone = sum(model.collective(s.kind, s.axes, n, s.bytes) for s in steps)
    saved = (len(steps) - 1) * fixed - model.local(copied, kernels=len(steps) + 1)
    return saved > 0 and saved >= MIN_SAVING * alone


def _shares(step: Step, plan: Plan) -> bool:
    """May ``step`` share its collective: a sum reduce-scatter or an all-gather whose collective costs about as much
    in latency as in bytes, or more (by the cost model in force)? A larger array gains little from sharing the
    latency and pays for being copied into and out of the shared buffer."""
    if not (step.kind == "all_gather" or (step.kind, step.op) == ("reduce_scatter", "sum")):
        return False
    if step.scale != 1 and mean_carrier(plan.src.dtype) is not None:
        return False  # an integer average scatters (quotient, remainder) pairs: not the blocks of its dtype
    n, fixed = _group_and_latency(step, plan)
    return model_in_force().collective(step.kind, step.axes, n, step.bytes) <= 2 * fixed


def _group_and_latency(step: Step, plan: Plan) -> tuple[int, float]:
    """The devices in ``step``'s collective, and what it costs without its bytes (launch and hops)."""
    n = math.prod(plan.src.mesh.shape[a] for a in step.axes)
    return n, model_in_force().collective(step.kind, step.axes, n, 0)


# ---------------------------------------------------------------------------------------------------
# layout simulation


def _layouts(spec: Spec, placements) -> tuple[np.ndarray, ...]:
    return spec.with_placements(placements, where="lowering").layouts


def _group_concat(layout: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Per device, the concatenation (in axis-tuple order) of the layouts of its group over ``axes``.

    Applied to the current layout it is an all_gather's buffer; applied to the target layout it is the
    buffer a tiled psum_scatter / all_to_all must be given (chunk t goes to the member with index t)."""
    mesh_shape, m = layout.shape[:-1], layout.shape[-1]
    k, group = len(mesh_shape), tuple(mesh_shape[a] for a in axes)
    rank = k + len(group) + 1
    index = []
    for a, n in enumerate(mesh_shape):
        at = k + axes.index(a) if a in axes else a  # on a grouped axis the member's coordinate is its group index
        index.append(np.arange(n).reshape([n if i == at else 1 for i in range(rank)]))
    index.append(np.arange(m).reshape((1,) * (rank - 1) + (m,)))
    return np.broadcast_to(layout[tuple(index)], mesh_shape + group + (m,)).reshape(mesh_shape + (-1,))


def _find(buffer: np.ndarray, target: np.ndarray, *, fill: int | None, what: str) -> np.ndarray:
    """Positions in ``buffer`` of each global index in ``target`` (per device; -1 = don't care).

    A target index missing from the buffer becomes ``fill`` when given (a position holding the identity),
    else it is an internal error: the plan would read a value the device does not have.
    """
    rows, m = int(np.prod(buffer.shape[:-1], dtype=int)), buffer.shape[-1]
    buf, tgt = buffer.reshape(rows, m).astype(np.int64), target.reshape(rows, -1).astype(np.int64)
    # one sorted search over all devices at once: (device row, global index) as a single key
    span = int(max(buf.max(initial=0), tgt.max(initial=0))) + 1
    keys = np.append(np.where(buf >= 0, buf + span * np.arange(rows)[:, None], -1).ravel(), -1)  # never empty
    order = np.argsort(keys, kind="stable")
    want = tgt + span * np.arange(rows)[:, None]
    at = order[np.clip(np.searchsorted(keys, want, sorter=order), 0, keys.size - 1)]
    need, found = tgt >= 0, keys[at] == want
    missing = need & ~found
    if fill is None and missing.any():
        r, j = np.argwhere(missing)[0]
        device = tuple(int(c) for c in np.unravel_index(r, buffer.shape[:-1]))
        raise AssertionError(f"lowering bug in {what}: device {device} needs index {tgt[r, j]} it does not hold")
    return np.where(need, np.where(found, at % max(m, 1), -1 if fill is None else fill), -1).reshape(target.shape)


# ---------------------------------------------------------------------------------------------------
# emitting JAX


def _sortable_int(dtype) -> np.dtype | None:
    """The signed int type of a float's width when the float is sign-magnitude with NaN at the all-ones
    magnitude (IEEE formats: f16, bf16, f32, f64, f8 e4m3fn/e5m2), else None (no NaN-ordered key)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    ints = np.dtype(f"int{np.dtype(dtype).itemsize * 8}")
    top = np.array([np.iinfo(ints).max, -1], ints).view(dtype)  # +/- all-ones magnitude
    return ints if np.isnan(top.astype(np.float32)).all() else None


def ordered_reduce(op: str, x, axes):
    """``pmax`` / ``pmin`` over ``axes`` where a NaN in any part gives NaN, as ``jnp.maximum`` does on one
    device (XLA's cross-device max/min may skip NaN).

    Floats are reduced as integer keys in one collective: flipping the magnitude bits of negative floats
    makes signed-int order equal float order (-0.0 sorts just below +0.0), and a NaN becomes the largest key
    for max, the smallest for min, so it wins. The map is its own inverse; the winning key's float is the
    result, identical on every device.
    """
    reduce = lax.pmax if op == "max" else lax.pmin
    ints = _sortable_int(x.dtype)
    if ints is None:
        return reduce(x, axes)
    info = np.iinfo(ints)
    flip = lambda i: i ^ ((i >> (info.bits - 1)) & info.max)  # arithmetic shift: all ones on negatives
    key = jnp.where(jnp.isnan(x), info.max if op == "max" else info.min, flip(lax.bitcast_convert_type(x, ints)))
    return lax.bitcast_convert_type(flip(reduce(key, axes)), x.dtype)


class _Select:
    """Re-index one tensor dim with a per-device table, as cheaply as its shape allows."""

    def __init__(self, table: np.ndarray, buffer_len: int, names: tuple[str, ...], dim: int):
        self.dim, self.m = dim, table.shape[-1]
        valid = table >= 0
        offsets = table - np.arange(self.m)
        first = valid.argmax(axis=-1)[..., None]
        starts = np.where(valid.any(axis=-1), np.take_along_axis(offsets, first, axis=-1)[..., 0], 0)
        contiguous = (bool(np.all(~valid | (offsets == starts[..., None])))
                      and bool(np.all((starts >= 0) & (starts + self.m <= buffer_len))))
        self.slice = contiguous
        # a slice reads its start as a scalar (no index op to take it out of a row)
        self.rows = PerDevice(starts.astype(np.int32) if contiguous else np.where(valid, table, 0), names)
        self.identity = contiguous and not self.rows.axes and int(self.rows.values) == 0 and self.m == buffer_len

    def __call__(self, x):
        if self.identity:
            return x
        row = self.rows()
        if self.slice:
            if not self.rows.axes:
                return lax.slice_in_dim(x, int(row), int(row) + self.m, axis=self.dim)
            # starts are never negative: no wrap-around code per slice
            return lax.dynamic_slice_in_dim(x, row, self.m, axis=self.dim, allow_negative_indices=False)
        return jnp.take(x, jnp.asarray(row, dtype=jnp.int32), axis=self.dim, mode="clip")


class _Mean:
    """A sum that an average divides by ``n``: the parts themselves for inexact dtypes (the sum, then ``/ n``);
    for integers the pairs ``(p // n, p % n)`` of ``mean_carrier`` on a new last axis (one collective moves
    both, whatever dim it scatters), and ``sum(p // n) + sum(p % n) // n`` after it, the exact ``floor(S / n)``
    that the dtype could not hold the sum of."""

    def __init__(self, n: int, dtype):
        self.n, self.dtype, self.carrier = n, dtype, mean_carrier(dtype) if n != 1 else None

    def split(self, x):
        if self.carrier is None:
            return x
        q, r = jnp.divmod(x.astype(self.carrier), self.n)  # floor division: 0 <= r < n
        return jnp.stack([q, r], axis=-1)

    def join(self, total):
        if self.n == 1:
            return total
        if self.carrier is None:
            return total / jnp.asarray(self.n, total.dtype)
        # the quotients' sum wraps modulo 2**bits like any integer sum; floor(S / n) is in range
        return (total[..., 0] + total[..., 1] // self.n).astype(self.dtype)


class _ReduceScatter:
    """A sum reduce-scatter step kept in its parts (re-index, collective, mean), so that several can share one
    collective (``together``)."""

    def __init__(self, pre: _Select, axes: tuple[str, ...], dim: int, group: int, mean: _Mean):
        self.pre, self.axes, self.dim, self.group, self.mean = pre, axes, dim, group, mean

    def __call__(self, x):
        x = self.mean.split(self.pre(x))
        return self.mean.join(lax.psum_scatter(x, self.axes, scatter_dimension=self.dim, tiled=True))

    @staticmethod
    def together(steps: list[_ReduceScatter], blocks: list) -> list:
        """``steps`` (one axes tuple, one dtype) on ``blocks`` with one ``psum_scatter``: each block's chunks, the
        one for group member t in row t, side by side in a (group, total) buffer whose row t goes to member t."""
        if len(steps) == 1:
            return [steps[0](blocks[0])]
        g = steps[0].group
        rows, shapes = [], []
        for step, x in zip(steps, blocks, strict=True):
            x, d = step.pre(x), step.dim
            split = x.shape[:d] + (g, x.shape[d] // g) + x.shape[d + 1:]
            rows.append(_move_axis(x.reshape(split), d, 0).reshape(g, -1))  # no copy where d is 0
            shapes.append(split[:d] + split[d + 1:])
        mine = lax.psum_scatter(jnp.concatenate(rows, axis=1), steps[0].axes, scatter_dimension=0, tiled=True)[0]
        pieces = _cut(mine, [math.prod(shape) for shape in shapes], steps[0].axes[0])
        return [step.mean.join(piece.reshape(shape)) for step, piece, shape in zip(steps, pieces, shapes, strict=True)]


class _AllGather:
    """An all-gather step kept in its parts (collective, re-index), so that several can share one collective
    (``together``)."""

    def __init__(self, axes: tuple[str, ...], dim: int, group: int, select: _Select):
        self.axes, self.dim, self.group, self.select = axes, dim, group, select

    def __call__(self, x):
        return self.select(lax.all_gather(x, self.axes, axis=self.dim, tiled=True))

    @staticmethod
    def together(steps: list[_AllGather], blocks: list) -> list:
        """``steps`` (one axes tuple, one dtype) on ``blocks`` with one ``all_gather`` of their blocks laid end to
        end: row t of the result is member t's, each block's part of it that member's block."""
        if len(steps) == 1:
            return [steps[0](blocks[0])]
        g = steps[0].group
        every = lax.all_gather(jnp.concatenate([x.reshape(-1) for x in blocks]), steps[0].axes, axis=0)
        out = []
        pieces = _cut(every, [x.size for x in blocks], steps[0].axes[0], axis=1)
        for step, x, piece in zip(steps, blocks, pieces, strict=True):
            d = step.dim  # members' blocks side by side along d, in group order, as a tiled all_gather puts them
            piece = _move_axis(piece.reshape((g,) + x.shape), 0, d)
            out.append(step.select(piece.reshape(x.shape[:d] + (g * x.shape[d],) + x.shape[d + 1:])))
        return out


def _move_axis(x, src: int, dst: int):
    """``jnp.moveaxis`` as one transpose, or nothing where ``src == dst``: a bucket moves dozens of blocks, and
    each jnp call would be a jitted function traced anew."""
    if src == dst:
        return x
    order = [a for a in range(x.ndim) if a != src]
    order.insert(dst, src)
    return lax.transpose(x, order)


def _cut(buffer, sizes: list[int], axis_name: str, axis: int = 0) -> list:
    """``buffer`` cut into consecutive pieces of ``sizes`` along ``axis``, at opaque offsets: each piece's kernel
    is its shape's, not one per offset (XLA compiles each distinct kernel once)."""
    offsets = opaque_ints(np.cumsum([0] + sizes[:-1]).tolist(), axis_name)
    return [lax.dynamic_slice_in_dim(buffer, at, n, axis=axis, allow_negative_indices=False)
            for at, n in zip(offsets, sizes, strict=True)]


def _exchange(mesh, step: Step, spec: Spec) -> Callable:
    """Rounds of ppermute, each sending one sub-block per device (see ``jshard.exchange``)."""
    names = tuple(mesh.axis_names)
    mesh_shape = tuple(mesh.axis_sizes)
    src, dst = spec.with_placements(step.src), spec.with_placements(step.dst)
    schedule = exchange_schedule(src, dst)
    padded = dst.local_block_shape
    n = len(list(np.ndindex(*mesh_shape)))

    def tables(transfers, shape):
        send = [np.zeros((n, m), dtype=np.int32) for m in shape]
        recv = [np.full((n, m), padded[d], dtype=np.int32) for d, m in enumerate(shape)]  # padding -> spare slot
        for t in transfers:
            for d in range(len(shape)):
                send[d][t.source, : len(t.src_pos[d])] = t.src_pos[d]
                recv[d][t.target, : len(t.dst_pos[d])] = t.dst_pos[d]
        wrap = lambda ts: [PerDevice(a.reshape(mesh_shape + a.shape[-1:]), names) for a in ts]
        return wrap(send), wrap(recv)

    local = None
    if schedule.local:
        local = tables(schedule.local, tuple(max(s) for s in zip(*(t.shape for t in schedule.local), strict=True)))
    rounds = [(tables(r, schedule.round_shape(i)), [(t.source, t.target) for t in r])
              for i, r in enumerate(schedule.rounds)]

    def run(x):
        ix = lambda rows: jnp.ix_(*[jnp.asarray(r()) for r in rows])
        out = jnp.zeros(tuple(p + 1 for p in padded), x.dtype)
        if local is not None:
            out = out.at[ix(local[1])].set(x[ix(local[0])])
        for (send, recv), pairs in rounds:
            out = out.at[ix(recv)].set(lax.ppermute(x[ix(send)], names, pairs))
        return out[tuple(slice(0, p) for p in padded)]

    return run


def _permute(mesh, step: Step, cur, tgt) -> Callable:
    """Device c takes the block of the device whose coordinate on axis i is c's on axis perm[i]."""
    names = tuple(mesh.axis_names)
    sigma = step.perm
    moved = [i for i in range(len(sigma)) if sigma[i] != i]
    sizes = [mesh.axis_sizes[i] for i in moved]
    pairs = []
    for t in np.ndindex(*sizes):
        coord = dict(zip(moved, t, strict=True))
        source = tuple(coord[sigma[i]] for i in moved)
        pairs.append((int(np.ravel_multi_index(source, sizes)), int(np.ravel_multi_index(t, sizes))))
    for c in np.ndindex(*mesh.devices.shape):
        src = tuple(c[sigma[i]] for i in range(len(sigma)))
        if not all(np.array_equal(a[src], b[c]) for a, b in zip(cur, tgt, strict=True)):
            raise AssertionError(f"lowering bug in {step}: device {c} would not receive its target block")
    axes = tuple(names[i] for i in moved)  # ppermute numbers devices in mesh order whatever the tuple order
    return lambda x: lax.ppermute(x, axes, pairs)


def _lower_step(mesh, step: Step, spec: Spec) -> Callable:
    names = tuple(mesh.axis_names)
    axis_of = {n: i for i, n in enumerate(names)}
    axes = tuple(axis_of[a] for a in step.axes)
    cur, tgt = _layouts(spec, step.src), _layouts(spec, step.dst)
    what = str(step)
    dtype = spec.dtype

    mean = _Mean(step.scale, dtype)
    group = int(np.prod([mesh.axis_sizes[a] for a in axes]))
    if step.kind == "all_gather":  # _buckets relies on this: every all-gather can share a collective
        d = step.dim
        buf = _group_concat(cur[d], axes)
        return _AllGather(step.axes, d, group, _Select(_find(buf, tgt[d], fill=None, what=what), buf.shape[-1],
                                                       names, d))

    if step.kind == "all_reduce":
        if step.op == "sum":
            return lambda x: mean.join(lax.psum(mean.split(x), step.axes))
        return lambda x: ordered_reduce(step.op, x, step.axes)

    if step.kind == "reduce_scatter":
        d = step.dim
        pre = _Select(_find(cur[d], _group_concat(tgt[d], axes), fill=None, what=what), cur[d].shape[-1], names, d)
        if step.op == "sum":  # _buckets relies on this: every sum reduce-scatter can share a collective
            return _ReduceScatter(pre, step.axes, d, group, mean)
        reduce = jnp.max if step.op == "max" else jnp.min  # NaN wins, as in ordered_reduce

        def scatter_extreme(x):  # psum_scatter sums only: each device's chunk from every device, then reduced
            x = pre(x)
            x = x.reshape(x.shape[:d] + (group, x.shape[d] // group) + x.shape[d + 1:])
            return reduce(lax.all_to_all(x, step.axes, d, d, tiled=True), axis=d)

        return scatter_extreme

    if step.kind == "permute":
        return _permute(mesh, step, cur, tgt)

    if step.kind == "exchange":
        return _exchange(mesh, step, spec)

    if step.kind == "empty":
        block = spec.with_placements(step.dst).local_block_shape
        return lambda x: jnp.zeros(block, x.dtype)

    if step.kind == "all_to_all":
        d, e = step.dim, step.split_dim
        pre = _Select(_find(cur[e], _group_concat(tgt[e], axes), fill=None, what=what), cur[e].shape[-1], names, e)
        buf = _group_concat(cur[d], axes)
        post = _Select(_find(buf, tgt[d], fill=None, what=what), buf.shape[-1], names, d)
        return lambda x: post(lax.all_to_all(pre(x), step.axes, e, d, tiled=True))

    # local steps: re-index every dim whose layout changed (slice; fill puts the identity around the
    # device's own shard), then keep a new Partial(sum)'s value on coordinate 0 only (partition)
    changed = [d for d in range(len(cur)) if not np.array_equal(cur[d], tgt[d])]
    fill_op = next((q.op for p, q in zip(step.src, step.dst, strict=True) if p.is_shard and q.is_partial), None)
    selects = []
    for d in changed:
        fill = cur[d].shape[-1] if fill_op is not None else None
        selects.append(_Select(_find(cur[d], tgt[d], fill=fill, what=what), cur[d].shape[-1] + (fill is not None),
                               names, d))
    identity = reduce_identity(fill_op, dtype) if fill_op is not None else None
    zeroed = tuple(names[a] for a, (p, q) in enumerate(zip(step.src, step.dst, strict=True))
                   if p.is_replicate and q.is_partial and q.op == "sum" and mesh.axis_sizes[a] > 1)

    def local(x):
        for sel in selects:
            if identity is not None:
                pad = list(x.shape)
                pad[sel.dim] = 1
                x = jnp.concatenate([x, jnp.full(pad, identity, x.dtype)], axis=sel.dim)
            x = sel(x)
        if zeroed:
            x = lax.select(lax.broadcast(at_origin(zeroed), x.shape), x, lax.full_like(x, 0))
        return x

    return local
