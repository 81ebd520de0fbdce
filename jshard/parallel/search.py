"""``autoplan``: the parallel plan of a whole training step, searched under a memory budget.

A plan gives each mesh axis a role: ``"dp"`` (the batch split, parameters replicated), ``"fsdp"`` (the batch
split, parameters sharded and gathered where used), ``"tp"`` (Megatron's tensor parallelism), ``"sp"`` (``"tp"``
with the norms and residual stream sharded on the sequence), ``"cp"`` (context parallelism: the sequence split,
attention crossing the axis as the cost model chooses), ``"pp"`` (pipeline parallelism: the list of identical
blocks split into stages, 1F1B over twice as many microbatches as stages where the batch allows) or ``"ep"`` (expert
parallelism, offered where the model has mixtures of experts: the batch split, every mixture's experts split and
kept in place, ``ExpertParallel``). Roles on several axes compose (FSDP on one data axis and data parallelism on
another is HSDP; one tensor, one context, one pipeline and one expert axis at most). Under ``"tp"`` / ``"sp"``
each linear layer's side is read from the model's own dataflow, not from its names: a layer fed by no other
layer's output (q, k, v, up, a head) runs column parallel, one fed by a column-parallel layer (o, down) row
parallel, alternating along a chain; embeddings looked up by the batch's ids are split on the vocabulary; norms
pin their output replicated (``"tp"``) or run sequence parallel (``"sp"``).

Each candidate is priced by jshard itself: the model's step (forward, gradients, optimizer update) is traced on
parameters that hold only their specs and planned by the engine, as ``TrainStep`` would run it, on the model cut
to two blocks, the second called inside a ``jax.named_scope`` of its own. Blocks share one plan, so every block
after the first costs what the second does: the equations of its scope (its forward and backward passes) and those
feeding only its own parameters and optimizer state (its gradients' moves, its update), counted once for each
further block, and its activations and gradients held once more for each in the memory walk. The search costs the
same for 2 blocks or 32, and nothing is ever built. The figures are

- communication: the cost model's µs of every collective the plan runs;
- computation: the FLOPs each device runs (its matmuls at its local shapes), at the rate the mesh's devices are
  measured to reach running together (a short matmul, once per process);
- memory per device: parameters, optimizer state and batch as placed, and the peak of the step's live
  intermediates (activations, gradients), from the plan's equations at their local shapes. Under a budget the
  compiler has the last word: the fastest plan predicted to fit is lowered and compiled on specs alone and taken
  only if its compiled step fits as well (``Plan.compiled_bytes``), else the next.

The candidates are few once axes of the same size and cost are taken as interchangeable (a role assignment and
its permutations are one candidate), so the search prices every one and is exact over its space: no solver's
relaxation, no heuristic pruning, and the runners-up come for free. Candidates with the same roles on the axes in
another order, or ``dp`` where the other has ``fsdp`` (priced with FSDP's gathers of parameters already whole,
``_Whole``), trace one step between them (``jshard.engine.shared_trace``): each pins the gradients in it to its
own parameters' placements and is planned on its own mesh (axes are named by their place in the order of roles). A
pipeline's step is one equation whatever the depth (its blocks stacked), priced whole: its layer's forward and
backward and its tail as its schedule runs them, tick by tick (each tick as long as its slowest device), and its
kernel's buffers in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..cost import COLLECTIVES, AxisCost, CostModel
from ..darray import DArray, abstract
from ..engine import (
    WHILE_TRIPS,
    JaxprPlan,
    axis_aliases,
    constrain_p,
    out_moves,
    own_collectives,
    paused_collector,
    shared_trace,
)
from ..jaxcompat import inlined_call, jc, open_jaxpr, scan_params
from ..placements import Placement, Replicate, Shard
from ..planner import Plan as MovePlan
from ..spec import Spec
from .initialise import building
from .parallelize import blocks_differ, kind_of, module_key, parallelize_shapes
from .plan import Memory, Plan, role_names
from .schedule import make_schedule
from .styles import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    FullyShard,
    ParallelStyle,
    PipelineParallel,
    RowwiseParallel,
    SequenceParallel,
    expert_weights,
)
from .training import GRADIENT_PINS, check_tx, mirror_placements, step_function

__all__ = ["ROLES", "autoplan"]

ROLES = ("dp", "fsdp", "ep", "tp", "sp", "cp", "pp")
_BATCH = ("dp", "fsdp", "ep")  # roles that split the batch
_TENSOR = ("tp", "sp")
_TRACED_AS = {"fsdp": "dp"}  # roles whose steps trace alike (see _Whole)


def autoplan(make: Callable[[], nnx.Module], mesh: Mesh, loss_fn: Callable, *batch: Any,
             tx: optax.GradientTransformation | None = None, memory_budget: int | None = None,
             styles: Sequence[str] | None = None, runners_up: int = 3) -> Plan:
    """The fastest plan for training ``make()`` on ``mesh`` with ``loss_fn(model, *batch)`` whose predicted
    memory per device fits ``memory_budget`` bytes (None: any).

    ``make``: the model's constructor, as ``parallelize`` takes it (it is only traced: nothing is built);
    ``batch``: arrays or ``jax.ShapeDtypeStruct``s at global shape; ``tx``: the optimizer (its state counts in
    memory; default ``optax.adamw(1e-3)``); ``styles``: the roles an axis may take (default all of ``ROLES``).
    Raises ``ValueError`` naming the budget and the smallest memory a plan reaches when none fits.

    >>> import jax, jax.numpy as jnp, jshard
    >>> from flax import nnx
    >>> from jshard.parallel import autoplan
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> make, x = lambda: nnx.Linear(64, 64, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((16, 64), jnp.float32)
    >>> free = autoplan(make, mesh, lambda m, x: jnp.mean(m(x) ** 2), x, styles=("dp", "fsdp"))
    >>> sorted(p.name for p in (free, *free.runners_up))  # both priced, the faster first
    ['dp(x)', 'fsdp(x)']
    >>> budget = min(p.memory.total for p in (free, *free.runners_up))  # room for the smaller one only
    >>> tight = autoplan(make, mesh, lambda m, x: jnp.mean(m(x) ** 2), x, styles=("dp", "fsdp"), memory_budget=budget)
    >>> tight.roles, tight.batch, tight.memory.total <= budget
    ({'x': 'fsdp'}, ((S(0),),), True)
    """
    with paused_collector():  # the search makes millions of short-lived objects over a large live heap
        return _autoplan(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up)


def _autoplan(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up) -> Plan:
    start = time.perf_counter()
    _check_args(make, mesh, loss_fn, batch, tx, memory_budget, styles)
    if isinstance(runners_up, bool) or not isinstance(runners_up, int) or runners_up < 0:
        raise ValueError(f"autoplan: runners_up is how many next-best plans to keep, an int >= 0, got {runners_up!r}")
    tx = optax.adamw(1e-3) if tx is None else tx
    styles = tuple(styles or ROLES)
    batch = tuple(jax.ShapeDtypeStruct(np.shape(b), b.dtype) for b in batch)
    with building():
        model = nnx.eval_shape(make)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"autoplan: make() must build an nnx.Module, it built {kind_of(model)}; pass the model's "
                        "constructor, lambda: GPT(cfg, rngs=nnx.Rngs(0))")
    blocks = _repeated(model)
    tensor = _tensor_sides(model, loss_fn, batch) if set(styles) & set(_TENSOR) else {}
    experts = _mixtures(model) if "ep" in styles else ()
    tensor.update((pattern, "experts") for pattern in experts)
    machine = _machine(mesh)
    priced, rejected, traces = [], [], {}
    # a pipeline takes blocks whose state is their parameters, as parallelize does: no plan it would refuse
    depth = len(list(_at(model, blocks))) if blocks is not None and blocks_differ(list(_at(model, blocks))) is None \
        else 0
    for roles in _candidates(mesh, tuple(s for s in styles if s != "ep" or experts), batch, depth):
        name = role_names(roles)
        try:
            priced.append(_priced(model, blocks, mesh, roles, tensor, loss_fn, batch, tx, machine, traces))
        except Exception as e:  # a role the model cannot take on this mesh (a dim the axis does not divide, ...)
            rejected.append((name, f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    if not priced:
        raise ValueError(f"autoplan: no plan of {styles} runs {type(model).__name__} on mesh "
                         f"{dict(mesh.shape)}: " + "; ".join(f"{n}: {w}" for n, w in rejected))
    fits = [p for p in priced if memory_budget is None or p.memory.total <= memory_budget]
    if not fits:
        least = min(priced, key=lambda p: p.memory.total)
        raise ValueError(f"autoplan: no plan fits memory_budget={memory_budget:,} bytes per device on mesh "
                         f"{dict(mesh.shape)}; the smallest is {least.name} at {least.memory.total:,} bytes "
                         f"predicted; raise the budget, add devices, or shrink the batch")
    rejected += [(p.name, f"over the budget: {p.memory.total:,} bytes predicted") for p in priced if p not in fits]
    fits.sort(key=lambda p: p.step_us)
    if memory_budget is not None:
        fits, over = _checked(fits, memory_budget, model, blocks, mesh, loss_fn, batch, tx)
        rejected += over
        if not fits:
            raise ValueError(f"autoplan: no plan fits memory_budget={memory_budget:,} bytes per device on mesh "
                             f"{dict(mesh.shape)} once compiled: " + "; ".join(f"{n}: {w}" for n, w in over)
                             + "; raise the budget, add devices, or shrink the batch")
    best, rest = fits[0], tuple(fits[1:1 + runners_up])
    return dataclasses.replace(best, runners_up=rest, rejected=tuple(rejected), budget=memory_budget,
                               solve_s=time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------
# errors


def _check_args(make, mesh, loss_fn, batch, tx, budget, styles) -> None:
    if isinstance(make, nnx.Module) or not callable(make):
        raise TypeError(f"autoplan: make must be the model's constructor, a function of no arguments (lambda: "
                        f"GPT(cfg, rngs=nnx.Rngs(0))), got {kind_of(make)}; it is only traced, never built")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"autoplan: mesh must be a jax.sharding.Mesh (say jax.make_mesh((2, 4), ('dp', 'tp'))), "
                        f"got {kind_of(mesh)}")
    if not callable(loss_fn):
        raise TypeError(f"autoplan: loss_fn must be a function loss_fn(model, *batch) -> scalar loss, got "
                        f"{kind_of(loss_fn)}")
    if not batch:
        raise ValueError("autoplan: pass the batch loss_fn takes (arrays or jax.ShapeDtypeStructs at global shape), "
                         "autoplan(make, mesh, loss_fn, ids, labels)")
    for i, b in enumerate(batch):
        if not (hasattr(b, "shape") and hasattr(b, "dtype")) or isinstance(b, DArray):
            raise TypeError(f"autoplan: batch input {i} must be an array or a jax.ShapeDtypeStruct at global shape, "
                            f"got {kind_of(b)}")
    if tx is not None:
        check_tx(tx, "autoplan")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, np.integer))
                               or budget <= 0):
        raise ValueError(f"autoplan: memory_budget is bytes per device, a positive int (say 2 * 2**30), got "
                         f"{budget!r}")
    if styles is not None:
        bad = [s for s in styles if s not in ROLES]
        if bad or not styles:
            raise ValueError(f"autoplan: styles are the roles a mesh axis may take, some of {ROLES}; got "
                             f"{tuple(styles)!r}")


# ---------------------------------------------------------------------------------------------------
# the candidates


def _candidates(mesh: Mesh, styles: tuple[str, ...], batch: tuple, depth: int) -> list[dict[str, str]]:
    """Every role assignment, one per class of assignments that differ only by a permutation of interchangeable
    axes (same size); an axis of size 1 does nothing, whatever its role, and is left ``"dp"``. A pipeline needs
    ``depth`` blocks (0: the model has no list of identical blocks) that its stages split, and microbatches."""
    names, sizes = list(mesh.axis_names), dict(mesh.shape)
    options = [("dp",) if sizes[a] == 1 else styles for a in names]
    rows = min((b.shape[0] for b in batch if b.shape), default=1)
    seen, out = set(), []
    for combo in itertools.product(*options):
        if sum(r in _TENSOR for r in combo) > 1 or any(combo.count(r) > 1 for r in ("cp", "pp", "ep")):
            continue
        data = math.prod(sizes[a] for a, r in zip(names, combo, strict=True) if r in _BATCH)
        if rows % data:
            continue
        stages = [sizes[a] for a, r in zip(names, combo, strict=True) if r == "pp"]
        if stages and (not depth or depth % stages[0] or _microbatches(stages[0], rows, data) is None):
            continue
        key = tuple(sorted((sizes[a], r) for a, r in zip(names, combo, strict=True)))
        if key in seen:
            continue
        seen.add(key)
        out.append(dict(zip(names, combo, strict=True)))
    return out


def _microbatches(stages: int, rows: int, data: int) -> int | None:
    """A pipeline's microbatches: twice its stages where the batch's rows allow (each microbatch split over the data
    axes), else as many as its stages (None: too few rows)."""
    return next((m for m in (2 * stages, stages) if rows % m == 0 and (rows // m) % data == 0), None)


def _styles_of(roles: dict[str, str], tensor: dict, blocks: tuple | None = None,
               microbatches: int | None = None, pricing: bool = False) -> tuple[dict, tuple]:
    """``(plan, default)`` for ``parallelize`` from a role assignment (a pipeline runs the blocks at ``blocks`` as
    ``microbatches`` microbatches); to price it (``pricing``), a data-parallel axis gathers its parameters, whole
    already, as an FSDP one does (``_Whole``)."""
    default = tuple(FullyShard(a) if r == "fsdp" else _Whole(a) for a, r in roles.items()
                    if r == "fsdp" or (pricing and r == "dp"))
    plan: dict[str, tuple[ParallelStyle, ...]] = {}
    for axis, role in roles.items():
        if role == "cp":
            plan[""] = (ContextParallel(axis),)
        if role == "pp":
            plan[module_key(blocks, any_index=True)] = (PipelineParallel(axis, microbatches=microbatches),)
        if role == "ep":
            for pattern in (p for p, side in tensor.items() if side == "experts"):
                plan[pattern] = (*plan.get(pattern, ()), ExpertParallel(axis))
        if role not in _TENSOR:
            continue
        seq = role == "sp"
        for pattern, side in tensor.items():
            if side == "experts":  # a mixture's experts: whole on the tensor axis
                continue
            if side == "col":
                style = ColwiseParallel(axis)
            elif side in ("row", "embed"):
                style = RowwiseParallel(axis, output=Shard(1) if seq else Replicate())
            else:  # a norm
                style = SequenceParallel(axis) if seq else ParallelStyle(axis, output=Replicate())
            plan[pattern] = (style,)
    return plan, default


@dataclasses.dataclass(frozen=True)
class _Whole(FullyShard):
    """Data parallelism as ``autoplan`` prices it: FSDP's gather of a module's parameters while it runs, of
    parameters already whole on the axis, which the plan drops (the constraint asks for what is there). A
    data-parallel step then traces as its FSDP twin does, and the two share one trace."""

    def param(self, module, name, shape):
        return Replicate()


def _batch_placements(mesh: Mesh, roles: dict[str, str], batch: tuple) -> tuple[tuple[Placement, ...], ...]:
    """The batch split over the data axes; its sequence dim (1) laid out as context parallelism takes it."""
    def placement(axis, b):
        if roles[axis] in _BATCH and b.shape:
            return Shard(0)
        if roles[axis] == "cp" and len(b.shape) >= 2:
            return ContextParallel(axis).sequence(b.shape[1], mesh.shape[axis])
        return Replicate()

    return tuple(tuple(placement(a, b) for a in mesh.axis_names) for b in batch)


# ---------------------------------------------------------------------------------------------------
# the model's structure


def _mixtures(model: nnx.Module) -> tuple[str, ...]:
    """The plan patterns of the model's mixtures of experts (``ExpertParallel``'s modules): modules whose own
    parameters of rank 3 share one leading dim, the expert count (``[E, D, H]``), written for every block alike."""
    found = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        leading = [shape[0] for _, shape in expert_weights(node)]
        if len(leading) >= 2 and len(set(leading)) == 1 and leading[0] > 1:
            found[module_key(tuple(path), any_index=True)] = None
    return tuple(found)


def _repeated(model: nnx.Module) -> tuple | None:
    """The path of the model's list of identical blocks holding the most parameters (None: no such list), identical
    as ``parallelize`` takes them (``blocks_differ``; a pipeline also needs them stateless, see ``_candidates``)."""
    best, most = None, 0
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, (nnx.List, list)) or len(node) < 2:
            continue
        members = list(node)
        if not all(isinstance(m, nnx.Module) for m in members):
            continue
        size = sum(math.prod(np.shape(v)) for v in jax.tree.leaves(nnx.state(node, nnx.Param)))
        if size > most and blocks_differ(members, stateless=False) is None:
            best, most = tuple(path), size
    return best


def _cut(model: nnx.Module, path: tuple | None, depth: int) -> nnx.Module:
    """A copy of the abstract ``model`` whose block list at ``path`` keeps its first ``depth`` blocks, the last
    called inside ``jax.named_scope(_BLOCK)`` (so the equations of its forward and backward passes say so)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state, copy=True)
    if path is not None:
        parent = _at(copy, path[:-1])
        kept = list(getattr(parent, path[-1]))[:depth]
        kept[-1].__class__ = _scoped(type(kept[-1]))
        setattr(parent, path[-1], nnx.List(kept))
    return copy


