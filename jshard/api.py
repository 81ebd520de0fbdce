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

import collections
import functools
import inspect
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jc
from jax.extend import source_info_util
from jax.extend.source_info_util import summarize
from jax.sharding import Mesh, PartitionSpec

from .caches import Cache
from .darray import DArray, DeletedArrayError, distribute, donation_of, donation_slot
from .lowering import local_equation, local_program
from .placements import Placement, Replicate, format_placements
from .planner import Plan, plan_redistribute
from .propagate import Choice, select
from .rules.registry import has_rule, rule_for
from .spec import Spec, _dtype_short, format_mesh

__all__ = ["Explanation", "Jitted", "apply", "constrain", "explain", "jit", "same_as"]

# calls whose body runs as it is: followed inline (autodiff already happened when the jaxpr was traced)
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


@dataclass(frozen=True)
class same_as:  # noqa: N801 - reads as a function in out_placements
    """In ``out_placements``: this output subtree takes the placements of argument ``argnum``, leaf by leaf
    (a training step returning parameters and optimizer state as they came in)."""

    argnum: int

    def __post_init__(self):
        if not isinstance(self.argnum, int) or isinstance(self.argnum, bool):
            raise TypeError(f"jshard.same_as: argnum must be the int position of an argument, got {self.argnum!r}")


def jit(fn: Callable, *, out_placements: Any = None, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = ()) -> Jitted:
    """Compile ``fn`` (global-shape JAX code) for DArray arguments; plain arrays and scalars are Replicate.

    Returns DArrays. ``out_placements`` pins outputs: a pytree prefix of the outputs whose leaves are a
    placement tuple, ``same_as(argnum)`` or None (free). ``static_argnums`` are fixed at trace time (hashable
    Python values: sizes, flags, modes), ``donate_argnums`` hand their arguments' storage to the outputs (the
    donated DArrays are deleted; using one again raises ``DeletedArrayError`` naming the call it went to).
    Negative argnums count from the end, as in ``jax.jit``. Typed PRNG key arrays (``jax.random.key``) are
    arguments like any other. Compiled programs are cached by the arguments' specs, tree structure and
    static values: a repeated call does no tracing. ``.lower(*args)`` gives the lowered program (for its HLO),
    ``.explain(*args)`` the plan.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard
    >>> x = jshard.distribute(np.arange(8.0), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> power = jshard.jit(lambda x, n: x ** n, static_argnums=1)
    >>> power(x, 2).full().tolist()[:4], power(x, 3).placements
    ([0.0, 1.0, 4.0, 9.0], (S(0),))
    """
    if not callable(fn):
        raise TypeError(f"jshard.jit: fn must be callable, got {type(fn).__name__} {fn!r:.60}")
    if not (out_placements is None or isinstance(out_placements, (tuple, list, dict, same_as))):
        raise TypeError(f"jshard.jit: out_placements must be a pytree prefix of the outputs with placement tuples, "
                        f"same_as(argnum) or None as leaves, got {type(out_placements).__name__} {out_placements!r}")
    return Jitted(fn, out_placements, _argnums(static_argnums, "static_argnums", fn),
                  _argnums(donate_argnums, "donate_argnums", fn))


