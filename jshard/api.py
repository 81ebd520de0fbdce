"""``jshard.jit``: plain JAX at global shapes in, one distributed ``shard_map`` program out.

The function is traced to a jaxpr at global shapes and planned by the engine (``jshard.engine``): every
equation gets its cheapest correct strategy, calls such as ``jit``, ``custom_jvp_call`` or ``remat`` are
followed inline, ``scan`` / ``while`` / ``cond`` bodies are planned as jaxprs of their own; the plan becomes one
per-device function (the redistributions of ``jshard.planner`` as explicit collectives, then each equation
on local blocks), compiled once per input specs as ``jax.jit(jax.shard_map(...))`` over block storage. This
module is the surface: reading a call's arguments, caching programs, pinning outputs, wrapping blocks as
DArrays.

>>> import jax, jax.numpy as jnp, numpy as np, jshard
>>> from jshard import Shard, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> x = jshard.distribute(np.ones((8, 16), np.float32), mesh, [Shard(0), Replicate()])
>>> w = jshard.distribute(np.ones((16, 4), np.float32), mesh, [Replicate(), Shard(0)])
>>> y = jshard.jit(lambda x, w: jnp.tanh(x @ w))(x, w)   # P(sum) over tp, all-reduced before tanh
>>> y.placements, bool(np.allclose(y.full(), np.tanh(16.0)))
((S(0), R), True)
>>> split = jshard.jit(lambda x, w: jnp.tanh(x @ w), out_placements=(Shard(0), Shard(0)))
>>> split(x, w).placements   # asked for split: reduce-scattered before tanh instead (half the bytes)
(S(0), S(0))
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .arguments import (
    argnums,
    as_darray,
    function_name,
    hashable,
    is_darray,
    is_plain_key,
    is_weak,
    mesh_of,
    parameter_names,
    plain_dtype,
    resolve_argnums,
)
from .caches import Cache
from .cost import CostModel
from .darray import DArray, distribute
from .engine import Program, compile_program, constrain_p, constrain_target, replicated, trace
from .engine.constrain import check_placements, without_hidden_axis
from .explanation import Explanation, explanation
from .jaxcompat import source_info_util
from .placements import Placement, Replicate
from .planner import check_cost_model

__all__ = ["Jitted", "constrain", "explain", "jit", "same_as"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))

_SPEC, _BLOCK = operator.attrgetter("spec"), operator.attrgetter("block")  # C-level reads per argument


@dataclass(frozen=True)
class same_as:  # noqa: N801 - reads as a function in out_placements
    """In ``out_placements``: this output subtree takes the placements of argument ``argnum``, leaf by leaf
    (a training step returning parameters and optimizer state as they came in)."""

    argnum: int

    def __post_init__(self):
        if not isinstance(self.argnum, int) or isinstance(self.argnum, bool):
            raise TypeError(f"jshard.same_as: argnum must be the int position of an argument, got {self.argnum!r}")


def jit(fn: Callable, *, out_placements: Any = None, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = (), mesh: Mesh | None = None,
        cost_model: CostModel | None = None) -> Jitted:
    """Compile ``fn`` (global-shape JAX code) for DArray arguments; plain arrays and scalars are Replicate.

    Returns DArrays. ``out_placements`` pins outputs: a pytree prefix of the outputs whose leaves are a
    placement tuple, ``same_as(argnum)`` or None (free). ``static_argnums`` are fixed at trace time (hashable
    Python values: sizes, flags, modes), ``donate_argnums`` hand their arguments' storage to the outputs (the
    donated DArrays are deleted; using one again raises ``DeletedArrayError`` naming the call it went to).
    Negative argnums count from the end, as in ``jax.jit``. Typed PRNG key arrays (``jax.random.key``) are
    arguments like any other. A ``jax.Array`` laid out on the mesh (a ``NamedSharding``, as a JAX program makes
    them) is taken as it is (``jshard.from_jax``), whether passed or closed over (on Auto or Explicit mesh
    axes): no host transfer, no collective. ``mesh`` names the mesh for a
    function that has no DArray argument (an initialiser: with ``out_placements``, each device computes only
    its own blocks). ``cost_model`` prices every choice of the plan (a ``jshard.CostModel``: the mesh axes' own
    latency and bandwidth, a fast tp axis inside a host next to a slow dp axis across hosts; None: the default).
    Compiled programs are cached by the arguments' specs, tree structure and static values: a repeated call does
    no tracing. ``.lower(*args)`` gives the lowered program (for its HLO),
    ``.explain(*args)`` the plan.

    Called inside another trace (its arguments JAX tracers: from an enclosing ``jshard.jit``, ``jax.jit`` or
    ``jax.grad``), the function runs inline, as a nested ``jax.jit`` does: the enclosing call plans it whole,
    and ``out_placements`` pin its outputs as ``jshard.constrain`` does (``same_as`` leaves them free there;
    under plain ``jax.jit`` the pins are the identity); ``donate_argnums`` does nothing there.

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
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"jshard.jit: mesh must be a jax.sharding.Mesh (say jax.make_mesh((8,), ('dp',))), got "
                        f"{type(mesh).__name__}")
    if cost_model is not None:
        check_cost_model(cost_model, "jshard.jit")
    return Jitted(fn, out_placements, argnums(static_argnums, "static_argnums", fn),
                  argnums(donate_argnums, "donate_argnums", fn), mesh, cost_model)


