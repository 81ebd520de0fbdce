"""Walking a jaxpr: every equation's strategy, then the moves between equations, as data.

``plan_jaxpr(closed, specs, mesh)`` walks the equations forwards from the inputs' specs, choosing each one's
cheapest correct strategy (``jshard.propagate.select``). Calls (``jit``, ``custom_jvp_call``, ``remat``, ...)
are followed inline; control flow (registered with ``@control(name)``, see ``jshard.engine.control``) walks its
bodies as plans of their own. A second pass looks back from the consumers: where every consumer of a value
moves it to one spec, its producer is asked to produce that spec directly when that costs no collective (or only
the reduction its consumers would make: a transpose, an add that would mask a bias into pending sums). A third
looks past one equation: where an equation moves an input with a collective, or a consumer moves its output with
one, its other strategies are tried with the change rippled through its consumers, and the cheapest is kept where
the program's moves cost less and send no more bytes. A fourth makes a value that a consumer slices sliced from the
start, where the moves that adds cost less than writing the bytes it saves. Then each operand's move is planned
(``jshard.planner``), dead equations are dropped, and a value moved to the same spec for several consumers moves
once.

The result is a ``JaxprPlan``: per equation (``EquationPlan``) the operands with their moves, the chosen
strategy and, for control flow, the local loop or switch. ``jshard.engine.kernel`` turns it into code.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from ..cost import CostModel
from ..jaxcompat import inlined_call, jc, open_jaxpr, source_info_util
from ..placements import Replicate
from ..planner import Plan, model_in_force, plan_redistribute
from ..propagate import Choice, alternatives, select
from ..rules.registry import has_rule, rule_for
from ..spec import Spec
from .constrain import constrain_p, constrain_target

__all__ = ["EquationPlan", "JaxprPlan", "Operand", "REUSED", "Value", "control", "move_cost", "plan_jaxpr",
           "replicated"]

class Value:
    """A value of the walked program. Inlined jaxprs are walked once per call site and share their Var objects
    (a cached inner jaxpr), so values are named by fresh ``Value`` objects, never by Vars."""

    __slots__ = ()


class _Reused:
    """The move of an operand that an earlier consumer already moved to the same spec."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "REUSED"


REUSED = _Reused()


class Operand(NamedTuple):
    """One input of a planned equation."""

    literal: bool  # a constant of the jaxpr, held in ``value``; else ``value`` is a Value of the program
    value: Any  # the Value, or the literal's numpy (or PRNG key) value
    move: Plan | _Reused | None = None  # to the spec the equation runs with: a plan, REUSED, or None (it is there)


class Body(NamedTuple):
    """A control-flow equation's body (a loop's, a branch, a pipeline's layer), planned as a jaxpr of its own."""

    label: str  # what it is to its equation: "body", "branch 1", "layer forward"
    plan: JaxprPlan
    pins: list  # per output: the spec it is moved to, or None
    runs: int | None = 1  # times it runs per run of its equation on a device (None: not known before it runs)
    alternative: bool = False  # one of a cond's branches: one of them runs


@dataclass
class EquationPlan:
    """One equation of a ``JaxprPlan``: what runs, on what, with which moves."""

    eqn: jc.JaxprEqn
    operands: list[Operand]  # moves are set once the consumers have had their say
    choice: Choice  # the specs its inputs run with and its outputs come out with, and the cost
    kernel: Callable | None = None  # control flow: the local loop / switch over the bodies' local functions
    outs: list | None = None  # per output: a fresh Value (None: dropped)
    bodies: tuple[Body, ...] = ()  # control flow: its bodies, for explain
    site: Any = None  # the source of the innermost call with a user frame (a library jit's body has none)
    scope: str = ""  # the name stacks (jax.named_scope) of the calls it was inlined from and its own, joined by "/"
    consts: list | None = None  # per input: its value when a literal (for re-selection)

    @property
    def source(self) -> str:
        """The user's line that made this equation."""
        summarize = source_info_util.summarize
        return summarize(self.eqn.source_info) or (summarize(self.site) if self.site is not None else "")


