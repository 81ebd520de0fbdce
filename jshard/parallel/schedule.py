"""Pipeline schedules as integer tables: which microbatch each stage runs forward and backward at each tick.

A pipeline splits the model into ``p`` stages along a mesh axis, one per device; with ``v`` virtual stages per
device the model is cut into ``p * v`` chunks and virtual stage ``vs`` lives on device ``vs % p`` as its chunk
``vs // p`` (device ``d`` holds ``d, p + d, 2p + d, ...``). A batch is split into ``m`` microbatches. A
*forward unit* ``F(i, vs)`` runs microbatch ``i`` through virtual stage ``vs``; a *backward unit* ``B(i, vs)``
takes its gradient.

The runtime is one SPMD program: a loop over *ticks*, every device of the axis running the same tick at once. In a
tick a device runs at most one forward unit, then (the last virtual stage's loss right after its forward) at most
one backward unit; what a unit sends arrives at the end of the tick, so ``F(i, vs)`` runs a tick after
``F(i, vs - 1)`` at the earliest and ``B(i, vs)`` a tick after ``B(i, vs + 1)``; ``B(i, last)`` may share the tick
of ``F(i, last)``. A tick lasts as long as its slowest device: ``f`` for a forward, ``b`` for a backward, ``f + b``
for both (default 1 and 2: a backward does twice a forward's matmuls). ``wasted()`` is the share of device time
spent idle or masked; ``theory()`` is the bubble ``(p - 1) / (v * m + p - 1)``, which every schedule here meets
exactly.

Each device keeps, per chunk, ``slots`` buffers of three kinds: the stash of forward inputs (written by
``F(i, vs)``, freed by ``B(i, vs)``), the forward inbox and the backward inbox (written when the neighbour's unit
of microbatch ``i`` ends, freed when this stage's unit runs). Microbatch ``i`` uses slot ``i % slots`` of each;
``slots`` is the least count for which no buffer is overwritten while in use.

``"gpipe"`` runs every forward, then every backward: its memory is ``m`` microbatches. ``"1f1b"`` starts the
backward wavefront as soon as the first loss is known, so a device runs a forward and a backward per tick and
its memory stays bounded whatever ``m``: device ``d`` holds ``2(p - 1 - d)`` microbatches at a tick's end (in
lockstep a round trip to the last stage and back costs a whole tick per hop; an asynchronous 1F1B, whose hops
cost one unit each, holds ``p - d``). ``"interleaved"`` cycles each device through its chunks in groups of ``p``
microbatches, dividing the bubble by ``v``; its memory grows with ``v``, not ``m``.

>>> s = make_schedule("1f1b", 2, 4)
>>> print(s.table())
tick     0   1      2      3      4      5
stage 0  F0  F1     F2 B0  F3 B1  B2     B3
stage 1  .   F0 B0  F1 B1  F2 B2  F3 B3  .
>>> s.wasted(), s.theory(), s.slots, s.in_flight().tolist()
(0.2, 0.2, 3, [2, 0])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["SCHEDULES", "Schedule", "make_schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: per tick and device, the microbatch and chunk of its forward and backward unit.

    ``forward[t, d]`` is the microbatch device ``d`` runs forward at tick ``t`` (-1 for none) and
    ``forward_chunk[t, d]`` its chunk (0 where none); ``backward`` and ``backward_chunk`` likewise. Microbatch
    ``i`` uses buffer slot ``i % slots``. Make one with ``make_schedule``.

    >>> s = make_schedule("gpipe", 2, 2)
    >>> s.ticks, s.forward[:, 1].tolist(), s.backward[:, 0].tolist()
    (5, [-1, 0, 1, -1, -1], [-1, -1, -1, 0, 1])
    """

    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    forward: np.ndarray
    forward_chunk: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray
    slots: int

    @property
    def ticks(self) -> int:
        """The number of ticks the schedule runs.

        >>> make_schedule("1f1b", 4, 8).ticks
        14
        """
        return self.forward.shape[0]

    def wasted(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """The share of device time idle or masked, a tick lasting as long as its slowest device.

        ``forward_cost`` and ``backward_cost`` are one chunk's forward and backward times.

        >>> round(make_schedule("gpipe", 4, 4).wasted(), 4), round(make_schedule("gpipe", 4, 4).wasted(1, 1), 4)
        (0.4286, 0.4286)
        """
        busy = forward_cost * (self.forward >= 0) + backward_cost * (self.backward >= 0)
        capacity = self.stages * float(busy.max(axis=1).sum())
        useful = self.microbatches * self.stages * self.virtual_stages * (forward_cost + backward_cost)
        return (capacity - useful) / capacity

    def theory(self) -> float:
        """The bubble a schedule of this shape cannot avoid: ``(p - 1) / (v * m + p - 1)``.

        >>> make_schedule("interleaved", 4, 8, 2).theory() == 3 / 19
        True
        """
        p, m, v = self.stages, self.microbatches, self.virtual_stages
        return (p - 1) / (v * m + p - 1)

    def in_flight(self) -> np.ndarray:
        """Per device, the most units whose forward ran and backward did not at a tick's end (activation memory).

        >>> make_schedule("gpipe", 2, 8).in_flight().tolist(), make_schedule("1f1b", 2, 8).in_flight().tolist()
        ([8, 7], [2, 0])
        """
        alive = np.cumsum((self.forward >= 0).astype(int) - (self.backward >= 0), axis=0)
        return alive.max(axis=0)

    def table(self) -> str:
        """The schedule as text: a row per device, a column per tick, ``F3`` / ``B1`` / ``F3 B1`` cells, ``.`` idle.

        With virtual stages a cell names the chunk too: ``F3.1`` is microbatch 3's forward through chunk 1.

        >>> print(make_schedule("interleaved", 2, 2, 2).table())
        tick     0     1     2     3          4          5     6     7
        stage 0  F0.0  F1.0  F0.1  F1.1       B0.1       B1.1  B0.0  B1.0
        stage 1  .     F0.0  F1.0  F0.1 B0.1  F1.1 B1.1  B0.0  B1.0  .
        """
        rows = [["tick", *map(str, range(self.ticks))]]
        for d in range(self.stages):
            rows.append([f"stage {d}", *(self._cell(t, d) for t in range(self.ticks))])
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                         for row in rows)

    def __repr__(self) -> str:
        return (f"Schedule({self.kind!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"virtual_stages={self.virtual_stages}, ticks={self.ticks}, slots={self.slots}, "
                f"wasted={self.wasted():.4f}, theory={self.theory():.4f})")

    def _cell(self, t: int, d: int) -> str:
        units = [f"{name}{mb[t, d]}" + (f".{chunk[t, d]}" if self.virtual_stages > 1 else "")
                 for name, mb, chunk in (("F", self.forward, self.forward_chunk),
                                         ("B", self.backward, self.backward_chunk)) if mb[t, d] >= 0]
        return " ".join(units) or "."


