"""Sharded initialisation whose compile time does not grow with depth: identical modules share one program.

``parallelize(make, mesh, plan)`` builds every parameter in its placements, each device drawing only its own
blocks. Compiled as one program, the constructor costs XLA time that grows with the model (a 16-layer GPT
took 8x as long to build as a 2-layer one). But a deep model is the same few modules many times over, and two
blocks' parameters differ only in the random key their draw starts from. So the constructor is traced once
(``jax.make_jaxpr``) and taken apart:

- **A parameter's slice**: the equations its value depends on, walking back from it and stopping at PRNG keys
  (values of a key dtype). NNX's ``Rngs`` makes the key of each draw as ``fold_in(base key, count)``, the count
  going up by one per draw; cut at that key, a parameter's slice is its initialiser alone
  (``truncated_normal(key, shape) * scale``), equation for equation the same in every block, the key its input.
- **Its signature**: the slice with its variables renamed by position: primitives, params (nested jaxprs by
  their own signatures), operand wiring, literal values bit for bit, shapes and dtypes; only the key values
  are left out. Parameters with equal signatures and equal placements form a **group**, compiled once as a
  ``jshard.jit`` program taking the keys as arguments and called once per member, with that member's keys.
  A member's program computes its value with the same equations on the same blocks as the one program did, so
  the values are bit for bit those of the eager construction, as before.
- **The key chain**: the equations that make the keys (seed, ``fold_in``, the counters; a few scalars per
  draw), run eagerly, op by op: nothing to compile.
- **The rest**, computed together by one more program as before: a parameter alone in its group (nothing to
  share), one whose slice shares a large value with another parameter (a weight tied to another), one whose
  key is made from a large value, one that is a constant or a key itself; and every parameter when the
  constructor has side effects.
- **The state besides parameters** (RNG streams, batch statistics) comes from the same trace, computed by
  ``jax.jit`` as plain arrays, as an eager construction holds them.

A 16-layer GPT then compiles as many programs as a 2-layer one: one per kind of parameter, and the rest
(the embeddings and the head). Four identical layers, two programs (the kernels', the biases'):

>>> import jax, numpy as np; from flax import nnx; from jshard import Shard
>>> def make():
...     return nnx.Sequential(*[nnx.Linear(16, 16, rngs=nnx.Rngs(i)) for i in range(4)])
>>> params, other = initialise(make, jax.make_mesh((8,), ("x",)), [(Shard(0),)] * 8)
>>> eager = [v.get_value() for _, v in nnx.iter_graph(make()) if isinstance(v, nnx.Param)]
>>> params[1].placements, all(np.allclose(p.full(), e) for p, e in zip(params, eager))
((S(0),), True)
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..api import jit
from ..caches import Cache
from ..darray import DArray
from ..jaxcompat import constructing, jc, open_jaxpr, run_equations
from ..operators import stack

__all__ = ["Constructor", "building", "initialise", "stack_members", "trace_constructor"]

# elements: a value this small is made by the eager key chain, and recomputed by every program that reads it
SMALL = 1 << 12


class Constructor(NamedTuple):
    """A module's constructor, traced once: ``module`` is what it builds with shapes and dtypes in place of values
    (as ``nnx.eval_shape`` makes it; placements are planned on it), ``jaxpr`` the trace ``initialise`` computes the
    values from. One trace serves both: tracing a deep model's constructor takes seconds."""

    module: nnx.Module
    jaxpr: Any  # a closed jaxpr of () -> (parameters in nnx.iter_graph order, other state, whole state)
    other: Any  # the other state's shapes (its tree)


@contextlib.contextmanager
def building() -> Iterator[None]:
    """While a constructor is traced: in time linear in its depth (``jaxcompat.constructing``), and with Flax's eager
    sharding off, so that a model written for JAX's explicit sharding (variables annotated ``out_sharding=``, as
    Flax's Gemma example) builds with no mesh in force: its annotations are metadata, which ``parallelize`` reads as
    the plan, rather than resharding the values as they are made."""
    with constructing(), nnx.use_eager_sharding(False):
        yield