@dataclass
class JaxprPlan:
    """A walked jaxpr: its input vars, the equations that stay live, its outputs and their specs, and the cost
    model that priced it (its outputs' moves and its lowering are priced by it too)."""

    in_vars: list
    equations: list[EquationPlan]
    outs: list  # per output: a Value, or a jc.Literal (a constant output)
    out_specs: list[Spec]
    cost_model: CostModel

    @property
    def cost(self) -> float:
        """Estimated µs of communication (loops weighted by their trip counts)."""
        return sum(eq.choice.cost for eq in self.equations)

    def without_rules(self) -> list[str]:
        """Names of the primitives, here and in control-flow bodies, that had no sharding rule and so ran
        replicated (each warned once when planned)."""
        names = set()
        for eq in self.equations:
            prim = eq.eqn.primitive
            if not (prim is constrain_p or prim.name in _AS_THEY_ARE or prim.name in _CONTROL or has_rule(prim)):
                names.add(prim.name)
            names.update(n for body in eq.bodies for n in body.plan.without_rules())
        return sorted(names)


# identities on each operand, whatever its placement (a Partial included): they run on the blocks as they are,
# bound as they are (None) or as the identity (reshard: its params name a global layout, which a block has not;
# jax.grad of a function that closes over a sharded array reshards the seed)
_AS_THEY_ARE: dict[str, Callable | None] = {"optimization_barrier": None, "reshard": lambda *blocks: list(blocks)}

# control flow: name -> walk(eqn, specs, mesh) -> (Choice, local kernel, bodies); see jshard.engine.control
_CONTROL: dict[str, Callable] = {}


def control(name: str) -> Callable[[Callable], Callable]:
    """Register how the walk plans the control-flow primitive ``name`` (its bodies are plans of their own)."""

    def register(walk: Callable) -> Callable:
        _CONTROL[name] = walk
        return walk

    return register


def plan_jaxpr(closed: jc.ClosedJaxpr, specs: list[Spec], mesh: Mesh, pinned: list[Spec | None] | None = None,
               lifted: list[Spec | None] | None = None) -> JaxprPlan:
    """The plan of ``closed`` for inputs with ``specs`` on ``mesh``; ``pinned`` (per output, a spec or None) are
    where the caller moves the outputs afterwards: producers are asked to make them there (an initialiser
    draws each device's shard, never the whole array). ``lifted`` (per const, a spec or None) makes consts
    inputs of the plan, ahead of the others (a sharded array the function closed over), instead of literals."""
    jaxpr, consts = open_jaxpr(closed)
    lifted = lifted or [None] * len(consts)
    env = dict(zip(jaxpr.invars, specs, strict=True))
    env.update((v, s) for v, s in zip(jaxpr.constvars, lifted, strict=True) if s is not None)
    const_vars = [v if s is not None else jc.Literal(c, jax.typeof(c))
                  for v, c, s in zip(jaxpr.constvars, consts, lifted, strict=True)]
    equations: list[EquationPlan] = []
    outs = _walk_closed(jaxpr, const_vars, list(jaxpr.invars), env, equations, mesh)
    pinned = pinned or [None] * len(outs)
    _reseat(equations, outs, env, mesh, pinned)
    _look_ahead(equations, outs, env, mesh, pinned)
    _shrink(equations, outs, env, mesh, pinned)
    for eq in equations:  # every move from the producer's final spec to what its consumer runs with; constants
        # move like values (R -> P(sum) of a literal: the value on one coordinate)
        eq.operands = [op._replace(move=None if s == t else plan_redistribute(s, t.placements))
                       for op, s, t in zip(eq.operands, _operand_specs(eq, env, mesh), eq.choice.ins, strict=True)]
    live = {o for o in outs if not isinstance(o, jc.Literal)}  # drop dead equations (and their collectives)
    kept = []
    for eq in reversed(equations):
        if eq.eqn.effects or any(o in live for o in eq.outs):
            kept.append(eq)
            live.update(op.value for op in eq.operands if not op.literal)
    equations = kept[::-1]
    seen = set()  # a value moved to the same spec for several consumers moves once; a move with no steps (a
    # size-1 mesh axis: S(0) -> R there leaves the block as it is) runs nothing, so there is nothing to reuse
    for eq in equations:
        for i, (op, target) in enumerate(zip(eq.operands, eq.choice.ins, strict=True)):
            if isinstance(op.move, Plan) and op.move.steps and not op.literal:
                if (op.value, target) in seen:
                    eq.operands[i] = op._replace(move=REUSED)
                seen.add((op.value, target))
    out_specs = [replicated(mesh, np.shape(o.val), o.aval.dtype) if isinstance(o, jc.Literal) else env[o]
                 for o in outs]  # a constant output is replicated: every device holds it whole
    inputs = [v for v, s in zip(jaxpr.constvars, lifted, strict=True) if s is not None] + list(jaxpr.invars)
    return JaxprPlan(inputs, equations, outs, out_specs, model_in_force())


