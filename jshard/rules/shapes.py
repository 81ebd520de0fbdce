"""Shape primitives: elements change places, never values.

Every output element of these primitives is one input element, the padding value, or (iota) its own
index. So on one mesh axis the question is only *where* elements sit:

- **every pending reduction passes**, sum, avg, max and min alike, integer avg included: an element that
  is copied is not combined. Primitives with several data operands (concatenate, pad's operand and
  padding value, dynamic_update_slice's operand and update) need the same Partial on all of them; a
  Replicate operand already is a ``P(avg|max|min)`` (the value on every coordinate) and becomes a
  ``P(sum)`` for free. Start indices are scalars, always Replicate.
- **a dim the primitive leaves alone keeps any shard**, renumbered: transpose permutes dims, squeeze drops
  unit dims, broadcast_in_dim maps operand dims into the output. A dim the broadcast makes (new, or
  from 1) repeats one value, so a device broadcasts a Replicate operand straight to its shard of it.
  slice, dynamic_slice, pad, concatenate, split and rev keep every dim they do not cut, shift, join or
  mirror. A dim they do touch needs offsets the device does not have, so it stays whole, unless the
  primitive takes all of it (a full-range slice). Padding rows of an uneven shard stay padding rows.
- **reshape works on groups**: the shortest runs of (non-unit) input and output dims with equal
  products. A one-to-one group is an identity dim and keeps any shard. In a larger group, a shard on the
  first dim stays a shard on the first dim when the chunk boundaries agree (even splits, or a rare
  uneven coincidence); when dims are merged, a shard on a later dim becomes ``StridedShard(merged, sf)``
  with ``sf`` the number of elements the preceding dims have *on the device*: their global product on
  a 1-D mesh, less where an earlier mesh axis already cut one of them. Splitting a dim inverts it:
  ``SS(ab, sf) -> S(b)``. A rule never sees the mesh, so it offers the divisors as split factors and
  ``check`` keeps what is exact on the N-D mesh: every device's output block must be the reshape of its
  input block (``pytorch#179502``, a shard landing on the wrong dim, cannot pass this test).
  ``dimensions`` (a transpose fused in) is the same rule on ``transpose(x, dimensions)``.
- **unit dims carry presence, not position**: sharding a size-1 dim leaves the whole value on
  coordinate 0 of the axis and garbage elsewhere, so any unit output dim may take it over
  (``unit_presence``). Likewise ``x[:1]`` of a sharded dim sits on coordinate 0.

Params that hold global sizes (reshape.new_sizes, broadcast_in_dim.shape, dynamic_slice.slice_sizes,
slice limits, iota.shape) are rewritten to the output's ``local_block_shape`` by ``local=`` functions.

``x[8, 4].reshape(32)`` (after the four Partials) and ``x.T``:

>>> import jax.numpy as jnp; from jax.core import ShapedArray
>>> x, y = ShapedArray((8, 4), jnp.float32), ShapedArray((32,), jnp.float32)
>>> _reshape((x,), (y,), {"new_sizes": (32,), "dimensions": None})[4:]
[(Φ0, Φ0), (SS(0,8), S(1)), (SS(0,4), S(1)), (SS(0,2), S(1)), (S(0), S(1))]
>>> _transpose((x,), (ShapedArray((4, 8), jnp.float32),), {"permutation": (1, 0)})[:2]
[(Φ0, Φ1), (Φ1, Φ0)]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
from jax import lax

from ..caches import memo
from ..local import global_index
from ..placements import Shard
from ..spec import Spec, dim_layout
from .algebra import PARTIALS, SUM, R
from .registry import ShardPlaceholder as Φ
from .registry import register, sharded

__all__ = ["unit_presence"]

_MAX_PRESENCE = 64  # more unit-dim combinations than this: offer none (fewer tuples is never wrong)
_MAX_MIXED = 4  # data inputs whose Replicate / P(avg|max|min) mixes are listed (2**k tuples each)


# -- shared helpers --------------------------------------------------------------------------------


def _partials(n_out: int, data: Sequence[bool]) -> list[tuple]:
    """Each pending reduction passes when every data input has it (the others are Replicate). A
    Replicate data input already *is* a ``P(avg|max|min)`` (the value on every coordinate), so those may
    also mix with Replicate data inputs (up to ``_MAX_MIXED`` data inputs; beyond, the free conversion
    is left to the infrastructure)."""
    pos = [i for i, d in enumerate(data) if d]
    t = []
    for p in PARTIALS:
        subsets = [pos] if p == SUM or len(pos) > _MAX_MIXED else [
            c for k in range(1, len(pos) + 1) for c in itertools.combinations(pos, k)]
        t += [(p,) * n_out + tuple(p if i in c else R for i in range(len(data))) for c in subsets]
    return t


def unit_presence(ins, outs) -> list[tuple]:
    """Tuples that shard size-1 dims: the value sits whole on coordinate 0, garbage elsewhere.

    A device at coordinate 0 of an input sharded on a unit dim holds exactly the Replicate block, so it
    computes the right output; every other device computes garbage, which an output sharded on one of
    its own unit dims declares as padding. Valid for any primitive computed per device from its blocks,
    with any mix of Replicate and unit-sharded inputs (at least one sharded).
    """
    units = lambda a: [Shard(d) for d, n in enumerate(a.shape) if n == 1]
    in_opts = [[R] + units(a) for a in ins]
    out_opts = list(itertools.product(*map(units, outs)))
    if len(out_opts) * math.prod(map(len, in_opts)) > _MAX_PRESENCE:
        return []
    return [o + i for o in out_opts for i in itertools.product(*in_opts) if any(p.is_shard for p in i)]


def _with_out_block(key: str) -> Callable:
    """A ``local=`` binding the primitive with ``params[key]`` = the output's padded block shape."""

    def local(prim, params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> Callable:
        bind = dict(prim.get_bind_params(params), **{key: out_specs[0].local_block_shape})
        if "sharding" in bind:
            bind["sharding"] = None  # the block is per device: no global sharding to keep
        return lambda *blocks: [prim.bind(*blocks, **bind)]

    return local


def _kept(pairs: Sequence[tuple[int, int]], n_other: int = 0, n_out: int = 1) -> list[tuple]:
    """``(Φo, ..., Φi, R...)`` for every ``(out dim o, in dim i)`` the primitive leaves alone."""
    return [(Φ(o),) * n_out + (Φ(i),) + (R,) * n_other for o, i in pairs]


# -- renumbering: transpose, squeeze, rev, broadcast_in_dim -----------------------------------------


@register("transpose")
def _transpose(ins, outs, params) -> list[tuple]:
    perm = [int(p) for p in params["permutation"]]
    return _kept(list(enumerate(perm))) + _partials(1, [True]) + unit_presence(ins, outs)


@register("squeeze")
def _squeeze(ins, outs, params) -> list[tuple]:
    rank = len(ins[0].shape)
    gone = {int(d) % rank for d in params["dimensions"]}
    kept = [d for d in range(rank) if d not in gone]
    return _kept(list(enumerate(kept))) + _partials(1, [True]) + unit_presence(ins, outs)


@register("rev")
def _rev(ins, outs, params) -> list[tuple]:
    # a reversed dim would need the mirrored block from another device; a unit one is not reversed
    mirrored = {int(d) for d in params["dimensions"]}
    kept = [(d, d) for d in range(len(ins[0].shape)) if d not in mirrored]
    return _kept(kept) + _partials(1, [True]) + unit_presence(ins, outs)


@register("broadcast_in_dim", local=_with_out_block("shape"))
def _broadcast_in_dim(ins, outs, params) -> list[tuple]:
    x, y = ins[0], outs[0]
    dims = [int(e) for e in params["broadcast_dimensions"]]
    kept = [(e, d) for d, e in enumerate(dims) if x.shape[d] == y.shape[e]]  # not a broadcast from 1
    # a dim made by the broadcast repeats one value: a device broadcasts straight to its shard of it
    made = [(Φ(e), R) for e in range(len(y.shape)) if e not in {o for o, _ in kept}]
    return _kept(kept) + made + _partials(1, [True]) + unit_presence(ins, outs)


# -- reshape ---------------------------------------------------------------------------------------


def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The shortest runs of non-unit dims of ``src`` and ``dst`` with equal products, in order.

    >>> _groups((2, 3, 4), (6, 1, 4)), _groups((4, 6), (6, 4))
    ([((0, 1), (0,)), ((2,), (2,))], [((0, 1), (0, 1))])
    """
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(a):
        ins, outs = [a[i]], [b[j]]
        p, q = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while p != q:
            if p < q:
                ins.append(a[i])
                p, i = p * src[a[i]], i + 1
            else:
                outs.append(b[j])
                q, j = q * dst[b[j]], j + 1
        groups.append((tuple(ins), tuple(outs)))
    return groups


def _divisors(n: int) -> list[int]:
    """Divisors of ``n``, largest first (the split factor of a 1-D mesh comes first)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]), reverse=True)


