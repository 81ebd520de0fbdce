"""Redistribution planning: the cheapest sequence of collectives from one spec to another.

The planner searches placement states (one placement per mesh axis) with A* (an admissible bound of
the launches and hops still needed). An edge changes the placement of one mesh axis with one
collective or one local operation:

============================  ==================  ===============================================
from -> to (one mesh axis)    kind                 allowed when
============================  ==================  ===============================================
S(d)/SS(d) -> R               all_gather           the axis cuts d innermost (*)
P(op) -> R                    all_reduce           always (avg: sum, then divide)
P(op) -> S(d)/SS(d)           reduce_scatter       it will cut d innermost (*) (max, min: all_to_all
                                                   and a local max / min)
S(d) -> S(e)                  all_to_all           the axis is the last on d, no later axis on e
                                                   (also several innermost axes of d at once)
R -> S(d)/SS(d)               slice (local)        it will cut d innermost (*)
R -> P(op)                    partition (local)    exact: sum keeps the value on coordinate 0
S(d) -> P(sum|max|min)        fill (local)         the axis cuts d innermost (*); the rest is the identity
the target, relabelled        permute              the placements are the target's on equal-size
                                                   axes in another order: one ppermute moves
                                                   every block to its new owner
anything -> anything          empty (local)        the array has a 0-size dim: every block is empty,
                                                   so every layout holds the same (no) values
============================  ==================  ===============================================

Besides the search, where the Partial axes stay as they are, an ``exchange`` (``jshard.exchange``)
sends every device exactly the sub-blocks it lacks in rounds of ppermute, either straight to the target
or to the target with the source's shards kept where the target replicates (then gathered); it is taken
when it is cheaper than the best path of collectives.

An integer ``Partial(avg)`` is ``floor(S / n)``, ``S`` the exact sum of the parts over its sum and avg axes and
``n`` the size of its avg axes, wrapped into the dtype like any integer sum (an average alone, of parts in range,
is in range: exact for every value of the dtype). ``floor(a / n) + floor(b / n)`` is not ``floor((a + b) / n)``,
nor is the average of sums that wrapped the average of their parts, so while an integer avg axis is pending,
its sum and avg axes are reduced together in one collective (of ``mean_carrier`` pairs: each part split into
quotient and remainder, so that ``S`` never has to fit the dtype), and a Partial target is partitioned again
afterwards.

(*) Innermost: last in mesh order (the order in which placements apply), or last in the dim's shard order when
its StridedShards spell one (``spec.cut_order``; FSDP inside TP, ``(SS(0,4), S(0))``, cuts on the data axis
innermost). Only the innermost cut of a dim can be gathered, scattered or sliced without disturbing the others.

Costs come from the alpha-beta ``CostModel``; a collective that continues a run of the same kind on the same
dim pays no second launch, and afterwards each such run is merged into **one** collective over an axis tuple,
ordered the way the layout is cut so that no local reshuffle is needed where one can be avoided.

>>> import jax; from jshard import Shard, Replicate, Partial
>>> from jshard.spec import Spec
>>> mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"))
>>> src = Spec.create(mesh, (Partial(), Replicate(), Partial()), (16, 16), "float32")
>>> [(s.kind, s.axes) for s in plan_redistribute(src, (Replicate(),) * 3).steps]
[('all_reduce', ('x', 'z'))]
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from . import exchange
from .caches import memo
from .cost import CostModel
from .placements import Placement, Replicate, StridedShard, format_placements, partial_ops_mix
from .spec import Spec, cut_order, padded_length

__all__ = ["Step", "Plan", "plan_redistribute", "plan_uncached", "check_cost_model", "pricing", "model_in_force",
           "mean_carrier", "DEFAULT_COST_MODEL"]

DEFAULT_COST_MODEL = CostModel()
# the model that prices what is planned with no model named: the default, or a jshard.jit's while it plans
_IN_FORCE = contextvars.ContextVar("jshard_cost_model", default=DEFAULT_COST_MODEL)
COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "permute", "exchange")
LOCAL_KINDS = ("slice", "partition", "fill", "empty")
_AXIS_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")  # the search's per-axis edges
_R = Replicate()


@dataclass(frozen=True)
class Step:
    """One collective (or local operation) of a plan.

    ``axes`` are mesh axis names in the order of the collective's axis tuple; ``src``/``dst`` are the
    placements before and after; ``dim`` is the tensor dim gathered, scattered or (all_to_all) concatenated,
    ``split_dim`` the dim an all_to_all splits; ``op`` the reduction (``sum``, ``max`` or ``min``) and
    ``scale`` the divisor that turns a sum into an average; ``perm`` (permute): the placement of axis
    ``i`` moves to axis ``perm[i]``, so device ``c`` receives the block of the device whose coordinate on
    axis ``i`` is ``c[perm[i]]``. ``bytes`` is each device's input buffer;
    ``count`` the number of collectives the step issues (an exchange is ``count`` ppermute rounds).
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
    perm: tuple[int, ...] | None = None
    count: int = 1

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS and self.count > 0

    @property
    def emitted(self) -> str:
        """The collective the lowering emits: ``kind``, except a max / min reduce_scatter, an all_to_all (followed
        by a local max / min) since ``psum_scatter`` only sums."""
        return "all_to_all" if self.kind == "reduce_scatter" and self.op in ("max", "min") else self.kind

    def __str__(self) -> str:
        what = {"all_reduce": f"{self.op}" + (f"/{self.scale}" if self.scale != 1 else ""),
                "reduce_scatter": f"{self.op} -> dim {self.dim}"
                                  + (f"/{self.scale}" if self.scale != 1 else ""),
                "all_gather": f"dim {self.dim}", "all_to_all": f"dim {self.dim} -> dim {self.split_dim}",
                "exchange": f"{self.count} ppermute rounds"}
        detail = what.get(self.kind, "")
        return (f"{self.kind}({','.join(self.axes)}{'; ' + detail if detail else ''}) "
                f"{format_placements(self.src)} -> {format_placements(self.dst)}  "
                f"{self.bytes} B  {self.cost:.1f} us")


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
    def collective_count(self) -> int:
        return sum(s.count for s in self.collectives)

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
    model = check_cost_model(cost_model, "plan_redistribute")
    if type(placements) is tuple and all(isinstance(p, Placement) for p in placements):
        return _planned(spec, placements, model)
    return _validated_plan(spec, placements, model)