_BLOCK = "jshard_autoplan_block"


@functools.cache
def _scoped(cls: type) -> type:
    def __call__(self, *args, **kwargs):
        with jax.named_scope(_BLOCK):
            return super(scoped, self).__call__(*args, **kwargs)

    scoped = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})
    return scoped


def _tensor_sides(model: nnx.Module, loss_fn: Callable, batch: tuple) -> dict[str, str]:
    """Per module pattern (block indices as ``*``): ``"col"`` / ``"row"`` for linear layers, by the parity of the
    longest chain of layers feeding them in the loss's dataflow; ``"embed"`` for embeddings looked up by the batch;
    ``"norm"`` for norms."""
    small = _cut(model, _repeated(model), 1)
    graphdef, params, rest = nnx.split(small, nnx.Param, ...)
    paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    closed = jax.make_jaxpr(lambda p, *b: loss_fn(nnx.merge(graphdef, p, rest), *b))(params, *batch)
    jaxpr = closed.jaxpr
    n = len(paths)
    source = {v: _path(paths[i]) for i, v in enumerate(jaxpr.invars[:n])}  # var -> parameter path it is
    from_batch = set(jaxpr.invars[n:])
    depth = {}
    sides: dict[str, str] = {}

    def enter(outer: list, inner: list) -> None:
        """What the outer vars are, said of the vars that stand for them inside a call or loop body (a scanned
        stack's kernel is the body's slice of it), or back out of it."""
        for a, b in zip(outer, inner, strict=True):
            if isinstance(a, jc.Literal) or isinstance(b, jc.Literal):
                continue
            if a in source:
                source[b] = source[a]
            depth[b] = depth.get(a, 0)
            if a in from_batch:
                from_batch.add(b)

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            body = inlined_call(eqn) or (scan_params(eqn).body if eqn.primitive.name == "scan" else None)
            inner = open_jaxpr(body)[0] if body is not None else None
            if inner is not None and len(inner.invars) == len(eqn.invars):
                enter(eqn.invars, inner.invars)
                walk(inner)
                enter(inner.outvars, eqn.outvars)
                continue
            ins = [v for v in eqn.invars if not isinstance(v, jc.Literal)]
            params_in = [source[v] for v in ins if v in source]
            d = max((depth.get(v, 0) for v in ins), default=0)
            if eqn.primitive.name in ("convert_element_type", "reshape", "transpose", "copy", "broadcast_in_dim") \
                    and len(params_in) == 1 and len(ins) == 1:
                source[eqn.outvars[0]] = params_in[0]  # still the parameter, in another form
                continue
            kernels = [p for p in params_in if p[-1] == "kernel"]
            if eqn.primitive.name == "dot_general" and kernels:
                other = [v for v in ins if source.get(v) != kernels[0]]
                d = 1 + max((depth.get(v, 0) for v in other), default=0)
                sides[module_key(kernels[0][:-1], any_index=True)] = "col" if d % 2 else "row"
            elif any(p[-1] == "embedding" for p in params_in) and any(v in from_batch for v in ins):
                sides[module_key(next(p for p in params_in if p[-1] == "embedding")[:-1], any_index=True)] = "embed"
            for o in eqn.outvars:
                depth[o] = d
                if any(v in from_batch for v in ins):
                    from_batch.add(o)

    walk(jaxpr)
    for path, node in nnx.iter_graph(small):
        if isinstance(node, (nnx.LayerNorm, nnx.RMSNorm)) and path:
            sides.setdefault(module_key(tuple(path), any_index=True), "norm")
    return sides