def replicated(mesh: Mesh, shape, dtype) -> Spec:
    """The spec of a value every device holds whole (a literal, a constant output)."""
    return _replicated(mesh, tuple(shape), dtype)


@lru_cache(4096)  # a walk asks for one per literal operand, the same few again and again
def _replicated(mesh: Mesh, shape: tuple, dtype) -> Spec:
    return Spec(mesh, (Replicate(),) * len(mesh.axis_names), shape, dtype)


def move_cost(src: list[Spec], dst: list[Spec]) -> float:
    """Estimated µs of moving values with specs ``src`` to ``dst`` (inf where no plan gets there; a None in
    ``dst`` stays where it is)."""
    total = 0.0
    for s, t in zip(src, dst, strict=True):
        if t is not None and s != t:
            try:
                total += plan_redistribute(s, t.placements).cost
            except ValueError:  # no way there (a Partial of another kind): never chosen
                return math.inf
    return total


# ---------------------------------------------------------------------------------------------------
# internals


def _walk(jaxpr: jc.Jaxpr, in_vars: list, env: dict, equations: list, mesh: Mesh, site=None, scope: str = "") -> list:
    """Choose strategies through ``jaxpr`` whose invars are bound to ``in_vars`` (outer values or literals);
    ``site`` is the source info of the call being inlined, ``scope`` the name stacks of the calls around it."""
    alias: dict = dict(zip(jaxpr.invars, in_vars, strict=True))

    def outer(v):
        return v if isinstance(v, jc.Literal) else alias[v]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = inlined_call(eqn)
        if inner is not None:
            inner_jaxpr, consts = open_jaxpr(inner)
            const_vars = [jc.Literal(c, jax.typeof(c)) for c in consts]
            here = eqn.source_info if source_info_util.summarize(eqn.source_info) else site
            outs = _walk_closed(inner_jaxpr, const_vars, [outer(v) for v in eqn.invars], env, equations, mesh, here,
                                f"{scope}/{eqn.source_info.name_stack}")
            for o, r in zip(eqn.outvars, outs, strict=True):
                if not isinstance(o, jc.DropVar):
                    alias[o] = r
            continue
        operands, specs, consts = [], [], []
        for v in map(outer, eqn.invars):
            if isinstance(v, jc.Literal):
                is_key = jax.dtypes.issubdtype(getattr(v.val, "dtype", np.float32), jax.dtypes.extended)
                val = v.val if is_key else np.asarray(v.val, dtype=v.aval.dtype)  # PRNG keys stay keys
                specs.append(replicated(mesh, val.shape, val.dtype))
                consts.append(None if is_key else val)
                operands.append(Operand(True, val))
            else:
                specs.append(env[v])
                consts.append(None)
                operands.append(Operand(False, v))
        kernel, bodies = None, ()
        if eqn.primitive is constrain_p:
            target = constrain_target(specs[0], eqn.params["placements"])
            choice = Choice((target,), (target,), 0.0, None)
        elif name in _AS_THEY_ARE:
            choice, kernel = Choice(tuple(specs), tuple(specs), 0.0, None), _AS_THEY_ARE[name]
        elif name in _CONTROL:
            choice, kernel, bodies = _CONTROL[name](eqn, specs, mesh)
        else:
            if not has_rule(eqn.primitive):  # the warning names the user's line
                rule_for(eqn.primitive, EquationPlan(eqn, [], None, site=site).source)
            choice = select(eqn.primitive, eqn.params, specs, [o.aval for o in eqn.outvars], consts=consts, mesh=mesh)
        equations.append(EquationPlan(eqn, operands, choice, kernel, bodies=bodies, site=site, consts=consts,
                                      scope=f"{scope}/{eqn.source_info.name_stack}"))
        values = []
        for o, s in zip(eqn.outvars, choice.outs, strict=True):
            if isinstance(o, jc.DropVar):
                values.append(None)
            else:
                values.append(Value())
                alias[o] = values[-1]
                env[values[-1]] = s
        equations[-1].outs = values
    return [outer(v) for v in jaxpr.outvars]


