"""A plan's per-device function: each operand's move as explicit collectives, then each equation on local blocks.

``local_function(plan, pins)`` is what runs inside ``shard_map``: local blocks of the plan's inputs in, local
blocks of its outputs out (moved to ``pins`` where given). Moves are ``jshard.lowering.local_program`` of
their plans; an equation runs as ``local_equation`` (its rule's local form where params hold global sizes or a
device needs its offsets, else the primitive itself on the blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from ..jaxcompat import jc
from ..local import coordinates_read_once
from ..lowering import local_program, local_programs
from ..planner import Plan, plan_redistribute, pricing
from ..rules.registry import has_rule, rule_for
from .constrain import constrain_p
from .walk import REUSED, JaxprPlan

__all__ = ["communicates", "local_equation", "local_function", "moved_together", "out_moves", "own_collectives"]


def local_equation(prim, params: dict, in_specs, out_specs) -> Callable:
    """The per-device function of one equation whose inputs have ``in_specs`` and outputs ``out_specs``
    (a strategy chosen by ``jshard.propagate.select``): padded local blocks in, a list of blocks out.

    Most primitives simply run on the local blocks; a rule supplies its own local form where params hold
    global sizes or a device needs its offsets (iota, reshape, gathers from a sharded table, RNG).
    """
    rule = rule_for(prim) if has_rule(prim) else None  # the walk warned already, naming the user's line
    if rule is not None and rule.local is not None:
        return rule.local(prim, params, tuple(in_specs), tuple(out_specs))
    bind = prim.get_bind_params(params)

    def run(*blocks):
        out = prim.bind(*blocks, **bind)
        return list(out) if prim.multiple_results else [out]

    return run


def out_moves(plan: JaxprPlan, pins: list) -> list[Plan | None]:
    """Per output of ``plan``: the plan moving it to its pinned spec, or None."""
    return [plan_redistribute(s, p.placements, cost_model=plan.cost_model) if p is not None and p != s else None
            for s, p in zip(plan.out_specs, pins, strict=True)]


def own_collectives(eq) -> list:
    """The collectives equation ``eq``'s local form runs itself (``jshard.cost.Communication`` records), as its rule
    declares them for the strategy chosen; none for most rules."""
    rule = eq.choice.rule
    if rule is None or rule.communicates is None:
        return []
    return list(rule.communicates(eq.eqn.params, eq.choice.ins, eq.choice.outs))


def communicates(plan: JaxprPlan, pins: list) -> bool:
    """Does running ``plan`` (loop and branch bodies included) and moving its outputs to ``pins`` need a
    collective (a move's, or one an equation's own local form runs)?"""
    for eq in plan.equations:
        if any(isinstance(op.move, Plan) and op.move.collectives for op in eq.operands):
            return True
        if own_collectives(eq):
            return True
        if any(communicates(body.plan, body.pins) for body in eq.bodies):
            return True
    return any(m is not None and m.collectives for m in out_moves(plan, pins))


def local_function(plan: JaxprPlan, pins: list | None = None) -> Callable:
    """The per-device function of ``plan``: local blocks of its inputs in, of its outputs out (moved to the
    specs in ``pins`` where given).

    Consecutive constraints (a training step's gradients pinned to their parameters' placements) move their
    operands side by side, and so do the outputs moved to ``pins``: their reduce-scatters and all-gathers share
    collectives (``jshard.lowering.local_programs``), where the model that priced ``plan`` says sharing pays.

    Made when first called: a plan that is only priced (a loop's or a pipeline's body, on a mesh of thousands of
    abstract devices, whose moves' index tables would be as large) never makes it.
    """
    made: list[Callable] = []

    def lazy(*blocks):
        if not made:
            made.append(_local_function(plan, pins))
        return made[0](*blocks)

    return lazy


def _local_function(plan: JaxprPlan, pins: list | None) -> Callable:
    finals = out_moves(plan, pins or [None] * len(plan.outs))
    kernels = [eq.kernel or ((lambda x: [x]) if eq.eqn.primitive is constrain_p else
                             local_equation(eq.eqn.primitive, eq.eqn.params, eq.choice.ins, eq.choice.outs))
               for eq in plan.equations]
    runs = _constraint_runs(plan.equations)
    moves = [[local_program(op.move) if _moving(op) and len(runs[i]) == 1 else None for op in eq.operands]
             for i, eq in enumerate(plan.equations)]
    with pricing(plan.cost_model):  # which moves share a collective is decided here, once
        finish = local_programs([m for m in finals if m is not None])
        together = {run[0]: local_programs(_run_moves(plan, run)) for run in set(runs) if len(run) > 1}

    @coordinates_read_once()
    def run(*blocks):
        vals = dict(zip(plan.in_vars, blocks, strict=True))
        moved = {}

        def fetch(op):
            return jnp.asarray(op.value) if op.literal else vals[op.value]

        for i, (eq, kernel, move) in enumerate(zip(plan.equations, kernels, moves, strict=True)):
            if len(runs[i]) > 1:
                if i != runs[i][0]:
                    continue  # ran with its run's first constraint
                _run_together([plan.equations[j] for j in runs[i]], together[i], vals, moved, fetch)
                continue
            args = []
            for op, m, target in zip(eq.operands, move, eq.choice.ins, strict=True):
                if op.move is REUSED:
                    args.append(moved[(op.value, target)])
                    continue
                a = fetch(op)
                if m is not None:
                    a = m(a)
                    if not op.literal:
                        moved[(op.value, target)] = a
                args.append(a)
            for o, r in zip(eq.outs, kernel(*args), strict=True):
                if o is not None:
                    vals[o] = r
        outs = [jnp.asarray(o.val, o.aval.dtype) if isinstance(o, jc.Literal) else vals[o] for o in plan.outs]
        moved_outs = iter(finish([v for v, m in zip(outs, finals, strict=True) if m is not None]))
        return [next(moved_outs) if m is not None else v for v, m in zip(outs, finals, strict=True)]

    return run


def moved_together(plan: JaxprPlan, pins: list) -> list[list[tuple[Any, Plan]]]:
    """The moves ``local_function(plan, pins)`` runs side by side (``jshard.lowering.local_programs``), each with
    whose it is (plans are cached and shared, so a plan does not name its move): those of each run of consecutive
    constraints (the constraint's ``EquationPlan``), and those of the outputs to ``pins`` (the output's index)."""
    runs = sorted({run for run in _constraint_runs(plan.equations) if len(run) > 1})
    groups = [[(plan.equations[i], plan.equations[i].operands[0].move) for i in run
               if _moving(plan.equations[i].operands[0])] for run in runs]
    return groups + [[(j, m) for j, m in enumerate(out_moves(plan, pins)) if m is not None]]


def _run_moves(plan: JaxprPlan, run: tuple[int, ...]) -> list[Plan]:
    return [plan.equations[i].operands[0].move for i in run if _moving(plan.equations[i].operands[0])]


def _moving(op) -> bool:
    return isinstance(op.move, Plan) and bool(op.move.steps)


def _constraint_runs(equations: list) -> list[tuple[int, ...]]:
    """Per equation, the indices of the run of consecutive constraints it belongs to (itself alone for any other
    equation). A run ends where a constraint reads what an earlier one of the run made, so every operand of a
    run is there before the run starts."""
    groups: list[list[int]] = []
    open_run, made = False, set()
    for i, eq in enumerate(equations):
        constraint = eq.eqn.primitive is constrain_p
        if constraint and open_run and not any(not op.literal and op.value in made for op in eq.operands):
            groups[-1].append(i)
        else:
            groups.append([i])
            open_run, made = constraint, set()
        made.update(o for o in eq.outs if o is not None)
    return [tuple(g) for g in groups for _ in g]


def _run_together(run: list, program: Callable, vals: dict, moved: dict, fetch: Callable) -> None:
    """The constraints in ``run``: their operands' moves as one ``local_programs`` call, then their outputs."""
    moving = [eq for eq in run if _moving(eq.operands[0])]
    results = dict(zip(map(id, moving), program([fetch(eq.operands[0]) for eq in moving]), strict=True))
    for eq in moving:
        if not eq.operands[0].literal:
            moved[(eq.operands[0].value, eq.choice.ins[0])] = results[id(eq)]
    for eq in run:
        (op,), (target,) = eq.operands, eq.choice.ins
        if id(eq) in results:
            vals[eq.outs[0]] = results[id(eq)]
        else:
            vals[eq.outs[0]] = moved[(op.value, target)] if op.move is REUSED else fetch(op)