def _path(keys: tuple) -> tuple:
    """A parameter's path in its state: its module's path and its name (the Variable's ``.value`` dropped)."""
    path = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keys)
    return path[:-1] if path and path[-1] == "value" else path


# ---------------------------------------------------------------------------------------------------
# pricing


def _priced(model, blocks, mesh, roles, tensor, loss_fn, batch, tx, machine: Machine, traces: dict) -> Plan:
    """A candidate's Plan: its figures from the model cut to two blocks, the second block's share (a block between
    blocks, as all but the first are) counted once more for each further block of the model.

    It is priced on its own mesh with the axes renamed by role (``_canonical``): every candidate with the same roles
    in either order, ``dp`` and ``fsdp`` taken as one (``_Whole``), traces the same step, which ``traces`` keeps
    (and the model cut), and only its plan is made again, with its own gradient pins (``_pinned``)."""
    names, canonical = _canonical(mesh, roles)
    canonical_roles = {names[a]: r for a, r in roles.items()}
    depth = len(list(_at(model, blocks))) if blocks is not None else 1
    stages = [mesh.shape[a] for a, r in roles.items() if r == "pp"]
    data = math.prod(mesh.shape[a] for a, r in roles.items() if r in _BATCH)
    micro = _microbatches(stages[0], min(b.shape[0] for b in batch if b.shape), data) if stages else None
    plan, default = _styles_of(canonical_roles, tensor, blocks, micro, pricing=True)
    placements = _batch_placements(canonical, canonical_roles, batch)
    shape = (tuple(sorted((a, _TRACED_AS.get(r, r)) for a, r in canonical_roles.items())),
             tuple(canonical.shape[a] for a, r in canonical_roles.items() if r in ("cp", "pp")),  # traced by size
             canonical.axis_names if stages else None)  # a pipeline's equation holds the mesh's axes in order
    # a pipeline's step is one equation whatever its depth (its blocks stacked): it is priced whole
    scoped = None if stages else blocks
    cut = depth if stages else min(depth, 2)
    if ("cut", scoped, cut) not in traces:  # cutting a deep model costs more than copying the cut one
        traces["cut", scoped, cut] = nnx.split(_cut(model, scoped, cut))
    small = nnx.merge(*traces["cut", scoped, cut], copy=True)  # a copy: parallelize_shapes changes it
    with axis_aliases(names):  # a jshard.constrain dict in the loss names the user's axes
        total, block = _figures(small, scoped, cut, depth - cut, canonical, plan, default, loss_fn,
                                batch, placements, tx, machine, traces, shape)
    at_cut = _memory(total, total["cut_temps"]).total  # the cut model's own, before the further blocks
    total = {k: v + (depth - cut) * block.get(k, 0.0) for k, v in total.items()}
    compute_us = (total["flops"] / machine.flops_per_us + total["written"] / machine.bytes_per_us
                  + total["pipeline_us"])
    plan, default = _styles_of(roles, tensor, blocks, micro)
    return Plan(roles=dict(roles), styles=plan, default=default, batch=_batch_placements(mesh, roles, batch),
                step_us=compute_us + total["comm_us"], bytes_moved=int(total["bytes"]),
                memory=_memory(total, total["temps"]),
                detail={"compute_us": compute_us, "comm_us": total["comm_us"], "flops": total["flops"],
                        "cut": cut, "depth": depth, "cut_bytes": at_cut})