def _walk_closed(jaxpr, const_vars, args, env, equations, mesh, site=None, scope=""):
    return _walk(jaxpr.replace(invars=list(jaxpr.constvars) + list(jaxpr.invars), constvars=[]),
                 list(const_vars) + list(args), env, equations, mesh, site, scope)


def _reseat(equations: list[EquationPlan], outs: list, env: dict, mesh: Mesh, pinned: list) -> None:
    """The walk chooses forwards, from the inputs' placements; this pass looks back from the consumers. Where
    every consumer of a value moves it to one spec (a pinned output is a consumer; an unpinned one keeps
    what the walk chose), the producer is asked to produce that spec directly,
    and does so when that needs no collective of its own (its inputs only slice): a dropout mask drawn
    only where the activations are, not drawn whole and sliced. Producers are visited last-first, so a
    re-seated equation's own input slices become demands on the equations before it. A transpose also takes
    over its consumers' all-reduces, and their reduce-scatters where its contraction is long; an elementwise
    equation that would mask a Replicate operand into pending sums takes over both (``_reduces_first``)."""
    uses: dict = {}
    made_by: dict = {}
    for eq in equations:
        for i, op in enumerate(eq.operands):
            if not op.literal:
                uses.setdefault(op.value, []).append((eq, i))
        made_by.update((o, eq) for o in eq.outs if o is not None)
    returned = set()
    for o, pin in zip(outs, pinned, strict=True):
        if isinstance(o, jc.Literal):
            continue
        if pin is None:
            returned.add(o)
        else:
            uses.setdefault(o, []).append((_Pin((pin,)), 0))
    for eq in reversed(equations):
        if eq.kernel is not None or eq.eqn.primitive is constrain_p:
            continue
        want = []
        for o in eq.outs:
            targets = {u.choice.ins[i] for u, i in uses.get(o, ())}
            only = targets.pop() if len(targets) == 1 else None
            want.append(only if o is not None and o not in returned and only is not None and only != env[o] else None)
        if not any(w is not None for w in want):
            continue
        specs = _operand_specs(eq, env, mesh)
        saved = sum(plan_redistribute(env[o], w.placements).cost
                    for o, w in zip(eq.outs, want, strict=True) if w is not None)
        choice = select(eq.eqn.primitive, eq.eqn.params, specs, [o.aval for o in eq.eqn.outvars], consts=eq.consts,
                        mesh=mesh, want=want)
        free = not _communicating(specs, choice.ins) or _reduces_first(eq, specs, choice, made_by)
        if choice.outs != eq.choice.outs and free and choice.cost <= eq.choice.cost + saved + 1e-9:
            eq.choice = choice
            for o, spec in zip(eq.outs, choice.outs, strict=True):
                if o is not None:
                    env[o] = spec


