"""Gather and the scatter family: which dims a lookup carries through, and how a sharded table answers.

A ``gather`` reads, for every *batch* position of its indices, one slice of the operand; the slice's
dims become the output's *offset* dims. Per mesh axis that leaves four ways to stay sharded:

- **pass-through**: an operand dim read whole by every slice (``slice_sizes[d] == operand.shape[d]``, not
  indexed) keeps its shard on the matching offset dim; the local gather reads the local block whole;
- **batch**: an indices batch dim keeps its shard on the output's batch dim (operand Replicate). When it
  is paired with an operand *batching* dim (``take_along_axis``), the operand may be sharded the same
  way, or Replicate: then each device first takes its own rows of the operand;
- **row-sharded table** (the embedding lookup): an indexed dim read one row at a time (slice size 1) may
  stay sharded with the indices Replicate. Each device looks up the ids it owns, shifted to its block,
  and puts the reduction's identity elsewhere: the output is ``P(sum)`` (or ``P(max)`` / ``P(min)``, with
  -inf / +inf as the identity) and the pending sum completes the lookup;
- **Partial operand**: a gather only selects elements, so any pending reduction passes through.

Out-of-range starts follow the mode *globally*: ``CLIP`` (and ``PROMISE_IN_BOUNDS``, which XLA clamps)
clamp to the global shape before a device looks for its rows; ``FILL_OR_DROP`` puts ``fill_value`` in
the slice, and since a pending sum would add the fill of every device, only coordinate 0 of the
``P(sum)`` axes keeps it, the others get 0. An integer ``P(avg)`` under ``FILL_OR_DROP`` is not offered:
``n`` copies of the default fill (the lowest integer) overflow before the division.

``scatter``, ``scatter-add``, ``-sub``, ``-mul``, ``-min``, ``-max`` mirror it: an operand dim covered
whole by every update window keeps its shard together with the updates' window dim; an indexed dim with
windows of one row may be sharded (each device applies the updates that land in its rows and drops the
others); batching dims are sharded together. Updates sharded along a scatter dim, with the indices sharded
the same way, leave each device with part of the updates: for ``scatter-add`` / ``-sub`` the result is
``P(sum)`` (the operand's ``R -> P(sum)`` is free and exact: this keeps embedding gradients pending), for
``scatter-max`` / ``-min`` it is ``P(max)`` / ``P(min)``. Which pending reductions survive the combiner
with Replicate indices is the combiner's algebra (``+`` is linear and shifts max/min; ``*`` by a
replicated factor is linear; ``max`` and ``min`` are monotone and idempotent; a plain ``scatter``
overwrites, so it passes whatever the operand and updates share). Rules that would need each position to
receive one update are offered only under ``unique_indices``.

>>> import jax.numpy as jnp; from jax import lax; from jax.core import ShapedArray
>>> dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
>>> table, ids = ShapedArray((50, 8), jnp.float32), ShapedArray((6, 1), jnp.int32)
>>> out, clip = ShapedArray((6, 8), jnp.float32), lax.GatherScatterMode.CLIP
>>> _gather((table, ids), (out,), dict(dimension_numbers=dn, slice_sizes=(1, 8), mode=clip))[:5]
[(Φ1, Φ1, R), (Φ0, R, Φ0), (P(sum), Φ0, R), (P(max), Φ0, R), (P(min), Φ0, R)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..local import PerDevice, at_origin, global_index, reduce_identity
from ..spec import Spec
from .algebra import AVG, MAX, MIN, ORDER, PARTIALS, SUM, R, inexact, linear, linear_in, monotone, swapped
from .registry import ShardPlaceholder as Φ
from .registry import register

__all__ = ["local_position"]

_FILL = lax.GatherScatterMode.FILL_OR_DROP


def _mode(params) -> lax.GatherScatterMode:
    return lax.GatherScatterMode.from_any(params["mode"])


def _kept(rank: int, dropped: Sequence[int]) -> list[int]:
    """Operand dims that appear in a slice / update window, in order (the others are dropped)."""
    return [d for d in range(rank) if d not in dropped]


# ---------------------------------------------------------------------------------------------------
# where a device keeps a global index


def local_position(spec: Spec, dim: int, g):
    """Where this device keeps global index ``g`` (any int array) of ``dim``: ``(position, owned)``.

    ``owned`` is False for indices outside ``[0, size)`` and for those held by other devices; ``position``
    is then meaningless. Layouts where every device holds a contiguous range (any chain of ``Shard``)
    need only its start; others (``StridedShard``) use a per-device inverse table.
    """
    lay = spec.layouts[dim]
    names = tuple(spec.mesh.axis_names)
    counts = (lay >= 0).sum(-1)
    starts = np.where(counts > 0, lay[..., 0], 0)
    if np.array_equal(lay, np.where(lay >= 0, starts[..., None] + np.arange(lay.shape[-1]), -1)):
        pos = g - jnp.asarray(PerDevice(starts, names)()).astype(g.dtype)
        return pos, (pos >= 0) & (pos < jnp.asarray(PerDevice(counts, names)()).astype(g.dtype))
    inverse = np.full(lay.shape[:-1] + (spec.shape[dim],), -1, dtype=np.int32)
    for c in np.ndindex(*lay.shape[:-1]):
        row = lay[c]
        inverse[c + (row[row >= 0],)] = np.flatnonzero(row >= 0)
    clipped = jnp.clip(g, 0, spec.shape[dim] - 1)
    pos = jnp.asarray(PerDevice(inverse, names)())[clipped].astype(g.dtype)
    return pos, (pos >= 0) & (clipped == g)


def _rows_table(src: Spec, sd: int, dst: Spec, dd: int) -> PerDevice:
    """Static per-device positions, in ``src``'s block along ``sd``, of the global indices ``dst`` holds
    along ``dd`` (padding -> 0)."""
    src_lay, dst_lay = src.layouts[sd], dst.layouts[dd]
    table = np.zeros(dst_lay.shape, dtype=np.int32)
    for c in np.ndindex(*dst_lay.shape[:-1]):
        where = {int(g): i for i, g in enumerate(src_lay[c]) if g >= 0}
        table[c] = [where.get(int(g), 0) for g in dst_lay[c]]
    return PerDevice(table, tuple(src.mesh.axis_names))


def _rows_within(inner: Spec, di: int, outer: Spec, do: int) -> bool:
    """Does every device hold, along ``do`` of ``outer``, each global index it holds along ``di`` of
    ``inner``? (A Replicate-then-take operand must have the rows its indices ask for.)"""
    if not outer.chain(do) or (inner.shape[di], inner.chain(di)) == (outer.shape[do], outer.chain(do)):
        return True  # the operand whole there, or cut as the indices are
    # the layouts vary along their chains' axes only: one device per combination of coordinates there
    axes = {ax for ax, _ in inner.chain(di) + outer.chain(do)}
    pick = tuple(slice(None) if ax in axes else slice(0, 1) for ax in range(len(inner.mesh_shape)))
    a, b = inner.layouts[di][pick], outer.layouts[do][pick]
    return all(np.isin(a[c][a[c] >= 0], b[c]).all() for c in np.ndindex(*a.shape[:-1]))


def _take_rows(pairs: list[tuple[int, PerDevice]]) -> Callable:
    """Replace the operand's rows along each dim by the rows its table names (batching dims)."""

    def take(x):
        for d, table in pairs:
            x = jnp.take(x, jnp.asarray(table()), axis=d)
        return x

    return take