class Jitted:
    """What ``jshard.jit`` returns: call it like the function; ``.lower`` and ``.explain`` take the same
    arguments."""

    def __init__(self, fn: Callable, out_placements: Any, static: tuple[int, ...], donate: tuple[int, ...]):
        if set(static) & set(donate):
            raise ValueError(f"jshard.jit: argument(s) {sorted(set(static) & set(donate))} are both in static_argnums "
                             f"{static} and donate_argnums {donate}; a static value has no storage to donate")
        self.fn, self.out_placements, self.static, self.donate = fn, out_placements, static, donate
        self._static_names = _parameter_names(fn, static)
        # programs by full key; the steady-state paths by DArray specs and by tree structure (see __call__)
        self._cache, self._by_tree, self._by_specs = Cache(256), Cache(256), Cache(256)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs) -> Any:
        # steady-state paths (Python work here is paid on every step): DArray arguments only, recognised by
        # their specs (flat positional calls) or by the tree structure, which carries each DArray's spec
        if not self.static:
            if not kwargs:
                program = self._by_specs.get(tuple([getattr(a, "spec", None) for a in args]))
                if program is not None:
                    return program.run_blocks([a.block for a in args])
            blocks, tree = jax.tree.flatten((args, kwargs))
            program = self._by_tree.get(tree)
            if program is not None:
                return program.run_blocks(blocks)
        program, darrays = self._prepare(args, kwargs)
        if not self.static and all(isinstance(a, DArray) for a in jax.tree.leaves((args, kwargs), is_leaf=_is_darray)):
            self._by_tree.put(jax.tree.structure((args, kwargs)), program)
            if not kwargs and all(type(a) is DArray for a in args):
                self._by_specs.put(tuple(a.spec for a in args), program)
        return program(darrays)

    def lower(self, *args, **kwargs) -> Any:
        """The lowered ``jax.jit`` program for these arguments (``.as_text()``, ``.compile()``)."""
        program, darrays = self._prepare(args, kwargs)
        return program.jitted.lower(*[d.block for d in darrays])

    def explain(self, *args, **kwargs) -> Explanation:
        """The plan these arguments would run with, as data (see ``jshard.explain``)."""
        dyn, statics = self._split(args, kwargs)
        leaves, treedef = jax.tree.flatten((dyn, kwargs), is_leaf=_is_darray)
        mesh = _mesh_of(leaves, self._name)
        values, keys = self._values(leaves, treedef, statics)
        specs = [v.spec if isinstance(v, DArray) else _replicated(mesh, v.shape, v.dtype) for v in values]
        return _explanation(_trace(self._traced_fn(args, treedef, keys), treedef, specs, mesh, self.out_placements,
                                   args, list(map(_is_weak, leaves)), self._name))

    @property
    def _name(self) -> str:
        return _fn_name(self.fn)

    def _split(self, args, kwargs):
        """(dynamic positional arguments, ((position, static value), ...)) of a call."""
        if not self.static:
            return args, ()
        passed = self._static_names & kwargs.keys()
        if passed:
            raise TypeError(f"jshard.jit: {self._name} takes {sorted(passed)} as static (static_argnums={self.static}) "
                            "but they were passed as keywords; pass static arguments positionally")
        static = _resolve(self.static, len(args), "static_argnums", self._name)
        return tuple(a for i, a in enumerate(args) if i not in static), tuple((i, args[i]) for i in sorted(static))

    def _flat_fn(self, args):
        """``fn`` of (dynamic args, kwargs), with the static values of this call put back in place."""
        _, statics = self._split(args, {})

        def flat(dyn, kwargs):
            full, it = [], iter(dyn)
            fixed = dict(statics)
            for i in range(len(dyn) + len(statics)):
                full.append(fixed[i] if i in fixed else next(it))
            return self.fn(*full, **kwargs)

        return flat

    def _where(self, leaf: int, treedef, statics=()) -> str:
        """The user's name for flat leaf ``leaf`` of a call: ``argument 1['w']`` or ``keyword 'b'``."""
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, range(treedef.num_leaves)))[0]]
        path = paths[leaf]
        kind, pos = path[0].idx, path[1]
        rest = jax.tree_util.keystr(tuple(path[2:]))
        if kind == 1:
            return f"keyword {pos.key!r}{rest} of {self._name}"
        static = sorted(i for i, _ in statics)
        argnum = [i for i in range(pos.idx + len(static) + 1) if i not in static][pos.idx]
        return f"argument {argnum}{rest} of {self._name}"

    def _values(self, leaves: list, treedef, statics) -> tuple[list, dict]:
        """Per flat leaf: the DArray, or the host value a plain leaf is distributed (replicated) from; and
        ``{position: PRNG implementation}`` of typed keys, which travel as their key data."""
        keys = {i: jax.random.key_impl(a) for i, a in enumerate(leaves) if _is_key(a)}
        return [a if isinstance(a, DArray) else jax.random.key_data(a) if i in keys else
                np.asarray(a, _dtype_of(a, self._where(i, treedef, statics))) for i, a in enumerate(leaves)], keys

    def _traced_fn(self, args, treedef, keys: dict) -> Callable:
        """The function traced for a call: (dynamic args, kwargs) in, typed keys wrapped again from key data."""
        fn = self._flat_fn(args)
        if not keys:
            return fn

        def call(*tree):
            leaves = [jax.random.wrap_key_data(a, impl=keys[i]) if i in keys else a
                      for i, a in enumerate(jax.tree.leaves(tree))]
            return fn(*jax.tree.unflatten(treedef, leaves))

        return call

    def _prepare(self, args, kwargs):
        dyn, statics = self._split(args, kwargs)
        leaves, treedef = jax.tree.flatten((dyn, kwargs), is_leaf=_is_darray)
        specs = tuple(a.spec if isinstance(a, DArray) else None for a in leaves)
        key = (treedef, specs, statics) if None not in specs else None
        try:
            program = self._cache.get(key)
        except TypeError:
            bad = [i for i, v in statics if not _hashable(v)]
            raise TypeError(f"jshard.jit: static argument(s) {bad} of {self._name} are not hashable "
                            f"({', '.join(type(dict(statics)[i]).__name__ for i in bad)}); static_argnums values must "
                            "be hashable (tuples, not lists or arrays)") from None
        if program is not None:
            return program, leaves
        mesh = _mesh_of(leaves, self._name)
        values, keys = self._values(leaves, treedef, statics)
        darrays = [v if isinstance(v, DArray) else distribute(v, mesh, (Replicate(),) * mesh.devices.ndim)
                   for v in values]
        weak = tuple(map(_is_weak, leaves))
        key = (treedef, tuple(d.spec for d in darrays), statics, tuple(keys.items())) + ((weak,) if any(weak) else ())
        program = self._cache.get(key)
        if program is None:
            program = _compile(self._traced_fn(args, treedef, keys), treedef, [d.spec for d in darrays], mesh,
                               self.out_placements, args, self._donated(args), weak, name=self._name,
                               where=functools.partial(self._where, treedef=treedef, statics=statics))
            self._cache.put(key, program)
        return program, darrays

    def _donated(self, args) -> tuple[int, ...]:
        """Positions among the flat leaves of the donated arguments' leaves (positional ones come first)."""
        if not self.donate:
            return ()
        static = _resolve(self.static, len(args), "static_argnums", self._name)
        donate = _resolve(self.donate, len(args), "donate_argnums", self._name)
        out, pos = [], 0
        for i in (i for i in range(len(args)) if i not in static):
            n = len(jax.tree.leaves(args[i], is_leaf=_is_darray))
            if i in donate:
                out.extend(range(pos, pos + n))
            pos += n
        return tuple(out)


def _is_darray(a) -> bool:
    return isinstance(a, DArray)


def _is_weak(a) -> bool:
    """Python numbers are weakly typed in JAX: ``x * 2.0`` keeps ``x``'s dtype."""
    return type(a) in (int, float, complex)


def _is_key(a) -> bool:
    """A plain typed PRNG key array (``jax.random.key``), which travels as its key data (a DArray of keys, returned
    by an earlier call, is an argument like any other DArray)."""
    dtype = getattr(a, "dtype", None)
    return not isinstance(a, DArray) and dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _hashable(v) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