def _moved(p, perm: Sequence[int]):
    """Placement ``p`` of the transposed operand ``transpose(x, perm)``, said of ``x``."""
    if isinstance(p, Φ):
        return Φ(perm[p.dim], p.even)
    if p.is_shard:
        return sharded(perm[p.dim], p.split_factor)
    return p


def _transposed(spec: Spec, perm: Sequence[int]) -> Spec:
    """The spec of ``transpose(x, perm)`` for ``x`` with ``spec``: the same blocks, dims renumbered."""
    back = {e: d for d, e in enumerate(perm)}
    placements = tuple(sharded(back[p.dim], p.split_factor) if p.is_shard else p for p in spec.placements)
    return Spec(spec.mesh, placements, tuple(spec.shape[e] for e in perm), spec.dtype)


def _reshape_check(params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> bool:
    perm = params.get("dimensions")
    src = in_specs[0] if perm is None else _transposed(in_specs[0], perm)
    return _reshape_exact(src, out_specs[0])


@register("reshape", local=_with_out_block("new_sizes"), check=_reshape_check)
def _reshape(ins, outs, params) -> list[tuple]:
    # ``dimensions`` (a transpose fused in, as conv gradients emit) reshapes transpose(x, dimensions):
    # the rule is the plain reshape's, its input dims renumbered; the local bind transposes the block
    perm = params.get("dimensions")
    src, dst = ins[0].shape, outs[0].shape
    if perm is not None:
        src = tuple(src[e] for e in perm)
    t = _partials(1, [True])
    if 0 not in src:  # an empty array has nothing to place
        for a, b in _groups(src, dst):
            t.append((Φ(b[0]), Φ(a[0])))  # first dim to first dim (identity dims included)
            if len(b) == 1:  # a merge: a later dim repeats once per element of the preceding dims on a device
                for p in range(1, len(a)):
                    before = math.prod(src[d] for d in a[:p])
                    t += [(sharded(b[0], sf), Shard(a[p])) for sf in _divisors(before)]
            if len(a) == 1:  # a split, the inverse
                for q in range(1, len(b)):
                    before = math.prod(dst[d] for d in b[:q])
                    t += [(Shard(b[q]), sharded(a[0], sf)) for sf in _divisors(before)]
    if perm is not None:
        t = [(o, _moved(i, perm)) for o, i in t]
    return t + unit_presence(ins, outs)


def _reshape_exact(src: Spec, dst: Spec) -> bool:
    """Is every device's output block (padding aside) the row-major reshape of its input block?"""
    return blocks_reshape(src.shape, dst.shape, src.mesh_shape, tuple(map(src.chain, range(src.rank))),
                           tuple(map(dst.chain, range(dst.rank))))


@memo(4096)
def blocks_reshape(src: tuple, dst: tuple, mesh_shape: tuple, src_chains: tuple, dst_chains: tuple) -> bool:
    if 0 in src:
        return True  # no elements: any blocks reshape (unit dims only ever hold presence)
    for a, b in _groups(src, dst):
        ca, cb = [src_chains[d] for d in a], [dst_chains[d] for d in b]
        if not any(ca + cb) or (len(a) == len(b) == 1 and ca == cb):
            continue  # whole on every device, or an identity dim with the same layout
        if not _group_exact([src[d] for d in a], [dst[d] for d in b], mesh_shape, ca, cb):
            return False
    return True


def _group_exact(src: list[int], dst: list[int], mesh_shape: tuple, src_chains: list,
                 dst_chains: list) -> bool:
    # simulate only the mesh axes that cut the group: the layout is the same along the others
    axes = {a for chain in src_chains + dst_chains for a, _ in chain}
    pick = tuple(slice(None) if a in axes else 0 for a in range(len(mesh_shape)))
    flat_in = _flat_block([dim_layout(n, mesh_shape, c)[pick] for n, c in zip(src, src_chains, strict=True)], src)
    flat_out = _flat_block([dim_layout(n, mesh_shape, c)[pick] for n, c in zip(dst, dst_chains, strict=True)], dst)
    if flat_in.shape != flat_out.shape:  # different element counts per block: no plain reshape
        return False
    return bool(np.all((flat_out < 0) | (flat_in == flat_out)))


def _flat_block(layouts: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """Per device, the row-major flat index (within the group) of every position of its block, -1 for
    padding: shape ``devices + (block elements,)``."""
    lead, k = layouts[0].shape[:-1], len(layouts)
    flat, valid = np.zeros(lead + (1,) * k, np.int64), np.ones(lead + (1,) * k, bool)
    for i, lay in enumerate(layouts):
        x = lay.reshape(lead + (1,) * i + lay.shape[-1:] + (1,) * (k - 1 - i))
        flat, valid = flat + x * math.prod(sizes[i + 1:]), valid & (x >= 0)
    return np.where(valid, flat, -1).reshape(lead + (-1,))


# -- cutting and joining: slice, dynamic_slice, pad, concatenate, split, dynamic_update_slice --------


def _whole(x, y) -> list[tuple[int, int]]:
    """``(d, d)`` for the dims a (dynamic) slice or update covers entirely (its start is clamped to 0)."""
    return [(d, d) for d in range(len(x.shape)) if y.shape[d] == x.shape[d]]


def _slice_local(prim, params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> Callable:
    src, dst = in_specs[0], out_specs[0]
    strides = params["strides"] or (1,) * src.rank
    box = []  # (start, limit, stride) per dim
    for d, (s, lim, st) in enumerate(zip(params["start_indices"], params["limit_indices"], strides, strict=True)):
        if dst.shape[d] == src.shape[d]:  # the whole dim: the block as it is, whatever its shard
            box.append((0, src.local_block_shape[d], 1))
        elif src.chain(d):  # one element of a sharded dim: at the same place on coordinate 0 (check)
            box.append((int(s), int(s) + 1, 1))
        else:  # a whole-on-every-device dim: the global slice
            box.append((int(s), int(lim), int(st)))
    starts, limits, steps = zip(*box, strict=True) if box else ((), (), ())
    return lambda x: [lax.slice(x, starts, limits, steps)]


def _slice_check(params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> bool:
    """A sharded dim that is cut must be cut to one element, which wherever the output holds it is at
    local position ``start`` of the input block, as global index ``start``."""
    src, dst = in_specs[0], out_specs[0]
    for d, s in enumerate(params["start_indices"]):
        if dst.shape[d] != src.shape[d] and src.chain(d):
            lay, holds = src.layouts[d], dst.layouts[d][..., 0] >= 0
            if dst.shape[d] != 1 or s >= lay.shape[-1] or not np.all(lay[..., s][holds] == s):
                return False
    return True


@register("slice", local=_slice_local, check=_slice_check)
def _slice(ins, outs, params) -> list[tuple]:
    x, y = ins[0], outs[0]
    # x[s:s+1] of a sharded dim: is s on coordinate 0? (the check says)
    head = [(d, d) for d in range(len(x.shape)) if y.shape[d] == 1 < x.shape[d]]
    return _kept(_whole(x, y) + head) + _partials(1, [True]) + unit_presence(ins, outs)


@register("dynamic_slice", local=_with_out_block("slice_sizes"))
def _dynamic_slice(ins, outs, params) -> list[tuple]:
    n = len(ins) - 1  # start indices
    return _kept(_whole(ins[0], outs[0]), n) + _partials(1, [True] + [False] * n) + unit_presence(ins, outs)


@register("dynamic_update_slice")
def _dynamic_update_slice(ins, outs, params) -> list[tuple]:
    n = len(ins) - 2
    t = [(Φ(d), Φ(d), Φ(d)) + (R,) * n for d, _ in _whole(ins[0], ins[1])]
    return t + _partials(1, [True, True] + [False] * n) + unit_presence(ins, outs)


@register("pad")
def _pad(ins, outs, params) -> list[tuple]:
    untouched = [(d, d) for d, c in enumerate(params["padding_config"]) if tuple(map(int, c)) == (0, 0, 0)]
    return _kept(untouched, 1) + _partials(1, [True, True]) + unit_presence(ins, outs)


@register("concatenate")
def _concatenate(ins, outs, params) -> list[tuple]:
    n, axis = len(ins), int(params["dimension"])
    t = [(Φ(d),) + (Φ(d),) * n for d in range(len(outs[0].shape)) if d != axis]
    return t + _partials(1, [True] * n) + unit_presence(ins, outs)


@register("split")
def _split(ins, outs, params) -> list[tuple]:
    axis, k = int(params["axis"]), len(outs)
    kept = [(d, d) for d in range(len(ins[0].shape)) if d != axis]
    return _kept(kept, n_out=k) + _partials(k, [True]) + unit_presence(ins, outs)


@register("unstack")
def _unstack(ins, outs, params) -> list[tuple]:
    # x[0], x[1], ... along ``axis`` at once (iterating over an array, a key array's split among them)
    axis, k = int(params["axis"]), len(outs)
    kept = [(d - (d > axis), d) for d in range(len(ins[0].shape)) if d != axis]
    return _kept(kept, n_out=k) + _partials(k, [True]) + unit_presence(ins, outs)


@register("stack")
def _stack(ins, outs, params) -> list[tuple]:
    # the arrays along a new dim ``axis`` (unstack's gradient on jax >= 0.12, lax.stack): each output dim but the new
    # one is the same dim of every input
    axis, n = int(params["axis"]), len(ins)
    t = [(Φ(d),) + (Φ(d - (d > axis)),) * n for d in range(len(outs[0].shape)) if d != axis]
    return t + _partials(1, [True] * n) + unit_presence(ins, outs)


# -- iota ------------------------------------------------------------------------------------------


def _iota_local(prim, params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> Callable:
    spec, dim, dtype = out_specs[0], int(params["dimension"]), params["dtype"]
    # each position's global index along ``dim`` is the value (padding gets -1: garbage is allowed there)
    block = spec.local_block_shape
    return lambda: [lax.broadcast_in_dim(global_index(spec, dim).astype(dtype), block, (dim,))]


@register("iota", local=_iota_local)
def _iota(ins, outs, params) -> list[tuple]:
    # iota has no inputs, so no shard kind fills these placeholders and it runs Replicate today; the
    # tuples state what holds, and the local function honours any sharded output spec
    return [(Φ(d),) for d in range(len(outs[0].shape))]


@register("empty2")
def _empty(ins, outs, params) -> list[tuple]:
    # an uninitialised scalar (autodiff of cond / scan makes them as placeholders): replicated, like any
    # input-free value
    return []