def _validated_plan(spec: Spec, placements, model: CostModel) -> Plan:
    dst = spec.with_placements(placements, where=f"plan_redistribute from {spec}")
    return _plan(spec, dst.placements, model)


# keyed by the placements as given: a planner asks for the same moves again and again, and validating them (and
# naming the spec for the error message) costs more than the lookup
_planned = memo(65536)(_validated_plan)


def check_cost_model(cost_model, where: str) -> CostModel:
    """``cost_model``, or the model in force for None (see ``pricing``); anything else is a TypeError naming
    ``where``."""
    if cost_model is None:
        return model_in_force()
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"{where}: cost_model must be a jshard.CostModel or None, got {cost_model!r}; e.g. "
                        "jshard.CostModel(axes={'dp': jshard.AxisCost(latency_us=10.0, bandwidth_gbps=5.0)})")
    return cost_model


def model_in_force() -> CostModel:
    """The cost model that prices a plan asked for with none named (the default outside ``pricing``)."""
    return _IN_FORCE.get()


@contextlib.contextmanager
def pricing(cost_model: CostModel) -> Iterator[CostModel]:
    """Within the block, whatever is planned without naming a cost model is priced by ``cost_model``: how
    ``jshard.jit(..., cost_model=...)`` reaches every choice of the walk, the redistributions and the lowering.

    >>> import jax; from jshard import CostModel, Replicate, Shard
    >>> from jshard.spec import Spec
    >>> src = Spec.create(jax.make_mesh((8,), ("x",)), (Shard(0),), (16,), "float32")
    >>> default = plan_redistribute(src, (Replicate(),)).cost
    >>> with pricing(CostModel(launch_us=60.0)):
    ...     round(plan_redistribute(src, (Replicate(),)).cost - default, 1)
    53.4
    """
    token = _IN_FORCE.set(check_cost_model(cost_model, "pricing"))
    try:
        yield cost_model
    finally:
        _IN_FORCE.reset(token)