def _look_ahead(equations: list[EquationPlan], outs: list, env: dict, mesh: Mesh, pinned: list) -> None:
    """The walk picks each equation's cheapest strategy for the inputs it has, blind to what its output then costs
    its consumers. Here every equation that moves an input with a collective weighs its next strategies (other
    output specs) by their effect on the whole program: the change ripples forwards, each consumer re-chosen
    greedily for its new inputs, until the specs are those of the current plan again, and it is kept where the
    program's moves (a value moved to one spec for several consumers counted once) cost less in all and send no
    more bytes.
    (Sequence parallelism's backward pass: gathering the gradient instead of the weight keeps the MLP's hidden
    dim sharded, where the greedy choice moved every GELU intermediate with an all-to-all.)"""
    users, pins, fixed = _consumers(equations, outs, pinned)
    for i, eq in enumerate(equations):
        if not _choosable(eq):
            continue
        specs = _operand_specs(eq, env, mesh)
        moving_in = _communicating(specs, eq.choice.ins)
        if not moving_in and not _output_moved(equations, users, pins, env, eq, specs):
            continue
        best = None
        for alt in alternatives(eq.eqn.primitive, eq.eqn.params, specs, [o.aval for o in eq.eqn.outvars],
                                consts=eq.consts, mesh=mesh):
            if alt.outs == eq.choice.outs:
                continue
            trial = _ripple(equations, users, env, mesh, fixed, i, alt)
            if trial is None:
                continue
            (cost, sent), (was, sent_before) = _trial_moves(equations, users, env, mesh, pins, trial)
            # cheaper, and never by trading a few small reductions' latency for more bytes moved (where only an
            # output's move asked, for fewer: a small sum's all-reduce is not traded for gathering what it sums)
            fewer = sent <= sent_before if moving_in else sent < sent_before
            if cost < was - 1e-9 and fewer and (best is None or cost < best[0] - 1e-9):
                best = cost, trial
        if best is not None:
            _apply(equations, env, best[1])


def _shrink(equations: list[EquationPlan], outs: list, env: dict, mesh: Mesh, pinned: list) -> None:
    """The walk and the passes after it price moves only, so a value made whole that one consumer slices while
    another takes it whole stays whole on every device, and so do the values made from it. Here, producers visited
    last-first, such a producer is asked to make what a consumer reads, or the slice its move starts with, where
    that is a smaller block; the change is rippled through the other consumers (a pending reduction completed
    where it is smallest) and kept where the moves it adds cost less than writing the bytes it saves
    (``CostModel.memory_gbps``); where the producer's inputs then take a collective instead, only where the moves
    cost less and send no more bytes.
    (Loss parallelism's backward pass: ``take_along_axis``'s gradient scatter-adds into zeros the logits' shape;
    whole, it and the softmax gradient's terms took four logits-sized blocks a device, sliced to the vocabulary
    shard only at the head's contraction. Made sharded, the row sums over the vocabulary pend and are
    all-reduced at their rows' size. And FSDP's embedding gradient: the updates gathered and scattered into the
    rows a device keeps, where a whole zero table took them and was reduce-scattered.)"""
    users, pins, fixed = _consumers(equations, outs, pinned)
    for i in reversed(range(len(equations))):
        eq = equations[i]
        if not _choosable(eq):
            continue
        for k, o in enumerate(eq.outs):
            if o is None or o in fixed:
                continue
            reads = [t for j in users.get(o, ())
                     for op, t in zip(equations[j].operands, equations[j].choice.ins, strict=True)
                     if not op.literal and op.value is o] + ([pins[o]] if o in pins else [])
            # a consumer's output of the value's shape (scatter-add into zeros writes its operand in place): the
            # value made as that block, where the consumer takes it so at no cost
            made = [s for j in users.get(o, ()) for s in equations[j].choice.outs
                    if s.shape == env[o].shape and s.dtype == env[o].dtype]
            smaller = [t for t in reads + made if t.local_bytes < env[o].local_bytes]
            slices = [t for t in map(partial(_sliced_part, env[o]), reads) if t is not None]
            # in the program's order, never a set's: every process must plan alike
            for t in sorted(dict.fromkeys(slices + smaller), key=lambda t: t.local_bytes):
                specs = _operand_specs(eq, env, mesh)
                want = [t if m == k else None for m in range(len(eq.outs))]
                choice = select(eq.eqn.primitive, eq.eqn.params, specs, [v.aval for v in eq.eqn.outvars],
                                consts=eq.consts, mesh=mesh, want=want)
                if choice.outs[k] != t:
                    continue
                trial = _ripple(equations, users, env, mesh, fixed, i, choice, steer=True)
                if trial is None:
                    continue
                (cost, sent), (was, sent_before) = _trial_moves(equations, users, env, mesh, pins, trial)
                written = sum(new.local_bytes - env[v].local_bytes for v, new in trial[1].items())
                if _new_collectives(specs, eq.choice.ins, choice.ins):  # its inputs move instead of its output
                    kept = written <= 0 and cost < was - 1e-9 and sent <= sent_before
                else:
                    kept = written < 0 and cost - was + model_in_force().local(written) < -1e-9
                if kept:
                    _apply(equations, env, trial)
                    break