class Jitted:
    """What ``jshard.jit`` returns: call it like the function; ``.lower`` and ``.explain`` take the same
    arguments."""

    def __init__(self, fn: Callable, out_placements: Any, static: tuple[int, ...], donate: tuple[int, ...],
                 mesh: Mesh | None = None, cost_model: CostModel | None = None):
        if set(static) & set(donate):
            raise ValueError(f"jshard.jit: argument(s) {sorted(set(static) & set(donate))} are both in static_argnums "
                             f"{static} and donate_argnums {donate}; a static value has no storage to donate")
        self.fn, self.out_placements, self.static, self.donate, self.mesh = fn, out_placements, static, donate, mesh
        self.cost_model = cost_model
        self._static_names = parameter_names(fn, static)
        # programs by full key; the steady-state paths by DArray specs and by tree structure (see __call__)
        self._cache, self._by_tree, self._by_specs = Cache(256), Cache(256), Cache(256)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs) -> Any:
        # steady-state paths (Python work here is paid on every step): DArray arguments only, recognised by
        # their specs (flat positional calls) or by the tree structure and the leaves' specs
        if not self.static:
            if not kwargs:
                try:
                    specs = tuple(map(_SPEC, args))
                except AttributeError:  # not all DArrays
                    specs = None
                last = self._by_specs.last
                program = last[1] if specs == last[0] else self._by_specs.get(specs)
                if program is not None:
                    self._by_specs.last = (specs, program)
                    return program.call(list(map(_BLOCK, args)))
            leaves, tree = jax.tree.flatten((args, kwargs))
            program = self._steady(leaves, tree)
            if program is not None:
                return program.call(list(map(_BLOCK, leaves)))
        else:
            leaves = jax.tree.leaves((args, kwargs))
        # inside another trace; with a DArray beside the tracers (one the enclosing function closed over) the call
        # is refused below instead, naming the traced argument
        if any(isinstance(a, jax.core.Tracer) for a in leaves) and not any(isinstance(a, DArray) for a in leaves):
            return self._inline(args, kwargs)
        program, darrays = self._prepare(args, kwargs)
        if not self.static and all(isinstance(a, DArray) for a in leaves):
            self._by_tree.put((jax.tree.structure((args, kwargs)), tuple(a.spec for a in leaves)), program)
            if not kwargs and all(type(a) is DArray for a in args):
                self._by_specs.put(tuple(a.spec for a in args), program)
        return program.call([d.block for d in darrays])

    def steady(self, *args, **kwargs) -> Program | None:
        """The compiled program a call with these arguments runs without tracing (an earlier call with DArrays of
        the same specs in the same tree made it), else None. ``TrainStep`` keeps its state flat by it."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        return None if self.static else self._steady(leaves, tree)

    def _steady(self, leaves: list, tree) -> Program | None:
        try:
            specs = tuple(map(_SPEC, leaves))
        except AttributeError:  # not all DArrays
            return None
        return self._by_tree.get((tree, specs))

    def _inline(self, args: tuple, kwargs: dict) -> Any:
        """A call inside another trace (an enclosing ``jshard.jit``, ``jax.jit``, ``jax.grad``): the function runs
        inline, as a nested ``jax.jit`` does, for the enclosing trace to plan (or compile) whole; its
        ``out_placements`` pin its outputs through ``jshard.constrain``."""
        self._split(args, kwargs)  # static arguments passed by keyword are refused here too
        out = self.fn(*args, **kwargs)
        if self.out_placements is None:
            return out
        outs, tree = jax.tree.flatten(out)
        pins = _pins(self.out_placements, tree, len(outs), args=None)
        return jax.tree.unflatten(tree, [o if p is None else constrain(o, p) for o, p in zip(outs, pins, strict=True)])

    def lower(self, *args, **kwargs) -> Any:
        """The lowered ``jax.jit`` program for these arguments (``.as_text()``, ``.compile()``)."""
        program, darrays = self._prepare(args, kwargs)
        return program.lower([d.block for d in darrays])

    def explain(self, *args, **kwargs) -> Explanation:
        """The plan these arguments would run with, as data (see ``jshard.explain``)."""
        return explanation(self.trace(*args, **kwargs))

    def trace(self, *args, **kwargs) -> Any:
        """The traced and planned function for these arguments (``jshard.engine.Traced``: its plan, output
        specs and pins), without compiling: what benchmarks time as trace + propagate."""
        dyn, statics = self._split(args, kwargs)
        leaves, treedef = jax.tree.flatten((dyn, kwargs), is_leaf=is_darray)
        mesh = mesh_of(leaves, self._name, self.mesh)
        values, keys = self._values(leaves, treedef, statics, mesh)
        specs = [v.spec if isinstance(v, DArray) else replicated(mesh, v.shape, v.dtype) for v in values]
        return trace(self._traced_fn(args, treedef, keys), treedef, specs, mesh, self._pins(args),
                     list(map(is_weak, leaves)), self._name, self.cost_model)

    @property
    def _name(self) -> str:
        return function_name(self.fn)

    def _pins(self, args) -> Callable[[Any, int], list]:
        """``pins(out_tree, n_out)`` for the engine: per output, the placements ``out_placements`` pin it to."""
        return functools.partial(_pins, self.out_placements, args=args)

    def _split(self, args, kwargs):
        """(dynamic positional arguments, ((position, static value), ...)) of a call."""
        if not self.static:
            return args, ()
        passed = self._static_names & kwargs.keys()
        if passed:
            raise TypeError(f"jshard.jit: {self._name} takes {sorted(passed)} as static (static_argnums={self.static}) "
                            "but they were passed as keywords; pass static arguments positionally")
        static = resolve_argnums(self.static, len(args), "static_argnums", self._name)
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
        positions = jax.tree.unflatten(treedef, range(treedef.num_leaves))
        path = [p for p, _ in jax.tree_util.tree_flatten_with_path(positions)[0]][leaf]
        kind, pos = path[0].idx, path[1]
        rest = jax.tree_util.keystr(tuple(path[2:]))
        if kind == 1:
            return f"keyword {pos.key!r}{rest} of {self._name}"
        static = sorted(i for i, _ in statics)
        argnum = [i for i in range(pos.idx + len(static) + 1) if i not in static][pos.idx]
        return f"argument {argnum}{rest} of {self._name}"

    def _values(self, leaves: list, treedef, statics, mesh: Mesh) -> tuple[list, dict]:
        """Per flat leaf: the DArray (a ``jax.Array`` on the mesh becomes one as it is), or the host value a plain
        leaf is distributed (replicated) from; and ``{position: PRNG implementation}`` of typed keys, which travel
        as their key data."""
        keys = {i: jax.random.key_impl(a) for i, a in enumerate(leaves) if is_plain_key(a)}
        values = []
        for i, a in enumerate(leaves):
            if isinstance(a, DArray):
                values.append(a)
            elif i in keys:
                values.append(jax.random.key_data(a))
            else:
                where = self._where(i, treedef, statics)
                d = as_darray(a, mesh, where)
                values.append(d if d is not None else np.asarray(a, plain_dtype(a, where)))
        return values, keys

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
        leaves, treedef = jax.tree.flatten((dyn, kwargs), is_leaf=is_darray)
        specs = tuple(a.spec if isinstance(a, DArray) else None for a in leaves)
        key = (treedef, specs, statics) if None not in specs else None
        try:
            program = self._cache.get(key)
        except TypeError:
            bad = [i for i, v in statics if not hashable(v)]
            raise TypeError(f"jshard.jit: static argument(s) {bad} of {self._name} are not hashable "
                            f"({', '.join(type(dict(statics)[i]).__name__ for i in bad)}); static_argnums values must "
                            "be hashable (tuples, not lists or arrays)") from None
        if program is not None:
            return program, leaves
        mesh = mesh_of(leaves, self._name, self.mesh)
        values, keys = self._values(leaves, treedef, statics, mesh)
        darrays = [v if isinstance(v, DArray) else distribute(v, mesh, (Replicate(),) * mesh.devices.ndim)
                   for v in values]
        weak = tuple(map(is_weak, leaves))
        key = (treedef, tuple(d.spec for d in darrays), statics, tuple(keys.items())) + ((weak,) if any(weak) else ())
        program = self._cache.get(key)
        if program is None:
            program = compile_program(self._traced_fn(args, treedef, keys), treedef, [d.spec for d in darrays], mesh,
                                      self._pins(args), self._donated(args), weak, name=self._name,
                                      where=functools.partial(self._where, treedef=treedef, statics=statics),
                                      cost_model=self.cost_model)
            self._cache.put(key, program)
        return program, darrays

    def _donated(self, args) -> tuple[int, ...]:
        """Positions among the flat leaves of the donated arguments' leaves (positional ones come first)."""
        if not self.donate:
            return ()
        static = resolve_argnums(self.static, len(args), "static_argnums", self._name)
        donate = resolve_argnums(self.donate, len(args), "donate_argnums", self._name)
        out, pos = [], 0
        for i in (i for i in range(len(args)) if i not in static):
            n = len(jax.tree.leaves(args[i], is_leaf=is_darray))
            if i in donate:
                out.extend(range(pos, pos + n))
            pos += n
        return tuple(out)


