"""Redistribution planning: the cheapest sequence of collectives from one spec to another.

The planner searches placement states (one placement per mesh axis) with Dijkstra. An edge changes the
placement of one mesh axis with one collective or one local operation:

============================  ==================  ===============================================
from -> to (one mesh axis)    kind                 allowed when
============================  ==================  ===============================================
S(d)/SS(d) -> R               all_gather           the axis is the last one sharding d
P(op) -> R                    all_reduce           always (avg: sum, then divide)
P(sum|avg) -> S(d)/SS(d)      reduce_scatter       no later axis shards d
S(d) -> S(e)                  all_to_all           the axis is the last on d, no later axis on e
R -> S(d)/SS(d)               slice (local)        no later axis shards d
R -> P(op)                    partition (local)    exact: sum keeps the value on coordinate 0
S(d) -> P(sum|max|min)        fill (local)         the axis is the last on d; the rest is the identity
============================  ==================  ===============================================

"Last" is in mesh order, the order in which placements apply: only the innermost cut of a dim can be
gathered, scattered or sliced without disturbing the others. Costs come from the alpha-beta
``CostModel``; a collective that continues a run of the same kind on the same dim pays no second launch,
and afterwards each such run is merged into **one** collective over an axis tuple, ordered the way the
layout is cut so that no local reshuffle is needed where one can be avoided.

>>> import jax; from jshard import Shard, Replicate, Partial
>>> from jshard.spec import Spec
>>> mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"))
>>> src = Spec.create(mesh, (Partial(), Replicate(), Partial()), (16, 16), "float32")
>>> [(s.kind, s.axes) for s in plan_redistribute(src, (Replicate(),) * 3).steps]
[('all_reduce', ('x', 'z'))]
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

from .cost import CostModel
from .placements import Partial, Placement, PlacementError, Replicate, format_placements
from .spec import Spec, _cut_order, dim_layout

__all__ = ["Step", "Plan", "plan_redistribute", "DEFAULT_COST_MODEL"]

DEFAULT_COST_MODEL = CostModel()
COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
LOCAL_KINDS = ("slice", "partition", "fill")
_R = Replicate()


@dataclass(frozen=True)
class Step:
    """One collective (or local operation) of a plan.

    ``axes`` are mesh axis names in the order of the collective's axis tuple; ``src``/``dst`` are the
    placements before and after; ``dim`` is the tensor dim gathered, scattered or (all_to_all) concatenated,
    ``split_dim`` the dim an all_to_all splits; ``op`` the reduction (``sum``, ``max`` or ``min``) and
    ``scale`` the divisor that turns a sum into an average. ``bytes`` is each device's input buffer.
    """

    kind: str
    axes: tuple[str, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    dim: int | None = None
    split_dim: int | None = None
    op: str | None = None
    scale: int = 1
    bytes: int = 0
    cost: float = 0.0

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def __str__(self) -> str:
        what = {"all_reduce": f"{self.op}" + (f"/{self.scale}" if self.scale != 1 else ""),
                "reduce_scatter": f"{self.op} -> dim {self.dim}" + (f"/{self.scale}" if self.scale != 1 else ""),
                "all_gather": f"dim {self.dim}", "all_to_all": f"dim {self.dim} -> dim {self.split_dim}"}
        detail = what.get(self.kind, "")
        return (f"{self.kind}({','.join(self.axes)}{'; ' + detail if detail else ''}) "
                f"{format_placements(self.src)} -> {format_placements(self.dst)}  {self.bytes} B  {self.cost:.1f} us")


@dataclass(frozen=True)
class Plan:
    """The steps that turn ``src`` into ``dst``; exactly what the lowering executes."""

    src: Spec
    dst: Spec
    steps: tuple[Step, ...]

    @property
    def collectives(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.is_collective)

    @property
    def cost(self) -> float:
        return sum(s.cost for s in self.steps)

    @property
    def bytes(self) -> int:
        """Per-device input bytes of all collectives."""
        return sum(s.bytes for s in self.collectives)

    def __str__(self) -> str:
        head = f"plan {self.src} -> {format_placements(self.dst.placements)}"
        if not self.steps:
            return head + ": nothing to do"
        return head + "\n" + "\n".join(f"  {i}. {s}" for i, s in enumerate(self.steps))


def plan_redistribute(src, placements, *, cost_model: CostModel | None = None) -> Plan:
    """The minimum-cost plan from ``src`` (a DArray or a Spec) to ``placements``.

    Plans are cached per (spec, placements, cost model).

    >>> import jax; from jshard import Shard, Replicate
    >>> from jshard.spec import Spec
    >>> src = Spec.create(jax.make_mesh((2, 4), ("dp", "tp")), (Shard(0), Shard(0)), (16, 24), "float32")
    >>> [str(s).split(")")[0] + ")" for s in plan_redistribute(src, (Replicate(), Replicate())).steps]
    ['all_gather(dp,tp; dim 0)']
    """
    spec = getattr(src, "spec", src)
    if not isinstance(spec, Spec):
        raise TypeError(f"plan_redistribute: src must be a DArray or a Spec, got {type(src).__name__}")
    dst = spec.with_placements(placements, where=f"plan_redistribute from {spec}")
    return _plan(spec, dst.placements, cost_model or DEFAULT_COST_MODEL)


# ---------------------------------------------------------------------------------------------------
# internals


@lru_cache(maxsize=65536)
def _padded_lengths(shape: tuple[int, ...], mesh_shape: tuple[int, ...], state: tuple[Placement, ...]):
    return tuple(
        dim_layout(n, mesh_shape, tuple((a, p.split_factor) for a, p in enumerate(state) if p.is_shard and p.dim == d)
                   ).shape[-1]
        for d, n in enumerate(shape)
    )


class _Search:
    """Dijkstra over placement states for one (spec, target, cost model)."""

    def __init__(self, spec: Spec, dst: tuple[Placement, ...], model: CostModel):
        self.shape, self.sizes, self.dst, self.model = spec.shape, spec.mesh_shape, dst, model
        self.names = tuple(spec.mesh.axis_names)
        self.itemsize = spec.itemsize
        # admissible lower bound of what an axis still needs: its hops, and one launch overall
        self.hop = [(n - 1) * model.axis(a).latency_us for a, n in zip(self.names, self.sizes)]

    def partials_ok(self, state) -> bool:
        ops = {p.op for p, n in zip(state, self.sizes) if p.is_partial and n > 1}
        return len(ops) <= 1 or ops <= {"sum", "avg"}

    def padded(self, state):
        return _padded_lengths(self.shape, self.sizes, state)

    def nbytes(self, state) -> int:
        return self.itemsize * math.prod(self.padded(state))

    def needs_collective(self, p, q) -> bool:
        return p != q and not p.is_replicate and not (p.is_shard and q.is_partial and q.op != "avg")

    def heuristic(self, state) -> float:
        hops = [h for p, q, h in zip(state, self.dst, self.hop) if self.needs_collective(p, q)]
        return self.model.launch_us + sum(hops) if hops else 0.0

    def moves(self, state):
        """(axis, new placement, kind, merge key, bytes) for every edge out of ``state``."""
        inner = {}
        for a, p in enumerate(state):
            if p.is_shard:
                inner[p.dim] = a
        for i, p in enumerate(state):
            q = self.dst[i]
            if self.sizes[i] == 1:
                continue
            if p.is_shard:
                if inner[p.dim] != i:
                    continue
                yield i, _R, "all_gather", ("all_gather", p.dim), None
                if q.is_partial and q.op != "avg":
                    yield i, q, "fill", None, None
                if q.is_shard and q.dim != p.dim and inner.get(q.dim, -1) < i:
                    yield i, q, "all_to_all", None, q.dim
            elif p.is_partial:
                if p == q:
                    continue
                yield i, _R, "all_reduce", ("all_reduce", "sum" if p.op == "avg" else p.op), None
                if q.is_shard and p.op in ("sum", "avg") and inner.get(q.dim, -1) < i:
                    yield i, q, "reduce_scatter", ("reduce_scatter", q.dim), q.dim
            elif q.is_shard and inner.get(q.dim, -1) < i:
                yield i, q, "slice", None, None
            elif q.is_partial:
                yield i, q, "partition", None, None

    def edge_bytes(self, state, new, kind, dim) -> int:
        if kind in LOCAL_KINDS:
            return 0
        if kind in ("reduce_scatter", "all_to_all"):
            i = next(a for a, (p, q) in enumerate(zip(state, new)) if p != q)
            return self.buffer_bytes(state, new, dim, self.sizes[i])
        return self.nbytes(state)

    def buffer_bytes(self, state, new, dim, group_size) -> int:
        """Input of a reduce_scatter or all_to_all: one padded target chunk of ``dim`` per device."""
        before, after = self.padded(state), self.padded(new)
        return self.nbytes(state) // before[dim] * group_size * after[dim] if before[dim] else 0

    def run(self, start) -> list[tuple]:
        dst = self.dst
        tie = itertools.count()
        best = {(start, None): 0.0}
        heap = [(self.heuristic(start), 0.0, 0, next(tie), start, None)]
        back = {}
        while heap:
            _, cost, nsteps, _, state, open_key = heapq.heappop(heap)
            if state == dst:
                path, node = [], (state, open_key)
                while node in back:
                    node, edge = back[node]
                    path.append(edge)
                return path[::-1]
            if best.get((state, open_key), math.inf) < cost:
                continue
            for i, q, kind, key, dim in self.moves(state):
                new = state[:i] + (q,) + state[i + 1:]
                if not self.partials_ok(new):
                    continue
                nbytes = self.edge_bytes(state, new, kind, dim if kind != "all_gather" else None)
                step_cost = 0.0 if kind in LOCAL_KINDS else self.model.collective(
                    kind, (self.names[i],), self.sizes[i], nbytes, launch=key is None or key != open_key)
                total = cost + step_cost
                node = (new, key)
                if total < best.get(node, math.inf) - 1e-9:
                    best[node] = total
                    back[node] = ((state, open_key), (i, state, new, kind, key))
                    heapq.heappush(heap, (total + self.heuristic(new), total, nsteps + 1, next(tie), new, key))
        raise AssertionError(f"no redistribution path to {format_placements(dst)}")  # all-R always reaches dst


@lru_cache(maxsize=16384)
def _plan(spec: Spec, dst: tuple[Placement, ...], model: CostModel) -> Plan:
    # a size-1 axis holds the whole value whatever its placement: relabel it for free
    start = tuple(q if n == 1 else p for p, q, n in zip(spec.placements, dst, spec.mesh_shape))
    search = _Search(spec, dst, model)
    return Plan(spec, spec.with_placements(dst), tuple(_merge(search, search.run(start))))


def _merge(search: _Search, edges) -> list[Step]:
    """Group consecutive edges of one merge key (or one local kind) into single steps."""
    steps: list[Step] = []
    groups = itertools.groupby(edges, key=lambda e: e[4] if e[4] is not None else (e[3], None) if e[3] in LOCAL_KINDS
                               else id(e))
    for _, group in groups:
        group = list(group)
        axes_idx = [e[0] for e in group]
        kind, first, last = group[0][3], group[0][1], group[-1][2]
        names = search.names
        dim = split_dim = op = None
        scale = 1
        if kind == "all_gather":
            dim = first[axes_idx[0]].dim
            order = _tuple_order(search, first, dim, reversed(axes_idx))
        elif kind == "reduce_scatter":
            dim = last[axes_idx[0]].dim
            order = _tuple_order(search, last, dim, axes_idx)
        elif kind == "all_to_all":
            dim, split_dim = first[axes_idx[0]].dim, last[axes_idx[0]].dim
            order = axes_idx
        else:
            order = sorted(axes_idx)
        if kind in ("all_reduce", "reduce_scatter"):
            ops = {first[a].op for a in order}
            op = "sum" if ops <= {"sum", "avg"} else ops.pop()
            scale = math.prod(search.sizes[a] for a in order if first[a].op == "avg")
        group_size = math.prod(search.sizes[a] for a in order)
        nbytes = 0
        cost = 0.0
        if kind in COLLECTIVE_KINDS:
            nbytes = (search.buffer_bytes(first, last, dim, group_size) if kind == "reduce_scatter"
                      else search.buffer_bytes(first, last, split_dim, group_size) if kind == "all_to_all"
                      else search.nbytes(first))
            cost = search.model.collective(kind, tuple(names[a] for a in order), group_size, nbytes)
        steps.append(Step(kind, tuple(names[a] for a in order), first, last, dim, split_dim, op, scale, nbytes, cost))
    return steps


def _tuple_order(search: _Search, state, dim, axes) -> list[int]:
    """Axis-tuple order for a merged gather/scatter of ``dim``: the order in which ``state`` cuts it
    when the merged axes are its innermost cuts (then no local reshuffle is needed), else ``axes``."""
    axes = list(axes)
    chain = tuple((a, p.split_factor) for a, p in enumerate(state) if p.is_shard and p.dim == dim)
    order = _cut_order(chain, search.sizes)
    if order is not None and set(order[len(order) - len(axes):]) == set(axes):
        return list(order[len(order) - len(axes):])
    return axes
