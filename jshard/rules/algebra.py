"""The algebra behind the rules: when a pending reduction may stay pending through a function.

A ``Partial(op)`` axis holds one *term* per device; the value is ``op`` over the terms, still to be
computed. A strategy may apply a function ``f`` to the terms and leave the reduction pending only when
``f`` commutes with it: reducing ``f`` of the terms must give ``f`` of the reduced value. Three facts
justify almost every such tuple in ``jshard/rules``:

- **linear maps commute with sums**: ``f(a1 + a2) = f(a1) + f(a2)``. An average is a sum divided by the
  axis size, so it passes too where division does not round (inexact dtypes: integer averages round).
  A function linear in one operand keeps ``P(sum|avg)`` there while the others are Replicate
  (``linear_in``): ``(a1 + a2) * c = a1 * c + a2 * c``;
- **monotone maps commute with max and min**: a non-decreasing ``f`` has ``f(max a_i) = max f(a_i)``,
  a non-increasing one turns the max into a min (``monotone``): ``-max(a_i) = min(-a_i)``;
- **a function that distributes over the reduction itself** keeps it with *every* operand pending alike
  (``homomorphic``): ``(a1 + a2) + (b1 + b2) = (a1 + b1) + (a2 + b2)``, and
  ``max(max a_i, max b_i) = max_i max(a_i, b_i)``.

Each helper returns single-axis tuples ``(output, inputs...)`` for a one-output primitive; the shards
come from ``pointwise`` (or a rule's own dims), and the all-Replicate tuple from the infrastructure.

>>> linear_in(2, 0, LINEAR) + monotone(2, 0, increasing=False)   # x * c for a constant c < 0
[(P(sum), P(sum), R), (P(avg), P(avg), R), (P(min), P(max), R), (P(max), P(min), R)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..placements import REDUCE_OPS, Partial, Replicate
from .registry import ShardPlaceholder

__all__ = ["R", "SUM", "AVG", "MAX", "MIN", "PARTIALS", "LINEAR", "ORDER", "inexact", "linear", "linear_into",
           "swapped", "linear_in", "monotone", "homomorphic", "pointwise"]

R = Replicate()
PARTIALS = SUM, AVG, MAX, MIN = tuple(Partial(op) for op in REDUCE_OPS)
LINEAR = (SUM, AVG)  # the pending reductions that distribute over + and scaling
ORDER = (MAX, MIN)  # the ones that commute with order-preserving maps
_SWAP = {MAX: MIN, MIN: MAX}


def inexact(dtype: Any) -> bool:
    """Whether ``dtype`` is a float or complex type, whose division does not round to an integer: only
    then is ``P(avg)`` linear.

    An integer average rounds, ``floor(a / n) + floor(b / n) != floor((a + b) / n)``, so an integer
    ``P(avg)`` never passes a sum. Integer sums themselves are fine: they wrap modulo ``2**bits``
    consistently, whatever the order of the terms.
    """
    return jnp.issubdtype(dtype, jnp.inexact)


def linear(dtype: Any) -> tuple[Partial, ...]:
    """The pending reductions that pass a map linear over values of ``dtype``: sum always, avg where
    division does not round (``inexact``).

    >>> linear(jnp.float32), linear(jnp.int32)
    ((P(sum), P(avg)), (P(sum),))
    """
    return LINEAR if inexact(dtype) else LINEAR[:1]


def linear_into(in_dtype: Any, out_dtype: Any) -> tuple[Partial, ...]:
    """The pending reductions of one factor that pass a product accumulated in ``out_dtype`` (a
    contraction: ``(a1 + a2) @ b = a1 @ b + a2 @ b``).

    Float into float: sum and avg. Integer into integer: the terms wrap modulo ``2**bits(in)``, and their
    products add up right modulo ``2**bits(out)`` only when that ring is no wider (int8 terms summed in an
    int32 accumulator would not wrap as their int8 sum did). Mixed kinds: none.

    >>> linear_into(jnp.int8, jnp.int8), linear_into(jnp.int8, jnp.int32)
    ((P(sum),), ())
    """
    if inexact(in_dtype) and inexact(out_dtype):
        return LINEAR
    if jnp.issubdtype(in_dtype, jnp.integer) and jnp.issubdtype(out_dtype, jnp.integer):
        return LINEAR[:1] if np.dtype(out_dtype).itemsize <= np.dtype(in_dtype).itemsize else ()
    return ()


def swapped(p: Partial) -> Partial:
    """``P(max)`` for ``P(min)`` and back: what a non-increasing map makes of an order reduction."""
    return _SWAP[p]


def _one_operand(n: int, j: int, outs: Sequence[Partial], ops: Sequence[Partial]) -> list[tuple]:
    """``(out, R, ..., p, ..., R)`` for each pair of ``outs`` and ``ops``: ``p`` at operand ``j`` of ``n``.
    (One list filled in place: rules run on every uncached selection.)"""
    column = [R] * (n + 1)
    found = []
    for out, p in zip(outs, ops, strict=True):
        column[0], column[j + 1] = out, p
        found.append(tuple(column))
    return found


def linear_in(n: int, j: int, ops: Sequence[Partial]) -> list[tuple]:
    """``f`` of ``n`` operands, linear in operand ``j`` when the others are fixed: each of ``ops`` passes
    from operand ``j`` to the output, the other operands Replicate (the same value in every term).

    >>> linear_in(2, 1, LINEAR)   # c * x
    [(P(sum), R, P(sum)), (P(avg), R, P(avg))]
    """
    return _one_operand(n, j, ops, ops)


def monotone(n: int, j: int, increasing: bool, ops: Sequence[Partial] = ORDER) -> list[tuple]:
    """``f`` of ``n`` operands, monotone in operand ``j`` when the others are fixed (and Replicate): a max or
    min of the terms passes, swapped when ``f`` is non-increasing.

    ``ops=(MIN,)`` for a map defined only on ``[a, inf)``: the terms of a ``P(min)`` that lose are larger
    than the value, so inside the domain; those of a ``P(max)`` may lie outside, where ``f`` is NaN.

    >>> monotone(1, 0, increasing=True)   # exp
    [(P(max), P(max)), (P(min), P(min))]
    """
    return _one_operand(n, j, ops if increasing else [swapped(p) for p in ops], ops)


def homomorphic(n: int, ops: Sequence[Partial]) -> list[tuple]:
    """``f`` of ``n`` operands that distributes over the reduction: ``f(⊕ a_i, ⊕ b_i) = ⊕ f(a_i, b_i)``,
    so each of ``ops`` passes with every operand pending alike (``+`` over sums, ``max`` over maxima).

    >>> homomorphic(2, [MAX])   # max(a, b)
    [(P(max), P(max), P(max))]
    """
    return [(p,) * (n + 1) for p in ops]


def pointwise(ins: Sequence[Any], outs: Sequence[Any], rank: int | None = None) -> list[tuple]:
    """The shards of a pointwise primitive: every output element reads the same position of each operand,
    so a shard on dim ``d`` (any ``d < rank``, the output's rank by default) is kept on every output and
    every operand that spans ``d``; an operand broadcast along ``d`` (rank 0, or size 1 where the output
    is longer) stays Replicate.

    >>> from jax.core import ShapedArray
    >>> x, b = ShapedArray((4, 6), jnp.float32), ShapedArray((1, 6), jnp.float32)
    >>> pointwise((x, b), (x,))
    [(Φ0, Φ0, R), (Φ1, Φ1, Φ1)]
    """
    shape = outs[0].shape
    return [(ShardPlaceholder(d),) * len(outs)
            + tuple(ShardPlaceholder(d) if a.shape and a.shape[d] == shape[d] else R for a in ins)
            for d in range(len(shape) if rank is None else rank)]