_TRACED = ("jshard.jit: {what}: a DArray reached a JAX transformation (jax.jit, lax.scan, jax.grad, ...) or "
           "was closed over by a jshard.jit function. DArrays run through jshard.jit as arguments: wrap the whole "
           "computation in jshard.jit and pass every DArray it uses as an argument")


def _dtype_of(a, where: str):
    """The dtype JAX gives a plain argument (Python floats are float32 unless x64 is on)."""
    if isinstance(a, jax.core.Tracer):
        raise TypeError(_TRACED.format(what=f"{where} is a JAX tracer"))
    if not isinstance(a, (np.ndarray, np.generic, jax.Array, bool, int, float, complex)):
        raise TypeError(f"jshard.jit: {where} is a {type(a).__name__} ({a!r:.40}), not an array; pass arrays, "
                        "DArrays or numbers, or mark it static with static_argnums")
    return jax.dtypes.canonicalize_dtype(jnp.result_type(a))


def _mesh_of(leaves, name: str) -> Mesh:
    meshes = list(dict.fromkeys(a.mesh for a in leaves if isinstance(a, DArray)))
    if not meshes:
        raise ValueError(f"jshard.jit: no DArray among the arguments of {name}, so there is no mesh to run on; "
                         "distribute one input with jshard.distribute(x, mesh, placements)")
    if len(meshes) > 1:
        raise ValueError(f"jshard.jit: the DArray arguments of {name} live on different meshes, "
                         f"{_mesh_desc(meshes[0])} and {_mesh_desc(meshes[1])}; one program runs on one mesh: "
                         "redistribute onto one (jshard.distribute(x.full(), mesh, placements))")
    return meshes[0]


def _mesh_desc(mesh: Mesh) -> str:
    return f"{format_mesh(mesh)} of devices {[d.id for d in mesh.devices.flat]}"