def mean_carrier(dtype) -> np.dtype | None:
    """What an integer average is reduced in: each part ``p`` as the pair ``(p // n, p % n)``, whose sums give
    ``floor(S / n) = sum(p // n) + sum(p % n) // n`` with no sum that must fit the dtype exactly (the quotients'
    sum may wrap like any integer sum; the result is in range). The dtype itself from 32 bits on, where the
    remainders (each below ``n``) add up far inside it; int32 for narrower ones, where neither ``n`` nor the
    remainders' sum need fit. None for inexact dtypes, which divide the sum directly."""
    if not jnp.issubdtype(dtype, jnp.integer):
        return None
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.int32)


# ---------------------------------------------------------------------------------------------------
# internals


@memo(65536)
def _padded_lengths(shape: tuple[int, ...], mesh_shape: tuple[int, ...], state: tuple[Placement, ...]):
    return tuple(
        padded_length(n, mesh_shape, tuple((a, p.split_factor) for a, p in enumerate(state)
                                           if p.is_shard and p.dim == d))
        for d, n in enumerate(shape)
    )


@memo(256)
def _axis_prices(model: CostModel, names, sizes):
    """Per kind and axis: a collective costs launch + hop + bytes * per_byte; and each axis's cheapest hop."""
    hop, per_byte = {}, {}
    for k in _AXIS_KINDS:
        hop[k] = [model.collective(k, (name,), n, 0, launch=False) for name, n in zip(names, sizes, strict=True)]
        per_byte[k] = [model.collective(k, (name,), n, 1, launch=False) - h
                       for name, n, h in zip(names, sizes, hop[k], strict=True)]
    return hop, per_byte, [min(hop[k][a] for k in _AXIS_KINDS) for a in range(len(sizes))]


class Edge(NamedTuple):
    """One step of a path: a collective or local operation that changes the placements of some mesh axes."""

    axes: tuple[int, ...]  # the mesh axes (indices) it changes
    before: tuple[int, ...]  # the state it starts from: one interned placement per mesh axis
    after: tuple[int, ...]  # the state it leads to
    kind: str  # a row of the module docstring's table: "all_gather", "slice", "permute", ...
    merge_key: tuple | None  # collectives with equal keys in a row merge into one; None never merges
    dim: int | None = None  # the tensor dim gathered, scattered or (all_to_all) split: sizes the buffer
    perm: tuple[int, ...] | None = None  # a permute's sigma: axis i's placement moves to axis sigma[i]


class Run(NamedTuple):
    """The open run of mergeable collectives the last edge of a path belongs to: extending it costs exactly
    what the merged collective costs more (no second launch)."""

    merge_key: tuple  # what its collectives share: the kind and the dim (or reduce op)
    axes: tuple[int, ...]  # the mesh axes merged so far, in order
    nbytes: int  # its input bytes per device, fixed by its first collective
    divides: bool  # whether it reduces a Partial(avg) axis (an integer average reduces every sum with it)


def _requirement(merge_key):
    """What an open run of collectives can still serve without a launch (see ``_Search.heuristic``)."""
    kind = merge_key[0]
    return merge_key if kind == "all_gather" else merge_key[1] if kind == "all_reduce" else merge_key[2]