def _consumers(equations, outs, pinned) -> tuple[dict, dict, set]:
    """Per value, the indices of the equations that read it; the pinned outputs' pins; the unpinned outputs (what
    an unpinned output shows is fixed: the walk chose it)."""
    users: dict = {}
    for i, eq in enumerate(equations):
        for op in eq.operands:
            if not op.literal:
                users.setdefault(op.value, []).append(i)
    pins = {o: p for o, p in zip(outs, pinned, strict=True) if p is not None and not isinstance(o, jc.Literal)}
    fixed = {o for o in outs if not isinstance(o, jc.Literal) and o not in pins}
    return users, pins, fixed


def _apply(equations, env, trial) -> None:
    choices, specs, _ = trial
    for j, choice in choices.items():
        equations[j].choice = choice
    env.update(specs)


def _trial_moves(equations, users, env, mesh, pins, trial) -> tuple[tuple[float, float], tuple[float, float]]:
    """``(µs, bytes sent)`` of the moves a ripple touches, with the trial and with the current plan."""
    choices, specs, touched = trial
    pinned = [(v, pin) for v, pin in pins.items() if v in specs]
    return (_moves_cost(equations, users, env, touched, choices, specs, mesh, pinned),
            _moves_cost(equations, users, env, touched, {}, {}, mesh, pinned))


def _ripple(equations, users, env, mesh, fixed, start, choice, *, steer=False, limit=256):
    """The plan with equation ``start`` running ``choice``, its consumers re-chosen for their new inputs as far as
    the specs differ: ``(choices, specs, touched)``, or None where it would change what an unpinned output shows
    or reaches too far. ``steer``: a consumer that would leave a reduction pending on a bigger output completes
    it on its inputs where that costs less than completing it later (a broadcast of a row sum)."""
    choices, specs, touched, queue = {start: choice}, {}, {start}, []

    def changed(eq, outs) -> bool:
        for o, new in zip(eq.outs, outs, strict=True):
            if o is not None and new != env[o]:
                if o in fixed:
                    return False
                specs[o] = new
                for j in users.get(o, ()):
                    if j not in touched:
                        touched.add(j)
                        heapq.heappush(queue, j)
        return True

    if not changed(equations[start], choice.outs):
        return None
    while queue:
        j = heapq.heappop(queue)
        if len(touched) > limit:
            return None
        eq = equations[j]
        if not _choosable(eq):  # it keeps its strategy: only its moves change
            continue
        new = [s if op.literal else specs.get(op.value, s)
               for op, s in zip(eq.operands, _operand_specs(eq, env, mesh), strict=True)]
        avals = [o.aval for o in eq.eqn.outvars]
        pick = select(eq.eqn.primitive, eq.eqn.params, new, avals, consts=eq.consts, mesh=mesh)
        if steer and any(p.is_partial for s in pick.outs for p in s.placements):
            want = [env[o] if o is not None and not any(p.is_partial for p in env[o].placements) else _reduced(s)
                    for o, s in zip(eq.outs, pick.outs, strict=True)]
            early = select(eq.eqn.primitive, eq.eqn.params, new, avals, consts=eq.consts, mesh=mesh, want=want)
            later = sum(plan_redistribute(s, _reduced(s).placements).cost for s in pick.outs)
            if early.cost < pick.cost + later - 1e-9:
                pick = early
        choices[j] = pick
        if pick.outs != eq.choice.outs and not changed(eq, pick.outs):
            return None
    return choices, specs, touched