def _argnums(nums, name: str, fn: Callable) -> tuple[int, ...]:
    """``nums`` as a tuple of ints, checked against ``fn``'s positional parameters when it has a fixed number."""
    nums = (nums,) if isinstance(nums, int) else tuple(nums) if isinstance(nums, (tuple, list, range)) else nums
    if not isinstance(nums, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(f"jshard.jit: {name} must be an int or a sequence of ints, got {nums!r}")
    n = _arity(fn)
    if n is not None:
        _resolve(nums, n, name, _fn_name(fn))
    return nums


def _arity(fn: Callable) -> int | None:
    """How many positional arguments ``fn`` takes, or None where that is open (``*args``, no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _parameter_names(fn: Callable, nums: tuple[int, ...]) -> frozenset:
    """The parameter names at positions ``nums`` (a static argument passed by keyword is refused by name)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(params[i].name for i in nums if -len(params) <= i < len(params))


def _resolve(nums: tuple[int, ...], n: int, name: str, fn_name: str) -> frozenset:
    """Argnums of a call with ``n`` positional arguments, negative ones counted from the end (``jax.jit``'s rule)."""
    out = set()
    for i in nums:
        if not -n <= i < n:
            raise ValueError(f"jshard.jit: {name} {i} is out of range for {fn_name}, which takes {n} positional "
                             f"argument(s) here; argnums count from 0 (negative ones from the end)")
        out.add(i % n)
    return frozenset(out)


def _fn_name(fn: Callable) -> str:
    """``name (file.py:line)`` of a user's function, for errors."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else name


_APPLIED = Cache(512)


def apply(f: Callable, *args, **static) -> Any:
    """Run ``f`` (any JAX function at global shapes) on DArrays eagerly, through a cached single-call program;
    ``static`` keyword arguments (axes, dtypes, indices) are fixed at trace time, arrays among them are keyed
    by their contents (boolean masks stay static; their shapes decide the result's). DArray operators use it.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard
    >>> x = jshard.distribute(np.arange(8.0).reshape(4, 2), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.apply(jnp.sum, x, axis=0).full().tolist()
    [12.0, 16.0]
    """
    leaves, tree = jax.tree.flatten(static)
    dynamic = tuple(i for i, v in enumerate(leaves) if isinstance(v, (DArray, jax.Array)) or
                    isinstance(v, np.ndarray) and v.dtype != np.bool_)
    key = (f, tree, dynamic, tuple(None if i in dynamic else _by_value(v, f) for i, v in enumerate(leaves)))
    program = _APPLIED.get(key)
    if program is None:
        fixed = [None if i in dynamic else v for i, v in enumerate(leaves)]

        @functools.wraps(f)  # errors name f, not this wrapper
        def call(*a):
            vals, it = list(fixed), iter(a[len(a) - len(dynamic):])
            for i in dynamic:
                vals[i] = next(it)
            return f(*a[:len(a) - len(dynamic)], **jax.tree.unflatten(tree, vals))

        call.__qualname__ = getattr(f, "__qualname__", getattr(call, "__name__", "apply"))  # a jnp ufunc has none

        program = jit(call)
        _APPLIED.put(key, program)
    return program(*args, *[leaves[i] for i in dynamic])


def _by_value(v, f: Callable) -> Any:
    """A hashable key equal for equal values of a static argument of ``apply(f, ...)``: arrays by shape, dtype and
    bytes; slices by their fields."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.shape, v.dtype.str, v.tobytes())
    if isinstance(v, slice):
        return ("slice", _by_value(v.start, f), _by_value(v.stop, f), _by_value(v.step, f))
    if not _hashable(v):
        raise TypeError(f"apply({_fn_name(f)}): static argument {v!r:.60} of type {type(v).__name__} is not hashable; "
                        "pass a tuple or an array")
    return (type(v), v)


@dataclass
class Explanation:
    """What ``jshard.jit`` does with a function: one row per equation (primitive, the user's source line,
    the specs its inputs run with, its output specs, the redistributions of its inputs as
    ``(input, kind, mesh axes, bytes per device)``), the output pins, and totals per collective kind
    (``{kind: (count, bytes)}``). ``str()`` prints it as a table."""

    rows: list[dict]
    totals: dict

    def __str__(self) -> str:
        def brief(spec):  # the mesh is printed once, in the header
            return f"{_dtype_short(spec.dtype)}[{','.join(map(str, spec.shape))}]{format_placements(spec.placements)}"

        meshes = {format_mesh(s.mesh) for r in self.rows for s in r["outs"]}
        lines = [f"jshard plan on {', '.join(sorted(meshes)) or 'no mesh'}: {len(self.rows)} equations"]
        for n, r in enumerate(self.rows):
            lines.append(f"{n:>4}  {r['primitive']:<28} {r['source']}")
            lines.append(f"      {', '.join(map(brief, r['ins']))} -> {', '.join(map(brief, r['outs']))}")
            for i, kind, axes, nbytes in r["moves"]:
                lines.append(f"      in{i}: {kind} over ({', '.join(axes)})  {nbytes:,} B per device")
        lines.append("totals: " + (", ".join(f"{k} x{c} ({b:,} B)" for k, (c, b) in sorted(self.totals.items()))
                                   or "no collectives"))
        return "\n".join(lines)


def explain(fn: Callable, *args, out_placements: Any = None, static_argnums: int | Sequence[int] = ()) -> Explanation:
    """The plan ``jshard.jit(fn, out_placements=..., static_argnums=...)`` would run on ``args``, as data (nothing
    compiles). Equations inside ``scan`` / ``while`` / ``cond`` bodies are listed under their loop or branch,
    once each (as they appear in the compiled program), with the moves of loop carries and branch results.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard, Replicate
    >>> x = jshard.distribute(np.ones((8, 4), np.float32), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.explain(lambda x: jnp.exp(x.sum(0)), x).totals
    {'all_reduce': (1, 16)}
    """
    return jit(fn, out_placements=out_placements, static_argnums=static_argnums).explain(*args)


def _explanation(t: _Traced) -> Explanation:
    rows, totals = [], {}

    def moves_of(i, plan):
        out = []
        for step in plan.collectives if isinstance(plan, Plan) else ():  # a reused move costs nothing
            out.append((i, step.kind, tuple(step.axes), int(step.bytes)))
            c, b = totals.get(step.kind, (0, 0))
            totals[step.kind] = (c + step.count, b + int(step.bytes))
        return out

    def walk(prog: _Program, pins: list, where: str):
        for st in prog.steps:
            moves = [m for i, (_, _, plan) in enumerate(st.ins) for m in moves_of(i, plan)]
            rows.append(dict(primitive=where + st.eqn.primitive.name, source=st.source,
                             ins=list(st.choice.ins), outs=list(st.choice.outs), moves=moves))
            for label, body, body_pins in st.bodies:
                walk(body, body_pins, f"{where}{st.eqn.primitive.name} {label} | ")
        for j, plan in enumerate(_out_plans(prog, pins)):
            if plan is not None and plan.collectives:
                rows.append(dict(primitive=where + ("(output pin)" if not where else "(result move)"),
                                 source=f"output {j}", ins=[plan.src], outs=[plan.dst], moves=moves_of(0, plan)))

    walk(t.program, t.pins, "")
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
        if not _is_pin(pin):
            raise TypeError(f"jshard.jit: out_placements has {pin!r} where a placement tuple (one per mesh axis), "
                            "same_as(argnum) or None belongs")
        if isinstance(pin, same_as):
            if not -len(args) <= pin.argnum < len(args):
                raise ValueError(f"jshard.jit: out_placements names same_as({pin.argnum}), but the function was "
                                 f"called with {len(args)} positional argument(s)")
            src = [a.placements for a in jax.tree.leaves(args[pin.argnum], is_leaf=_is_darray)
                   if isinstance(a, DArray)]
            if len(src) != len(idx):
                raise ValueError(f"jshard.jit: out_placements same_as({pin.argnum}) pins {len(idx)} outputs, but "
                                 f"argument {pin.argnum} has {len(src)} DArrays")
            for i, p in zip(idx, src):
                pins[i] = p
        elif pin is not None:
            for i in idx:
                pins[i] = tuple(pin)

    try:
        jax.tree.map(assign, out_placements, positions, is_leaf=_is_pin)
    except ValueError as e:
        if "structure" not in str(e) and "mismatch" not in str(e).lower():
            raise
        raise ValueError(f"jshard.jit: out_placements {out_placements!r:.80} is not a prefix of the outputs' tree "
                         f"{out_tree}; give one entry per output (None leaves an output free)") from None
    return pins


def constrain(x, placements, *, pin_gradient: bool = True) -> Any:
    """Inside a ``jshard.jit`` function: ``x`` with ``placements`` from here on (the engine redistributes it
    there, like ``with_sharding_constraint``); the identity anywhere else. Its gradient is constrained the same
    way, unless ``pin_gradient=False``: then a gradient finds its own placement (a column-parallel layer's
    input gradient stays ``Partial(sum)``, summed with its siblings' and reduced once further back).

    ``placements`` is one entry per mesh axis, or a dict ``{axis name: placement}``; a None entry (or an axis
    the dict leaves out) keeps that axis as the engine has it. ``Shard(-1)`` counts from the last dim. Outside
    ``jshard.jit`` a DArray is redistributed there, as ``jax.lax.with_sharding_constraint`` does eagerly.

    >>> import jax, numpy as np, jshard
    >>> from jshard import Shard, Replicate
    >>> x = jshard.distribute(np.arange(8.0), jax.make_mesh((8,), ("x",)), [Replicate()])
    >>> jshard.jit(lambda x: jshard.constrain(x * 2, [Shard(0)]) + 1)(x).placements
    (S(0),)
    >>> jshard.constrain(x, {"x": Shard(0)}).placements
    (S(0),)
    """
    if isinstance(placements, dict):
        entries = tuple(placements.items())
        if not all(isinstance(k, str) and isinstance(p, Placement) for k, p in entries):
            raise TypeError(f"jshard.constrain: a placements dict maps mesh axis names to placements, got {placements!r}")
    elif isinstance(placements, (tuple, list)):
        entries = tuple(placements)
        if not all(p is None or isinstance(p, Placement) for p in entries):
            raise TypeError(f"jshard.constrain: placements holds {next(p for p in entries if not (p is None or isinstance(p, Placement)))!r}; "
                            "each entry is a placement (Shard(0), Replicate(), ...) or None")
    else:
        raise TypeError(f"jshard.constrain: placements must be a sequence with one placement (or None) per mesh axis, "
                        f"or a dict {{axis name: placement}}; got {placements!r}" +
                        (f" (write ({placements!r},) for a one-axis mesh)" if isinstance(placements, Placement) else ""))
    if not isinstance(pin_gradient, bool):
        raise TypeError(f"jshard.constrain: pin_gradient must be True or False, got {pin_gradient!r}")
    if isinstance(x, DArray):
        return x.redistribute(_constrain_target(x.spec, entries).placements)
    return _constrain_p.bind(x, placements=entries, pin_gradient=pin_gradient)


def _constrain_target(spec: Spec, placements: tuple) -> Spec:
    """The spec a ``constrain`` asks for, given the spec the engine has: None entries and axes a dict
    leaves out stay as they are."""
    current = list(spec.placements)
    if placements and isinstance(placements[0], tuple):  # (axis name, placement) pairs
        names = list(spec.mesh.axis_names)
        for name, p in placements:
            if name not in names:
                raise ValueError(f"jshard.constrain: mesh axis {name!r} is not in the mesh {format_mesh(spec.mesh)}; "
                                 f"name one of {names}")
            current[names.index(name)] = p
    else:
        if len(placements) != len(current):
            raise ValueError(f"jshard.constrain: {len(placements)} placements for the {len(current)} axes of "
                             f"{format_mesh(spec.mesh)}; give one per axis (None keeps an axis as it is)")
        current = [c if p is None else p for p, c in zip(placements, current)]
    return spec.with_placements(current, where="jshard.constrain")


def _constrain_prim():
    from jax.interpreters import ad, batching, mlir

    p = jc.Primitive("jshard_constrain")
    p.def_impl(lambda x, **_: x)
    p.def_abstract_eval(lambda x, **_: x)
    # as with JAX's sharding constraints, the cotangent is pinned like the value (unless pin_gradient=False)
    ad.deflinear2(p, lambda ct, x, placements, pin_gradient: [
        p.bind(ct, placements=placements, pin_gradient=True) if pin_gradient else ct])
    batching.defvectorized(p)
    mlir.register_lowering(p, lambda ctx, x, **_: [x])
    return p


_constrain_p = _constrain_prim()

# equations are attributed to the user's line: jshard's own wrappers are not it
for _file in ("api.py", "darray.py", os.path.join("parallel", "parallelize.py")):
    source_info_util.register_exclusion(os.path.join(os.path.dirname(__file__), _file))


# ---------------------------------------------------------------------------------------------------
# tracing and propagation


_REUSE = "reuse"  # the input was already moved to this spec for an earlier consumer


@dataclass
class _Step:
    eqn: jc.JaxprEqn
    ins: list  # per input: ("var", key, plan | None) or ("lit", value, plan | None); plans set by _reseat
    choice: Choice
    kernel: Callable | None = None  # control flow: the loop / switch over local bodies
    outs: list | None = None  # a fresh key per output (None: dropped); keys, not Vars, name values
    bodies: tuple = ()  # control flow: (label, _Program, pins) per body, for explain
    site: Any = None  # the source of the innermost call with a user frame (a library jit's body has none)
    consts: list | None = None  # per input: its value when a literal (for re-selection)

    @property
    def source(self) -> str:
        """The user's line that made this equation."""
        return summarize(self.eqn.source_info) or (summarize(self.site) if self.site is not None else "")


class _Key:
    """A value of the walked program. Inlined jaxprs are walked once per call site and share their Var
    objects (a cached inner jaxpr), so values are named by fresh keys, never by Vars."""

    __slots__ = ()


def _walk(jaxpr: jc.Jaxpr, in_vars: list, env: dict, steps: list, mesh: Mesh, site=None) -> list:
    """Propagate specs through ``jaxpr`` whose invars are bound to ``in_vars`` (outer vars or literals);
    ``site`` is the source info of the call being inlined."""
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
            here = eqn.source_info if summarize(eqn.source_info) else site
            outs = _walk_closed(inner_jaxpr, const_vars, [outer(v) for v in eqn.invars], env, steps, mesh, here)
            for o, r in zip(eqn.outvars, outs):
                if not isinstance(o, jc.DropVar):
                    alias[o] = r
            continue
        ins, specs, consts = [], [], []
        for v in map(outer, eqn.invars):
            if isinstance(v, jc.Literal):
                key = jax.dtypes.issubdtype(getattr(v.val, "dtype", np.float32), jax.dtypes.extended)
                val = v.val if key else np.asarray(v.val, dtype=v.aval.dtype)  # PRNG keys stay keys
                specs.append(_replicated(mesh, val.shape, val.dtype))
                consts.append(None if key else val)
                ins.append(("lit", val))
            else:
                specs.append(env[v])
                consts.append(None)
                ins.append(("var", v))
        kernel, bodies = None, ()
        if eqn.primitive is _constrain_p:
            target = _constrain_target(specs[0], eqn.params["placements"])
            choice = Choice((target,), (target,), 0.0, None)
        elif name in _CONTROL:
            choice, kernel, bodies = _CONTROL[name](eqn, specs, mesh)
        else:
            if not has_rule(eqn.primitive):  # the warning names the user's line
                rule_for(eqn.primitive, _Step(eqn, [], None, site=site).source)
            choice = select(eqn.primitive, eqn.params, specs, [o.aval for o in eqn.outvars], consts=consts, mesh=mesh)
        # the moves are planned once the consumers have had their say (_reseat)
        steps.append(_Step(eqn, [(kind, x, None) for kind, x in ins], choice, kernel, bodies=bodies, site=site,
                           consts=consts))
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


def _walk_closed(jaxpr, const_vars, args, env, steps, mesh, site=None):
    return _walk(jaxpr.replace(invars=list(jaxpr.constvars) + list(jaxpr.invars), constvars=[]),
                 list(const_vars) + list(args), env, steps, mesh, site)


@dataclass
class _Program:
    """A walked jaxpr: its input vars, the steps that stay live, its outputs and their specs."""

    in_vars: list
    steps: list
    outs: list
    out_specs: list

    @property
    def cost(self) -> float:
        """Estimated µs of communication (loops weighted by their trip counts)."""
        return sum(st.choice.cost for st in self.steps)


@dataclass
class _Traced:
    out_tree: Any
    program: _Program
    pins: list  # per output: the spec it is moved to, or None

    @property
    def out_specs(self) -> list[Spec]:
        return [p or s for s, p in zip(self.program.out_specs, self.pins)]


def _program(closed: jc.ClosedJaxpr, specs: list[Spec], mesh: Mesh) -> _Program:
    env = dict(zip(closed.jaxpr.invars, specs))
    const_vars = [jc.Literal(c, jax.typeof(c)) for c in closed.consts]
    steps: list[_Step] = []
    outs = _walk_closed(closed.jaxpr, const_vars, list(closed.jaxpr.invars), env, steps, mesh)
    _reseat(steps, outs, env, mesh)
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
        out_specs.append(_replicated(mesh, np.shape(o.val), o.aval.dtype)
                         if isinstance(o, jc.Literal) else env[o])
    return _Program(list(closed.jaxpr.invars), steps, outs, out_specs)


def _reseat(steps: list[_Step], outs: list, env: dict, mesh: Mesh) -> None:
    """The walk chooses forwards, from the inputs' placements; this pass looks back from the consumers. Where
    every consumer of a value moves it to one spec, the producer is asked to produce that spec directly,
    and does so when that needs no collective of its own (its inputs only slice): a dropout mask drawn
    only where the activations are, not drawn whole and sliced. Producers are visited last-first, so a
    re-seated equation's own input slices become demands on the equations before it."""
    uses: dict = {}
    for st in steps:
        for i, (kind, x, _) in enumerate(st.ins):
            if kind == "var":
                uses.setdefault(x, []).append((st, i))
    returned = {o for o in outs if not isinstance(o, jc.Literal)}
    for st in reversed(steps):
        if st.kernel is not None or st.eqn.primitive is _constrain_p:
            continue
        want = []
        for o in st.outs:
            targets = {u.choice.ins[i] for u, i in uses.get(o, ())}
            only = targets.pop() if len(targets) == 1 else None
            want.append(only if o is not None and o not in returned and only is not None and only != env[o] else None)
        if not any(w is not None for w in want):
            continue
        specs = _in_specs(st, env, mesh)
        saved = sum(plan_redistribute(env[o], w.placements).cost for o, w in zip(st.outs, want) if w is not None)
        choice = select(st.eqn.primitive, st.eqn.params, specs, [o.aval for o in st.eqn.outvars], consts=st.consts,
                        mesh=mesh, want=want)
        free = all(s == t or not plan_redistribute(s, t.placements).collectives for s, t in zip(specs, choice.ins))
        if choice.outs != st.choice.outs and free and choice.cost <= st.choice.cost + saved + 1e-9:
            st.choice = choice
            for o, spec in zip(st.outs, choice.outs):
                if o is not None:
                    env[o] = spec
    # every move from the (possibly re-seated) producer's spec to what its consumer runs with; constants move
    # like values (R -> P(sum) of a literal: the value on one coordinate)
    for st in steps:
        st.ins = [(kind, x, None if s == t else plan_redistribute(s, t.placements))
                  for (kind, x, _), s, t in zip(st.ins, _in_specs(st, env, mesh), st.choice.ins)]


def _in_specs(st: _Step, env: dict, mesh: Mesh) -> list[Spec]:
    """The specs a step's inputs come with (a literal is replicated)."""
    return [env[x] if kind == "var" else _replicated(mesh, x.shape, x.dtype) for kind, x, _ in st.ins]


def _replicated(mesh: Mesh, shape, dtype) -> Spec:
    """The spec of a value every device holds whole (a literal, a constant output)."""
    return Spec(mesh, (Replicate(),) * mesh.devices.ndim, tuple(shape), dtype)


def _communicates(prog: _Program, pins: list) -> bool:
    """Does running ``prog`` (loop and branch bodies included) and moving its outputs to ``pins`` need a
    collective?"""
    for st in prog.steps:
        if any(isinstance(p, Plan) and p.collectives for _, _, p in st.ins):
            return True
        if any(_communicates(body, body_pins) for _, body, body_pins in st.bodies):
            return True
    return any(p is not None and p.collectives for p in _out_plans(prog, pins))


def _out_plans(prog: _Program, pins: list) -> list:
    """Per output of ``prog``: the plan moving it to its pinned spec, or None."""
    return [plan_redistribute(s, p.placements) if p is not None and p != s else None
            for s, p in zip(prog.out_specs, pins)]


def _local(prog: _Program, pins: list | None = None) -> Callable:
    """The per-device function of ``prog``: local blocks of its inputs in, of its outputs out (moved to the
    specs in ``pins`` where given)."""
    finals = [local_program(p) if p is not None else None for p in _out_plans(prog, pins or [None] * len(prog.outs))]
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


def _trace(fn: Callable, treedef, specs: list[Spec], mesh: Mesh, out_placements, args, weak=None, name: str = ""
           ) -> _Traced:
    """Trace ``fn`` (called with the unflattened leaves) at global shapes and walk it; ``weak`` marks Python
    scalars, which JAX types weakly (``x * 2.0`` keeps ``x``'s dtype)."""
    weak = weak or [False] * len(specs)
    avals = [jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=w) for s, w in zip(specs, weak)]

    def traced(*leaves):
        out = fn(*jax.tree.unflatten(treedef, leaves))
        bad = [(jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(out)[0]
               if not isinstance(v, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))]
        if bad:
            raise TypeError(f"jshard.jit: {name or 'the function'} returned a {type(bad[0][1]).__name__} "
                            f"({bad[0][1]!r:.40}) at output{bad[0][0] or ''}; a jshard.jit function returns arrays "
                            "(or pytrees of arrays)")
        return out

    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*avals)
    out_tree = jax.tree.structure(out_shape)
    prog = _program(closed, specs, mesh)
    pins = [None if pin is None else prog.out_specs[i].with_placements(pin, where=f"out_placements (output {i})")
            for i, pin in enumerate(_pins(out_placements, out_tree, len(prog.outs), args))]
    return _Traced(out_tree, prog, pins)


_CPU_IN_FLIGHT = 4  # collective programs queued at once on XLA:CPU (see _compile)


def _compile(fn: Callable, treedef, specs: list[Spec], mesh: Mesh, out_placements, args, donated=(), weak=None, *,
             name: str = "", where: Callable[[int], str] = str) -> Callable:
    """The compiled program of ``fn`` for these specs; ``name`` and ``where(leaf)`` (the user's name for an input
    leaf) make the errors of a call name the function and the argument."""
    t = _trace(fn, treedef, specs, mesh, out_placements, args, weak, name)
    out_specs, out_tree = t.out_specs, t.out_tree
    run = _local(t.program, t.pins)
    k = mesh.devices.ndim
    # XLA:CPU runs every device's part of a program on one shared thread pool: with many collective programs
    # queued, parts of one program can wait on each other until the rendezvous aborts the process. Such
    # programs return a completion token (never donated) and at most _CPU_IN_FLIGHT of them are queued.
    bounded = mesh.devices.flat[0].platform == "cpu" and _communicates(t.program, t.pins)

    def body(*blocks):
        results = run(*[b.reshape(b.shape[k:]) for b in blocks])
        token = [jnp.zeros((), jnp.bool_)] if bounded else []
        return [r.reshape((1,) * k + r.shape) for r in results + token]

    block = PartitionSpec(*mesh.axis_names)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(block,) * len(specs),
                                    out_specs=[block] * (len(out_specs) + bounded), check_vma=False),
                      donate_argnums=donated)
    in_flight: collections.deque = collections.deque()
    single = out_tree == jax.tree.structure(0)  # one array out: no tree to rebuild

    donated_set = frozenset(donated)

    slot = donation_slot(lambda i: where(i) + " (jshard.jit donate_argnums)") if donated else None

    def run_blocks(blocks: list) -> Any:
        # XLA kills the process on a deleted or twice-donated buffer: check first (microseconds per call)
        try:
            deleted = any([b.is_deleted() for b in blocks])
        except (AttributeError, jax.errors.ConcretizationTypeError):  # a DArray unflattened inside jax.jit, ...
            raise TypeError(_TRACED.format(what=f"{name} got DArrays whose blocks are JAX tracers")) from None
        if deleted:
            i = next(i for i, b in enumerate(blocks) if b.is_deleted())
            went = donation_of(blocks[i])
            raise DeletedArrayError(f"jshard.jit: {where(i)} ({specs[i]}) has been deleted"
                                    + (f": it was donated to {went}" if went else "")
                                    + "; its storage belongs to that call's outputs: pass them instead")
        if donated:
            if len({id(b) for b in blocks}) < len(blocks):
                _refuse_shared_donation(blocks, donated, donated_set, where)
            slot.blocks = blocks
        blocks = program(*blocks)
        if bounded:
            in_flight.append(blocks.pop())
            if len(in_flight) > _CPU_IN_FLIGHT:
                in_flight.popleft().block_until_ready()
        if single:
            return DArray(blocks[0], out_specs[0])
        return jax.tree.unflatten(out_tree, [DArray(b, s) for b, s in zip(blocks, out_specs)])

    def call(darrays: list[DArray]) -> Any:
        return run_blocks([d.block for d in darrays])

    call.jitted, call.run_blocks = program, run_blocks
    return call