class _Search:
    """A* over placement states for one (spec, target, cost model).

    States are tuples of small ints (placements interned per search: the replicate placement, the
    source's and the target's) so that hashing and tests stay cheap on large meshes.
    """

    def __init__(self, spec: Spec, start: tuple[Placement, ...], dst: tuple[Placement, ...],
                 model: CostModel):
        self.shape, self.sizes, self.model = spec.shape, spec.mesh_shape, model
        self.names = tuple(spec.mesh.axis_names)
        self.dtype, self.itemsize = spec.dtype, spec.itemsize
        self.table = list(dict.fromkeys((_R, *start, *dst)))
        ids = {p: i for i, p in enumerate(self.table)}
        self.start, self.dst = tuple(ids[p] for p in start), tuple(ids[p] for p in dst)
        self.shard_dim = [p.dim if p.is_shard else -1 for p in self.table]
        self.op = [p.op if p.is_partial else None for p in self.table]
        self.fillable = [p.is_partial and p.op != "avg" for p in self.table]
        self.strided = [isinstance(p, StridedShard) for p in self.table]
        self.split = [p.split_factor if p.is_shard else 0 for p in self.table]
        self._innermost: dict = {}
        self._strided_target = any(self.strided[q] for q in self.dst)
        self._dst_multiset = sorted(zip(self.dst, self.sizes, strict=True))
        self.hop, self.per_byte, self.min_hop = _axis_prices(model, self.names, self.sizes)
        self.floor_divides = jnp.issubdtype(spec.dtype, jnp.integer)  # an integer average rounds down
        self._padded: dict = {}
        self._prices: dict = {}

    def decode(self, state) -> tuple[Placement, ...]:
        return tuple(self.table[i] for i in state)

    def padded(self, state) -> tuple[int, ...]:
        got = self._padded.get(state)
        if got is None:
            got = self._padded[state] = _padded_lengths(self.shape, self.sizes, self.decode(state))
        return got

    def nbytes(self, state) -> int:
        return self.itemsize * math.prod(self.padded(state))

    def partials_ok(self, state) -> bool:
        return partial_ops_mix({self.op[p] for p, n in zip(state, self.sizes, strict=True) if self.op[p] and n > 1})

    def divides_early(self, state, run) -> bool:
        """Whether closing ``run`` in ``state`` splits an integer average's sum between collectives.

        ``floor(a / n) + floor(b / n)`` is not ``floor((a + b) / n)``, and an average of integer sums that
        wrapped is not the average of their parts: with an integer dtype, a run of sums that divides (reduces a
        Partial(avg) axis), or that leaves one pending, must leave no Partial sum or avg pending, so every sum
        and avg axis is reduced in that one collective. Floats divide anywhere; integer sums alone wrap alike
        in any order.
        """
        if not (self.floor_divides and run is not None and _requirement(run.merge_key) == "sum"):
            return False
        pending = {self.op[p] for p, n in zip(state, self.sizes, strict=True) if n > 1} & {"sum", "avg"}
        return bool(pending) and (run.divides or "avg" in pending)

    def avg_to_floor(self, state) -> bool:
        """Whether an integer sum or avg axis still has to be reduced while an avg axis is pending: then
        the sum and avg axes already in place are reduced with it (and partitioned again), so that one
        collective divides the exact sum of every part (``divides_early``)."""
        if not self.floor_divides:
            return False
        reduced = avg = False
        for p, q, n in zip(state, self.dst, self.sizes, strict=True):
            if n > 1 and self.op[p] in ("sum", "avg"):
                reduced |= p != q
                avg |= self.op[p] == "avg"
        return reduced and avg

    def heuristic(self, state, open_run) -> float:
        """Admissible: every axis still needing a collective pays its cheapest hops; each dim (or
        reduce op) still needing one pays a launch, except the run that is already open."""
        hops, classes = 0.0, set()
        for a, (p, q) in enumerate(zip(state, self.dst, strict=True)):
            if p == q or p == 0:
                continue
            if self.shard_dim[p] >= 0:
                if self.fillable[q]:
                    continue
                classes.add(("all_gather", self.shard_dim[p]))
            else:
                classes.add("sum" if self.op[p] == "avg" else self.op[p])
            hops += self.min_hop[a]
        if not classes:
            return 0.0
        launches = len(classes) - (open_run is not None and _requirement(open_run.merge_key) in classes)
        return launches * self.model.launch_us + hops

    def moves(self, state):
        """Every useful edge out of ``state`` as ``(axes, after, kind, merge_key, dim)``, the fields of an
        ``Edge`` that vary: plain tuples, since this is the search's inner loop and most edges are priced
        and dropped (``run`` makes ``Edge`` records of the path's)."""
        dim_of, dst = self.shard_dim, self.dst
        chains: dict[int, list[int]] = {}
        for a, p in enumerate(state):
            if dim_of[p] >= 0:
                chains.setdefault(dim_of[p], []).append(a)
        inner = {d: c[-1] for d, c in chains.items()}
        for i, p in enumerate(state):
            q = dst[i]
            if self.sizes[i] == 1:
                continue
            d, e = dim_of[p], dim_of[q]
            if d >= 0:
                if inner[d] != i and self.innermost(state, d) != i:
                    continue
                # an axis already in place is gathered only to let an earlier axis on its dim change
                if p != q or any(state[j] != dst[j] and d in (dim_of[state[j]], dim_of[dst[j]])
                                 for j in range(i)):
                    yield (i,), state[:i] + (0,) + state[i + 1:], "all_gather", ("all_gather", d), d
                if self.fillable[q]:
                    yield (i,), state[:i] + (q,) + state[i + 1:], "fill", None, None
            elif p:
                op = self.op[p]
                if p == q and not (op in ("sum", "avg") and self.avg_to_floor(state)):
                    continue
                key = ("all_reduce", "sum" if op == "avg" else op)
                yield (i,), state[:i] + (0,) + state[i + 1:], "all_reduce", key, None
                after = state[:i] + (q,) + state[i + 1:]
                # P(max|min) too: an all_to_all and a local max move what psum_scatter moves
                if e >= 0 and (inner.get(e, -1) < i or self.innermost(after, e) == i):
                    key = ("reduce_scatter", e, "sum" if op == "avg" else op)
                    yield (i,), after, "reduce_scatter", key, e
            elif e >= 0:
                after = state[:i] + (q,) + state[i + 1:]
                if inner.get(e, -1) < i or self.innermost(after, e) == i:
                    yield (i,), after, "slice", None, None
            elif q:
                yield (i,), state[:i] + (q,) + state[i + 1:], "partition", None, None
        # all_to_all: the innermost cuts of d (one axis or several) become the innermost cuts of e
        for d, chain in chains.items():
            for k in range(1, len(chain) + 1):
                axes = chain[-k:]
                e = dim_of[dst[axes[0]]]
                if e < 0 or e == d or inner.get(e, -1) > axes[0] or any(
                        dst[a] != dst[axes[0]] or self.sizes[a] == 1 for a in axes):
                    break
                new = list(state)
                for a in axes:
                    new[a] = dst[a]
                yield tuple(axes), tuple(new), "all_to_all", None, e

    def innermost(self, state, dim: int) -> int | None:
        """The axis that cuts ``dim`` last when its axes cut it in a shard order (``spec.cut_order``: FSDP inside
        TP is ``(SS(0, tp), S(0))``, the data axis innermost though first in the mesh), else None. Only the
        innermost cut is one contiguous piece of every block: gathered, scattered or sliced locally."""
        chain = tuple((a, self.split[p]) for a, p in enumerate(state) if self.shard_dim[p] == dim)
        got = self._innermost.get((chain, dim), -1)
        if got == -1:
            order = cut_order(chain, self.sizes, self.shape[dim])
            got = self._innermost[(chain, dim)] = order[-1] if order else None
        return got

    def relabelling(self, state) -> tuple[int, ...] | None:
        """``sigma`` with ``dst[sigma[i]] == state[i]`` over equal-size axes, keeping the order of the
        axes that shard each dim, or None. Strided shards are left to the other edges."""
        if (state == self.dst or self._strided_target
                or sorted(zip(state, self.sizes, strict=True)) != self._dst_multiset):
            return None
        if any(self.strided[p] for p in state):
            return None
        sigma = [i if p == q else None for i, (p, q) in enumerate(zip(state, self.dst, strict=True))]
        free = {}
        for j, q in enumerate(self.dst):
            if sigma[j] is None:
                free.setdefault((q, self.sizes[j]), []).append(j)
        for i, p in enumerate(state):
            if sigma[i] is None:
                slots = free.get((p, self.sizes[i]))
                if not slots:
                    return None
                sigma[i] = slots.pop(0)
        for d in range(len(self.shape)):
            chain = [sigma[i] for i, p in enumerate(state) if self.shard_dim[p] == d]
            if chain != sorted(chain):
                return None
        return tuple(sigma)

    def buffer_bytes(self, state, new, dim, group_size) -> int:
        """Input of a reduce_scatter or all_to_all: one padded target chunk of ``dim`` per device."""
        before, after = self.padded(state), self.padded(new)
        return self.nbytes(state) // before[dim] * group_size * after[dim] if before[dim] else 0

    def price(self, kind, axes, nbytes) -> float:
        """Cost of ``kind`` over the axis tuple ``axes`` without its launch, memoised."""
        key = (kind, axes, nbytes)
        got = self._prices.get(key)
        if got is None:
            if len(axes) == 1:
                got = self.hop[kind][axes[0]] + nbytes * self.per_byte[kind][axes[0]]
            else:
                got = self.model.collective(kind, tuple(self.names[a] for a in axes),
                                            math.prod(self.sizes[a] for a in axes), nbytes, launch=False,
                                            sizes={self.names[a]: self.sizes[a] for a in axes})
            self._prices[key] = got
        return got

    def run(self) -> list[Edge]:
        """The cheapest path, as edges.

        A node is ``(state, open run)``: the same state reached inside a run of mergeable collectives
        and outside one costs differently from there on, so they are different nodes.
        """
        start, dst = self.start, self.dst
        tie = itertools.count()  # heap ties go to the older entry, never to comparing runs
        best = {(start, None): 0.0}
        heap = [(self.heuristic(start, None), 0.0, next(tie), start, None)]
        back = {}  # node -> (the node it was reached from, then axes, kind, merge_key, dim, perm of the edge)
        launch = self.model.launch_us
        while heap:
            _, cost, _, state, run = heapq.heappop(heap)
            must_extend = self.divides_early(state, run)  # closing the open run now would divide too early
            if state == dst and not must_extend:
                path, node = [], (state, run)
                while node in back:
                    after, _ = node
                    node, axes, kind, key, dim, perm = back[node]
                    before, _ = node
                    path.append(Edge(axes, before, after, kind, key, dim, perm))
                return path[::-1]
            if best.get((state, run), math.inf) < cost:
                continue
            for axes, new, kind, key, dim in self.moves(state):
                extends = run is not None and key == run.merge_key
                if must_extend and not extends:
                    continue
                if kind in LOCAL_KINDS:
                    if not self.partials_ok(new):
                        continue
                    total, new_run = cost, None
                else:
                    divides = kind in ("all_reduce", "reduce_scatter") and self.op[state[axes[0]]] == "avg"
                    if extends:
                        new_run = Run(key, run.axes + axes, run.nbytes, run.divides or divides)
                        total = (cost + self.price(kind, new_run.axes, run.nbytes)
                                 - self.price(kind, run.axes, run.nbytes))
                    else:
                        if kind in ("all_gather", "all_reduce"):
                            nbytes = self.nbytes(state)
                        else:  # one target chunk per device of the group
                            group = math.prod(self.sizes[a] for a in axes)
                            nbytes = self.buffer_bytes(state, new, dim, group)
                        total = cost + launch + self.price(kind, axes, nbytes)
                        new_run = Run(key, axes, nbytes, divides) if key is not None else None
                node = (new, new_run)
                if total < best.get(node, math.inf) - 1e-9:
                    best[node] = total
                    back[node] = ((state, run), axes, kind, key, dim, None)
                    estimate = total + self.heuristic(new, new_run)
                    heapq.heappush(heap, (estimate, total, next(tie), new, new_run))
            sigma = self.relabelling(state)
            if sigma is not None and not must_extend:
                moved = tuple(i for i in range(len(sigma)) if sigma[i] != i)
                total = cost + self.model.collective("permute", tuple(self.names[i] for i in moved), 2,
                                                     self.nbytes(state))
                node = (dst, None)
                if total < best.get(node, math.inf) - 1e-9:
                    best[node] = total
                    back[node] = ((state, run), moved, "permute", None, None, sigma)
                    heapq.heappush(heap, (total, total, next(tie), dst, None))
        raise AssertionError(f"no redistribution path to {format_placements(self.decode(dst))}")


