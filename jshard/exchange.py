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
from functools import lru_cache

import numpy as np

from .spec import Spec

__all__ = ["Transfer", "Schedule", "exchange_schedule"]


@dataclass(frozen=True)
class Transfer:
    """One sub-block: per dim, positions in the sender's local block and in the receiver's target block."""

    source: int  # device index in mesh order
    target: int
    src_pos: tuple[tuple[int, ...], ...]
    dst_pos: tuple[tuple[int, ...], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(map(len, self.dst_pos))


@dataclass(frozen=True)
class Schedule:
    """What each device keeps (``local``, one Transfer with source == target per device that keeps
    something) and what it receives, round by round."""

    local: tuple[Transfer, ...]
    rounds: tuple[tuple[Transfer, ...], ...]

    def round_shape(self, r: int) -> tuple[int, ...]:
        return tuple(max(s) for s in zip(*(t.shape for t in self.rounds[r])))

    def round_bytes(self, r: int, itemsize: int) -> int:
        return itemsize * math.prod(self.round_shape(r))


def eligible(src: Spec, dst_placements) -> bool:
    """Partial axes must stay as they are; the exchange moves values, it does not reduce them."""
    return all(p == q if p.is_partial or q.is_partial else True for p, q in zip(src.placements, dst_placements)) \
        and all(n > 0 for n in src.shape)


@lru_cache(maxsize=4096)
def exchange_schedule(src: Spec, dst: Spec) -> Schedule:
    mesh_shape = src.mesh_shape
    coords = list(np.ndindex(*mesh_shape))
    partial_axes = [a for a, p in enumerate(src.placements) if p.is_partial]
    rank = src.rank
    # per dim: the source shard ("cell") of every global index, and every device's cell and positions
    owner, cell_of, inverse = [], [], []
    for d in range(rank):
        lay = src.layouts[d]
        own = np.full(src.shape[d], -1, dtype=np.int64)
        cells, inv = [], []
        for c in coords:
            held = lay[c][lay[c] >= 0]
            cells.append(int(held[0]) if held.size else -1)  # a shard is named by its first index
            own[held] = held[0] if held.size else -1
            pos = np.full(src.shape[d], -1, dtype=np.int64)
            pos[held] = np.arange(held.size)
            inv.append(pos)
        owner.append(own)
        cell_of.append(cells)
        inverse.append(inv)
    holders: dict = {}
    for i, c in enumerate(coords):
        key = (tuple(cell_of[d][i] for d in range(rank)), tuple(c[a] for a in partial_axes))
        holders.setdefault(key, []).append(i)

    local, demands = [], []
    for t, c in enumerate(coords):
        need = []  # per dim: {cell: (target positions, global indices)}
        for d in range(rank):
            lay = dst.layouts[d][c]
            held = lay[lay >= 0]
            by_cell: dict = {}
            for j, g in enumerate(held):
                by_cell.setdefault(int(owner[d][g]), []).append((j, int(g)))
            need.append(by_cell)
        if any(not n for n in need):
            continue  # an empty target block
        pc = tuple(c[a] for a in partial_axes)
        for combo in itertools.product(*[sorted(n) for n in need]):
            devices = holders[(combo, pc)]
            parts = [need[d][combo[d]] for d in range(rank)]
            dst_pos = tuple(tuple(j for j, _ in part) for part in parts)
            globals_ = [[g for _, g in part] for part in parts]
            if t in devices:
                local.append(Transfer(t, t, _positions(inverse, t, globals_), dst_pos))
            else:
                demands.append((t, devices, dst_pos, globals_))
    rounds = []
    while demands:
        matched = _match(demands)
        rounds.append(tuple(Transfer(s, demands[k][0], _positions(inverse, s, demands[k][3]), demands[k][2])
                            for k, s in matched))
        served = {k for k, _ in matched}
        demands = [dm for k, dm in enumerate(demands) if k not in served]
    return Schedule(tuple(local), tuple(rounds))


def _positions(inverse, device: int, globals_) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(inverse[d][device][g]) for g in gs) for d, gs in enumerate(globals_))


def _match(demands) -> list[tuple[int, int]]:
    """A maximum matching of receivers to senders (each at most once per round), as (demand, sender)."""
    wanted: dict = {}  # receiver -> senders able to serve one of its demands
    for t, devices, _, _ in demands:
        wanted.setdefault(t, dict.fromkeys(())).update(dict.fromkeys(devices))
    receiver_of: dict = {}

    def augment(t, seen) -> bool:  # Kuhn's augmenting path
        for s in wanted[t]:
            if s not in seen:
                seen.add(s)
                if s not in receiver_of or augment(receiver_of[s], seen):
                    receiver_of[s] = t
                    return True
        return False

    for t in wanted:
        augment(t, set())
    out = []
    for s, t in receiver_of.items():
        out.append((next(k for k, dm in enumerate(demands) if dm[0] == t and s in dm[1]), s))
    return sorted(out)