def _memory(total: dict[str, float], temps: float) -> Memory:
    """The Memory of a step's figures whose intermediates peak at ``temps`` (parameters' gradients among them)."""
    return Memory(params=int(total["params"]), grads=int(total["params"]), optimizer=int(total["optimizer"]),
                  batch=int(total["batch"]), activations=int(max(temps - total["params"], 0)))


def _canonical(mesh: Mesh, roles: dict[str, str]) -> tuple[dict[str, str], Mesh]:
    """Each axis's name by its place in the order of roles (``ROLES``: the data axes first, ``dp`` and ``fsdp`` as
    one), then of sizes: ``x0``, ``x1``, ...; and ``mesh`` with those names, its axes in their own order.

    Names by place, not by role: the plans of candidates with other roles then ask the engine many of the same
    questions (how to run a matmul whose batch is split on ``x0``, how to move its output), whose answers it keeps.
    The axes keep their order: where two of them split one dim (a sequence under ``sp`` and ``cp``), the order says
    which splits it first, and so which layouts meet without a move."""
    order = sorted(mesh.axis_names, key=lambda a: (ROLES.index(_TRACED_AS.get(roles[a], roles[a])), mesh.shape[a],
                                                   mesh.axis_names.index(a)))
    names = {a: f"x{i}" for i, a in enumerate(order)}
    return names, Mesh(mesh.devices, tuple(names[a] for a in mesh.axis_names))


