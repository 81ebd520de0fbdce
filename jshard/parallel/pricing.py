"""The price of a training step under a role assignment: its time, bytes and memory per chip, on specs alone.

``price`` traces the model's step (forward, gradients, optimizer update) on parameters that hold only their
specs, has the engine plan it as ``TrainStep`` would run it, and walks the plan's equations. The model is cut to
two blocks, the second called inside a ``jax.named_scope`` of its own; blocks share one plan, so every block after
the first costs what the second does: the equations of its scope (its forward and backward passes) and those
feeding only its own parameters and optimizer state (its gradients' moves, its update), counted once for each
further block, and its activations and gradients held once more for each in the memory walk. Pricing costs the
same for 2 blocks or 126, and nothing is ever built: the mesh may be abstract (``jax.sharding.AbstractMesh``), of
any size. The figures, per chip, on a ``Hardware`` (described or measured):

- communication: every collective the plan runs (its operands' moves, a rule's own, as a body runs them), priced
  by the hardware's links by level (a collective over an axis that leaves the node runs at the ``inter`` link's
  pace), with the share of the collectives that hides behind compute taken off (``Hardware.overlap`` of the data
  axes', ``Hardware.tensor_overlap`` of the others');
- computation: the matmul FLOPs (at their local shapes, as ``dot_general`` and the rules that declare them) at
  ``flops * efficiency``, and the bytes each equation writes (those XLA fuses away left out) at the memory's
  bandwidth;
- a pipeline priced by its schedule: tick by tick, each tick as long as its slowest stage's units, and its
  kernel's buffers in memory;
- memory: parameters, optimizer state and batch as placed, and the peak of the step's live intermediates
  (activations, gradients) from the plan's equations at their local shapes.

Shared by ``autoplan`` (which prices every candidate) and ``predict`` (one configuration).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from ..cost import COLLECTIVES
from ..darray import DArray, abstract
from ..engine import (
    WHILE_TRIPS,
    JaxprPlan,
    axis_aliases,
    constrain_p,
    out_moves,
    own_collectives,
    shared_trace,
)
from ..jaxcompat import jc
from ..placements import Placement, Replicate
from ..planner import Plan as MovePlan
from ..spec import Spec
from .hardware import LEVELS, Hardware
from .parallelize import parallelize_shapes
from .plan import Memory, Plan
from .roles import (
    BATCH_ROLES,
    BLOCK_SCOPE,
    ROLES,
    TRACED_AS,
    batch_placements,
    compute_dtype,
    cut_model,
    module_at,
    param_path,
    pipeline_microbatches,
    styles_of,
)
from .schedule import make_schedule
from .training import GRADIENT_PINS, mirror_placements, step_function

__all__ = ["FIGURES", "Rates", "memory_of", "price", "step_inputs"]

# what a step's figures hold per chip: µs in collectives (all, by link level, on the data axes), bytes sent in
# them, matmul FLOPs, bytes written, µs of a pipeline's schedule and the FLOPs its units run (in that time)
FIGURES = ("comm_us", *(f"{level}_us" for level in LEVELS), "data_us", "bytes", "flops", "written", "pipeline_us",
           "pipeline_flops")


class Rates:
    """What a step's figures are priced at on one mesh: the hardware's compute and memory rates, and its links'
    cost model with each axis at its level; a collective's µs are told by level, and as the data axes' (those
    splitting the batch: what overlaps with compute)."""

    def __init__(self, hardware: Hardware, mesh: Mesh | AbstractMesh, roles: dict[str, str]):
        self.hardware, self.mesh = hardware, mesh
        self.links = hardware.costs(mesh)
        self.flops_per_us, self.bytes_per_us = hardware.flops_per_us, hardware.bytes_per_us
        self.data = frozenset(a for a, r in roles.items() if r in BATCH_ROLES)

    @functools.lru_cache(maxsize=None)  # noqa: B019  (one Rates per priced candidate)
    def level(self, axes: tuple[str, ...]) -> str:
        return self.hardware.levels(self.mesh, axes)

    def collective(self, kind: str, axes: tuple[str, ...], sizes: dict, nbytes: float, count: int = 1) -> dict:
        """The figures of ``count`` collectives ``kind`` over ``axes`` with ``nbytes`` in per chip."""
        us = count * self.links.collective(kind, axes, math.prod(sizes[a] for a in axes), nbytes, sizes=sizes)
        out = {"comm_us": us, f"{self.level(axes)}_us": us, "bytes": nbytes * count}
        if axes and set(axes) <= self.data:
            out["data_us"] = us
        return out


def price(model, blocks, mesh, roles, tensor, loss_fn, batch, tx, hardware: Hardware, traces: dict,
          microbatches: int | None = None, remat: bool = False) -> Plan:
    """A candidate's Plan: its figures from the model cut to two blocks, the second block's share (a block between
    blocks, as all but the first are) counted once more for each further block of the model.

    It is priced on its own mesh with the axes renamed by role (``_canonical``): every candidate with the same roles
    in either order, ``dp`` and ``fsdp`` taken as one (``_Whole``), traces the same step, which ``traces`` keeps
    (and the model cut), and only its plan is made again, with its own gradient pins (``_pinned``)."""
    names, canonical = _canonical(mesh, roles)
    canonical_roles = {names[a]: r for a, r in roles.items()}
    depth = len(list(module_at(model, blocks))) if blocks is not None else 1
    stages = [mesh.shape[a] for a, r in roles.items() if r == "pp"]
    data = math.prod(mesh.shape[a] for a, r in roles.items() if r in BATCH_ROLES)
    micro = microbatches or (pipeline_microbatches(stages[0], min(b.shape[0] for b in batch if b.shape), data)
                             if stages else None)
    rates = Rates(hardware, canonical, canonical_roles)
    if ("compute dtype",) not in traces:  # the model is the search's one: read once, not per candidate
        traces["compute dtype",] = compute_dtype(model)
    cast = traces["compute dtype",]
    plan, default = styles_of(canonical_roles, tensor, blocks, micro, pricing=True, param_dtype=cast,
                              remat=remat and bool(stages))
    placements = batch_placements(canonical, canonical_roles, batch)
    shape = (tuple(sorted((a, TRACED_AS.get(r, r)) for a, r in canonical_roles.items())),
             tuple(canonical.shape[a] for a, r in canonical_roles.items() if r in ("cp", "pp")),  # traced by size
             canonical.axis_names if stages else None,  # a pipeline's equation holds the mesh's axes in order
             remat, cast, micro)
    # a pipeline's step is one equation whatever its depth (its blocks stacked): it is priced whole
    scoped = None if stages else blocks
    cut = depth if stages else min(depth, 2)
    if ("cut", scoped, cut, remat) not in traces:  # cutting a deep model costs more than copying the cut one
        # a pipeline's layers recompute by its style's remat, its blocks kept alike
        traces["cut", scoped, cut, remat] = nnx.split(cut_model(model, scoped, cut, remat and not stages))
    small = nnx.merge(*traces["cut", scoped, cut, remat], copy=True)  # a copy: parallelize_shapes changes it
    with axis_aliases(names):  # a jshard.constrain dict in the loss names the user's axes
        total, block = _figures(small, scoped, cut, depth - cut, canonical, plan, default, loss_fn,
                                batch, placements, tx, rates, traces, shape)
    at_cut = memory_of(total, total["cut_temps"]).total  # the cut model's own, before the further blocks
    total = {k: v + (depth - cut) * block.get(k, 0.0) for k, v in total.items()}
    compute_us = (total["flops"] / rates.flops_per_us + total["written"] / rates.bytes_per_us
                  + total["pipeline_us"])
    hidden = _hidden(total, compute_us, hardware)
    plan, default = styles_of(roles, tensor, blocks, micro, param_dtype=cast, remat=remat and bool(stages))
    return Plan(roles=dict(roles), styles=plan, default=default, batch=batch_placements(mesh, roles, batch),
                step_us=compute_us + total["comm_us"] - hidden, bytes_moved=int(total["bytes"]),
                memory=memory_of(total, total["temps"]),
                detail={"compute_us": compute_us, "comm_us": total["comm_us"], "hidden_us": hidden,
                        "flops": total["flops"] + total["pipeline_flops"], "intra_us": total["intra_us"],
                        "inter_us": total["inter_us"],
                        "pipeline_us": total["pipeline_us"], "microbatches": micro, "remat": remat,
                        "abstract": isinstance(mesh, AbstractMesh),
                        "cut": cut, "depth": depth, "cut_bytes": at_cut},
                mesh_shape=tuple(mesh.axis_sizes), axis_names=tuple(mesh.axis_names))


def memory_of(total: dict[str, float], temps: float) -> Memory:
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
    order = sorted(mesh.axis_names, key=lambda a: (ROLES.index(TRACED_AS.get(roles[a], roles[a])), mesh.shape[a],
                                                   mesh.axis_names.index(a)))
    names = {a: f"x{i}" for i, a in enumerate(order)}
    renamed = tuple(names[a] for a in mesh.axis_names)
    if isinstance(mesh, AbstractMesh):
        return names, AbstractMesh(mesh.axis_sizes, renamed)
    return names, Mesh(mesh.devices, renamed)


def _figures(model, blocks, cut, more, mesh, plan, default, loss_fn, batch, placements, tx, rates: Rates,
             traces: dict, key: Any) -> tuple[dict[str, float], dict[str, float]]:
    """The step of ``model`` (its block list at ``blocks`` cut to ``cut`` blocks) under the plan, traced and planned
    on specs alone: its figures per device, and the share of them that its last block makes (its forward and
    backward passes, the moves and updates of its parameters and optimizer state), to be counted ``more`` times
    more; its peak memory is found with ``more`` blocks more (``_peak``). The step's jaxpr is shared
    with the candidates of the same ``key``, each pinning the gradients in it to its own parameters' placements
    (``_pinned``)."""
    params, opt, rest, data = step_inputs(model, mesh, plan, default, placements, batch, tx)
    pins = [tuple(zip(mesh.axis_names, d.placements, strict=True)) for d in _darrays(params)]
    with shared_trace(traces, (key, blocks, cut), adapt=functools.partial(_pinned, pins)):
        traced = step_function(model, tx, loss_fn).trace(params, opt, rest, *data)
    inside = (lambda path: _within(path, (*blocks, cut - 1))) if blocks is not None else (lambda path: False)
    total = {"batch": sum(d.spec.local_bytes for d in data)}
    block = {}
    for name, tree in (("params", params), ("optimizer", opt)):
        leaves = [(param_path(k), d) for k, d in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, DArray))[0] if isinstance(d, DArray)]
        total[name] = sum(d.spec.local_bytes for _, d in leaves)
        block[name] = sum(d.spec.local_bytes for p, d in leaves if inside(p))
    plan_ = traced.plan
    outputs = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(traced.out_tree, range(len(plan_.outs))))[0]
    own = {j for path, j in outputs if inside(param_path(path))}  # the block's parameters and optimizer state, updated
    ours = _block_equations(plan_, own)
    sizes, fused = dict(mesh.shape), _fused(plan_)
    total.update(dict.fromkeys(FIGURES, 0.0))
    for eq in plan_.equations:
        figures = _equation_figures(eq, rates, sizes, fused)
        for k, v in figures.items():
            total[k] = total.get(k, 0.0) + v
            if id(eq) in ours:
                block[k] = block.get(k, 0.0) + v
    for j, move in enumerate(out_moves(plan_, traced.pins)):
        if move is not None:
            for k, v in _move_figures(move, rates, sizes).items():
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


def step_inputs(model, mesh, plan, default, placements, batch, tx) -> tuple:
    """The training step's arguments for the abstract ``model`` (changed in place) under a plan, holding specs
    alone: parameters, optimizer state, other state, batch."""
    parallelize_shapes(model, mesh, plan, default=default)
    params = nnx.state(model, nnx.Param)
    whole = (Replicate(),) * len(mesh.axis_names)

    def carried(a):  # the other state as TrainStep carries it: numbers replicated (a mixture's bias and load)
        numeric = isinstance(a, jax.ShapeDtypeStruct) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
        return _shaped(mesh, whole, a.shape, a.dtype) if numeric else a

    rest = jax.tree.map(carried, nnx.split(model, nnx.Param, ...)[2])
    opt = _optimizer_state(tx, params, mesh)
    data = [_shaped(mesh, p, b.shape, b.dtype) for p, b in zip(placements, batch, strict=True)]
    return params, opt, rest, data


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
        elif BLOCK_SCOPE in eq.scope:
            ours[id(eq)] = "backward" if _backward(eq) else "forward"
        for op in eq.operands:
            if not op.literal:
                feeds.setdefault(op.value, set()).update(fed)
    return ours


def _equation_figures(eq, rates: Rates, sizes: dict, fused: frozenset = frozenset()) -> dict[str, float]:
    """One equation's figures per device: its operands' moves and its own collectives (µs by the measured links,
    bytes), its matmul FLOPs and the bytes it writes (``fused``: values it never writes), its bodies' as they run
    (a scan's once per trip, a while loop's for as many trips as the plan assumed, a cond's costliest branch); a
    pipeline's as its schedule runs them (``pipeline_us``)."""
    written = sum(s.local_bytes for o, s in zip(eq.outs or (), eq.choice.outs, strict=True) if o not in fused)
    if eq.eqn.primitive is constrain_p and not any(isinstance(op.move, MovePlan) and op.move.steps
                                                    for op in eq.operands):
        written = 0  # a constraint its operand meets hands the same buffer on
    out = dict.fromkeys(FIGURES, 0.0)
    out.update(flops=_flops(eq), written=float(written))
    for op in eq.operands:
        if isinstance(op.move, MovePlan):
            for k, v in _move_figures(op.move, rates, sizes).items():
                out[k] += v
    for c in own_collectives(eq):
        for k, v in rates.collective(c.kind, tuple(c.axes), sizes, c.nbytes, c.count).items():
            out[k] += v
    bodies = [(b, _body_figures(b.plan, b.pins, rates, _sub_sizes(sizes, eq))) for b in eq.bodies]
    if eq.eqn.primitive.name == "jshard_pipeline":  # its bodies' time is its schedule's; their bytes as they run
        out["pipeline_us"] = _pipeline_time(eq, [f for _, f in bodies], rates, sizes)
        out["bytes"] += sum(b.runs * f["bytes"] for b, f in bodies)
        out["pipeline_flops"] = sum(b.runs * f["flops"] for b, f in bodies)
        return out
    branches = [f for b, f in bodies if b.alternative]
    runs = [(f, WHILE_TRIPS if b.runs is None else b.runs) for b, f in bodies if not b.alternative]
    if branches:
        runs.append((max(branches, key=lambda f: _unit_us(f, rates)), 1))
    for figures, n in runs:
        for k, v in figures.items():
            out[k] += n * v
    return out


def _unit_us(figures: dict[str, float], rates: Rates) -> float:
    """The µs of figures: their FLOPs and writes at the measured rates, their collectives less what hides behind
    those (``_hidden``), a pipeline's ticks."""
    compute = figures["flops"] / rates.flops_per_us + figures["written"] / rates.bytes_per_us
    return compute + figures["comm_us"] - _hidden(figures, compute, rates.hardware) + figures["pipeline_us"]


def _hidden(figures: dict[str, float], compute_us: float, hardware: Hardware) -> float:
    """The µs of collectives that run behind ``compute_us`` of computation: ``Hardware.overlap`` of the data axes',
    ``Hardware.tensor_overlap`` of the others', never more than the computation."""
    data = hardware.overlap * min(figures["data_us"], compute_us)
    return data + hardware.tensor_overlap * min(figures["comm_us"] - figures["data_us"], compute_us - data)


def _sub_sizes(sizes: dict, eq) -> dict:
    """The mesh axes an equation's bodies are planned on: a pipeline's, the mesh without its axis."""
    return {a: n for a, n in sizes.items() if a != eq.eqn.params.get("axis")} \
        if eq.eqn.primitive.name == "jshard_pipeline" else sizes


def _body_figures(body: JaxprPlan, pins: list, rates: Rates, sizes: dict) -> dict[str, float]:
    out = dict.fromkeys(FIGURES, 0.0)
    fused = _fused(body)
    for inner in body.equations:
        for k, v in _equation_figures(inner, rates, sizes, fused).items():
            out[k] += v
    for move in out_moves(body, pins):
        if move is not None:
            for k, v in _move_figures(move, rates, sizes).items():
                out[k] += v
    return out


def _pipeline_time(eq, bodies: list[dict], rates: Rates, sizes: dict) -> float:
    """A pipeline's µs on the critical path: its schedule's ticks, each as long as its slowest device's units (a
    forward unit and a backward unit of ``L / (p v)`` layers each, rounded up: the fullest stage's), the tail after the
    last stage's forward."""
    prm = eq.eqn.params
    p = sizes[prm["axis"]]
    depth = eq.choice.ins[0].shape[0]
    m = eq.choice.ins[sum(prm["counts"][:2])].shape[0]
    sched = make_schedule(prm["kind"], p, m, prm["virtual"])
    layers = -(-depth // (p * prm["virtual"]))  # the fullest stage's (uneven stages: the last hold fewer)
    forward, backward, tail, *state = (_unit_us(f, rates) for f in bodies)  # state: what a layer's call leaves
    forward += sum(state)
    busy = layers * (forward * (sched.forward >= 0) + backward * (sched.backward >= 0))
    busy[:, -1] += tail * (sched.forward[:, -1] >= 0)
    return float(busy.max(axis=1).sum())


def _move_figures(move: MovePlan, rates: Rates, sizes: dict) -> dict[str, float]:
    """A redistribution's collectives, priced by ``rates`` (the plan was made under the cost model in force, as
    ``TrainStep`` makes it)."""
    out = dict.fromkeys(("comm_us", "bytes", *(f"{level}_us" for level in LEVELS), "data_us"), 0.0)
    for step in move.collectives:
        kind = step.emitted if step.emitted in COLLECTIVES else "permute"
        for k, v in rates.collective(kind, tuple(step.axes), sizes, step.bytes, step.count).items():
            out[k] += v
    return out


def _flops(eq) -> float:
    """FLOPs one device runs in an equation at its local shapes: a matmul's, a convolution's, a grouped matmul's
    (``ragged_dot``: every row by its group's matrix), or what its rule declares (``Rule.flops``: attention, a
    mixture of experts, a user's ``rules.function``)."""
    name, ins, outs = eq.eqn.primitive.name, eq.choice.ins, eq.choice.outs
    if name == "dot_general":
        (lc, _), _ = eq.eqn.params["dimension_numbers"]
        lhs = ins[0].local_block_shape
        return 2.0 * math.prod(outs[0].local_block_shape) * math.prod(lhs[d] for d in lc)
    if name == "conv_general_dilated":  # each output element: a window of the kernel's spatial dims and inputs
        kernel = ins[1].local_block_shape
        spec = eq.eqn.params["dimension_numbers"].rhs_spec  # (out features, in features, *spatial)
        window = math.prod(kernel[d] for d in spec[1:])
        return 2.0 * math.prod(outs[0].local_block_shape) * window
    if name in ("ragged_dot", "ragged_dot_general"):
        m, k = ins[0].local_block_shape[-2:]
        return 2.0 * m * k * outs[0].local_block_shape[-1]
    rule = eq.choice.rule
    if rule is not None and rule.flops is not None:
        return float(rule.flops(eq.eqn.params, ins, outs))
    return 0.0


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
    every block holds at once are held ``more`` times more: the block's gradients and updates (``ours``' ``"own"``),
    its forward pass's values that a backward pass reads (its activations) and its input where its forward pass and
    a backward pass read it. One walk: at each equation the bytes held are ``base + more * extra``."""
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
                # held once per block: its gradients and updates, and what a backward pass reads of its forward
                # pass and of its input (all a block under remat keeps)
                readers = users.get(o, ())
                backward = any(map(_backward, readers))
                kept = (kind == "own" or (kind == "forward" and backward)
                        or (kind is None and backward and any(ours.get(id(u)) == "forward" for u in readers)))
                size[o] = (spec.local_bytes, spec.local_bytes if kept else 0)
                live[0] += size[o][0]
                live[1] += size[o][1]
        moved = sum(t.local_bytes for op, t in zip(eq.operands, eq.choice.ins, strict=True)
                    if isinstance(op.move, MovePlan) and op.move.steps)
        held = _pipeline_held(eq) if eq.eqn.primitive.name == "jshard_pipeline" else 0
        points.add((live[0] + moved + held, live[1]))  # a moved copy lives while its consumer runs: once
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
    ``slots`` microbatches' layer residuals for each of its layers, and the forward and backward inputs received;
    ``jshard.parallel.schedule``), and at their peaks its layer's forward or backward and its tail."""
    prm = eq.eqn.params
    n, k, _ = prm["counts"]
    x0 = eq.choice.ins[n + k]
    p = x0.mesh.shape[prm["axis"]]
    sched = make_schedule(prm["kind"], p, x0.shape[0], prm["virtual"])
    per = -(-eq.choice.ins[0].shape[0] // (p * prm["virtual"]))
    kept = sum(sp.local_bytes for sp in eq.bodies[0].plan.out_specs[1:])  # one layer's residuals, a microbatch
    forward, backward, tail = (_peak(b.plan, {}, _fused(b.plan))(0) for b in eq.bodies[:3])
    bodies = max(forward, backward, tail)  # one at a time: the tail after the forward unit, the backward after both
    return prm["virtual"] * sched.slots * (2 * (x0.local_bytes // x0.shape[0]) + per * kept) + bodies


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