def _refuse_shared_donation(blocks: list, donated: tuple, donated_set: frozenset, where) -> None:
    """Raise where one array is donated and also passed again (donated twice, or donated and kept)."""
    first: dict = {}
    for i, b in enumerate(blocks):
        j = first.setdefault(id(b), i)
        if j != i and (i in donated_set or j in donated_set):
            raise ValueError(f"jshard.jit: {where(j)} and {where(i)} are the same array, and "
                             f"{'both are' if i in donated_set and j in donated_set else 'one is'} donated: donated "
                             "storage is handed to the outputs, so it cannot also be read; pass a copy "
                             "(x.redistribute(x.placements) after jshard.jit, or jnp.copy) or donate neither")


# ---------------------------------------------------------------------------------------------------
# control flow: bodies are walked as programs of their own and run as local loops / switches

_WHILE_TRIPS = 8  # a while loop's trip count is unknown when the plan is made: assume a few


def _unshard_dim0(spec: Spec) -> Spec:
    """``spec`` with its leading dim whole (a loop slices it per iteration)."""
    return spec.with_placements([Replicate() if p.is_shard and p.dim == 0 else p for p in spec.placements])


def _shift(spec: Spec, shape, delta: int) -> Spec:
    """The spec of one slice (``delta=-1``) or of a stack (``+1``) of arrays laid out like ``spec``."""
    moved = [type(p)(p.dim + delta, *([p.split_factor] if p.split_factor != 1 else [])) if p.is_shard else p
             for p in spec.placements]
    return Spec.create(spec.mesh, moved, shape, spec.dtype)