def trace_constructor(build: Callable[[], nnx.Module]) -> Constructor:
    """``build`` traced: the abstract module and what ``initialise`` needs to give it values.

    >>> from flax import nnx
    >>> c = trace_constructor(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)))
    >>> c.module.kernel.get_value().shape
    (16, 32)
    """
    made = {}

    def run():
        module = build()
        if not isinstance(module, nnx.Module):
            made["module"] = module
            return [], {}, {}
        made["graphdef"], state = nnx.split(module)
        return (*_split(module), state)

    eager = nnx.using_eager_sharding()
    with building():
        closed, (_, other, state) = jax.make_jaxpr(run, return_shape=True)()
    if "graphdef" not in made:
        raise TypeError(f"parallelize: the constructor returned {type(made['module']).__name__}, not a Flax "
                        "nnx.Module")
    module = nnx.merge(made["graphdef"], state)
    # as eager construction records it: the model's state has the tree structure of an eagerly built one
    variables = [v for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)]
    variables += jax.tree.leaves(other, is_leaf=lambda v: isinstance(v, nnx.Variable))
    for v in variables:
        if isinstance(v, nnx.Variable) and v.get_metadata().get("eager_sharding") is not None:
            v.set_metadata("eager_sharding", eager)
    return Constructor(module, closed, other)


def initialise(build: Callable[[], nnx.Module] | Constructor, mesh: Mesh, placements: list[tuple],
               stacks: list[tuple[list[int], tuple]] = ()) -> tuple[list[DArray | None], Any]:
    """The parameters ``build()`` makes as DArrays with ``placements`` (in ``nnx.iter_graph`` order), every
    device computing only its own blocks, and the module's other state (an ``nnx.State`` of plain arrays).
    ``build`` may be its ``trace_constructor`` already.

    ``stacks``: ``(members, placements)`` pairs, parameters (by position) to make as one array stacked along a
    new dim 0 with those placements (a pipeline's blocks): where the members are one group, one program draws
    the stack from their keys, every device only its own members' blocks, and it takes the first member's place
    in the result, the others' being None. Members that are not one group come back one by one."""
    closed, other = (build if isinstance(build, Constructor) else trace_constructor(build))[1:]
    graph = _Graph(*open_jaxpr(closed))
    n, n_other = len(placements), len(jax.tree.leaves(other))
    params, others = graph.outvars[:n], graph.outvars[n:n + n_other]
    groups, rest = graph.groups(params, placements)
    # the keys travel as their data, fetched in one go: a host value is cut for the devices without a program
    roots, made = graph.evaluate([v for g in groups for m in g for v in graph.slices[m][1]])
    data = dict(zip(roots, jax.device_get([jax.random.key_data(k) for k in made]), strict=True))
    impls = {v: jax.random.key_impl(k) for v, k in zip(roots, made, strict=True)}
    values: list[Any] = [None] * n
    stacked = {m: k for k, (members, _) in enumerate(stacks) for m in members}
    drawn = set()
    for members in groups:
        order, cuts = graph.slices[members[0]]
        draw = _from_key_data(graph.replay(order, cuts, [params[members[0]]]), [impls[v] for v in cuts])
        for k in dict.fromkeys(stacked[m] for m in members if m in stacked):
            ms, where = stacks[k]
            if set(ms) <= set(members):  # a stage draws only its own members: the keys are split like the stack
                keys = [np.stack(column) for column in zip(*[[data[v] for v in graph.slices[m][1]] for m in ms],
                                                           strict=True)]
                values[ms[0]] = _program(jax.vmap(draw, axis_size=len(ms)), keys, [where], mesh)(*keys)[0]
                drawn.add(k)
        firsts = [data[v] for v in graph.slices[members[0]][1]]
        program = _program(draw, firsts, [placements[members[0]]], mesh)
        for m in members:
            if stacked.get(m) not in drawn:
                values[m] = program(*[data[v] for v in graph.slices[m][1]])[0]
    if rest:
        order, _ = graph.closure([params[m] for m in rest])
        together = _program(graph.replay(order, [], [params[m] for m in rest]), [],
                            [placements[m] for m in rest], mesh)
        for m, value in zip(rest, together(), strict=True):
            values[m] = value
    values = stack_members(values, [s for k, s in enumerate(stacks) if k not in drawn])  # drawn apart: stacked now
    order, _ = graph.closure(others)
    state = jax.jit(graph.replay(order, [], others))() if others else []
    return values, jax.tree.unflatten(jax.tree.structure(other), state)


def stack_members(values: list, stacks: list[tuple[list[int], tuple]]) -> list:
    """``values`` with the members of each stack stacked into the first member's place (with the stack's
    placements), the others None."""
    for members, placements in stacks:
        values[members[0]] = stack([values[m] for m in members], placements)
        for m in members[1:]:
            values[m] = None
    return values


