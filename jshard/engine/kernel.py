"""A plan's per-device function: each operand's move as explicit collectives, then each equation on local blocks.

``local_function(plan, pins)`` is what runs inside ``shard_map``: local blocks of the plan's inputs in, local
blocks of its outputs out (moved to ``pins`` where given). Moves are ``jshard.lowering.local_program`` of
their plans; an equation runs as ``local_equation`` (its rule's local form where params hold global sizes or a
device needs its offsets, else the primitive itself on the blocks).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from ..jaxcompat import jc
from ..lowering import local_program
from ..planner import Plan, plan_redistribute
from ..rules.registry import has_rule, rule_for
from .constrain import constrain_p
from .walk import REUSED, JaxprPlan

__all__ = ["communicates", "local_equation", "local_function", "out_moves"]


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
    return [plan_redistribute(s, p.placements) if p is not None and p != s else None
            for s, p in zip(plan.out_specs, pins)]


def communicates(plan: JaxprPlan, pins: list) -> bool:
    """Does running ``plan`` (loop and branch bodies included) and moving its outputs to ``pins`` need a
    collective?"""
    for eq in plan.equations:
        if any(isinstance(op.move, Plan) and op.move.collectives for op in eq.operands):
            return True
        if any(communicates(body, body_pins) for _, body, body_pins in eq.bodies):
            return True
    return any(m is not None and m.collectives for m in out_moves(plan, pins))


def local_function(plan: JaxprPlan, pins: list | None = None) -> Callable:
    """The per-device function of ``plan``: local blocks of its inputs in, of its outputs out (moved to the
    specs in ``pins`` where given)."""
    finals = [local_program(m) if m is not None else None for m in out_moves(plan, pins or [None] * len(plan.outs))]
    kernels = [eq.kernel or ((lambda x: [x]) if eq.eqn.primitive is constrain_p else
                             local_equation(eq.eqn.primitive, eq.eqn.params, eq.choice.ins, eq.choice.outs))
               for eq in plan.equations]
    moves = [[local_program(op.move) if isinstance(op.move, Plan) and op.move.steps else None for op in eq.operands]
             for eq in plan.equations]

    def run(*blocks):
        vals = dict(zip(plan.in_vars, blocks))
        moved = {}
        for eq, kernel, move in zip(plan.equations, kernels, moves):
            args = []
            for op, m, target in zip(eq.operands, move, eq.choice.ins):
                if op.move is REUSED:
                    args.append(moved[(op.value, target)])
                    continue
                a = jnp.asarray(op.value) if op.literal else vals[op.value]
                if m is not None:
                    a = m(a)
                    if not op.literal:
                        moved[(op.value, target)] = a
                args.append(a)
            for o, r in zip(eq.outs, kernel(*args)):
                if o is not None:
                    vals[o] = r
        outs = [jnp.asarray(o.val, o.aval.dtype) if isinstance(o, jc.Literal) else vals[o] for o in plan.outs]
        return [m(v) if m is not None else v for v, m in zip(outs, finals)]

    return run