def _require_batch_indices(name: str, idx: Spec) -> None:
    """Indices are only ever Replicate or sharded on batch dims: a pending sum of ids, or an index vector
    split across devices, names no element (the rules never offer them; refuse instead of guessing)."""
    if any(p.is_partial for p in idx.placements) or idx.chain(idx.rank - 1):
        raise ValueError(f"{name}: indices {idx} must be Replicate or sharded on batch dims")


def _with_column(idx, k: int, column):
    """``idx`` with its last dim's entry ``k`` replaced by ``column``: slices and a concatenate, which fuse into
    what reads them (``idx.at[..., k].set`` is a scatter, which XLA:CPU expands into a loop)."""
    return jnp.concatenate([idx[..., :k], column[..., None].astype(idx.dtype), idx[..., k + 1:]], axis=-1)


# ---------------------------------------------------------------------------------------------------
# gather


def _gather_parts(op_rank: int, out_rank: int, dn) -> tuple[list[int], list[int]]:
    """``(window, batch)``: the operand dims of the slice (in offset-dim order) and the output batch dims
    (in indices-dim order)."""
    window = _kept(op_rank, dn.collapsed_slice_dims + dn.operand_batching_dims)
    batch = [o for o in range(out_rank) if o not in dn.offset_dims]
    return window, batch