def plan_uncached(spec: Spec, placements, cost_model: CostModel | None = None) -> Plan:
    """``plan_redistribute``'s search itself, with no memo in front of it: what a benchmark of planning times."""
    _padded_lengths.cache_clear()
    return _plan.__wrapped__(spec, tuple(placements), cost_model or DEFAULT_COST_MODEL)


@memo(16384)
def _plan(spec: Spec, dst: tuple[Placement, ...], model: CostModel) -> Plan:
    if 0 in spec.shape:
        # no elements: a collective would move nothing (and XLA rejects 0-size collective dims)
        steps = () if dst == spec.placements else (Step("empty", (), spec.placements, dst),)
        return Plan(spec, spec.with_placements(dst), steps)
    # a size-1 axis holds the whole value whatever its placement (one chunk, one part): the search sees it
    # Replicate at both ends, so it costs nothing and never constrains the other axes (an outer shard gathered
    # while a size-1 axis shards the same dim inside it)
    target = _size_one_replicated(dst, spec.mesh_shape)
    start = spec.with_placements(_size_one_replicated(spec.placements, spec.mesh_shape))
    search = _Search(start, start.placements, target, model)
    steps = _merge(search, search.run())
    # an exchange can only beat paths that move shards (gathers, all_to_alls); try it straight to the
    # target, and to the target with the source's shards kept where the target replicates (then gather)
    if any(s.kind in ("all_gather", "all_to_all") for s in steps) and exchange.eligible(start, target):
        middle = tuple(q if not q.is_replicate or not p.is_shard else p
                       for p, q in zip(start.placements, target, strict=True))
        for via in dict.fromkeys((target, middle)):  # middle keeps dst's Partial axes, so it is valid
            if via == start.placements:
                continue
            candidate = _exchange_step(start, via, model, search.names)
            if via != target:
                rest = _Search(start, via, target, model)
                candidate += _merge(rest, rest.run())
            if sum(s.cost for s in candidate) < sum(s.cost for s in steps) - 1e-9:
                steps = candidate
    return Plan(spec, spec.with_placements(dst), tuple(steps))


