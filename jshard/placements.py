"""Placements: how one mesh axis holds an array.

A DArray carries one placement per mesh axis. Read left to right (mesh axis 0 first), they say how the
global value is cut up or spread over the devices:

- ``Replicate()`` (``R``): every device along the axis holds the whole value.
- ``Shard(d)`` (``S(d)``): dim ``d`` is cut into contiguous chunks with ``torch.chunk`` sizes
  (ceil-divide; trailing chunks may be short or empty); coordinate ``c`` holds chunk ``c``.
- ``StridedShard(d, sf)`` (``SS(d,sf)``): dim ``d`` is first cut into ``sf`` blocks, each block is cut
  into chunks, and coordinate ``c`` holds chunk ``c`` of every block, concatenated. ``sf == 1`` is a
  Shard. It describes a non-default shard order or a layout produced by flattening.
- ``Partial(op)`` (``P(op)``): the value is ``op`` applied elementwise across the devices of the axis;
  ``op`` is one of ``sum``, ``avg``, ``max``, ``min``.

Example::

    >>> from jshard import Shard, Partial, Replicate
    >>> (Shard(0), Partial("max"), Replicate())
    (S(0), P(max), R)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "Placement",
    "Replicate",
    "Shard",
    "StridedShard",
    "Partial",
    "PlacementError",
    "REDUCE_OPS",
    "normalize_placements",
    "format_placements",
    "partial_ops_mix",
    "as_index",
    "shift_dims",
]

REDUCE_OPS = ("sum", "avg", "max", "min")


class PlacementError(ValueError):
    """A placement, or a tuple of placements, that cannot describe the array it is given for."""


def as_index(value) -> int | None:
    """``value`` as a Python int when it is an integer (Python, numpy or a concrete JAX scalar), else None.

    A bool is no index here (``Shard(True)`` is a typo), nor is a float (``16.7`` rows is a bug upstream,
    not a size to truncate).

    >>> import numpy as np
    >>> as_index(np.int64(3)), as_index(True), as_index(2.0)
    (3, None, None)
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class Placement:
    """Base class of the four placement kinds; instances are immutable and hashable."""

    __slots__ = ()
    is_replicate: ClassVar[bool] = False
    is_shard: ClassVar[bool] = False  # Shard or StridedShard: the axis cuts a tensor dim
    is_partial: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every device along the mesh axis holds the whole value.

    >>> Replicate()
    R
    """

    is_replicate: ClassVar[bool] = True

    def __repr__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Tensor dim ``dim`` is cut into ``torch.chunk`` pieces along the mesh axis.

    Ten rows over four devices are held as 3, 3, 3 and 1 rows; nine rows as 3, 3, 3 and 0.

    >>> Shard(1)
    S(1)
    """

    dim: int
    is_shard: ClassVar[bool] = True

    def __post_init__(self):
        dim = as_index(self.dim)
        if dim is None:
            raise PlacementError(f"Shard(dim={self.dim!r}): dim must be an int (negative counts from the end)")
        object.__setattr__(self, "dim", dim)  # numpy ints become ints: equal placements print and hash alike

    @property
    def split_factor(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class StridedShard(Placement):
    """Tensor dim ``dim`` is cut into ``split_factor`` blocks and each block is sharded along the axis.

    Coordinate ``c`` holds chunk ``c`` of every block, concatenated: ``[0..7]`` over two devices with
    ``split_factor=2`` is held as ``[0, 1, 4, 5]`` and ``[2, 3, 6, 7]``.

    >>> StridedShard(0, 2)
    SS(0,2)
    """

    dim: int
    split_factor: int
    is_shard: ClassVar[bool] = True

    def __post_init__(self):
        dim, split_factor = as_index(self.dim), as_index(self.split_factor)
        if dim is None:
            raise PlacementError(f"StridedShard(dim={self.dim!r}): dim must be an int")
        if split_factor is None or split_factor < 1:
            raise PlacementError(
                f"StridedShard({self.dim}, split_factor={self.split_factor!r}): split_factor must be an int >= 1 "
                "(1 is the same layout as Shard)"
            )
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "split_factor", split_factor)

    def __repr__(self) -> str:
        return f"SS({self.dim},{self.split_factor})"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """The value is ``op`` applied across the devices of the mesh axis (a pending reduction).

    >>> Partial(), Partial("max")
    (P(sum), P(max))
    """

    op: str = "sum"
    is_partial: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.op, str) or self.op not in REDUCE_OPS:
            raise PlacementError(f"Partial({self.op!r}): unknown reduce op; allowed: {', '.join(REDUCE_OPS)}")

    def __repr__(self) -> str:
        return f"P({self.op})"