def make_schedule(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The ``kind`` schedule of ``microbatches`` through ``stages`` devices holding ``virtual_stages`` chunks each.

    ``kind`` is one of ``SCHEDULES``; ``virtual_stages`` > 1 needs ``"interleaved"`` and ``microbatches`` a
    multiple of ``stages``. Schedules are cached and their tables read-only.

    >>> make_schedule("1f1b", 4, 8)
    Schedule('1f1b', stages=4, microbatches=8, virtual_stages=1, ticks=14, slots=7, wasted=0.2727, theory=0.2727)
    """
    if kind not in SCHEDULES:
        raise ValueError(f"make_schedule: kind={kind!r} is not a pipeline schedule; use one of {SCHEDULES}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"make_schedule: {name} must be an int, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"make_schedule: {name}={value} must be at least 1 (kind={kind!r}, stages={stages}, "
                             f"microbatches={microbatches}, virtual_stages={virtual_stages})")
    if virtual_stages > 1 and kind != "interleaved":
        raise ValueError(f"make_schedule: virtual_stages={virtual_stages} needs kind='interleaved', got "
                         f"kind={kind!r}; pass kind='interleaved' or virtual_stages=1")
    if virtual_stages > 1 and microbatches % stages:
        raise ValueError(f"make_schedule: kind='interleaved' runs microbatches in groups of stages={stages}, but "
                         f"microbatches={microbatches} is not a multiple of it; use "
                         f"microbatches={_round_up(microbatches, stages)} (or virtual_stages=1)")
    return _build(kind, int(stages), int(microbatches), int(virtual_stages))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


# Why the tables look as they do. A schedule meets the theory for every forward and backward cost only if exactly
# v*m + p - 1 ticks hold a forward, as many hold a backward, and every tick holding both has a device running both.
# That forces wavefronts: device 0 runs a forward every tick from tick 0, device d the same sequence d ticks later;
# the last device runs a backward every tick from some tick `start`, device d the same sequence p-1-d ticks later.
# The kinds differ in `start` alone: GPipe waits for the last forward, 1F1B and interleaved take the least `start`
# the dependencies allow, and the last device then runs both units in every tick the wavefronts share. The price
# of the lockstep: a round trip from device d to the last stage and back takes 2(p-1-d) ticks, so device d holds
# 2(p-1-d) microbatches (more with chunks), the least any schedule meeting the theory can.
@functools.lru_cache(maxsize=256)
def _build(kind: str, p: int, m: int, v: int) -> Schedule:
    forward_order, backward_order = _orders(p, m, v)
    units = m * v
    positions = np.arange(units)
    forward_at = _position(forward_order, m, v)
    backward_at = _position(backward_order, m, v)
    last_chunk = v - 1
    if kind == "gpipe":
        start = units + p - 2
    else:
        # B(i, last) on the last device at start + its place may share F(i, last)'s tick, never precede it
        start = max(0, int(np.max(forward_at[:, last_chunk] + p - 1 - backward_at[:, last_chunk])))
    ticks = start + units + p - 1
    tables = {name: np.full((ticks, p), fill, np.int32)
              for name, fill in (("forward", -1), ("forward_chunk", 0), ("backward", -1), ("backward_chunk", 0))}
    for d in range(p):
        tables["forward"][positions + d, d] = forward_order[:, 0]
        tables["forward_chunk"][positions + d, d] = forward_order[:, 1]
        tables["backward"][start + positions + p - 1 - d, d] = backward_order[:, 0]
        tables["backward_chunk"][start + positions + p - 1 - d, d] = backward_order[:, 1]
    for table in tables.values():
        table.setflags(write=False)
    slots = _least_slots(p, m, v, forward_at, backward_at, start)
    return Schedule(kind, p, m, v, slots=slots, **tables)


def _orders(p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Device 0's forward sequence and the last device's backward sequence of (microbatch, chunk), [m*v, 2] each.

    Groups of p microbatches go through the chunks in turn (forward ascending, backward descending), so a
    microbatch is back on device 0 for its next chunk exactly when the wavefront reaches it; with v = 1 the
    sequence is the microbatches in order.
    """
    forward, backward = [], []
    for first in range(0, m, p):
        group = range(first, min(first + p, m))
        forward += [(i, c) for c in range(v) for i in group]
        backward += [(i, c) for c in reversed(range(v)) for i in group]
    return np.array(forward, np.int32), np.array(backward, np.int32)


def _position(order: np.ndarray, m: int, v: int) -> np.ndarray:
    """[m, v]: the place of (microbatch, chunk) in ``order``."""
    at = np.empty((m, v), np.int64)
    at[order[:, 0], order[:, 1]] = np.arange(len(order))
    return at


def _least_slots(p: int, m: int, v: int, forward_at: np.ndarray, backward_at: np.ndarray, start: int) -> int:
    """The least slot count for which no buffer of a (device, chunk) is written while another microbatch uses it.

    Each buffer use is an interval of moments ``5 * tick + phase``: phase 1 a forward, 2 the loss, 3 a backward,
    4 the sends at the tick's end; a write conflicts with a use of the same slot that has not ended.
    """
    vs = np.arange(p * v)
    device, chunk = vs % p, vs // p
    f_tick = forward_at[:, chunk] + device  # [m, p*v]: the tick of F(i, vs)
    b_tick = start + backward_at[:, chunk] + p - 1 - device
    last = p * v - 1
    uses = [(5 * f_tick + 1, 5 * b_tick + 3),  # stash: F(i, vs) to B(i, vs)
            (5 * f_tick[:, :-1] + 4, 5 * f_tick[:, 1:] + 1),  # forward inbox of vs + 1 (vs 0 reads the batch)
            # backward inbox: filled by B(i, vs + 1), or by the loss on the last virtual stage
            (np.concatenate([5 * b_tick[:, 1:] + 4, 5 * f_tick[:, last:] + 2], axis=1), 5 * b_tick + 3)]
    for slots in range(1, m):
        if all(_disjoint(begin[i], end[i], begin[j], end[j])
               for begin, end in uses for i in range(m) for j in range(i + slots, m, slots)):
            return slots
    return m


def _disjoint(begin_a: np.ndarray, end_a: np.ndarray, begin_b: np.ndarray, end_b: np.ndarray) -> bool:
    """Whether two microbatches' uses of a buffer, per virtual stage, never overlap."""
    return bool(np.all((begin_b > end_a) | (begin_a > end_b)))
