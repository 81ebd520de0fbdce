"""Control flow: ``scan``, ``while`` and ``cond`` bodies are planned as jaxprs of their own and run as local loops
and switches.

A loop carry settles on the specs that cost least over the loop: the initial specs, or each set the body
reaches from them, priced as the initial value's move there plus, per trip, the body's communication and
the move of its result back (``settle_carry``). A cond's result settles where moving every branch's result
costs least. Each planner is registered with the walk by ``@control(name)`` and returns ``(Choice, local
kernel, bodies)``: the kernel runs the bodies' local functions under ``lax.scan`` / ``while_loop`` /
``switch``, so every device takes the same trip count and branch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from ..jaxcompat import cond_branches, jc, scan_params, while_params
from ..placements import Replicate, shift_dims
from ..propagate import Choice
from ..spec import Spec
from .kernel import local_function
from .walk import Body, JaxprPlan, control, move_cost, plan_jaxpr

__all__ = ["plan_cond", "plan_scan", "plan_while", "settle_carry"]

WHILE_TRIPS = 8  # a while loop's trip count is unknown when the plan is made: assume a few


def settle_carry(make: Callable, init: list[Spec], trips: int, rounds: int = 3) -> tuple[float, list[Spec], JaxprPlan]:
    """Loop-carry specs at least cost, as ``(cost, carry specs, body plan)``. ``make(carry)`` plans the body
    with the carry at ``carry`` and returns ``(plan, carry specs it returns)``. The cost holds the initial
    value's move once and, per trip, the body's communication and its result's move back."""
    best, carry, tried = None, list(init), []
    for _ in range(rounds + 1):
        if carry in tried:
            break
        tried.append(carry)
        plan, out = make(carry)
        cost = move_cost(init, carry) + trips * (plan.cost + move_cost(out, carry))
        if best is None or cost < best[0]:
            best = (cost, carry, plan)
        carry = list(out)
    return best


@control("scan")
def plan_scan(eqn: jc.JaxprEqn, specs: list[Spec], mesh) -> tuple[Choice, Callable, tuple]:
    p = scan_params(eqn)
    nc, nk, body = p.consts, p.carry, p.body
    consts, init, xs = specs[:nc], specs[nc:nc + nk], [_unshard_dim0(s) for s in specs[nc + nk:]]
    x_iter = [_shift(s, s.shape[1:], -1) for s in xs]

    def make(carry):
        plan = plan_jaxpr(body, consts + carry + x_iter, mesh)
        return plan, plan.out_specs[:nk]

    cost, carry, plan = settle_carry(make, init, p.length)
    ys = [_shift(s, (p.length,) + s.shape, +1) for s in plan.out_specs[nk:]]
    pins = carry + [None] * len(ys)
    fn = local_function(plan, pins)

    def kernel(*blocks):
        c, k0, x = blocks[:nc], blocks[nc:nc + nk], blocks[nc + nk:]
        step = lambda k, xi: (lambda o: (o[:nk], o[nk:]))(fn(*c, *k, *xi))
        k1, y = jax.lax.scan(step, list(k0), list(x), length=p.length, reverse=p.reverse, unroll=p.unroll)
        return list(k1) + list(y)

    ins = consts + carry + xs
    # settle_carry's cost already holds the initial carry's move; the xs' move to whole leading dims is extra
    return (Choice(tuple(ins), tuple(carry + ys), cost + move_cost(specs[nc + nk:], xs), None), kernel,
            (Body("body", plan, pins, p.length),))


@control("while")
def plan_while(eqn: jc.JaxprEqn, specs: list[Spec], mesh) -> tuple[Choice, Callable, tuple]:
    p = while_params(eqn)
    cn, bn = p.cond_consts, p.body_consts
    cconsts, bconsts, init = specs[:cn], specs[cn:cn + bn], specs[cn + bn:]

    def make(carry):
        plan = plan_jaxpr(p.body, bconsts + carry, mesh)
        return plan, plan.out_specs

    cost, carry, body = settle_carry(make, init, WHILE_TRIPS)
    cond = plan_jaxpr(p.cond, cconsts + carry, mesh)
    whole = [s.with_placements((Replicate(),) * len(mesh.axis_names)) for s in cond.out_specs]
    body_fn, cond_fn = local_function(body, carry), local_function(cond, whole)  # every device takes one branch

    def kernel(*blocks):
        cc, bc, k0 = blocks[:cn], blocks[cn:cn + bn], blocks[cn + bn:]
        return list(jax.lax.while_loop(lambda k: cond_fn(*cc, *k)[0], lambda k: body_fn(*bc, *k), list(k0)))

    ins = cconsts + bconsts + carry
    cost += WHILE_TRIPS * (cond.cost + move_cost(cond.out_specs, whole))  # the carry's move: in cost already
    return (Choice(tuple(ins), tuple(carry), cost, None), kernel,
            (Body("cond", cond, whole, runs=None), Body("body", body, carry, runs=None)))


@control("cond")
def plan_cond(eqn: jc.JaxprEqn, specs: list[Spec], mesh) -> tuple[Choice, Callable, tuple]:
    branches = cond_branches(eqn)
    index = specs[0].with_placements((Replicate(),) * len(mesh.axis_names))  # every device takes the same branch
    ops = specs[1:]
    plans = [plan_jaxpr(b, ops, mesh) for b in branches]
    # each output settles where moving every branch's result costs least (ties: the first branch's)
    outs = []
    for j in range(len(plans[0].out_specs)):
        results = [pl.out_specs[j] for pl in plans]
        outs.append(min(results, key=lambda t: move_cost(results, [t] * len(results))))
    fns = [local_function(pl, outs) for pl in plans]

    def kernel(i, *blocks):
        return list(jax.lax.switch(i, [lambda *a, f=f: f(*a) for f in fns], *blocks))

    cost = move_cost(specs[:1], [index]) + max(pl.cost + move_cost(pl.out_specs, outs) for pl in plans)
    return (Choice((index, *ops), tuple(outs), cost, None), kernel,
            tuple(Body(f"branch {b}", pl, outs, alternative=True) for b, pl in enumerate(plans)))


def _unshard_dim0(spec: Spec) -> Spec:
    """``spec`` with its leading dim whole (a loop slices it per iteration)."""
    return spec.with_placements([Replicate() if p.is_shard and p.dim == 0 else p for p in spec.placements])


def _shift(spec: Spec, shape, delta: int) -> Spec:
    """The spec of one slice (``delta=-1``) or of a stack (``+1``) of arrays laid out like ``spec``."""
    return Spec.create(spec.mesh, shift_dims(spec.placements, delta), shape, spec.dtype)