def _moves_cost(equations, users, env, touched, choices, specs, mesh, pinned) -> tuple[float, float]:
    """What the moves into the ``touched`` equations and the ``pinned`` outputs' moves (value, pin) cost with
    ``choices`` and ``specs`` over the current plan, in µs and in bytes a device sends: a value moved to one spec
    for several consumers moves once."""
    moves = []
    seen = set()
    for j in touched:
        eq = equations[j]
        ins = choices.get(j, eq.choice).ins
        for op, s, t in zip(eq.operands, _operand_specs(eq, env, mesh), ins, strict=True):
            if op.literal:
                moves.append((s, t))
                continue
            for k in users[op.value]:  # all its consumers: the moves they share are paid once
                user = equations[k]
                for o, u in zip(user.operands, choices.get(k, user.choice).ins, strict=True):
                    if not o.literal and o.value is op.value:
                        seen.add((op.value, u))
    moves += [(specs.get(v, env[v]), t) for v, t in seen]
    moves += [(specs.get(v, env[v]), pin) for v, pin in pinned]
    try:
        plans = [plan_redistribute(s, t.placements) for s, t in moves if s != t]
    except ValueError:  # no way there (a Partial of another kind)
        return math.inf, math.inf
    return math.fsum(p.cost for p in plans), sum(p.bytes for p in plans)  # exact: every process plans alike


def _sliced_part(src: Spec, dst: Spec) -> Spec | None:
    """The part of moving ``src`` to ``dst`` that is a local slice: ``src`` with ``dst``'s shard on each mesh axis
    where ``src`` is Replicate, where that is a smaller block a device, made without a collective; else None."""
    cut = tuple(d if s.is_replicate and d.is_shard else s for s, d in zip(src.placements, dst.placements, strict=True))
    if cut == src.placements:
        return None
    spec = Spec(src.mesh, cut, src.shape, src.dtype)
    if spec.local_bytes >= src.local_bytes or plan_redistribute(src, cut).collectives:
        return None
    return spec


def _reduced(spec: Spec) -> Spec:
    """``spec`` with its pending reductions completed (Replicate there)."""
    return Spec(spec.mesh, tuple(Replicate() if p.is_partial else p for p in spec.placements), spec.shape, spec.dtype)


def _new_collectives(specs: list[Spec], was: tuple, now: tuple) -> bool:
    """Does running with inputs ``now`` instead of ``was`` move an input with a collective it did not take?"""
    return any(t != w and plan_redistribute(s, t.placements).collectives
               for s, w, t in zip(specs, was, now, strict=True))


def _output_moved(equations, users, pins, env, eq: EquationPlan, specs: list[Spec]) -> bool:
    """Does a consumer (or the output's pin) move one of ``eq``'s outputs, a block larger than any of its inputs',
    with a collective? A strategy that moves nothing in may leave its output where every consumer pays (an
    embedding's gradient scattered whole, as pending sums over the tensor axis, and then reduce-scattered at the size
    of the table); moving the smaller inputs instead is the saving looked for, so an output no larger than an input
    is not (a third of the planning time of a 32-layer GPT went to those)."""
    largest = max((s.local_bytes for s in specs), default=0)
    for o in eq.outs or ():
        if o is None or o not in env or env[o].local_bytes <= largest:
            continue
        targets = [equations[j].choice.ins[k] for j in users.get(o, ())
                   for k, op in enumerate(equations[j].operands) if not op.literal and op.value is o]
        if o in pins:
            targets.append(pins[o])
        if _communicating([env[o]] * len(targets), targets):
            return True
    return False


