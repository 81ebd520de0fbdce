"""``jshard.jit``: plain JAX at global shapes in, one distributed ``shard_map`` program out.

The function is traced to a jaxpr at global shapes; every equation gets its strategy from
``jshard.propagate.select`` (calls such as ``jit``, ``custom_jvp_call`` or ``remat`` are followed inline);
the plan is lowered to one per-device function — the redistributions of ``jshard.planner`` as explicit
collectives, then each equation's local form from ``jshard.lowering.local_equation`` — and compiled once
per input specs as ``jax.jit(jax.shard_map(...))`` over block storage.

>>> import jax, jax.numpy as jnp, numpy as np, jshard
>>> from jshard import Shard, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> x = jshard.distribute(np.ones((8, 16), np.float32), mesh, [Shard(0), Replicate()])
>>> w = jshard.distribute(np.ones((16, 4), np.float32), mesh, [Replicate(), Shard(0)])
>>> y = jshard.jit(lambda x, w: jnp.tanh(x @ w))(x, w)   # P(sum) over tp, reduce-scattered before tanh
>>> y.placements, bool(np.allclose(y.full(), np.tanh(16.0)))
((S(0), S(0)), True)

``scan`` / ``while`` / ``cond`` bodies are walked as programs of their own (loop carries settle on placements both
the initial value and the body reach) and run as local loops and switches. ``apply`` (and the DArray operators) run single calls eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jc
from jax.sharding import Mesh, PartitionSpec

from .darray import DArray, distribute
from .lowering import local_equation, local_program
from .placements import Placement, Replicate
from .planner import Plan, plan_redistribute
from .propagate import Choice, select
from .spec import Spec

__all__ = ["Explanation", "apply", "constrain", "explain", "jit", "same_as"]

# calls whose body runs as it is: followed inline (autodiff already happened when the jaxpr was traced)
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


@dataclass(frozen=True)
class same_as:  # noqa: N801 - reads as a function in out_placements
    """In ``out_placements``: this output subtree takes the placements of argument ``argnum``, leaf by leaf
    (a training step returning parameters and optimizer state as they came in)."""

    argnum: int


def jit(fn: Callable, *, out_placements: Any = None) -> Callable:
    """Compile ``fn`` (global-shape JAX code) for DArray arguments; plain arrays and scalars are Replicate.

    Returns DArrays. ``out_placements`` pins outputs: a pytree prefix of the outputs whose leaves are a
    placement tuple, ``same_as(argnum)`` or None (free). Compiled programs are cached by the arguments'
    specs and tree structure; ``.lower(*args)`` gives the lowered program (for its HLO).
    """
    cache: dict = {}

    def prepare(args):
        leaves, treedef = jax.tree.flatten(args, is_leaf=lambda a: isinstance(a, DArray))
        mesh = next((a.mesh for a in leaves if isinstance(a, DArray)), None)
        if mesh is None:
            raise ValueError("jshard.jit: no DArray among the arguments, so there is no mesh to run on; "
                             "distribute one input with jshard.distribute(x, mesh, placements)")
        darrays = [a if isinstance(a, DArray) else distribute(np.asarray(a), mesh, (Replicate(),) * mesh.devices.ndim)
                   for a in leaves]
        key = (treedef, tuple(d.spec for d in darrays))
        program = cache.get(key)
        if program is None:
            program = cache[key] = _compile(fn, treedef, [d.spec for d in darrays], mesh, out_placements, args)
        return program, darrays

    def run(*args):
        program, darrays = prepare(args)
        return program(darrays)

    def lower(*args):
        program, darrays = prepare(args)
        return program.jitted.lower(*[d.block for d in darrays])

    run.lower = lower
    return run


_APPLIED: dict = {}


def apply(f: Callable, *args, **static) -> Any:
    """Run ``f`` (any JAX function at global shapes) on DArrays eagerly, through a cached single-call program;
    ``static`` keyword arguments (axes, dtypes, indices) are fixed at trace time. DArray operators use it.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard
    >>> x = jshard.distribute(np.arange(8.0).reshape(4, 2), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.apply(jnp.sum, x, axis=0).full().tolist()
    [12.0, 16.0]
    """
    key = (f, repr(sorted(static.items())))
    program = _APPLIED.get(key)
    if program is None:
        program = _APPLIED[key] = jit(functools.partial(f, **static) if static else f)
    return program(*args)


@dataclass
class Explanation:
    """What ``jshard.jit`` does with a function: one row per equation (primitive, the user's source line,
    the specs its inputs run with, its output specs, the redistributions of its inputs as
    ``(input, kind, mesh axes, bytes per device)``), the output pins, and totals per collective kind
    (``{kind: (count, bytes)}``). ``str()`` prints it as a table."""

    rows: list[dict]
    totals: dict

    def __str__(self) -> str:
        lines = []
        for r in self.rows:
            lines.append(f"{r['primitive']:<22} {r['source']:<34} -> {', '.join(map(str, r['outs']))}")
            for i, kind, axes, nbytes in r["moves"]:
                lines.append(f"    in{i}: {kind} over {','.join(axes)}  {nbytes:,} B")
        lines.append("totals: " + (", ".join(f"{k} x{c} ({b:,} B)" for k, (c, b) in sorted(self.totals.items()))
                                   or "no collectives"))
        return "\n".join(lines)


def explain(fn: Callable, *args, out_placements: Any = None) -> Explanation:
    """The plan ``jshard.jit(fn, out_placements=...)`` would run on ``args``, as data (nothing compiles).

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard, Replicate
    >>> x = jshard.distribute(np.ones((8, 4), np.float32), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.explain(lambda x: jnp.exp(x.sum(0)), x).totals
    {'all_reduce': (1, 16)}
    """
    leaves, treedef = jax.tree.flatten(args, is_leaf=lambda a: isinstance(a, DArray))
    mesh = next(a.mesh for a in leaves if isinstance(a, DArray))
    specs = [a.spec if isinstance(a, DArray) else
             Spec.create(mesh, (Replicate(),) * mesh.devices.ndim, np.shape(a), np.asarray(a).dtype) for a in leaves]
    t = _trace(fn, treedef, specs, mesh, out_placements, args)
    from jax.extend.source_info_util import summarize

    rows, totals = [], {}

    def moves_of(i, plan):
        out = []
        for step in plan.collectives if isinstance(plan, Plan) else ():  # a reused move costs nothing
            out.append((i, step.kind, tuple(step.axes), int(step.bytes)))
            c, b = totals.get(step.kind, (0, 0))
            totals[step.kind] = (c + step.count, b + int(step.bytes))
        return out

    for st in t.steps:
        moves = [m for i, (_, _, plan) in enumerate(st.ins) for m in moves_of(i, plan)]
        rows.append(dict(primitive=st.eqn.primitive.name, source=summarize(st.eqn.source_info),
                         ins=list(st.choice.ins), outs=list(st.choice.outs), moves=moves))
    for j, plan in enumerate(t.final_plans):
        if plan is not None and plan.collectives:
            rows.append(dict(primitive="(output pin)", source=f"output {j}", ins=[plan.src], outs=[plan.dst],
                             moves=moves_of(0, plan)))
    return Explanation(rows, totals)


def _is_pin(p) -> bool:
    return p is None or isinstance(p, same_as) or (isinstance(p, (tuple, list)) and all(isinstance(q, Placement) for q in p))


def _pins(out_placements, out_tree, n_out: int, args) -> list:
    """Per output leaf: the placements it is pinned to, or None."""
    pins: list = [None] * n_out
    if out_placements is None:
        return pins
    positions = jax.tree.unflatten(out_tree, list(range(n_out)))

    def assign(pin, sub):
        idx = jax.tree.leaves(sub)
        if isinstance(pin, same_as):
            src = [a.placements for a in jax.tree.leaves(args[pin.argnum], is_leaf=lambda a: isinstance(a, DArray))
                   if isinstance(a, DArray)]
            if len(src) != len(idx):
                raise ValueError(f"jshard.jit: out_placements same_as({pin.argnum}) pins {len(idx)} outputs, but "
                                 f"argument {pin.argnum} has {len(src)} DArrays")
            for i, p in zip(idx, src):
                pins[i] = p
        elif pin is not None:
            for i in idx:
                pins[i] = tuple(pin)

    jax.tree.map(assign, out_placements, positions, is_leaf=_is_pin)
    return pins


def constrain(x, placements) -> Any:
    """Inside a ``jshard.jit`` function: ``x`` with ``placements`` from here on (the engine redistributes it
    there, like ``with_sharding_constraint``); the identity anywhere else, gradients included.

    >>> import jax, numpy as np, jshard
    >>> from jshard import Shard, Replicate
    >>> x = jshard.distribute(np.arange(8.0), jax.make_mesh((8,), ("x",)), [Replicate()])
    >>> jshard.jit(lambda x: jshard.constrain(x * 2, [Shard(0)]) + 1)(x).placements
    (S(0),)
    """
    return _constrain_p.bind(x, placements=tuple(placements))


def _constrain_prim():
    from jax.interpreters import ad, batching, mlir

    p = jc.Primitive("jshard_constrain")
    p.def_impl(lambda x, placements: x)
    p.def_abstract_eval(lambda x, placements: x)
    ad.deflinear2(p, lambda ct, x, placements: [ct])  # the gradient is not pinned: it finds its own placement
    batching.defvectorized(p)
    mlir.register_lowering(p, lambda ctx, x, placements: [x])
    return p


_constrain_p = _constrain_prim()


# ---------------------------------------------------------------------------------------------------
# tracing and propagation


_REUSE = "reuse"  # the input was already moved to this spec for an earlier consumer


@dataclass
class _Step:
    eqn: jc.JaxprEqn
    ins: list  # per input: ("var", var, plan | None) or ("lit", value)
    choice: Choice
    kernel: Callable | None = None  # control flow: the loop / switch over local bodies
    outs: list | None = None  # a fresh key per output (None: dropped); keys, not Vars, name values


class _Key:
    """A value of the walked program. Inlined jaxprs are walked once per call site and share their Var
    objects (a cached inner jaxpr), so values are named by fresh keys, never by Vars."""

    __slots__ = ()


def _walk(jaxpr: jc.Jaxpr, in_vars: list, env: dict, steps: list, mesh: Mesh) -> list:
    """Propagate specs through ``jaxpr`` whose invars are bound to ``in_vars`` (outer vars or literals)."""
    alias: dict = dict(zip(jaxpr.invars, in_vars))

    def outer(v):
        if isinstance(v, jc.Literal):
            return v
        return alias[v]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        sub = _CALLS.get(name)
        if sub is not None and sub in eqn.params:
            inner = eqn.params[sub]
            inner_jaxpr = inner.jaxpr if isinstance(inner, jc.ClosedJaxpr) else inner
            consts = list(inner.consts) if isinstance(inner, jc.ClosedJaxpr) else []
            const_vars = [jc.Literal(c, jax.typeof(c)) for c in consts]
            outs = _walk_closed(inner_jaxpr, const_vars, [outer(v) for v in eqn.invars], env, steps, mesh)
            for o, r in zip(eqn.outvars, outs):
                if not isinstance(o, jc.DropVar):
                    alias[o] = r
            continue
        ins, specs, consts = [], [], []
        for v in map(outer, eqn.invars):
            if isinstance(v, jc.Literal):
                key = jax.dtypes.issubdtype(getattr(v.val, "dtype", np.float32), jax.dtypes.extended)
                val = v.val if key else np.asarray(v.val, dtype=v.aval.dtype)  # PRNG keys stay keys
                specs.append(Spec(mesh, (Replicate(),) * mesh.devices.ndim, tuple(val.shape), val.dtype))
                consts.append(None if key else val)
                ins.append(("lit", val))
            else:
                specs.append(env[v])
                consts.append(None)
                ins.append(("var", v))
        kernel = None
        if eqn.primitive is _constrain_p:
            target = specs[0].with_placements(eqn.params["placements"], where="jshard.constrain")
            choice = Choice((target,), (target,), 0.0, None)
        elif name in _CONTROL:
            choice, kernel = _CONTROL[name](eqn, specs, mesh)
        else:
            choice = select(eqn.primitive, eqn.params, specs, [o.aval for o in eqn.outvars], consts=consts, mesh=mesh)
        # constants move like values (R -> P(sum) of a literal: the value on one coordinate)
        ins = [(kind, x, None if s == t else plan_redistribute(s, t.placements))
               for (kind, x), s, t in zip(ins, specs, choice.ins)]
        steps.append(_Step(eqn, ins, choice, kernel))
        keys = []
        for o, s in zip(eqn.outvars, choice.outs):
            if isinstance(o, jc.DropVar):
                keys.append(None)
            else:
                keys.append(_Key())
                alias[o] = keys[-1]
                env[keys[-1]] = s
        steps[-1].outs = keys
    return [outer(v) for v in jaxpr.outvars]


def _walk_closed(jaxpr, const_vars, args, env, steps, mesh):
    return _walk(jaxpr.replace(invars=list(jaxpr.constvars) + list(jaxpr.invars), constvars=[]),
                 list(const_vars) + list(args), env, steps, mesh)


@dataclass
class _Traced:
    closed: jc.ClosedJaxpr
    out_tree: Any
    steps: list
    outs: list
    out_specs: list
    final_plans: list
    program: _Program


@dataclass
class _Program:
    """A walked jaxpr: its input vars, the steps that stay live, its outputs and their specs."""

    in_vars: list
    steps: list
    outs: list
    out_specs: list


def _program(closed: jc.ClosedJaxpr, specs: list[Spec], mesh: Mesh) -> _Program:
    env = dict(zip(closed.jaxpr.invars, specs))
    const_vars = [jc.Literal(c, jax.typeof(c)) for c in closed.consts]
    steps: list[_Step] = []
    outs = _walk_closed(closed.jaxpr, const_vars, list(closed.jaxpr.invars), env, steps, mesh)
    live = {o for o in outs if not isinstance(o, jc.Literal)}  # drop dead equations (and their collectives)
    kept = []
    for st in reversed(steps):
        if st.eqn.effects or any(o in live for o in st.outs):
            kept.append(st)
            live.update(x for kind, x, _ in st.ins if kind == "var")
    steps = kept[::-1]
    seen = set()  # a value moved to the same spec for several consumers moves once
    for st in steps:
        for i, ((kind, x, plan), target) in enumerate(zip(st.ins, st.choice.ins)):
            if isinstance(plan, Plan) and kind == "var":
                if (x, target) in seen:
                    st.ins[i] = (kind, x, _REUSE)
                seen.add((x, target))
    out_specs = []
    for o in outs:  # a constant output is replicated: every device holds it whole
        out_specs.append(Spec(mesh, (Replicate(),) * mesh.devices.ndim, tuple(np.shape(o.val)), o.aval.dtype)
                         if isinstance(o, jc.Literal) else env[o])
    return _Program(list(closed.jaxpr.invars), steps, outs, out_specs)


def _local(prog: _Program, pins: list | None = None) -> Callable:
    """The per-device function of ``prog``: local blocks of its inputs in, of its outputs out (moved to the
    specs in ``pins`` where given)."""
    pins = pins or [None] * len(prog.outs)
    finals = [local_program(plan_redistribute(s, p.placements)) if p is not None and p != s else None
              for s, p in zip(prog.out_specs, pins)]
    kernels = [st.kernel or ((lambda x: [x]) if st.eqn.primitive is _constrain_p else
                             local_equation(st.eqn.primitive, st.eqn.params, st.choice.ins, st.choice.outs))
               for st in prog.steps]
    moves = [[local_program(p) if isinstance(p, Plan) and p.steps else None for (_, _, p) in st.ins]
             for st in prog.steps]

    def run(*blocks):
        vals = dict(zip(prog.in_vars, blocks))
        moved = {}
        for st, kernel, move in zip(prog.steps, kernels, moves):
            args = []
            for (kind, x, plan), m, target in zip(st.ins, move, st.choice.ins):
                if plan is _REUSE:
                    args.append(moved[(x, target)])
                    continue
                a = jnp.asarray(x) if kind == "lit" else vals[x]
                if m is not None:
                    a = m(a)
                    if kind == "var":
                        moved[(x, target)] = a
                args.append(a)
            for o, r in zip(st.outs, kernel(*args)):
                if o is not None:
                    vals[o] = r
        outs = [jnp.asarray(o.val, o.aval.dtype) if isinstance(o, jc.Literal) else vals[o] for o in prog.outs]
        return [m(v) if m is not None else v for v, m in zip(outs, finals)]

    return run


def _trace(fn: Callable, treedef, specs: list[Spec], mesh: Mesh, out_placements, args) -> _Traced:
    avals = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in specs]
    closed = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(treedef, leaves)), return_shape=True)
    closed, out_shape = closed(*avals)
    out_tree = jax.tree.structure(out_shape)
    prog = _program(closed, specs, mesh)
    steps, outs, out_specs = prog.steps, prog.outs, list(prog.out_specs)
    final_plans = []
    for i, pin in enumerate(_pins(out_placements, out_tree, len(outs), args)):
        plan = plan_redistribute(out_specs[i], pin) if pin is not None else None
        final_plans.append(plan)
        out_specs[i] = plan.dst if plan is not None else out_specs[i]
    return _Traced(closed, out_tree, steps, outs, out_specs, final_plans, prog)


def _compile(fn: Callable, treedef, specs: list[Spec], mesh: Mesh, out_placements, args) -> Callable:
    t = _trace(fn, treedef, specs, mesh, out_placements, args)
    outs, out_specs, out_tree = t.outs, t.out_specs, t.out_tree
    run = _local(t.program, [p.dst if p is not None else None for p in t.final_plans])
    k = mesh.devices.ndim

    def body(*blocks):
        results = run(*[b.reshape(b.shape[k:]) for b in blocks])
        return [r.reshape((1,) * k + r.shape) for r in results]

    block = PartitionSpec(*mesh.axis_names)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(block,) * len(specs),
                                    out_specs=[block] * len(outs), check_vma=False))

    def call(darrays: list[DArray]) -> Any:
        blocks = program(*[d.block for d in darrays])
        return jax.tree.unflatten(out_tree, [DArray(b, s) for b, s in zip(blocks, out_specs)])

    call.jitted = program
    return call


# ---------------------------------------------------------------------------------------------------
# control flow: bodies are walked as programs of their own and run as local loops / switches


def _unshard_dim0(spec: Spec) -> Spec:
    """``spec`` with its leading dim whole (a loop slices it per iteration)."""
    return spec.with_placements([Replicate() if p.is_shard and p.dim == 0 else p for p in spec.placements])


def _shift(spec: Spec, shape, delta: int) -> Spec:
    """The spec of one slice (``delta=-1``) or of a stack (``+1``) of arrays laid out like ``spec``."""
    moved = [type(p)(p.dim + delta, *([p.split_factor] if p.split_factor != 1 else [])) if p.is_shard else p
             for p in spec.placements]
    return Spec.create(spec.mesh, moved, shape, spec.dtype)


def _carry_fixpoint(make, init: list[Spec], rounds: int = 3):
    """Carry specs both the initial value and the body reach: start from the initial specs and follow what the
    body returns; if that does not settle, keep the initial specs (the body's outputs move back to them)."""
    carry = list(init)
    for _ in range(rounds):
        prog, out = make(carry)
        if out == carry:
            return carry, prog
        carry = out
    return list(init), make(list(init))[0]


def _scan(eqn, specs, mesh):
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    body: jc.ClosedJaxpr = p["jaxpr"]
    consts, init, xs = specs[:nc], specs[nc:nc + nk], [_unshard_dim0(s) for s in specs[nc + nk:]]
    x_iter = [_shift(s, s.shape[1:], -1) for s in xs]

    def make(carry):
        prog = _program(body, consts + carry + x_iter, mesh)
        return prog, prog.out_specs[:nk]

    carry, prog = _carry_fixpoint(make, init)
    ys = [_shift(s, (p["length"],) + s.shape, +1) for s in prog.out_specs[nk:]]
    fn = _local(prog, carry + [None] * len(ys))

    def kernel(*blocks):
        c, k0, x = blocks[:nc], blocks[nc:nc + nk], blocks[nc + nk:]
        step = lambda k, xi: (lambda o: (o[:nk], o[nk:]))(fn(*c, *k, *xi))
        k1, y = jax.lax.scan(step, list(k0), list(x), length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return list(k1) + list(y)

    return Choice(tuple(consts + carry + xs), tuple(carry + ys), 0.0, None), kernel


def _while(eqn, specs, mesh):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = specs[:cn], specs[cn:cn + bn], specs[cn + bn:]

    def make(carry):
        prog = _program(p["body_jaxpr"], bconsts + carry, mesh)
        return prog, prog.out_specs

    carry, body = _carry_fixpoint(make, init)
    cond = _program(p["cond_jaxpr"], cconsts + carry, mesh)
    replicated = [s.with_placements((Replicate(),) * mesh.devices.ndim) for s in cond.out_specs]
    body_fn, cond_fn = _local(body, carry), _local(cond, replicated)  # every device takes the same branch

    def kernel(*blocks):
        cc, bc, k0 = blocks[:cn], blocks[cn:cn + bn], blocks[cn + bn:]
        return list(jax.lax.while_loop(lambda k: cond_fn(*cc, *k)[0], lambda k: body_fn(*bc, *k), list(k0)))

    return Choice(tuple(cconsts + bconsts + carry), tuple(carry), 0.0, None), kernel


def _cond(eqn, specs, mesh):
    branches = eqn.params["branches"]
    index = specs[0].with_placements((Replicate(),) * mesh.devices.ndim)  # every device takes the same branch
    ops = specs[1:]
    progs = [_program(b, ops, mesh) for b in branches]
    outs = progs[0].out_specs  # the other branches' outputs move to the first one's
    fns = [_local(pr, outs) for pr in progs]

    def kernel(i, *blocks):
        return list(jax.lax.switch(i, [lambda *a, f=f: f(*a) for f in fns], *blocks))

    return Choice((index, *ops), tuple(outs), 0.0, None), kernel


_CONTROL = {"scan": _scan, "while": _while, "cond": _cond}