def _split(module: nnx.Module) -> tuple[list, nnx.State]:
    """The values of ``module``'s parameters (in ``nnx.iter_graph`` order) and its other state."""
    params = [v.get_value() for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param)]
    return params, nnx.state(module, nnx.Not(nnx.Param))


_PROGRAMS = Cache(256)  # initialiser programs by what they compute: a model built again reuses them, compiled


def _program(fn: Callable[..., list], args: list, placements: list, mesh: Mesh) -> Callable[..., list]:
    """``jshard.jit(fn, out_placements=placements, mesh=mesh)``, one per computation: keyed by ``fn``'s jaxpr on
    ``args``' shapes (its text and its constants' bytes), so that ``parallelize`` of the same constructor structure
    on the same mesh calls the programs the first one compiled. A computation holding a large constant (a closed-over
    pretrained array, perhaps sharded over processes) is not keyed: its bytes are never fetched to be hashed."""
    closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args])
    constants = open_jaxpr(closed)[1]
    if any(np.size(c) > SMALL or not getattr(c, "is_fully_addressable", True) for c in constants):
        return jit(fn, out_placements=placements, mesh=mesh)
    consts = tuple((np.shape(c), str(np.asarray(c).dtype), hashlib.sha256(np.asarray(c).tobytes()).hexdigest())
                   for c in constants)
    key = (str(closed), consts, tuple(map(tuple, placements)), mesh)
    program = _PROGRAMS.get(key)
    if program is None:
        program = jit(fn, out_placements=placements, mesh=mesh)
        _PROGRAMS.put(key, program)
    return program


def _from_key_data(fn: Callable[..., list], impls: list) -> Callable[..., list]:
    """``fn`` of PRNG keys as a function of their key data (members of a group have keys of one kind)."""
    return lambda *data: fn(*[jax.random.wrap_key_data(d, impl=impl) for d, impl in zip(data, impls, strict=True)])


def _is_key(v) -> bool:
    return jax.dtypes.issubdtype(getattr(v.aval, "dtype", None), jax.dtypes.prng_key)


def _small(eqn) -> bool:
    return all(getattr(v.aval, "shape", None) is not None and math.prod(v.aval.shape) <= SMALL for v in eqn.outvars)