def _communicating(specs: list[Spec], targets) -> bool:
    """Does moving values with ``specs`` to ``targets`` take a collective?"""
    return any(plan_redistribute(s, t.placements).collectives for s, t in zip(specs, targets, strict=True) if s != t)


def _reduces_first(eq: EquationPlan, specs: list[Spec], choice: Choice, made_by: dict) -> bool:
    """May ``eq`` run as ``choice`` although its inputs then take a collective: a transpose whose inputs are
    only all-reduced, or reduce-scattered where the contraction that made the sums is long enough
    (``CostModel.scatter_first_rows``). ``_reseat`` checks that it costs no more than its consumers' moves (the
    same bytes).

    A reduction of a transpose's input is one of its output, but where it sits matters to XLA: right after the
    contraction that made the pending sums (where GSPMD's partitioner puts it), XLA folds the transpose into the
    consumers, while a transpose between them is folded into the contraction, which XLA:CPU then runs outside
    its fast matmul kernels (13 of the 51 dots of the GPT's DP2 x TP4 training step, its weight gradients). A
    gradient scattered so no longer shares the collective of the gradients scattered at their pins: measured on
    the GPT's FSDP2 x TP4 step at width 512 and 1024 rows a device, the faster dots gain more than the shared
    rendezvous saved (1585 against 1668 ms a step).

    An elementwise equation that keeps a sum pending only by making a Replicate operand Partial (the bias of a
    row-parallel Linear, on one coordinate) also completes the sum first: the pending way runs the equation on
    every device's whole block before the reduction, where completing first runs it on the reduced block (a
    quarter of it after a reduce-scatter over 4) and lets XLA fuse it with the consumers that follow (the
    residual add), as GSPMD's program does."""
    transpose = eq.eqn.primitive.name == "transpose"
    if not transpose and not (_masks_a_replicate(specs, eq.choice.ins) and not _masks_a_replicate(specs, choice.ins)):
        return False
    moves = [plan_redistribute(s, t.placements) for s, t in zip(specs, choice.ins, strict=True) if s != t]
    scatters = [step for m in moves for step in m.steps if step.is_collective and step.emitted != "all_reduce"]
    if any(step.kind != "reduce_scatter" for step in scatters):
        return False
    return (not transpose or not scatters
            or all(_summed_rows(made_by.get(op.value)) >= model_in_force().scatter_first_rows
                   for op in eq.operands if not op.literal))


def _masks_a_replicate(specs: list[Spec], ins: tuple) -> bool:
    """Does running with ``ins`` put an operand that is Replicate on a mesh axis on one coordinate there (as a
    ``P(sum)``)? A Replicate block already is a ``P(avg|max|min)`` one, with nothing masked."""
    return any(p.is_replicate and q.is_partial and q.op == "sum"
               for s, t in zip(specs, ins, strict=True) for p, q in zip(s.placements, t.placements, strict=True))


def _summed_rows(eq: EquationPlan | None) -> int:
    """How many terms each output element of ``eq`` sums on a device: a contraction's local contracted length
    (0 for anything else)."""
    if eq is None or eq.eqn.primitive.name != "dot_general":
        return 0
    (contract, _), _ = eq.eqn.params["dimension_numbers"]
    return math.prod(eq.choice.ins[0].local_block_shape[d] for d in contract)


def _choosable(eq: EquationPlan) -> bool:
    """May the planner change this equation's strategy (a rule's; not control flow, a pin or an identity)?"""
    return eq.kernel is None and not eq.bodies and eq.eqn.primitive is not constrain_p and has_rule(eq.eqn.primitive)


class _Pin(NamedTuple):
    """A pinned output, seen by ``_reseat`` as one more consumer: it runs with ``ins[0]``."""

    ins: tuple

    @property
    def choice(self):
        return self


def _operand_specs(eq: EquationPlan, env: dict, mesh: Mesh) -> list[Spec]:
    """The specs an equation's operands come with (a literal is replicated)."""
    return [replicated(mesh, op.value.shape, op.value.dtype) if op.literal else env[op.value] for op in eq.operands]
