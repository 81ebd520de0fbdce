"""Specs: an array's global shape and dtype, a mesh and one placement per mesh axis.

A spec answers, for every device, which global indices it holds. The rule is ``torch.chunk``'s
(ceil-divide, trailing shards short or empty), applied left to right over the mesh axes: a dim sharded by
two axes is chunked by the first, and each chunk again by the second. ``StridedShard`` is applied the
same way (see ``placements``). Every dim is laid out independently, so a device's local block is the
outer product of one index list per dim.

Block storage pads every device's local block to the largest local shape (``Spec.local_block_shape``);
the padding holds no value.

>>> import jax
>>> from jshard import Shard, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> spec = Spec.create(mesh, (Shard(0), Shard(0)), (10, 3), "float32")
>>> print(spec)
f32[10,3] (S(0), S(0)) on mesh(dp=2, tp=4)
>>> spec.local_shape((1, 3)), spec.local_block_shape
((0, 3), (2, 3))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .caches import memo
from .placements import (
    Partial,
    Placement,
    PlacementError,
    Replicate,
    Shard,
    StridedShard,
    as_index,
    format_placements,
    normalize_placements,
)

__all__ = ["Spec", "LayoutError", "format_mesh", "check_mesh", "check_dtype", "chunk_sizes", "dim_layout", "cut_order",
           "even_length", "padded_length", "block_sharding", "block_of", "local_of", "shard_order"]


class LayoutError(ValueError):
    """A spec whose layout has no equivalent in the requested JAX form (PartitionSpec, NamedSharding)."""


def format_mesh(mesh: Mesh, names: Sequence[str] | None = None) -> str:
    """``mesh(dp=2, tp=4)``; ``names`` in place of the mesh's own axis names."""
    names = mesh.axis_names if names is None else names
    return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.axis_sizes, strict=True)) + ")"


def check_mesh(mesh, where: str, abstract: bool = False) -> Mesh:
    """``mesh`` if it is a concrete ``jax.sharding.Mesh`` (or, where ``abstract``, a ``jax.sharding.AbstractMesh``:
    sizes and names without devices, which specs are priced on), else a TypeError naming ``where``."""
    if not isinstance(mesh, (Mesh, AbstractMesh) if abstract else Mesh):
        raise TypeError(f"{where}: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)), got {mesh!r}")
    return mesh