class _Graph:
    """A traced constructor's top-level equations, with what each variable is made by: slices, signatures and
    replays of them."""

    def __init__(self, jaxpr, consts: list):
        self.jaxpr, self.eqns, self.outvars = jaxpr, jaxpr.eqns, list(jaxpr.outvars)
        self.env = dict(zip(jaxpr.constvars, consts, strict=True))
        self.made = {v: i for i, e in enumerate(self.eqns) for v in e.outvars}
        self.slices: dict[int, tuple[list[int], list]] = {}  # parameter -> (equations, keys read), in order
        self._jaxprs: dict[int, tuple[Any, int]] = {}  # id of a nested jaxpr -> (it, its interned signature)
        self._interned: dict[tuple, int] = {}

    def closure(self, roots: list, cut: Callable[[Any], bool] = lambda v: False) -> tuple[list[int], list]:
        """The equations ``roots`` are computed by, in jaxpr order, walking back and stopping at variables
        ``cut`` picks; and those variables, in the order the equations first read them."""
        picked, todo, seen, stops = set(), list(roots), set(), set()
        while todo:
            v = todo.pop()
            if isinstance(v, jc.Literal) or v in seen:
                continue
            seen.add(v)
            if cut(v):
                stops.add(v)
            elif v in self.made and self.made[v] not in picked:
                picked.add(self.made[v])
                todo.extend(self.eqns[self.made[v]].invars)
        order = sorted(picked)
        reads = [v for i in order for v in self.eqns[i].invars if not isinstance(v, jc.Literal)]
        return order, list(dict.fromkeys(v for v in reads if v in stops))

    def groups(self, params: list, placements: list[tuple]) -> tuple[list[list[int]], list[int]]:
        """Parameters (by position) that one program computes from their keys, in groups of two or more; and the
        rest, for one program together."""
        if self.jaxpr.effects:  # side effects run once, in order: the constructor as one program
            return [], list(range(len(params)))
        heavy = {v for v, c in self.env.items() if math.prod(np.shape(c)) > SMALL}  # what a large value went into
        for e in self.eqns:
            if not _small(e) or any(v in heavy for v in e.invars if not isinstance(v, jc.Literal)):
                heavy.update(e.outvars)
        rest = set()
        for m, v in enumerate(params):
            if isinstance(v, jc.Literal) or v in self.env or _is_key(v):
                rest.add(m)
                continue
            self.slices[m] = self.closure([v], _is_key)
            if any(k in heavy for k in self.slices[m][1]):
                rest.add(m)
        uses = Counter(i for order, _ in self.slices.values() for i in order)
        shared = {i for i, n in uses.items() if n > 1 and not _small(self.eqns[i])}
        rest.update(m for m, (order, _) in self.slices.items() if shared.intersection(order))
        by_signature: dict[tuple, list[int]] = {}
        for m in sorted(self.slices.keys() - rest):
            by_signature.setdefault((self._signature(m, params[m]), tuple(placements[m])), []).append(m)
        groups = [g for g in by_signature.values() if len(g) > 1]
        rest.update(g[0] for g in by_signature.values() if len(g) == 1)
        return groups, sorted(rest)

    def evaluate(self, roots: list) -> tuple[list, list]:
        """``roots`` and their values, computed eagerly (the key chain)."""
        roots = list(dict.fromkeys(roots))
        order, _ = self.closure(roots)
        return roots, self.replay(order, [], roots)()

    def replay(self, order: list[int], inputs: list, outvars: list) -> Callable[..., list]:
        """A function of values for ``inputs`` running equations ``order`` and returning ``outvars``, each
        equation under its source line (errors and warnings then name the user's line)."""
        eqns = [self.eqns[i] for i in order]

        def run(*values):
            env = dict(self.env)
            env.update(zip(inputs, values, strict=True))
            return run_equations(eqns, env, outvars)

        return run

    def _signature(self, m: int, root) -> tuple:
        """Parameter ``m``'s slice with its variables renamed by position, its keys by their place alone."""
        order, cuts = self.slices[m]
        names = {v: ("key", k, v.aval) for k, v in enumerate(cuts)}
        return self._ops([self.eqns[i] for i in order], names), self._ref(root, names)

    def _ops(self, eqns: list, names: dict) -> tuple:
        ops = []
        for j, e in enumerate(eqns):
            ops.append((e.primitive, self._canon(e.params), tuple(self._ref(v, names) for v in e.invars),
                        tuple(v.aval for v in e.outvars)))
            names.update((v, ("eqn", j, o)) for o, v in enumerate(e.outvars))
        return tuple(ops)

    def _ref(self, v, names: dict) -> tuple:
        if isinstance(v, jc.Literal):
            return "literal", v.aval, self._canon(v.val)
        if v in names:
            return names[v]
        return "const", self._canon(self.env[v])

    def _canon(self, x) -> Any:
        """A hashable value equal for params that act alike: nested jaxprs by their signature, small arrays and
        floats bit for bit (0.0 and -0.0 differ), other hashable values as they compare (with their type), anything
        else by identity (every object named is held by the jaxpr, so no id is reused meanwhile)."""
        if isinstance(x, (jc.ClosedJaxpr, jc.Jaxpr)):
            return "jaxpr", self._nested(x)
        if isinstance(x, (tuple, list)):
            return type(x), tuple(map(self._canon, x))
        if isinstance(x, dict):
            return dict, tuple((k, self._canon(x[k])) for k in sorted(x))
        if isinstance(x, (np.ndarray, np.generic)) and x.size <= SMALL:
            return "array", x.shape, x.dtype.str, x.tobytes()
        if isinstance(x, (float, complex)):
            return type(x), np.asarray(x).tobytes()
        try:
            hash(x)
        except TypeError:
            return "object", id(x)
        return type(x), x

    def _nested(self, jaxpr) -> int:
        """A nested jaxpr's signature, interned (one nested jaxpr is read by many slices)."""
        if id(jaxpr) not in self._jaxprs:
            inner, consts = open_jaxpr(jaxpr)
            names = {v: ("in", k, v.aval) for k, v in enumerate(inner.invars)}
            names.update((v, ("const", self._canon(c))) for v, c in zip(inner.constvars, consts, strict=True))
            signature = self._ops(inner.eqns, names), tuple(self._ref(v, names) for v in inner.outvars)
            self._jaxprs[id(jaxpr)] = jaxpr, self._interned.setdefault(signature, len(self._interned))
        return self._jaxprs[id(jaxpr)][1]
