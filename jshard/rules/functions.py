"""Functions with rules of their own: a whole function planned as one equation, its local form free to communicate.

Most of a program is planned equation by equation. Some functions are better run as a unit whose per-device form
is written by hand and talks to the other devices itself: ring attention passes key/value blocks around a mesh
axis with ``ppermute`` while it computes. ``function(strategies, local=...)`` makes such a unit. The decorated
function still means what its body computes at global shapes (outside ``jshard.jit``, and on one device, it *is*
its body), but a traced call is one equation of a primitive made for it, with a ``Rule`` in the registry:

- ``strategies(ins, outs, params)`` lists single-axis placement tuples, as for any primitive (``params`` holds
  the call's keyword arguments and ``jaxpr``, the body traced at global shapes);
- ``local(params, in_specs, out_specs)`` returns the per-device function (local blocks in, a list of blocks out)
  for the N-D specs the engine chose; it may use collectives over the mesh axes the specs name;
- ``communicates(params, in_specs, out_specs)`` lists the collectives ``local`` runs (``Communication`` records): the
  selection adds their cost to the moves it prices, ``explain`` lists and totals them, and on XLA:CPU the
  program's in-flight limit applies.

Gradients: ``vjp=(fwd, bwd)`` (``fwd(*args, **kw) -> (outputs, residuals)``, ``bwd(residuals, cotangents, **kw)
-> input cotangents``, each typically a ``function`` too) makes the backward pass a unit as well; without it JAX
differentiates the body, equation by equation.

A sum over a sharded dim that finishes with a ring of ``ppermute`` steps instead of an all-reduce:

>>> import jax, jax.numpy as jnp, numpy as np, jshard
>>> from jshard import Replicate, Shard
>>> from jshard.cost import Communication
>>> from jshard.rules.registry import ShardPlaceholder
>>> def ring_local(params, ins, outs):
...     axes = tuple(a for a, p in zip(ins[0].mesh.axis_names, ins[0].placements) if p.is_shard)
...     n = int(np.prod([ins[0].mesh.shape[a] for a in axes]))
...     def run(block):
...         total = part = block.sum(0)
...         for _ in range(n - 1):  # pass the running part one step around the ring
...             part = jax.lax.ppermute(part, axes, [(i, (i + 1) % n) for i in range(n)])
...             total = total + part
...         return [total]
...     return run
>>> def ring_traffic(params, ins, outs):
...     axes = tuple(a for a, p in zip(ins[0].mesh.axis_names, ins[0].placements) if p.is_shard)
...     n = int(np.prod([ins[0].mesh.shape[a] for a in axes]))
...     return [Communication("permute", axes, 4 * outs[0].shape[0], count=n - 1)] if axes else []
>>> @function(lambda ins, outs, params: [(Replicate(), ShardPlaceholder(0, even=True))], local=ring_local,
...           communicates=ring_traffic)
... def column_sums(x):
...     return x.sum(0)
>>> mesh = jax.make_mesh((8,), ("x",))
>>> a = np.random.default_rng(0).normal(size=(4096, 64)).astype(np.float32)
>>> x = jshard.distribute(a, mesh, [Shard(0)])
>>> out = jshard.jit(column_sums)(x)
>>> out.placements, bool(np.allclose(out.full(), a.sum(0), atol=1e-3))
((R,), True)
>>> jshard.explain(column_sums, x).totals  # 7 steps of 64 floats: cheaper than gathering 1 MiB
{'permute': (7, 1792)}

The selection weighs the ring against moving the input: a small input is gathered instead, and summed whole.

>>> jshard.explain(column_sums, x[:64]).totals
{'all_gather': (1, 2048)}
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..caches import memo
from ..jaxcompat import ad, batching, jc, lowered, mlir
from .registry import register

__all__ = ["function", "function_names"]

_FUNCTIONS: dict[str, None] = {}  # primitive names of the functions made so far, in order


def function(strategies: Callable[[tuple, tuple, dict], Sequence[tuple]], *,
             local: Callable[[dict, tuple, tuple], Callable], communicates: Callable | None = None,
             check: Callable | None = None, vjp: tuple[Callable, Callable] | None = None,
             name: str | None = None, flops: Callable | None = None) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` becomes one equation with its own rule wherever ``jshard.jit`` traces it (see the module
    docstring). Arrays are passed positionally (pytrees allowed); keyword arguments are static, reach
    ``strategies`` / ``local`` / ``communicates`` in ``params`` and must be hashable. As with ``jax.jit``, the body
    is traced once per argument types and keyword values, so it should depend on nothing else. ``name`` (default:
    the function's qualified name) names its primitive, ``jshard.<name>``, in jaxprs and in ``explain``; ``flops``
    (``(params, in_specs, out_specs) -> float``, optional) the FLOPs one device's local form runs, which a step's
    pricing (``autoplan``, ``predict``) counts as compute (without it the unit computes nothing there)."""
    if not callable(strategies):
        raise TypeError(f"jshard.rules.function: strategies must be a function (ins, outs, params) -> [placement "
                        f"tuples], got {type(strategies).__name__}")
    if not callable(local):
        raise TypeError("jshard.rules.function: local must be a function (params, in_specs, out_specs) -> the "
                        f"per-device function of the blocks, got {type(local).__name__}")
    if vjp is not None and not (isinstance(vjp, tuple) and len(vjp) == 2 and all(map(callable, vjp))):
        raise TypeError(f"jshard.rules.function: vjp must be a pair (fwd, bwd) of functions, got {vjp!r:.80}")

    def decorate(fn: Callable) -> Callable:
        prim = _primitive(f"jshard.{name or getattr(fn, '__qualname__', 'function')}")
        register(prim, local=lambda _, params, ins, outs: local(params, ins, outs), check=check,
                 communicates=communicates, replace=prim.name in _FUNCTIONS, flops=flops)(strategies)  # again
        _FUNCTIONS[prim.name] = None

        def bound(args: tuple, static: dict) -> Any:
            leaves, tree = jax.tree.flatten(args)
            body = _body_of(fn, tree, tuple(sorted(static.items(), key=lambda item: item[0])))  # in any order
            closed, shapes = jax.make_jaxpr(body, return_shape=True)(*leaves)
            out = prim.bind(*leaves, jaxpr=lowered(closed), **static)
            return jax.tree.unflatten(jax.tree.structure(shapes), out)

        @functools.wraps(fn)
        def call(*args: Any, **static: Any) -> Any:
            if vjp is None:
                return bound(args, static)
            fwd, bwd = vjp
            unit = jax.custom_vjp(lambda *a: bound(a, static))
            unit.defvjp(lambda *a: fwd(*a, **static), lambda res, ct: bwd(res, ct, **static))
            return unit(*args)

        call.primitive = prim
        return call

    return decorate