def _move_cost(src: list[Spec], dst: list[Spec]) -> float:
    total = 0.0
    for s, t in zip(src, dst):
        if s != t:
            try:
                total += plan_redistribute(s, t.placements).cost
            except ValueError:  # no way there (a Partial of another kind): never chosen
                return math.inf
    return total


def _settle_carry(make, init: list[Spec], trips: int, rounds: int = 3):
    """Loop-carry specs at least cost. ``make(carry)`` walks the body with the carry at ``carry`` and returns
    ``(program, carry specs it returns)``. Candidates: the initial specs and each spec set the body reaches
    from them (until it settles); each costs the move of the initial value there plus, per trip, the body's
    own communication and the move of the body's result back to it."""
    best, carry, tried = None, list(init), []
    for _ in range(rounds + 1):
        if carry in tried:
            break
        tried.append(carry)
        prog, out = make(carry)
        cost = _move_cost(init, carry) + trips * (prog.cost + _move_cost(out, carry))
        if best is None or cost < best[0]:
            best = (cost, carry, prog)
        carry = list(out)
    return best


def _scan(eqn, specs, mesh):
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    body: jc.ClosedJaxpr = p["jaxpr"]
    consts, init, xs = specs[:nc], specs[nc:nc + nk], [_unshard_dim0(s) for s in specs[nc + nk:]]
    x_iter = [_shift(s, s.shape[1:], -1) for s in xs]

    def make(carry):
        prog = _program(body, consts + carry + x_iter, mesh)
        return prog, prog.out_specs[:nk]

    cost, carry, prog = _settle_carry(make, init, p["length"])
    ys = [_shift(s, (p["length"],) + s.shape, +1) for s in prog.out_specs[nk:]]
    pins = carry + [None] * len(ys)
    fn = _local(prog, pins)

    def kernel(*blocks):
        c, k0, x = blocks[:nc], blocks[nc:nc + nk], blocks[nc + nk:]
        step = lambda k, xi: (lambda o: (o[:nk], o[nk:]))(fn(*c, *k, *xi))
        k1, y = jax.lax.scan(step, list(k0), list(x), length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return list(k1) + list(y)

    ins = consts + carry + xs
    # _settle_carry's cost already holds the initial carry's move; the xs' move to whole leading dims is extra
    return (Choice(tuple(ins), tuple(carry + ys), cost + _move_cost(specs[nc + nk:], xs), None), kernel,
            (("body", prog, pins),))


def _while(eqn, specs, mesh):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = specs[:cn], specs[cn:cn + bn], specs[cn + bn:]

    def make(carry):
        prog = _program(p["body_jaxpr"], bconsts + carry, mesh)
        return prog, prog.out_specs

    cost, carry, body = _settle_carry(make, init, _WHILE_TRIPS)
    cond = _program(p["cond_jaxpr"], cconsts + carry, mesh)
    replicated = [s.with_placements((Replicate(),) * mesh.devices.ndim) for s in cond.out_specs]
    body_fn, cond_fn = _local(body, carry), _local(cond, replicated)  # every device takes the same branch

    def kernel(*blocks):
        cc, bc, k0 = blocks[:cn], blocks[cn:cn + bn], blocks[cn + bn:]
        return list(jax.lax.while_loop(lambda k: cond_fn(*cc, *k)[0], lambda k: body_fn(*bc, *k), list(k0)))

    ins = cconsts + bconsts + carry
    cost += _WHILE_TRIPS * (cond.cost + _move_cost(cond.out_specs, replicated))  # the carry's move: in cost
    return (Choice(tuple(ins), tuple(carry), cost, None), kernel,
            (("cond", cond, replicated), ("body", body, carry)))


def _cond(eqn, specs, mesh):
    branches = eqn.params["branches"]
    index = specs[0].with_placements((Replicate(),) * mesh.devices.ndim)  # every device takes the same branch
    ops = specs[1:]
    progs = [_program(b, ops, mesh) for b in branches]
    # each output settles where moving every branch's result costs least (ties: the first branch's)
    outs = []
    for j in range(len(progs[0].out_specs)):
        results = [pr.out_specs[j] for pr in progs]
        outs.append(min(results, key=lambda t: _move_cost(results, [t] * len(results))))
    fns = [_local(pr, outs) for pr in progs]

    def kernel(i, *blocks):
        return list(jax.lax.switch(i, [lambda *a, f=f: f(*a) for f in fns], *blocks))

    cost = _move_cost(specs[:1], [index]) + max(pr.cost + _move_cost(pr.out_specs, outs) for pr in progs)
    return (Choice((index, *ops), tuple(outs), cost, None), kernel,
            tuple((f"branch {b}", pr, outs) for b, pr in enumerate(progs)))


_CONTROL = {"scan": _scan, "while": _while, "cond": _cond}