def _check_shape(shape, where: str) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints: a sequence of non-negative integers (``as_index``)."""
    dims = None
    if not isinstance(shape, (str, bytes)):
        try:
            dims = tuple(shape)
        except TypeError:
            pass
    if dims is None:
        hint = f"; for a 1-d array write ({shape},)" if as_index(shape) is not None else ""
        raise TypeError(f"{where}: shape must be a tuple of ints, got {shape!r}{hint}")
    out = []
    for d, n in enumerate(dims):
        size = as_index(n)
        if size is None:
            raise TypeError(f"{where}: shape {shape!r} has {n!r} at dim {d}; every dim must be an int")
        if size < 0:
            raise ValueError(f"{where}: shape {shape!r} has {size} at dim {d}; sizes must be >= 0")
        out.append(size)
    return tuple(out)


def check_dtype(dtype, where: str) -> np.dtype:
    """The dtype JAX stores for ``dtype`` (f64 -> f32 without x64), which must be numeric, bool or a PRNG key."""
    try:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            return dtype  # typed PRNG keys: JAX's own dtype, never canonicalized
        stored = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    except (TypeError, ValueError, SyntaxError):  # numpy parses "a,b" strings as record formats
        stored = None
    if stored is None or not (stored == np.bool_ or jnp.issubdtype(stored, jnp.number)):
        shown = repr(dtype) if stored is None else str(stored)
        raise TypeError(f"{where}: dtype {shown} is not a numeric or bool dtype, which a DArray needs "
                        "(float32, bfloat16, int32, bool, ...)")
    return stored


def dtype_short(dtype: np.dtype) -> str:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)  # PRNG keys: key<fry>
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return "bool"
    kind = {"f": "f", "i": "i", "u": "u", "c": "c", "V": "bf"}.get(dtype.kind, dtype.kind)
    if dtype.name == "bfloat16":
        return "bf16"
    return f"{kind}{dtype.itemsize * 8}"


def chunk_sizes(length: int, n: int) -> list[int]:
    """``torch.chunk`` sizes of ``length`` elements over ``n`` pieces: ``chunk_sizes(9, 4) == [3, 3, 3, 0]``."""
    k = -(-length // n)
    return [max(0, min(length - c * k, k)) for c in range(n)]


def _chunk(idx: np.ndarray, n: int, c: int) -> np.ndarray:
    k = -(-len(idx) // n)
    return idx[min(c * k, len(idx)) : min((c + 1) * k, len(idx))]


def _strided_chunk(idx: np.ndarray, n: int, c: int, split_factor: int) -> np.ndarray:
    k = -(-len(idx) // split_factor)
    blocks = [idx[b * k : (b + 1) * k] for b in range(split_factor)]
    return np.concatenate([_chunk(b, n, c) for b in blocks]) if blocks else idx[:0]


def even_length(length: int, mesh_shape: tuple[int, ...], chain: tuple[tuple[int, int], ...]) -> int | None:
    """The length every device holds of a dim of ``length`` cut by ``chain`` where its cuts are all even (each
    axis's ``n`` pieces of each of its ``split_factor`` blocks the same length), else None: the common case, read
    without the index tables (which a mesh of thousands of devices makes costly).

    >>> even_length(16, (2, 4), ((0, 1), (1, 1))), even_length(10, (2, 4), ((1, 1),))
    (2, None)
    """
    for axis, sf in chain:
        n = mesh_shape[axis]
        if length % (sf * n):
            return None
        length //= n
    return length


@memo(65536)
def padded_length(length: int, mesh_shape: tuple[int, ...], chain: tuple[tuple[int, int], ...]) -> int:
    """The largest length a device holds of a dim of ``length`` cut by ``chain`` (``dim_layout``'s last dim),
    without the index tables: how long a device's piece is after a cut depends only on how long it was, so the
    lengths are followed as a set, cut by cut.

    >>> padded_length(9, (8,), ((0, 1),)), padded_length(10, (2, 4), ((0, 2), (1, 1)))
    (2, 2)
    """
    even = even_length(length, mesh_shape, chain)
    if even is not None:
        return even
    lengths = {length}
    for axis, sf in chain:
        lengths = {int(m) for n in lengths for m in _cut_lengths(n, mesh_shape[axis], sf)}
    return max(lengths)


def _cut_lengths(length: int, n: int, split_factor: int) -> np.ndarray:
    """The length of each of the ``n`` pieces ``_strided_chunk`` (``_chunk`` where ``split_factor`` is 1) cuts from
    ``length`` elements: every block's ``torch.chunk`` piece, summed over the blocks."""
    k = -(-length // split_factor)
    blocks = np.clip(length - np.arange(split_factor) * k, 0, k)[:, None]
    piece = -(-blocks // n)
    return np.clip(blocks - np.arange(n)[None, :] * piece, 0, piece).sum(axis=0)


@memo(4096)
def dim_layout(length: int, mesh_shape: tuple[int, ...], chain: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Global indices held along one tensor dim, for every device.

    ``chain`` lists ``(mesh axis, split factor)`` for the axes that shard this dim, in mesh order.
    Returns an int array of shape ``mesh_shape + (padded,)``: device ``c``'s indices in local order,
    then ``-1`` for padding. The result is read-only (it is cached).

    A device's indices depend only on its coordinates along the chain's axes, so they are computed there and
    broadcast along the others (a view): on a mesh of 16,384 devices a dim split 8 ways costs 8 index lists.

    >>> dim_layout(5, (2, 3), ((1, 1),))[1, 2], dim_layout(5, (2, 3), ((1, 1),)).shape
    (array([ 4, -1]), (2, 3, 2))
    """
    axes = [a for a, _ in chain]
    own = tuple(mesh_shape[a] for a in axes)
    lists = {}
    for coords in np.ndindex(*own):
        lo, hi, idx = 0, length, None  # a contiguous range until a strided split breaks it up
        for (axis, sf), c in zip(chain, coords, strict=True):
            n = mesh_shape[axis]
            if idx is None and sf == 1:
                k = -(-(hi - lo) // n)
                lo, hi = min(lo + c * k, hi), min(lo + (c + 1) * k, hi)
                continue
            idx = np.arange(lo, hi) if idx is None else idx
            idx = _chunk(idx, n, c) if sf == 1 else _strided_chunk(idx, n, c, sf)
        lists[coords] = np.arange(lo, hi) if idx is None else idx
    padded = max((len(v) for v in lists.values()), default=0)
    table = np.full(own + (padded,), -1, dtype=np.int64)
    for coords, idx in lists.items():
        table[coords][: len(idx)] = idx
    # the chain's axes put in mesh order (a chain may cut in another), every other axis of size 1, broadcast
    order = sorted(range(len(axes)), key=lambda i: axes[i])
    table = table.transpose(*order, len(axes))
    shape = [1] * len(mesh_shape) + [padded]
    for a in axes:
        shape[a] = mesh_shape[a]
    out = np.broadcast_to(table.reshape(shape), tuple(mesh_shape) + (padded,))
    out.flags.writeable = False
    return out


def cut_order(chain: tuple[tuple[int, int], ...], mesh_shape: tuple[int, ...],
              length: int | None = None) -> tuple[int, ...] | None:
    """The order in which the chain's axes cut the dim, major first, or None if it is no such order.

    An axis whose split factor is the product of the sizes of the higher-index axes that cut before it
    is how StridedShard spells a non-default shard order (``docs/dtensor-semantics.md`` §1.4). That holds
    where the splits are even; given the dim's ``length``, an order is returned only where every device's
    indices are those of cutting in that order (uneven splits may interleave differently):

    >>> cut_order(((0, 2), (1, 1)), (4, 2)), cut_order(((0, 2), (1, 1)), (4, 2), length=9)
    ((1, 0), None)
    """
    want = dict(chain)
    for order in itertools.permutations(want):
        if all(
            want[a] == math.prod(mesh_shape[b] for b in order[: order.index(a)] if b > a) for a in order
        ):
            # an even split cuts alike in every order: the tables are compared only where one is uneven
            uneven = length is not None and length % math.prod(mesh_shape[a] for a in order)
            if uneven and not np.array_equal(dim_layout(length, mesh_shape, chain),
                                                         dim_layout(length, mesh_shape, tuple((a, 1) for a in order))):
                return None
            return order
    return None


def shard_order(dim: int, order: Sequence[int], mesh_shape: tuple[int, ...]) -> dict[int, Placement]:
    """The placements that cut ``dim`` by the mesh axes ``order``, major first: the inverse of ``cut_order``.
    An axis cut after a higher-index axis is a StridedShard whose split factor is the sizes cut before it.

    >>> shard_order(0, [1, 0], (2, 4))   # tp (axis 1) outside, dp (axis 0) inside: FSDP within TP
    {1: S(0), 0: SS(0,4)}
    """
    out = {}
    for pos, a in enumerate(order):
        sf = math.prod(mesh_shape[b] for b in order[:pos] if b > a)
        out[a] = Shard(dim) if sf == 1 else StridedShard(dim, sf)
    return out


@dataclass(frozen=True)
class Spec:
    """Mesh + placements + global shape + dtype: everything about a DArray but its values.

    Build one with ``Spec.create`` (validates and normalizes) or ``Spec.from_named_sharding``.
    """

    mesh: Mesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def create(cls, mesh: Mesh, placements, shape, dtype, *, where: str = "Spec") -> Spec:
        """Validate ``placements`` for an array of ``shape``/``dtype`` on ``mesh``.

        >>> import jax; from jshard import Partial
        >>> Spec.create(jax.make_mesh((8,), ("x",)), [Partial("max")], (4,), "int32").placements
        (P(max),)
        """
        mesh = check_mesh(mesh, where, abstract=True)
        shape = _check_shape(shape, where)
        dtype = check_dtype(dtype, where)
        placements = normalize_placements(placements, len(mesh.axis_names), len(shape), where=where)
        if not jnp.issubdtype(dtype, jnp.number) and any(p.is_partial for p in placements):  # bool, PRNG keys
            raise PlacementError(
                f"{where}: {format_placements(placements)} puts a Partial on a {dtype} array of shape {shape}; "
                "a pending reduction needs a numeric dtype (cast to int32 or float first)"
            )
        ordered = any(p.is_partial and p.op in ("max", "min") for p in placements)
        if ordered and jnp.issubdtype(dtype, jnp.complexfloating):
            raise PlacementError(
                f"{where}: {format_placements(placements)} puts a Partial(max|min) on a {dtype} array of shape "
                f"{shape}; complex numbers have no order (use Partial sum or avg, or reduce real and imaginary "
                "parts separately)"
            )
        return cls(mesh, placements, shape, dtype)

    def __hash__(self) -> int:
        # specs key every memo table: hash once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.placements, self.shape, self.dtype))
            object.__setattr__(self, "_hash", h)
        return h

    # -- printing ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        return (
            f"{dtype_short(self.dtype)}[{','.join(map(str, self.shape))}] "
            f"{format_placements(self.placements)} on {format_mesh(self.mesh)}"
        )

    __repr__ = __str__

    # -- shard math -------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.axis_sizes)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def chain(self, dim: int) -> tuple[tuple[int, int], ...]:
        """``(mesh axis, split factor)`` of every axis sharding ``dim``, in mesh order."""
        return tuple((a, p.split_factor) for a, p in enumerate(self.placements) if p.is_shard and p.dim == dim)

    @cached_property
    def layouts(self) -> tuple[np.ndarray, ...]:
        """Per dim, ``dim_layout``: the global indices of every device (``-1`` = padding)."""
        return tuple(dim_layout(n, self.mesh_shape, self.chain(d)) for d, n in enumerate(self.shape))

    @cached_property
    def local_block_shape(self) -> tuple[int, ...]:
        """The padded local shape every device stores: the largest local shape, dim by dim."""
        return tuple(self._padded(d) for d in range(self.rank))

    def _padded(self, dim: int) -> int:
        return padded_length(self.shape[dim], self.mesh_shape, self.chain(dim))

    def _even(self, dim: int) -> int | None:
        return even_length(self.shape[dim], self.mesh_shape, self.chain(dim))

    @cached_property
    def local_bytes(self) -> int:
        """Bytes one device stores and a collective moves of it: its padded block (``local_block_shape``).

        >>> import jax; from jshard import Shard
        >>> Spec.create(jax.make_mesh((8,), ("x",)), [Shard(0)], (9, 4), "float32").local_bytes  # 2 rows of 4
        32
        """
        return math.prod(self.local_block_shape) * self.itemsize

    @property
    def device_block_shape(self) -> tuple[int, ...]:
        """One device's piece of block storage: ``local_block_shape`` (``(1,)`` for a scalar)."""
        return self.local_block_shape or (1,)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of the block-storage array: the devices' blocks one after another along dim 0, in mesh device
        order (``block_sharding``)."""
        first, *rest = self.device_block_shape
        return (math.prod(self.mesh_shape) * first, *rest)

    @cached_property
    def local_shapes(self) -> np.ndarray:
        """Int array ``mesh.shape + (rank,)``: every device's true local shape."""
        if not self.shape:
            return np.zeros(self.mesh_shape + (0,), dtype=np.int64)
        return np.stack([np.full(self.mesh_shape, n) if (n := self._even(d)) is not None
                         else (self.layouts[d] >= 0).sum(-1) for d in range(self.rank)], axis=-1)

    def local_shape(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        """True local shape of the device at mesh ``coords``."""
        return tuple(int(s) for s in self.local_shapes[tuple(coords)])

    def global_indices(self, coords: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Per dim, the global indices the device at ``coords`` holds, in local order."""
        return tuple(lay[tuple(coords)][lay[tuple(coords)] >= 0] for lay in self.layouts)

    @property
    def is_even(self) -> bool:
        """True when every device holds a full, unpadded block."""
        return bool((self.local_shapes == np.array(self.local_block_shape, dtype=np.int64)).all())

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def with_placements(self, placements, *, where: str = "Spec") -> Spec:
        return Spec.create(self.mesh, placements, self.shape, self.dtype, where=where)

    # -- JAX equivalents --------------------------------------------------------------------------
    def to_partition_spec(self, *, where: str = "to_partition_spec") -> PartitionSpec:
        """The ``PartitionSpec`` of the same layout; ``Partial(sum)`` becomes ``unreduced``.

        Raises ``LayoutError`` (its message starting with ``where``) where JAX has no equivalent: uneven
        shards, Partial avg/max/min, and strided layouts that are not a shard order.

        >>> import jax; from jshard import Shard, StridedShard, Partial
        >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
        >>> Spec.create(mesh, (StridedShard(0, 4), Shard(0)), (16, 8), "float32").to_partition_spec()
        P(('tp', 'dp'), None)
        >>> Spec.create(mesh, (Shard(1), Partial()), (16, 8), "float32").to_partition_spec()
        P(None, 'dp', unreduced={'tp'}...)
        """
        names = self.mesh.axis_names
        entries = []
        for d in range(self.rank):
            chain = self.chain(d)
            if self.shape[d] % math.prod(self.mesh_shape[a] for a, _ in chain):
                raise LayoutError(
                    f"{where}: {self}: dim {d} of size {self.shape[d]} is split unevenly; JAX shardings need even "
                    "splits. Keep it as a DArray, or pad the dim to a multiple of the shard count"
                )
            order = cut_order(chain, self.mesh_shape)
            if order is None:
                raise LayoutError(
                    f"{where}: {self}: the StridedShard layout of dim {d} is not a shard order, so no PartitionSpec "
                    "describes it; redistribute to Shard/Replicate placements first"
                )
            axes = tuple(names[a] for a in order)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        others = {p.op for p in self.placements if p.is_partial and p.op != "sum"}
        if others:
            raise LayoutError(
                f"{where}: {self}: Partial({', '.join(sorted(others))}) has no JAX sharding equivalent (JAX only has "
                "`unreduced`, a pending sum); redistribute those axes to Replicate() or Shard first"
            )
        unreduced = {names[a] for a, p in enumerate(self.placements) if p.is_partial}
        return PartitionSpec(*entries, unreduced=unreduced) if unreduced else PartitionSpec(*entries)

    def nearest_jax_layout(self) -> tuple[Placement, ...]:
        """The placements nearest to these that a ``NamedSharding`` expresses without ``unreduced``: pending
        reductions completed (``Replicate``), dims split unevenly or in no shard order gathered, every other
        placement kept. What a DArray becomes where plain JAX code reads it.

        >>> import jax; from jshard import Shard, Partial
        >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
        >>> Spec.create(mesh, (Shard(0), Partial()), (16, 6), "float32").nearest_jax_layout()
        (S(0), R)
        >>> Spec.create(mesh, (Shard(0), Shard(1)), (16, 6), "float32").nearest_jax_layout()
        (S(0), R)
        """
        out = [Replicate() if p.is_partial else p for p in self.placements]
        for d in range(self.rank):
            chain = self.chain(d)
            uneven = self.shape[d] % math.prod(self.mesh_shape[a] for a, _ in chain)
            if uneven or cut_order(chain, self.mesh_shape) is None:
                for a, _ in chain:
                    out[a] = Replicate()
        return tuple(out)

    def to_named_sharding(self, *, where: str = "to_named_sharding") -> NamedSharding:
        """``NamedSharding(mesh, self.to_partition_spec())``."""
        return NamedSharding(self.mesh, self.to_partition_spec(where=where))

    @classmethod
    def from_named_sharding(cls, sharding: NamedSharding, shape, dtype, *, where: str = "from_named_sharding") -> Spec:
        """The spec of an array laid out by ``sharding``: the inverse of ``to_named_sharding``.

        An axis tuple in a non-mesh order, such as ``P(('tp', 'dp'))``, becomes StridedShard.
        """
        if not isinstance(sharding, NamedSharding):
            raise LayoutError(
                f"{where}: expected a NamedSharding, got {type(sharding).__name__}; put the array "
                "on a mesh first (jax.device_put(x, NamedSharding(mesh, spec)))"
            )
        mesh, spec = sharding.mesh, sharding.spec
        if not isinstance(mesh, Mesh):
            raise LayoutError(f"{where}: {sharding} has an abstract mesh; use a concrete jax Mesh")
        index = {n: i for i, n in enumerate(mesh.axis_names)}
        sizes = tuple(mesh.devices.shape)
        placements: list[Placement] = [Replicate()] * len(sizes)
        if getattr(spec, "reduced", None):
            raise LayoutError(f"{where}: {spec} has `reduced` axes, which have no placement")
        for d, entry in enumerate(spec.partitions):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            for a, p in shard_order(d, [index[name] for name in axes], sizes).items():
                placements[a] = p
        for name in getattr(spec, "unreduced", ()) or ():
            placements[index[name]] = Partial("sum")
        return cls.create(mesh, placements, shape, dtype, where=where)


def block_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of block storage: dim 0 cut over every mesh axis, so each device holds exactly its own block,
    with its local shape. (Stacking the blocks on leading size-1 mesh dims instead would put a reshape on every
    input and output of a program, and XLA then copies each donated buffer rather than update it in place.)"""
    return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def local_of(block, spec: Spec):
    """Inside ``shard_map``: a device's piece of block storage as its local block (a scalar's ``(1,)`` as ``()``)."""
    return block.reshape(()) if not spec.shape else block


def block_of(local):
    """Inside ``shard_map``: a device's local block as its piece of block storage (``local_of`` undone)."""
    return local.reshape((1,)) if not local.shape else local