def _size_one_replicated(placements: tuple[Placement, ...], mesh_shape) -> tuple[Placement, ...]:
    return tuple(_R if n == 1 else p for p, n in zip(placements, mesh_shape, strict=True))


def _exchange_step(spec: Spec, via, model: CostModel, names) -> list[Step]:
    schedule = exchange.exchange_schedule(spec, spec.with_placements(via))
    sizes = [schedule.round_bytes(r, spec.itemsize) for r in range(len(schedule.rounds))]
    cost = sum(model.collective("permute", names, 2, b) for b in sizes)
    # zero rounds is still a step: each device re-indexes what it already holds
    return [Step("exchange", names, spec.placements, via, bytes=sum(sizes), cost=cost, count=len(sizes))]


def _group(edge: Edge):
    """Edges with equal groups in a row become one step: a run of one merge key, or of one local kind."""
    if edge.merge_key is not None:
        return edge.merge_key
    return (edge.kind, None) if edge.kind in LOCAL_KINDS else id(edge)


def _merge(search: _Search, edges: list[Edge]) -> list[Step]:
    """Group consecutive edges of one merge key (or one local kind) into single steps."""
    steps: list[Step] = []
    for _, group in itertools.groupby(edges, key=_group):
        group = list(group)
        kind, first_ids, last_ids = group[0].kind, group[0].before, group[-1].after
        first, last = search.decode(first_ids), search.decode(last_ids)
        names = search.names
        if kind == "permute":
            nbytes = search.nbytes(first_ids)
            axes = tuple(names[i] for i in group[0].axes)
            cost = search.model.collective("permute", axes, 2, nbytes)
            steps.append(Step("permute", axes, first, last, bytes=nbytes, cost=cost, perm=group[0].perm))
            continue
        axes_idx = [a for e in group for a in e.axes]
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
            if kind in ("reduce_scatter", "all_to_all"):
                cut = dim if kind == "reduce_scatter" else split_dim
                nbytes = search.buffer_bytes(first_ids, last_ids, cut, group_size)
            else:
                nbytes = search.nbytes(first_ids)
            carrier = mean_carrier(search.dtype) if scale != 1 else None
            if carrier is not None:  # an integer average moves a (quotient, remainder) pair per element
                nbytes = nbytes // search.itemsize * 2 * carrier.itemsize
            cost = search.model.collective(kind, tuple(names[a] for a in order), group_size, nbytes,
                                           sizes={names[a]: search.sizes[a] for a in order})
        steps.append(Step(kind, tuple(names[a] for a in order), first, last, dim, split_dim, op, scale,
                          nbytes, cost))
    return steps


def _tuple_order(search: _Search, state, dim, axes) -> list[int]:
    """Axis-tuple order for a merged gather/scatter of ``dim``: the order in which ``state`` cuts it
    when the merged axes are its innermost cuts (then no local reshuffle is needed), else ``axes``."""
    axes = list(axes)
    chain = tuple((a, p.split_factor) for a, p in enumerate(state) if p.is_shard and p.dim == dim)
    order = cut_order(chain, search.sizes, search.shape[dim])
    if order is not None and set(order[len(order) - len(axes):]) == set(axes):
        return list(order[len(order) - len(axes):])
    return axes