def _holds_batch_rows(op: Spec, idx: Spec, operand_dims: Sequence[int], indices_dims: Sequence[int]) -> bool:
    """Does every device hold the operand rows that its indices' batching dims pair with?"""
    return all(_rows_within(idx, b, op, d) for d, b in zip(operand_dims, indices_dims, strict=True))


def _gather_check(params, in_specs, out_specs) -> bool:
    op, idx = in_specs
    dn = params["dimension_numbers"]
    return _holds_batch_rows(op, idx, dn.operand_batching_dims, dn.start_indices_batching_dims)


def _gather_local(prim, params, in_specs, out_specs):
    op_spec, idx_spec = in_specs
    out_spec = out_specs[0]
    _require_batch_indices("gather", idx_spec)
    dn, mode = params["dimension_numbers"], _mode(params)
    window, _ = _gather_parts(op_spec.rank, out_spec.rank, dn)
    sizes = list(params["slice_sizes"])
    for d in window:  # a pass-through dim is read whole: the local block's size
        if sizes[d] == op_spec.shape[d] and d not in dn.start_index_map:
            sizes[d] = op_spec.local_block_shape[d]
    take = _take_rows([(d, _rows_table(op_spec, d, idx_spec, b))
                       for d, b in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True)
                       if not np.array_equal(op_spec.layouts[d], idx_spec.layouts[b])])
    rows = [(k, d) for k, d in enumerate(dn.start_index_map) if op_spec.chain(d)]
    names = tuple(out_spec.mesh.axis_names)
    sum_axes = [names[a] for a, p in enumerate(out_spec.placements) if p.is_partial and p.op == "sum"]
    bind = dict(params, slice_sizes=tuple(sizes))
    if not rows and not (mode == _FILL and sum_axes):
        return lambda op, idx: [prim.bind(take(op), idx, **bind)]
    row_axes = {a for _, d in rows for a, _ in op_spec.chain(d)}
    row_op = next((out_spec.placements[a].op for a in sorted(row_axes) if out_spec.placements[a].is_partial),
                  "sum")
    dtype = op_spec.dtype
    upper = np.array([op_spec.shape[d] - params["slice_sizes"][d] for d in dn.start_index_map])
    bind.update(indices_are_sorted=False, unique_indices=False)

    def run(op, idx):
        in_range = jnp.all((idx >= 0) & (idx <= upper.astype(idx.dtype)), axis=-1)
        if mode != _FILL:  # CLIP, and PROMISE_IN_BOUNDS which XLA clamps: clamp to the *global* shape
            idx = jnp.clip(idx, 0, upper.astype(idx.dtype))
        owned = jnp.ones(idx.shape[:-1], bool)
        for k, d in rows:
            pos, own = local_position(op_spec, d, idx[..., k])
            idx = _with_column(idx, k, jnp.where(own, pos, 0))
            owned = owned & own
        out = prim.bind(take(op), idx, **bind)
        spread = lambda m: jnp.expand_dims(m, dn.offset_dims)  # batch mask -> output positions
        if rows:  # other devices' rows: the identity of the pending reduction
            out = jnp.where(spread(owned), out, reduce_identity(row_op, dtype))
        if mode == _FILL:  # a pending sum must see the fill once: coordinate 0 of the P(sum) axes
            fill = jnp.where(at_origin(sum_axes), jnp.asarray(params["fill_value"], dtype),
                             jnp.zeros((), dtype))
            out = jnp.where(spread(in_range), out, fill)
        return [out]

    return run


