"""Point-to-point exchange: every device fetches exactly the sub-blocks it lacks.

Where source and target differ only in Shard/Replicate placements (Partial axes unchanged), each
device's target block is a union of sub-blocks of source blocks: per dim, the indices it needs fall into
a few source shards, and every combination of them is held whole by some device. An exchange sends each
missing sub-block from one holder, in rounds; a round is a ``ppermute`` (each device sends at most one
sub-block and receives at most one), found as a maximum bipartite matching of receivers to holders. The
bytes a device receives are then the information lower bound (its target block minus what it already
holds), padded within a round to the round's largest sub-block.

The planner prices a schedule; the lowering turns the same (cached) schedule into gathers, ppermutes
and scatters.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .caches import memo
from .spec import Spec

__all__ = ["Transfer", "Schedule", "exchange_schedule"]


@dataclass(frozen=True, eq=False)
class Transfer:
    """One sub-block: per dim, positions in the sender's local block and in the receiver's target block."""

    source: int  # device index in mesh order
    target: int
    src_pos: tuple[np.ndarray, ...]
    dst_pos: tuple[np.ndarray, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(len, self.dst_pos))


@dataclass(frozen=True, eq=False)
class Schedule:
    """What each device keeps (``local``, one Transfer with source == target per device that keeps
    something) and what it receives, round by round."""

    local: tuple[Transfer, ...]
    rounds: tuple[tuple[Transfer, ...], ...]

    def round_shape(self, r: int) -> tuple[int, ...]:
        return tuple(max(s) for s in zip(*(t.shape for t in self.rounds[r]), strict=True))

    def round_bytes(self, r: int, itemsize: int) -> int:
        return itemsize * math.prod(self.round_shape(r))


# the most devices an exchange is planned for: its schedule matches receivers to holders device by device
# (quadratic in the devices: a second for one array at 96) and runs as many ``ppermute`` rounds; larger meshes (the
# clusters ``jshard.parallel.predict`` prices) move by collectives alone
MAX_DEVICES = 32


def eligible(src: Spec, dst_placements) -> bool:
    """Partial axes must stay as they are (the exchange moves values, it does not reduce them), on a mesh of at
    most ``MAX_DEVICES`` devices."""
    return (src.rank > 0 and all(n > 0 for n in src.shape) and math.prod(src.mesh_shape) <= MAX_DEVICES
            and all(p == q for p, q in zip(src.placements, dst_placements, strict=True)
                    if p.is_partial or q.is_partial))


class _Dim:
    """One tensor dim: which source shard holds each global index, and where."""

    def __init__(self, src_layout: np.ndarray, dst_layout: np.ndarray, length: int):
        self.src = src_layout.reshape(-1, src_layout.shape[-1])
        self.dst = dst_layout.reshape(-1, dst_layout.shape[-1])
        self.owner = np.full(length, -1, dtype=np.int64)
        self.cell = np.full(len(self.src), -1, dtype=np.int64)
        self.position = {}  # cell -> position of each global index within that shard (same on every holder)
        for i, row in enumerate(self.src):
            held = row[row >= 0]
            if held.size:
                self.cell[i] = held[0]  # a shard is named by its first index
                if held[0] not in self.position:
                    self.owner[held] = held[0]
                    pos = np.full(length, -1, dtype=np.int64)
                    pos[held] = np.arange(held.size)
                    self.position[int(held[0])] = pos
        self._needs: dict = {}

    def needs(self, t: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per source shard: (positions in t's target list, source positions) of what t needs from it."""
        row = self.dst[t]
        key = row.tobytes()
        got = self._needs.get(key)
        if got is None:
            held = row[row >= 0]
            owners = self.owner[held]
            got = {}
            for c in np.unique(owners):
                j = np.nonzero(owners == c)[0]
                got[int(c)] = (j, self.position[int(c)][held[j]])
            self._needs[key] = got
        return got


@memo(4096)
def exchange_schedule(src: Spec, dst: Spec) -> Schedule:
    """The rounds in which every device of ``dst`` receives the sub-blocks of ``src`` it lacks."""
    coords = list(np.ndindex(*src.mesh_shape))
    partial_axes = [a for a, p in enumerate(src.placements) if p.is_partial]
    dims = [_Dim(src.layouts[d], dst.layouts[d], src.shape[d]) for d in range(src.rank)]
    holders: dict = {}
    for i, c in enumerate(coords):
        key = (tuple(int(dim.cell[i]) for dim in dims), tuple(c[a] for a in partial_axes))
        holders.setdefault(key, []).append(i)
    local, demands = [], []
    for t, c in enumerate(coords):
        need = [dim.needs(t) for dim in dims]
        if any(not n for n in need):
            continue  # an empty target block
        pc = tuple(c[a] for a in partial_axes)
        for combo in itertools.product(*[sorted(n) for n in need]):
            devices = holders[(combo, pc)]
            parts = [need[d][cell] for d, cell in enumerate(combo)]
            dst_pos, src_pos = tuple(p[0] for p in parts), tuple(p[1] for p in parts)
            if t in devices:
                local.append(Transfer(t, t, src_pos, dst_pos))
            else:
                demands.append((t, devices, dst_pos, src_pos))
    rounds = []
    while demands:
        matched = _match(demands)
        rounds.append(tuple(Transfer(s, demands[k][0], demands[k][3], demands[k][2]) for k, s in matched))
        served = {k for k, _ in matched}
        demands = [dm for k, dm in enumerate(demands) if k not in served]
    return Schedule(tuple(local), tuple(rounds))


def _match(demands) -> list[tuple[int, int]]:
    """A maximum matching of receivers to senders (each at most once per round), as (demand, sender).

    The busiest receivers and senders go first, so that a round serves every device that still has the
    most to receive or send and the number of rounds stays at the largest such count where possible.
    """
    wanted: dict = {}  # receiver -> senders able to serve one of its demands
    load: dict = {}  # sender -> how many demands it could serve
    for t, devices, _, _ in demands:
        wanted.setdefault(t, {}).update(dict.fromkeys(devices))
        for s in devices:
            load[s] = load.get(s, 0) + 1
    for t in wanted:
        wanted[t] = sorted(wanted[t], key=lambda s: -load[s])
    receiver_of: dict = {}

    def augment(t, seen) -> bool:  # Kuhn's augmenting path
        for s in wanted[t]:
            if s not in seen:
                seen.add(s)
                if s not in receiver_of or augment(receiver_of[s], seen):
                    receiver_of[s] = t
                    return True
        return False

    pending = {}
    for t, _, _, _ in demands:
        pending[t] = pending.get(t, 0) + 1
    for t in sorted(wanted, key=lambda t: -pending[t]):
        augment(t, set())
    out = []
    for s, t in receiver_of.items():
        out.append((next(k for k, dm in enumerate(demands) if dm[0] == t and s in dm[1]), s))
    return sorted(out)