def _at(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _figures(model, blocks, cut, more, mesh, plan, default, loss_fn, batch, placements, tx, machine: Machine,
             traces: dict, key: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The step of ``model`` (its block list at ``blocks`` cut to ``cut`` blocks) under the plan, traced and planned
    on specs alone: its figures per device, and the share of them that its last block makes (its forward and
    backward passes, the moves and updates of its parameters and optimizer state), to be counted ``more`` times
    more; its peak memory is found with ``more`` blocks more (``_peak``). The step's jaxpr is shared
    with the candidates of the same ``key``, each pinning the gradients in it to its own parameters' placements
    (``_pinned``)."""
    params, opt, rest, data = _step_inputs(model, mesh, plan, default, placements, batch, tx)
    pins = [tuple(zip(mesh.axis_names, d.placements, strict=True)) for d in _darrays(params)]
    with shared_trace(traces, (key, blocks, cut), adapt=functools.partial(_pinned, pins)):
        traced = step_function(model, tx, loss_fn).trace(params, opt, rest, *data)
    inside = (lambda path: _within(path, (*blocks, cut - 1))) if blocks is not None else (lambda path: False)
    total = {"batch": sum(d.spec.local_bytes for d in data)}
    block = {}
    for name, tree in (("params", params), ("optimizer", opt)):
        leaves = [(_path(k), d) for k, d in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, DArray))[0] if isinstance(d, DArray)]
        total[name] = sum(d.spec.local_bytes for _, d in leaves)
        block[name] = sum(d.spec.local_bytes for p, d in leaves if inside(p))
    plan_ = traced.plan
    outputs = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(traced.out_tree, range(len(plan_.outs))))[0]
    own = {j for path, j in outputs if inside(_path(path))}  # the block's parameters and optimizer state, updated
    ours = _block_equations(plan_, own)
    sizes, fused = dict(mesh.shape), _fused(plan_)
    total["pipeline_us"] = 0.0
    for eq in plan_.equations:
        figures = _equation_figures(eq, machine, sizes, fused)
        for k, v in figures.items():
            total[k] = total.get(k, 0.0) + v
            if id(eq) in ours:
                block[k] = block.get(k, 0.0) + v
    for j, move in enumerate(out_moves(plan_, traced.pins)):
        if move is not None:
            for k, v in _move_figures(move, machine.links, sizes).items():
                total[k] += v
                if j in own:
                    block[k] = block.get(k, 0.0) + v
    peak = _peak(plan_, ours, fused)
    total["temps"], total["cut_temps"] = peak(more), peak(0)
    return total, block


def _pinned(pins: list[tuple], closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    """A step's jaxpr with its gradients pinned to ``pins`` (per parameter, in the step's order, ``(axis name,
    placement)`` pairs): the constraints ``TrainStep`` makes of them, in its ``GRADIENT_PINS`` scope."""
    eqns, k = [], 0
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive is constrain_p and GRADIENT_PINS in str(eqn.source_info.name_stack):
            eqn = eqn.replace(params=dict(eqn.params, placements=pins[k]))
            k += 1
        eqns.append(eqn)
    if k != len(pins):
        raise AssertionError(f"autoplan: the step pins {k} gradients, for {len(pins)} parameters")
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))


def _step_inputs(model, mesh, plan, default, placements, batch, tx) -> tuple:
    """The training step's arguments for the abstract ``model`` (changed in place) under a plan, holding specs
    alone: parameters, optimizer state, other state, batch."""
    parallelize_shapes(model, mesh, plan, default=default)
    params = nnx.state(model, nnx.Param)
    rest = nnx.split(model, nnx.Param, ...)[2]
    opt = _optimizer_state(tx, params, mesh)
    data = [_shaped(mesh, p, b.shape, b.dtype) for p, b in zip(placements, batch, strict=True)]
    return params, opt, rest, data


def _checked(fits: list[Plan], budget: int, model, blocks, mesh, loss_fn, batch, tx) -> tuple[list[Plan], list]:
    """``fits`` (fastest first) from the first whose compiled step fits ``budget``, that one carrying its compiled
    bytes, and the ones before it, rejected with theirs. The prediction cannot see how XLA schedules and lays out
    the step's buffers (a collective's result kept, a gather's index arrays), so the compiler has the last word.

    A plan is compiled at the depth it was priced at (two blocks; a pipeline whole), on parameters that hold only
    their specs: arguments plus temporaries per device, as ``memory_analysis`` gives them, and the share the
    prediction adds for the further blocks."""
    over = []
    for i, p in enumerate(fits):
        cut = p.detail["cut"]
        small = _cut(model, blocks if cut < p.detail["depth"] else None, cut)
        args = _step_inputs(small, mesh, p.styles, p.default, p.batch, batch, tx)
        memory = step_function(small, tx, loss_fn).lower(*args[:3], *args[3]).compile().memory_analysis()
        if memory is None:  # a backend that does not say: the prediction stands
            return fits[i:], over
        compiled = int(memory.argument_size_in_bytes + memory.temp_size_in_bytes
                       + p.memory.total - p.detail["cut_bytes"])
        if compiled <= budget:
            return [dataclasses.replace(p, compiled_bytes=compiled), *fits[i + 1:]], over
        over.append((p.name, f"over the budget compiled: {compiled:,} bytes (predicted {p.memory.total:,})"))
    return [], over


def _within(path: tuple, prefix: tuple) -> bool:
    """Whether ``prefix`` is a run of consecutive keys of ``path`` (a block's parameter inside the optimizer's
    state, under ``mu`` or ``nu``)."""
    n = len(prefix)
    return any(path[i:i + n] == prefix for i in range(len(path) - n + 1))


def _block_equations(plan: JaxprPlan, own: set[int]) -> dict[int, str]:
    """The equations the block makes, by id: ``"own"`` for those feeding only its own outputs (its gradients, their
    moves to their parameters, its optimizer update), else ``"forward"`` / ``"backward"`` for those inside its
    scope, by pass."""
    feeds: dict = {}
    for j, o in enumerate(plan.outs):
        if not isinstance(o, jc.Literal):
            feeds.setdefault(o, set()).add(j)
    ours, none = {}, frozenset()
    for eq in reversed(plan.equations):
        fed = set()
        for o in eq.outs or ():
            fed.update(feeds.get(o, none))
        if fed and fed <= own:
            ours[id(eq)] = "own"
        elif _BLOCK in eq.scope:
            ours[id(eq)] = "backward" if _backward(eq) else "forward"
        for op in eq.operands:
            if not op.literal:
                feeds.setdefault(op.value, set()).update(fed)
    return ours


def _equation_figures(eq, machine: Machine, sizes: dict, fused: frozenset = frozenset()) -> dict[str, float]:
    """One equation's figures per device: its operands' moves and its own collectives (µs by the measured links,
    bytes), its matmul FLOPs and the bytes it writes (``fused``: values it never writes), its bodies' as they run
    (a scan's once per trip, a while loop's for as many trips as the plan assumed, a cond's costliest branch); a
    pipeline's as its schedule runs them (``pipeline_us``)."""
    links = machine.links
    written = sum(s.local_bytes for o, s in zip(eq.outs or (), eq.choice.outs, strict=True) if o not in fused)
    out = {"comm_us": 0.0, "bytes": 0.0, "flops": _flops(eq), "written": float(written), "pipeline_us": 0.0}
    for op in eq.operands:
        if isinstance(op.move, MovePlan):
            for k, v in _move_figures(op.move, links, sizes).items():
                out[k] += v
    for c in own_collectives(eq):
        out["comm_us"] += c.cost(links, sizes)
        out["bytes"] += c.nbytes * c.count
    bodies = [(b, _body_figures(b.plan, b.pins, machine, _sub_sizes(sizes, eq))) for b in eq.bodies]
    if eq.eqn.primitive.name == "jshard_pipeline":  # its bodies' time is its schedule's; their bytes as they run
        out["pipeline_us"] = _pipeline_time(eq, [f for _, f in bodies], machine, sizes)
        out["bytes"] += sum(b.runs * f["bytes"] for b, f in bodies)
        return out
    branches = [f for b, f in bodies if b.alternative]
    runs = [(f, WHILE_TRIPS if b.runs is None else b.runs) for b, f in bodies if not b.alternative]
    if branches:
        runs.append((max(branches, key=lambda f: _unit_us(f, machine)), 1))
    for figures, n in runs:
        for k, v in figures.items():
            out[k] += n * v
    return out


def _unit_us(figures: dict[str, float], machine: Machine) -> float:
    """The µs of figures: their FLOPs and writes at the measured rates, their collectives, a pipeline's ticks."""
    return (figures["flops"] / machine.flops_per_us + figures["written"] / machine.bytes_per_us
            + figures["comm_us"] + figures["pipeline_us"])


def _sub_sizes(sizes: dict, eq) -> dict:
    """The mesh axes an equation's bodies are planned on: a pipeline's, the mesh without its axis."""
    return {a: n for a, n in sizes.items() if a != eq.eqn.params.get("axis")} \
        if eq.eqn.primitive.name == "jshard_pipeline" else sizes


def _body_figures(body: JaxprPlan, pins: list, machine: Machine, sizes: dict) -> dict[str, float]:
    out = {"comm_us": 0.0, "bytes": 0.0, "flops": 0.0, "written": 0.0, "pipeline_us": 0.0}
    fused = _fused(body)
    for inner in body.equations:
        for k, v in _equation_figures(inner, machine, sizes, fused).items():
            out[k] += v
    for move in out_moves(body, pins):
        if move is not None:
            for k, v in _move_figures(move, machine.links, sizes).items():
                out[k] += v
    return out


def _pipeline_time(eq, bodies: list[dict], machine: Machine, sizes: dict) -> float:
    """A pipeline's µs on the critical path: its schedule's ticks, each as long as its slowest device's units (a
    forward unit of ``L / (p v)`` layers; a backward unit of as many layers, after the forward of all but the last
    again), the tail after the last stage's forward."""
    prm = eq.eqn.params
    p = sizes[prm["axis"]]
    depth = eq.choice.ins[0].shape[0]
    m = eq.choice.ins[sum(prm["counts"][:2])].shape[0]
    sched = make_schedule(prm["kind"], p, m, prm["virtual"])
    layers = depth // (p * prm["virtual"])
    forward, backward, tail = (_unit_us(f, machine) for f in bodies)
    busy = (layers * forward * (sched.forward >= 0)
            + ((layers - 1) * forward + layers * backward) * (sched.backward >= 0))
    busy[:, -1] += tail * (sched.forward[:, -1] >= 0)
    return float(busy.max(axis=1).sum())


def _move_figures(move: MovePlan, links: CostModel, sizes: dict) -> dict[str, float]:
    """A redistribution's collectives: µs (priced by ``links``, the measured collectives; the plan was made under
    the cost model in force, as ``TrainStep`` makes it) and bytes per device."""
    us = moved = 0.0
    for step in move.collectives:
        kind = step.emitted if step.emitted in COLLECTIVES else "permute"
        us += step.count * links.collective(kind, tuple(step.axes), math.prod(sizes[a] for a in step.axes),
                                            step.bytes)
        moved += step.bytes * step.count
    return {"comm_us": us, "bytes": moved}


def _flops(eq) -> float:
    """FLOPs one device runs in an equation's matmuls (attention's included), at their local shapes."""
    name = eq.eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eq.eqn.params["dimension_numbers"]
        lhs = eq.choice.ins[0].local_block_shape
        return 2.0 * math.prod(eq.choice.outs[0].local_block_shape) * math.prod(lhs[d] for d in lc)
    if name in _ATTENTION:  # q [b, t, h, d] against k [b, s, h, d]: two matmuls
        b, t, h, d = eq.choice.ins[0].local_block_shape
        # against every key: a ring or a gather brings the keys a device does not hold
        return _ATTENTION[name] * 4.0 * b * t * h * d * eq.choice.ins[1].shape[1]
    return 0.0


# attention's FLOPs in units of its forward's two matmuls: the backward recomputes the scores and runs four
_ATTENTION = {"jshard.attention_fwd": 1.0, "jshard.attention_bwd": 2.5}


def _backward(eq) -> bool:
    return "transpose(" in eq.scope


def _fused(plan: JaxprPlan) -> frozenset:
    """The values never written to memory: those XLA fuses away (made by an elementwise equation and read only by
    one other elementwise equation or reduction, never an output), and an input handed on by a constraint it
    already meets (``_Whole``'s gathers of whole parameters)."""
    users: dict = {}
    inputs = set(plan.in_vars)
    for eq in plan.equations:
        for op in eq.operands:
            if not op.literal:
                users.setdefault(op.value, []).append(eq.eqn.primitive.name)
        if eq.eqn.primitive is constrain_p:  # one operand, one output (None: dropped)
            op, out = eq.operands[0], eq.outs[0]
            if not op.literal and op.value in inputs and op.move is None and out is not None:
                inputs.add(out)
    ends = {o for o in plan.outs if not isinstance(o, jc.Literal)}
    fused = (o for eq in plan.equations if eq.eqn.primitive.name in _FUSED for o in eq.outs or ()
             if o is not None and o not in ends and len(users.get(o, ())) == 1 and users[o][0] in _FUSED | _READS)
    return frozenset(fused).union(inputs - set(plan.in_vars))


def _peak(plan: JaxprPlan, ours: dict[int, str], fused: frozenset) -> Callable[[int], int]:
    """The most bytes a device holds at once in the intermediates (not the inputs) of the plan of a model cut
    short, as a function of how many blocks like its last the model has ``more``: each value from its equation to
    its last use, a moved operand's copy while its consumer runs (``fused``: values never written). The values
    every block holds at once are held ``more`` times more: the block's gradients and updates (``ours``' ``"own"``)
    and its forward pass's values that its backward pass reads (its activations). One walk: at each equation the
    bytes held are ``base + more * extra``."""
    last, users = {}, {}
    for i, eq in enumerate(plan.equations):
        for op in eq.operands:
            if not op.literal:
                last[op.value] = i
                users.setdefault(op.value, []).append(eq)
    ends = {o for o in plan.outs if not isinstance(o, jc.Literal)}
    size, live, points = {}, [0, 0], set()
    for i, eq in enumerate(plan.equations):
        kind = ours.get(id(eq))
        for o, spec in zip(eq.outs or (), eq.choice.outs, strict=True):
            if o is not None and o not in fused:
                kept = kind == "own" or (kind == "forward" and any(map(_backward, users.get(o, ()))))
                size[o] = (spec.local_bytes, spec.local_bytes if kept else 0)
                live[0] += size[o][0]
                live[1] += size[o][1]
        moved = sum(t.local_bytes for op, t in zip(eq.operands, eq.choice.ins, strict=True)
                    if isinstance(op.move, MovePlan) and op.move.steps)
        held = _pipeline_held(eq) if eq.eqn.primitive.name == "jshard_pipeline" else 0
        points.add((live[0] + moved + held, live[1] + (moved if kind == "own" else 0)))
        for op in eq.operands:
            if not op.literal and last.get(op.value) == i and op.value in size and op.value not in ends:
                base, extra = size.pop(op.value)
                live[0] -= base
                live[1] -= extra
        for o in eq.outs or ():
            if o is not None and o not in last and o not in ends:
                base, extra = size.pop(o, (0, 0))
                live[0] -= base
                live[1] -= extra
    return lambda more: max((base + more * extra for base, extra in points), default=0)


def _pipeline_held(eq) -> int:
    """What a pipeline holds while it runs besides its inputs and outputs: its kernel's buffers (per chunk,
    ``slots`` microbatches' activations for each of the stash, the forward inputs and the backward inputs
    received; ``jshard.parallel.schedule``), and at their peaks its layer's forward or backward (recomputing the
    forward) and its tail."""
    prm = eq.eqn.params
    n, k, _ = prm["counts"]
    x0 = eq.choice.ins[n + k]
    sched = make_schedule(prm["kind"], x0.mesh.shape[prm["axis"]], x0.shape[0], prm["virtual"])
    forward, backward, tail = (_peak(b.plan, {}, _fused(b.plan))(0) for b in eq.bodies)
    bodies = max(forward, backward, tail)  # one at a time: the tail after the forward unit, the backward after both
    return 3 * prm["virtual"] * sched.slots * (x0.local_bytes // x0.shape[0]) + bodies


def _shaped(mesh: Mesh, placements, shape, dtype) -> DArray:
    return abstract(Spec.create(mesh, placements, shape, dtype))


def _darrays(tree) -> list[DArray]:
    return [d for d in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, DArray)) if isinstance(d, DArray)]


def _optimizer_state(tx, params, mesh: Mesh):
    """``tx.init(params)`` as spec-only DArrays, placed as ``init_optimizer`` places it."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params,
                         is_leaf=lambda x: isinstance(x, DArray))
    shapes = jax.eval_shape(tx.init, avals)
    pins = mirror_placements(tx.init, params)
    return jax.tree.map(lambda p, s: _shaped(mesh, p, s.shape, s.dtype), pins, shapes,
                        is_leaf=lambda x: type(x) is tuple and all(isinstance(q, Placement) for q in x))


# primitives XLA fuses into their consumers, and those that read fused operands (reductions)
_FUSED = frozenset({"add", "sub", "mul", "div", "neg", "exp", "log", "tanh", "logistic", "max", "min", "abs",
                    "sqrt", "rsqrt", "square", "integer_pow", "pow", "select_n", "convert_element_type",
                    "broadcast_in_dim", "reshape", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "sign",
                    "erf", "exp2", "log1p", "expm1", "stop_gradient", "squeeze", "expand_dims", "iota"})
_READS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"})


class Machine(NamedTuple):
    """What the mesh's devices were measured to do, all of them at once: matmul FLOPs per µs and bytes of their own
    memory written per µs, per device; and the cost of collectives among them (a ``CostModel`` fitted to an
    all-reduce of a small and a large buffer and an all-gather of a small one)."""

    flops_per_us: float
    bytes_per_us: float
    links: CostModel


@functools.cache
def _measured(devices: tuple) -> Machine:
    mesh = Mesh(np.array(devices), ("d",))
    n = len(devices)
    split, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    rows, k = 256, 512
    a, b = _ones((n * rows, k), split), _ones((k, k), whole)
    matmul = _seconds(jax.jit(lambda a, b: (a @ b) @ b), a, b)
    big = _ones((n * 2**20,), split)
    write = _seconds(jax.jit(lambda x: x * 2.0 + 1.0), big)
    if n > 1:
        def timed(collective, size):
            x = _ones((n * size,), split)
            f = jax.jit(jax.shard_map(collective, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d")))
            return _seconds(f, x) * 1e6

        def summed(x):
            return jax.lax.psum(x, "d")

        def gathered(x):
            return jax.lax.all_gather(x, "d", tiled=True)

        small, large, gather = timed(summed, 256), timed(summed, 2**20), timed(gathered, 256)
    else:
        small = large = gather = 0.0
    figures = np.array([2 * 2 * rows * k * k / (matmul * 1e6), 2 * 4 * 2**20 / (write * 1e6), small, large, gather])
    if jax.process_count() > 1:  # every process must find the same plan: process 0's measurements for all
        from jax.experimental import multihost_utils
        figures = np.asarray(multihost_utils.broadcast_one_to_all(figures.astype(np.float32)), np.float64)
    flops, written, small, large, gather = figures.tolist()
    links = CostModel()
    if n > 1:
        # a small all-reduce takes 2 (n - 1) steps of a ring, a small all-gather n - 1: a collective's fixed cost
        # (launch) and each step's (latency) from the two
        latency = max(small - gather, 0.0) / (n - 1)
        volume = 4 * 2**20 * 2 * (n - 1) / n
        links = CostModel(launch_us=max(small - 2 * (n - 1) * latency, 0.0),
                          default=AxisCost(latency_us=latency,
                                           bandwidth_gbps=volume / max(large - small, 1e-3) / 1e3))
    return Machine(flops, written, links)


def _ones(shape: tuple, sharding: NamedSharding) -> jax.Array:
    """Ones made where ``sharding`` puts them: each device makes its own block, no device or host the whole."""
    return jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=sharding)()


def _seconds(f: Callable, *args) -> float:
    """The fastest of five timed calls of ``f`` (compiled and run once first)."""
    jax.block_until_ready(f(*args))
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _machine(mesh: Mesh) -> Machine:
    """The measured ``Machine`` of ``mesh``'s devices (once per process and set of devices)."""
    return _measured(tuple(mesh.devices.flat))
