"""Tracing a function to a plan, and compiling the plan as one ``shard_map`` program over block storage.

``trace`` runs the function at global shapes (``jax.make_jaxpr``) and plans its jaxpr; ``compile_program``
turns the plan's per-device function into ``jax.jit(jax.shard_map(...))`` over block arrays (every device
holds exactly its block) and returns a ``Program``, whose ``run(blocks)`` is the steady-state call: it checks
that no input was deleted or is donated twice (XLA would kill the process), runs, and returns the output
blocks (``out_specs`` say what they mean).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import gc
import operator
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..cost import CostModel
from ..darray import DArray, DeletedArrayError, adopt, donation_of, donation_slot
from ..jaxcompat import is_sharding_type_error, open_jaxpr, source_info_util
from ..planner import model_in_force, pricing
from ..spec import Spec, block_of, block_sharding, local_of
from .kernel import communicates, local_function
from .walk import JaxprPlan, plan_jaxpr

__all__ = ["CPU_IN_FLIGHT", "TRACED_DARRAY", "Program", "Traced", "compile_program", "trace", "tracing_mesh"]

# equations are attributed to the user's line: the wrapper that calls the user's function is not it
source_info_util.register_exclusion(os.path.abspath(__file__))

CPU_IN_FLIGHT = 4  # collective programs queued at once on XLA:CPU (see Program)

TRACED_DARRAY = ("jshard.jit: {what}: a DArray reached a JAX transformation (jax.jit, lax.scan, jax.grad, ...) "
                 "or was closed over by a jshard.jit function. DArrays run through jshard.jit as arguments: wrap "
                 "the whole computation in jshard.jit and pass every DArray it uses as an argument")

_IS_DELETED = operator.methodcaller("is_deleted")
# jax 0.10 kills the process when a donating program on several devices is given a deleted buffer, so such calls
# are checked first; later releases (and every non-donating call) raise, and run() names the argument afterwards
_CRASHES_ON_DELETED = jax.__version_info__[:2] < (0, 11)


@dataclass
class Traced:
    """A traced and planned function."""

    out_tree: Any  # the tree structure of its outputs
    plan: JaxprPlan
    pins: list  # per output: the spec it is moved to, or None
    lifted: list  # the sharded arrays it closed over (DArrays), the plan's first inputs

    @property
    def out_specs(self) -> list[Spec]:
        return [p or s for s, p in zip(self.plan.out_specs, self.pins, strict=True)]


@contextlib.contextmanager
def paused_collector():
    """Python's cyclic garbage collector, paused while a program is traced, planned and compiled (or a plan
    searched, ``jshard.parallel.autoplan``).

    These make some 10^5 short-lived objects, and each time enough pile up the collector walks the whole live
    heap (the user's model, JAX's caches): 10-15% of a GPT step's first call. Paused, it runs as usual after
    (the objects are freed by reference counting meanwhile; cycles wait for the next collection)."""
    if not gc.isenabled():  # the user paused it: leave it so
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@paused_collector()
def trace(fn: Callable, treedef, specs: list[Spec], mesh: Mesh, pins: Callable[[Any, int], list],
          weak: list[bool] | None = None, name: str = "", cost_model: CostModel | None = None) -> Traced:
    """Trace ``fn`` (called with the leaves unflattened by ``treedef``) at global shapes and plan it; ``weak``
    marks Python scalars, which JAX types weakly (``x * 2.0`` keeps ``x``'s dtype). ``pins(out_tree, n_out)``
    gives per output the placements it is pinned to, or None; ``name`` is the function's, for errors;
    ``cost_model`` prices the plan (None: the model in force)."""
    weak = weak or [False] * len(specs)
    avals = [jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=w) for s, w in zip(specs, weak, strict=True)]

    def traced(*leaves):
        out = fn(*jax.tree.unflatten(treedef, leaves))
        bad = [(jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(out)[0]
               if not isinstance(v, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))]
        if bad:
            raise TypeError(f"jshard.jit: {name or 'the function'} returned a {type(bad[0][1]).__name__} "
                            f"({bad[0][1]!r:.40}) at output{bad[0][0] or ''}; a jshard.jit function returns arrays "
                            "(or pytrees of arrays)")
        return out

    shared = _SHARED.get()
    if shared is not None and shared[1] in shared[0]:
        closed, out_shape = shared[0][shared[1]]
    else:
        token = _TRACING.set(mesh)
        try:
            closed, out_shape = _jaxpr(traced, avals, mesh)
        finally:
            _TRACING.reset(token)
        if shared is not None:
            shared[0][shared[1]] = (closed, out_shape)
    if shared is not None and shared[2] is not None:
        closed = shared[2](closed)
    out_tree = jax.tree.structure(out_shape)
    pinned = [None if pin is None else Spec.create(mesh, pin, a.shape, a.dtype, where=f"out_placements (output {i})")
              for i, (pin, a) in enumerate(zip(pins(out_tree, len(closed.out_avals)), closed.out_avals, strict=True))]
    lifted = [_lifted(c, mesh, name) for c in open_jaxpr(closed)[1]]
    with pricing(cost_model or model_in_force()):
        plan = plan_jaxpr(closed, specs, mesh, pinned, [d.spec if d is not None else None for d in lifted])
    return Traced(out_tree, plan, pinned, [d for d in lifted if d is not None])


def tracing_mesh() -> Mesh | None:
    """The mesh of the ``jshard.jit`` function being traced (None outside one): code that binds equations of its
    own (a pipeline) reads the mesh's axes from it."""
    return _TRACING.get()


_TRACING: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("jshard_tracing_mesh", default=None)


@contextlib.contextmanager
def shared_trace(store: dict, key: Any, adapt: Callable | None = None) -> Iterator[None]:
    """While open, ``trace`` takes its jaxpr from ``store[key]`` when there (else traces and puts it there) and only
    plans it. For a caller tracing functions it knows give one jaxpr (``autoplan``: one step under plans that differ
    only in which devices each mesh axis holds, or in constraints it sets itself), so that it plans each of them
    without tracing it again. ``adapt(closed jaxpr) -> closed jaxpr`` makes the jaxpr this caller's before it is
    planned (``autoplan`` sets each candidate's gradient pins in it)."""
    token = _SHARED.set((store, key, adapt))
    try:
        yield
    finally:
        _SHARED.reset(token)


_SHARED: contextvars.ContextVar[tuple[dict, Any, Callable | None] | None] = contextvars.ContextVar(
    "jshard_shared_trace", default=None)


def _jaxpr(traced: Callable, avals: list, mesh: Mesh) -> tuple[Any, Any]:
    """``jax.make_jaxpr(traced, return_shape=True)(*avals)``, under the call's mesh where JAX's sharding types
    need one.

    A function closing over an array on Explicit mesh axes computes with sharded types, and some of JAX's
    rules (the transpose of a matmul with such a weight, under ``jax.grad``) type their result after an input
    that, traced at global shapes with no mesh around, has none: a ``ShardingTypeError``, which ``jax.jit``
    avoids because its arguments are on the mesh. The trace is then done again with the call's mesh as JAX's
    mesh (as ``with jax.set_mesh(mesh):`` does), where the inputs are replicated on it, as they are in the
    plan's view before placement. Only on that error: a mesh in force changes more than types (Flax places
    annotated variables itself under one), so a function that traces without it is traced without it."""
    try:
        return jax.make_jaxpr(traced, return_shape=True)(*avals)
    except Exception as e:
        if not (is_sharding_type_error(e) and jax.sharding.get_abstract_mesh().empty):
            raise
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            try:
                return jax.make_jaxpr(traced, return_shape=True)(*avals)
            except Exception:
                raise e from None


def _lifted(const: Any, mesh: Mesh, name: str) -> DArray | None:
    """A closed-over constant as a DArray input, when it is a ``jax.Array`` split over the mesh's devices or
    spanning other processes (as a literal it would be fetched whole to the host); None for the others.

    One on Explicit mesh axes (``jax.make_mesh``'s default) carries its sharding in its type, and so do the
    equations that use it; the plan reads only shapes and dtypes, and the body runs on local blocks, so it is
    lifted like any other: the sharding it has is where its blocks start from."""
    if not (isinstance(const, jax.Array) and isinstance(const.sharding, NamedSharding)):
        return None
    if const.is_fully_replicated and const.is_fully_addressable:
        return None  # a literal: every device may hold it whole
    return adopt(const, mesh, f"a constant {name or 'the function'} closes over")


class Program:
    """A compiled traced function over block storage: ``run(blocks)`` gives the output blocks, laid out as
    ``out_specs`` (``out_tree`` rebuilds the outputs' structure); ``jitted`` is the ``jax.jit`` program.

    XLA:CPU runs every device's part of a program on one shared thread pool: with many collective programs
    queued, parts of one program can wait on each other until the rendezvous aborts the process. There,
    programs that communicate return a completion token (never donated) and at most ``CPU_IN_FLIGHT`` of them
    are queued."""

    def __init__(self, traced: Traced, specs: list[Spec], mesh: Mesh, donated: tuple[int, ...] = (), *,
                 name: str = "", where: Callable[[int], str] = str):
        self.out_specs, self.out_tree = traced.out_specs, traced.out_tree
        self.single = self.out_tree == jax.tree.structure(0)  # one array out: no tree to rebuild
        self._specs, self._name, self._where = specs, name, where
        self._lifted = [d.block for d in traced.lifted]  # closed-over sharded arrays: the first inputs
        lift = len(self._lifted)
        self._donated, self._donated_set = donated, frozenset(donated)
        self._slot = donation_slot(lambda i: where(i) + " (jshard.jit donate_argnums)") if donated else None
        run = local_function(traced.plan, traced.pins)
        in_specs = [d.spec for d in traced.lifted] + list(specs)
        self._bounded = mesh.devices.flat[0].platform == "cpu" and communicates(traced.plan, traced.pins)
        self._in_flight: collections.deque = collections.deque()
        self._compiled = False  # the first call traces the body and compiles it (see paused_collector)

        def body(*blocks):
            results = run(*[local_of(b, s) for b, s in zip(blocks, in_specs, strict=True)])
            token = [jnp.zeros((), jnp.bool_)] if self._bounded else []
            return [block_of(r) for r in results + token]

        block = block_sharding(mesh).spec
        self.jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(block,) * (lift + len(specs)),
                                            out_specs=[block] * (len(self.out_specs) + self._bounded),
                                            check_vma=False), donate_argnums=tuple(lift + i for i in donated))

    def lower(self, blocks: list) -> Any:
        """The lowered ``jax.jit`` program for input ``blocks`` (``.as_text()``, ``.compile()``)."""
        with paused_collector():
            return self.jitted.lower(*self._lifted, *blocks)

    def call(self, blocks: list) -> Any:
        """A call's outputs: DArrays in the function's output structure (``run``'s blocks, wrapped)."""
        out = self.run(blocks)
        if self.single:
            return DArray(out[0], self.out_specs[0])
        return jax.tree.unflatten(self.out_tree, [DArray(b, s) for b, s in zip(out, self.out_specs, strict=True)])

    def run(self, blocks: list) -> list:
        """The output blocks of a call on input ``blocks``."""
        if self._donated:
            if _CRASHES_ON_DELETED:
                self._check_blocks(blocks)
            if len({id(b) for b in blocks}) < len(blocks):
                self._refuse_shared_donation(blocks)
            self._slot.blocks = blocks
        try:
            if self._compiled:
                out = self.jitted(*self._lifted, *blocks)
            else:
                with paused_collector():
                    out = self.jitted(*self._lifted, *blocks)
                self._compiled = True
        except (RuntimeError, ValueError):  # JAX's own refusal of a deleted buffer: say which argument, and why
            self._check_blocks(blocks)
            raise
        if out and isinstance(out[0], jax.core.Tracer):  # blocks traced by an enclosing transformation
            self._check_blocks(blocks)
        if self._bounded:
            self._in_flight.append(out.pop())
            if len(self._in_flight) > CPU_IN_FLIGHT:
                self._in_flight.popleft().block_until_ready()
        return out

    def _check_blocks(self, blocks: list) -> None:
        """Refuse deleted blocks (naming the call they were donated to) and traced ones."""
        try:
            deleted = any(map(_IS_DELETED, blocks))
        except (AttributeError, jax.errors.ConcretizationTypeError):  # a DArray unflattened inside jax.jit, ...
            what = f"{self._name} got DArrays whose blocks are JAX tracers"
            raise TypeError(TRACED_DARRAY.format(what=what)) from None
        if deleted:
            self._refuse_deleted(blocks)

    def _refuse_deleted(self, blocks: list) -> None:
        i = next(i for i, b in enumerate(blocks) if b.is_deleted())
        went = donation_of(blocks[i])
        raise DeletedArrayError(f"jshard.jit: {self._where(i)} ({self._specs[i]}) has been deleted"
                                + (f": it was donated to {went}" if went else "")
                                + "; its storage belongs to that call's outputs: pass them instead")

    def _refuse_shared_donation(self, blocks: list) -> None:
        """Raise where one array is donated and also passed again (donated twice, or donated and kept)."""
        first: dict = {}
        for i, b in enumerate(blocks):
            j = first.setdefault(id(b), i)
            if j != i and (i in self._donated_set or j in self._donated_set):
                both = i in self._donated_set and j in self._donated_set
                raise ValueError(f"jshard.jit: {self._where(j)} and {self._where(i)} are the same array, and "
                                 f"{'both are' if both else 'one is'} donated: donated storage is handed to the "
                                 "outputs, so it cannot also be read; pass a copy (x.redistribute(x.placements) "
                                 "after jshard.jit, or jnp.copy) or donate neither")


def compile_program(fn: Callable, treedef, specs: list[Spec], mesh: Mesh, pins: Callable[[Any, int], list],
                    donated: tuple[int, ...] = (), weak: list[bool] | None = None, *, name: str = "",
                    where: Callable[[int], str] = str, cost_model: CostModel | None = None) -> Program:
    """``trace`` and compile: the ``Program`` of ``fn`` for inputs with ``specs``; ``name`` and ``where(leaf)``
    (the user's name for an input leaf) make a call's errors name the function and the argument; ``cost_model``
    prices the plan and its lowering (None: the model in force)."""
    with paused_collector():
        return Program(trace(fn, treedef, specs, mesh, pins, weak, name, cost_model), specs, mesh, donated,
                       name=name, where=where)