@register("gather", local=_gather_local, check=_gather_check)
def _gather(ins, outs, params) -> list[tuple]:
    op, idx = ins
    dn, sizes = params["dimension_numbers"], params["slice_sizes"]
    window, batch = _gather_parts(len(op.shape), len(outs[0].shape), dn)
    t = [(Φ(o), Φ(d), R) for d, o in zip(window, dn.offset_dims, strict=True)
         if sizes[d] == op.shape[d] and d not in dn.start_index_map]
    paired = dict(zip(dn.start_indices_batching_dims, dn.operand_batching_dims, strict=True))
    for b, o in enumerate(batch):
        t.append((Φ(o), R, Φ(b)))
        if b in paired:
            t.append((Φ(o), Φ(paired[b]), Φ(b)))
    for d in sorted(set(dn.start_index_map)):
        if sizes[d] == 1:  # a table sharded by rows: each device answers for its own rows
            t += [(p, Φ(d), R) for p in (SUM, MAX, MIN)]
    avg_ok = inexact(op.dtype) or _mode(params) != _FILL
    t += [(p, p, R) for p in PARTIALS if p != AVG or avg_ok]
    return t


# ---------------------------------------------------------------------------------------------------
# scatter family


def _scatter_parts(op_rank: int, upd_rank: int, dn) -> tuple[list[int], list[int]]:
    """``(window, batch)``: the operand dims of an update window (in window-dim order) and the updates'
    scatter dims (in indices-dim order)."""
    window = _kept(op_rank, dn.inserted_window_dims + dn.operand_batching_dims)
    batch = [u for u in range(upd_rank) if u not in dn.update_window_dims]
    return window, batch


def _combiner_partials(kind: str, dtype, unique: bool) -> list[tuple]:
    """Pending reductions that pass a scatter with Replicate indices, as (out, operand, R, updates)."""
    lin = linear(dtype)
    avg = (AVG,) if inexact(dtype) else ()
    if kind == "set":  # overwrite: each position is the operand's or an update's, on every device alike
        t = [(p, p, R, p) for p in PARTIALS]
        return t + [(p, p, R, R) for p in avg + ORDER] + [(p, R, R, p) for p in avg + ORDER]
    if kind in ("add", "sub"):
        t = [(p, p, R, p) for p in lin] + [(p, p, R, R) for p in avg + ORDER] + [(p, R, R, p) for p in avg]
        if unique:  # one update per position: o +- u_c is monotone in u_c
            t += monotone(3, 2, kind == "add")
        return t
    if kind == "mul":
        return linear_in(3, 0, lin)
    own = MAX if kind == "max" else MIN  # max / min: monotone in each argument, and idempotent
    t = [(own, own, R, own)] + monotone(3, 0, True) + [(own, R, R, own)]
    if unique:
        t.append((swapped(own), R, R, swapped(own)))
    return t