def function_names() -> tuple[str, ...]:
    """Primitive names of the functions given rules with ``function`` (the user's, not jshard's own: the
    validator's samples cover only these).

    >>> same = function(lambda ins, outs, params: [], local=lambda params, ins, outs: lambda x: [x],
    ...                 name="examples.same")(lambda x: x)
    >>> "jshard.examples.same" in function_names()
    True
    """
    return tuple(_FUNCTIONS)


# ---------------------------------------------------------------------------------------------------
# internals


@memo(1024)
def _body_of(fn: Callable, tree, static: tuple) -> Callable:
    """The body of a call with this argument structure and these static keywords: one object for them all, so
    that JAX's trace cache (keyed, as ``jax.jit``'s, on the function, the argument types and JAX's context) traces
    it once. A training step calls attention in every block, and a search prices many steps."""
    return functools.partial(_body, fn, tree, dict(static))


def _body(fn: Callable, tree, static: dict, *leaves) -> Any:
    return fn(*jax.tree.unflatten(tree, leaves), **static)


def _run_body(*args, jaxpr, **_) -> list:
    return jc.jaxpr_as_fun(jaxpr)(*args)


def _primitive(name: str) -> jc.Primitive:
    """A primitive whose meaning is its ``jaxpr`` param: run, lowered, batched and differentiated as the body."""
    prim = jc.Primitive(name)
    prim.multiple_results = True
    prim.def_impl(_run_body)
    prim.def_abstract_eval(lambda *_, jaxpr, **__: jaxpr.out_avals)
    mlir.register_lowering(prim, mlir.lower_fun(_run_body, multiple_results=True))

    def batch(args, dims, *, jaxpr, **static):  # vmapped: the body, batched equation by equation
        return jax.vmap(lambda *a: _run_body(*a, jaxpr=jaxpr), in_axes=dims)(*args), [0] * len(jaxpr.out_avals)

    def jvp(primals, tangents, *, jaxpr, **static):  # the rule's outputs; tangents through the body
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        _, out_tangents = jax.jvp(lambda *a: _run_body(*a, jaxpr=jaxpr), list(primals), tangents)
        return prim.bind(*primals, jaxpr=jaxpr, **static), out_tangents

    batching.primitive_batchers[prim] = batch
    ad.primitive_jvps[prim] = jvp
    return prim