def partial_ops_mix(ops: set[str]) -> bool:
    """Whether Partial reductions with these ops may coexist in one placements tuple: only sum and avg
    commute, so any other pair has no single meaning."""
    return len(ops) <= 1 or ops <= {"sum", "avg"}


def shift_dims(placements: Sequence[Placement], delta: int) -> list[Placement]:
    """``placements`` with every shard's dim moved by ``delta``: the layout of a stack of such arrays (``+1``: a
    new leading dim) or of one of them (``-1``: the leading dim taken away).

    >>> shift_dims([Shard(0), StridedShard(1, 2), Replicate()], 1)
    [S(1), SS(2,2), R]
    """
    return [type(p)(p.dim + delta, *([p.split_factor] if p.split_factor != 1 else [])) if p.is_shard else p
            for p in placements]


def format_placements(placements: Sequence[Placement]) -> str:
    """``(S(0), P(sum))``: the compact form used in every message."""
    return "(" + ", ".join(map(repr, placements)) + ")"


def normalize_placements(
    placements: Sequence[Placement], mesh_ndim: int, rank: int, *, where: str = "placements"
) -> tuple[Placement, ...]:
    """Validate ``placements`` for an array of ``rank`` dims on a mesh of ``mesh_ndim`` axes.

    Negative shard dims are counted from the end; the result is a tuple with every dim in
    ``[0, rank)``. ``where`` names the calling operation in error messages.

    >>> normalize_placements([Shard(-1), Replicate()], mesh_ndim=2, rank=3)
    (S(2), R)
    """
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise PlacementError(
            f"{where}: expected a sequence of {mesh_ndim} placements (one per mesh axis), got {placements!r}"
        )
    placements = tuple(placements)
    shown = format_placements(placements) if all(isinstance(p, Placement) for p in placements) else repr(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"{where}: {shown} has {len(placements)} placements but the mesh has {mesh_ndim} axes; "
            "give exactly one placement per mesh axis (Replicate() for an axis that does not split the array)"
        )
    out = []
    for axis, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise PlacementError(
                f"{where}: entry {axis} of {shown} is {p!r}, not a placement; "
                "use Replicate(), Shard(d), StridedShard(d, sf) or Partial(op)"
            )
        if p.is_shard:
            if not -rank <= p.dim < rank:
                raise PlacementError(
                    f"{where}: {p!r} on mesh axis {axis} of {shown} names dim {p.dim}, but the array has rank "
                    f"{rank}; use a dim in [{-rank}, {rank})"
                )
            if p.dim < 0:
                p = Shard(p.dim + rank) if isinstance(p, Shard) else StridedShard(p.dim + rank, p.split_factor)
            if isinstance(p, StridedShard) and p.split_factor == 1:
                p = Shard(p.dim)
        out.append(p)
    ops = {p.op for p in out if p.is_partial}
    if not partial_ops_mix(ops):
        raise PlacementError(
            f"{where}: {shown} mixes Partial({'), Partial('.join(sorted(ops))}); only sum and avg may be mixed, "
            "because only they commute (a sum of averages is an average of sums). Reduce one of them first "
            "(redistribute that axis to Replicate())"
        )
    return tuple(out)