def explain(fn: Callable, *args, out_placements: Any = None, static_argnums: int | Sequence[int] = (),
            cost_model: CostModel | None = None) -> Explanation:
    """The plan ``jshard.jit(fn, out_placements=..., static_argnums=..., cost_model=...)`` would run on ``args``, as
    data (nothing compiles). Equations inside ``scan`` / ``while`` / ``cond`` bodies are listed under their loop
    or branch, once each (as they appear in the compiled program), with the moves of loop carries and branch
    results.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard, Replicate
    >>> x = jshard.distribute(np.ones((8, 4), np.float32), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.explain(lambda x: jnp.exp(x.sum(0)), x).totals
    {'all_reduce': (1, 16)}
    """
    return jit(fn, out_placements=out_placements, static_argnums=static_argnums, cost_model=cost_model).explain(*args)


def constrain(x, placements, *, pin_gradient: bool = True) -> Any:
    """Inside a ``jshard.jit`` function: ``x`` with ``placements`` from here on (the engine redistributes it
    there, like ``with_sharding_constraint``); the identity anywhere else. Its gradient is constrained the same
    way, unless ``pin_gradient=False``: then a gradient finds its own placement (a column-parallel layer's
    input gradient stays ``Partial(sum)``, summed with its siblings' and reduced once further back).

    ``placements`` is one entry per mesh axis, or a dict ``{axis name: placement}``; a None entry (or an axis
    the dict leaves out) keeps that axis as the engine has it. ``Shard(-1)`` counts from the last dim. Outside
    ``jshard.jit`` a DArray is redistributed there, as ``jax.lax.with_sharding_constraint`` does eagerly; any
    other value (a plain array, a tracer of ``jax.jit``) is returned as it is, once its placements are checked
    against its rank as ``jshard.jit`` would check them: a ``Shard(9)`` on a matrix fails wherever it runs.

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
            raise TypeError(f"jshard.constrain: a placements dict maps mesh axis names to placements, "
                            f"got {placements!r}")
    elif isinstance(placements, (tuple, list)):
        entries = tuple(placements)
        bad = [p for p in entries if not (p is None or isinstance(p, Placement))]
        if bad:
            raise TypeError(f"jshard.constrain: placements holds {bad[0]!r}; each entry is a placement (Shard(0), "
                            "Replicate(), ...) or None")
    else:
        hint = f" (write ({placements!r},) for a one-axis mesh)" if isinstance(placements, Placement) else ""
        raise TypeError(f"jshard.constrain: placements must be a sequence with one placement (or None) per mesh axis, "
                        f"or a dict {{axis name: placement}}; got {placements!r}{hint}")
    if not isinstance(pin_gradient, bool):
        raise TypeError(f"jshard.constrain: pin_gradient must be True or False, got {pin_gradient!r}")
    if isinstance(x, DArray):
        return x.redistribute(constrain_target(x.spec, entries).placements)
    entries = without_hidden_axis(entries)
    check_placements(entries, np.ndim(x))
    return constrain_p.bind(x, placements=entries, pin_gradient=pin_gradient)


def _is_pin(p) -> bool:
    return p is None or isinstance(p, same_as) or (isinstance(p, (tuple, list))
                                                   and all(isinstance(q, Placement) for q in p))


def _pins(out_placements, out_tree, n_out: int, *, args) -> list:
    """Per output leaf: the placements it is pinned to, or None. ``args=None`` (a call inlined in another
    trace, whose arguments are tracers): ``same_as`` leaves its outputs free, the arguments' placements being
    the enclosing plan's to choose."""
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
            if args is None:
                return
            if not -len(args) <= pin.argnum < len(args):
                raise ValueError(f"jshard.jit: out_placements names same_as({pin.argnum}), but the function was "
                                 f"called with {len(args)} positional argument(s)")
            src = [a.placements for a in jax.tree.leaves(args[pin.argnum], is_leaf=is_darray)
                   if isinstance(a, DArray)]
            if len(src) != len(idx):
                raise ValueError(f"jshard.jit: out_placements same_as({pin.argnum}) pins {len(idx)} outputs, but "
                                 f"argument {pin.argnum} has {len(src)} DArrays")
            for i, p in zip(idx, src, strict=True):
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