def _scatter_rule(kind: str):
    def rule(ins, outs, params) -> list[tuple]:
        op, idx, upd = ins
        dn = params["dimension_numbers"]
        window, batch = _scatter_parts(len(op.shape), len(upd.shape), dn)
        wsize = {d: upd.shape[w] for d, w in zip(window, dn.update_window_dims, strict=True)}
        t = [(Φ(d), Φ(d), R, Φ(w)) for d, w in zip(window, dn.update_window_dims, strict=True)
             if wsize[d] == op.shape[d] and d not in dn.scatter_dims_to_operand_dims]
        t += [(Φ(d), Φ(d), R, R) for d in sorted(set(dn.scatter_dims_to_operand_dims))
              if wsize.get(d, 1) == 1]
        paired = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims, strict=True))
        for b, u in enumerate(batch):
            if b in paired:
                t += [(Φ(paired[b]), Φ(paired[b]), Φ(b), Φ(u)), (Φ(paired[b]), R, Φ(b), Φ(u))]
            elif kind in ("add", "sub"):  # each device adds its own updates: the sum of all devices
                t.append((SUM, SUM, Φ(b), Φ(u)))
            elif kind in ("max", "min"):  # max / min are idempotent: a Replicate operand may stay
                own = MAX if kind == "max" else MIN
                t += [(own, own, Φ(b), Φ(u)), (own, R, Φ(b), Φ(u))]
        return t + _combiner_partials(kind, op.dtype, bool(params["unique_indices"]))

    return rule


def _scatter_check(params, in_specs, out_specs) -> bool:
    op, idx, _ = in_specs
    dn = params["dimension_numbers"]
    return _holds_batch_rows(op, idx, dn.operand_batching_dims, dn.scatter_indices_batching_dims)


def _scatter_local(prim, params, in_specs, out_specs):
    op_spec, idx_spec, upd_spec = in_specs
    out_spec = out_specs[0]
    _require_batch_indices(prim.name, idx_spec)
    dn, mode = params["dimension_numbers"], _mode(params)
    take = _take_rows([(d, _rows_table(op_spec, d, out_spec, d)) for d in dn.operand_batching_dims
                       if not np.array_equal(op_spec.layouts[d], out_spec.layouts[d])])
    rows = [(k, d) for k, d in enumerate(dn.scatter_dims_to_operand_dims) if op_spec.chain(d)]
    padded = [b for b in range(idx_spec.rank - 1) if not np.all(idx_spec.layouts[b] >= 0)]
    if not rows and not padded:
        return lambda op, idx, upd: [prim.bind(take(op), idx, upd, **params)]
    window, _ = _scatter_parts(op_spec.rank, upd_spec.rank, dn)
    wsize = {d: upd_spec.shape[w] for d, w in zip(window, dn.update_window_dims, strict=True)}
    upper = np.array([op_spec.shape[d] - wsize.get(d, 1) for d in dn.scatter_dims_to_operand_dims])
    # an update is dropped by giving it a start past the local block: the local scatter runs in drop mode
    beyond = np.array([op_spec.local_block_shape[d] for d in dn.scatter_dims_to_operand_dims])
    bind = dict(params, mode=_FILL, indices_are_sorted=False, unique_indices=False)

    def run(op, idx, upd):
        if mode == lax.GatherScatterMode.CLIP:  # clamp to the *global* shape before looking for rows
            idx = jnp.clip(idx, 0, upper.astype(idx.dtype))
        keep = jnp.ones(idx.shape[:-1], bool)
        for b in padded:  # padding of sharded indices holds garbage: never apply it
            shape = [1] * (idx.ndim - 1)
            shape[b] = -1
            keep = keep & jnp.reshape(global_index(idx_spec, b) >= 0, shape)
        for k, d in rows:
            pos, own = local_position(op_spec, d, idx[..., k])
            idx = _with_column(idx, k, jnp.where(own, pos, 0))
            keep = keep & own
        idx = jnp.where(keep[..., None], idx, beyond.astype(idx.dtype))
        return [prim.bind(take(op), idx, upd, **bind)]

    return run


for _kind, _name in (("set", "scatter"), ("add", "scatter-add"), ("sub", "scatter-sub"),
                     ("mul", "scatter-mul"), ("min", "scatter-min"), ("max", "scatter-max")):
    register(_name, local=_scatter_local, check=_scatter_check)(_scatter_rule(_kind))
