"""Elementwise primitives: shards follow the output dim, Partials follow the algebra of the function.

Every elementwise primitive keeps a shard on any dim (``algebra.pointwise``: rank-0 operands, the scalars a
jaxpr broadcasts, stay Replicate). Which pending reductions survive is the function's algebra, so the
primitives are grouped into named classes below, each a tuple of names with its algebra in a comment, and
each class is registered in one call:

- **additive** (add, sub, add_any, complex): ``P(sum)`` / ``P(avg)`` on every operand stays pending; a
  Replicate operand becomes ``P(sum)`` exactly (value on one coordinate);
- **linear in one operand** (neg, real parts, mul, div's numerator, shift_left): one ``P(sum|avg)``
  operand, the others Replicate;
- **monotone**: a map that is non-decreasing in an operand (the others Replicate) keeps ``P(max)`` and
  ``P(min)`` there; a non-increasing one swaps them (neg, erfc, rsqrt). Maps defined only on
  ``[a, inf)`` (log, sqrt) keep only ``P(min)``: the parts of a ``P(max)`` that lose may lie outside
  the domain, where they would turn into NaN;
- ``max(P(max), P(max))`` and ``min(P(min), P(min))`` stay pending (the reduction itself).

``P(avg)`` is linear only for inexact dtypes: integer averages round, and rounding does not commute.
Integer arithmetic wraps as in JAX: sums stay exact modulo 2**bits; order claims (``x * 2`` keeps
``P(max)``) assume the values do not overflow, as JAX's own integer arithmetic does.

>>> import jax.numpy as jnp; from jax.core import ShapedArray
>>> f = ShapedArray((4, 6), jnp.float32)
>>> from jshard.rules.registry import rule_for
>>> "exp" in NON_DECREASING, rule_for("exp").strategies((f,), (f,), {})
(True, [(Φ0, Φ0), (Φ1, Φ1), (P(max), P(max)), (P(min), P(min))])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .algebra import (
    AVG,
    LINEAR,
    MAX,
    MIN,
    ORDER,
    SUM,
    R,
    homomorphic,
    inexact,
    linear,
    linear_in,
    monotone,
    pointwise,
)
from .registry import ShardPlaceholder, register

__all__ = ["IDENTITY", "COMPLEX_PARTS", "NEGATION", "NON_DECREASING", "NON_INCREASING", "DOMAIN_LIMITED",
           "DOMAIN_LIMITED_DECREASING", "BITWISE_NOT", "INTEGER_POW", "UNARY_PLAIN", "ADDITIVE",
           "SUBTRACTIVE", "COMPLEX", "MULTIPLICATIVE", "DIVISION", "SHIFT_LEFT", "NON_DECREASING_IN_FIRST",
           "SHIFT_RIGHT_LOGICAL", "MAXIMUM", "MINIMUM", "INCOMPLETE_GAMMA", "INCOMPLETE_GAMMA_COMPLEMENT",
           "BINARY_PLAIN", "ELEMENTWISE"]

# What a class keeps beyond the shards: ``keeps(ins, outs, params)`` lists tuples ``(out, operands...)``.
_Keeps = Callable[[Sequence[Any], Sequence[Any], dict], list[tuple]]


def _const_sign(a) -> int:
    """+1 / -1 when the operand is a known constant of one strict sign, else 0."""
    v = getattr(a, "value", None)
    if v is None:
        return 0
    v = np.asarray(v)
    if v.dtype == np.bool_ or not np.isrealobj(v):
        return 0
    if np.all(v > 0):
        return 1
    if np.all(v < 0):
        return -1
    return 0


def _always(tuples: list[tuple]) -> _Keeps:
    """A class whose algebra does not depend on dtypes, constants or params."""
    return lambda ins, outs, params: tuples


# -- unary: tuples (out, x); dtypes are the operand's ---------------------------------------------------

# f(x) = x: every pending reduction passes
IDENTITY = ("copy", "stop_gradient")
# linear over the reals, f(a1 + a2) = f(a1) + f(a2), but not ordered (complex numbers): P(sum|avg) pass
COMPLEX_PARTS = ("real", "imag", "conj")
# f(x) = -x: linear, and order-reversing (a max of the parts becomes a min)
NEGATION = ("neg",)
# non-decreasing on their whole domain: f(max a_i) = max f(a_i), and min alike
NON_DECREASING = ("exp", "exp2", "expm1", "tanh", "logistic", "sinh", "asinh", "atan", "erf", "cbrt",
                  "floor", "ceil", "round", "sign", "reduce_precision")
# non-increasing on their whole domain: max and min swap
NON_INCREASING = ("erfc",)
# non-decreasing, but defined only on [a, inf): P(min) alone passes (see algebra.monotone)
DOMAIN_LIMITED = ("log", "log2", "log1p", "sqrt", "acosh")  # log2: its own primitive since jax 0.11.2
# non-increasing on (0, inf), defined only there: P(min) in, P(max) out
DOMAIN_LIMITED_DECREASING = ("rsqrt",)
# ~x = -x - 1 on integers: order-reversing; on bools no algebra
BITWISE_NOT = ("not",)
# x ** y for a static integer y: x itself for y = 1, non-decreasing for odd y > 0, else no algebra
INTEGER_POW = ("integer_pow",)
# neither linear nor monotone: shards only
UNARY_PLAIN = ("abs", "square", "sin", "cos", "tan", "asin", "acos", "atanh", "cosh", "lgamma", "digamma",
               "erf_inv", "is_finite", "population_count", "clz", "bessel_i0e", "bessel_i1e",
               "one_minus_square")  # 1 - x**2: tanh's derivative, emitted by jax.grad since jax 0.11.2


def _integer_pow(ins, outs, params) -> list[tuple]:
    y = params["y"]
    if y == 1:
        return linear_in(1, 0, linear(ins[0].dtype)) + monotone(1, 0, True)
    return monotone(1, 0, True) if y > 0 and y % 2 == 1 else []


_UNARY: tuple[tuple[tuple[str, ...], _Keeps], ...] = (
    (IDENTITY, lambda ins, outs, params: linear_in(1, 0, linear(ins[0].dtype)) + monotone(1, 0, True)),
    (COMPLEX_PARTS, lambda ins, outs, params: linear_in(1, 0, linear(ins[0].dtype))),
    (NEGATION, lambda ins, outs, params: linear_in(1, 0, linear(ins[0].dtype)) + monotone(1, 0, False)),
    (NON_DECREASING, _always(monotone(1, 0, True))),
    (NON_INCREASING, _always(monotone(1, 0, False))),
    (DOMAIN_LIMITED, _always(monotone(1, 0, True, ops=(MIN,)))),
    (DOMAIN_LIMITED_DECREASING, _always(monotone(1, 0, False, ops=(MIN,)))),
    (BITWISE_NOT, lambda ins, outs, params: [] if ins[0].dtype == np.bool_ else monotone(1, 0, False)),
    (INTEGER_POW, _integer_pow),
    (UNARY_PLAIN, _always([])),
)


# -- binary: tuples (out, a, b); dtypes are the output's ------------------------------------------------

# a + b (add_any: autodiff's sum of cotangents): additive in both operands, non-decreasing in each
ADDITIVE = ("add", "add_any")
# a - b: additive in both operands, non-decreasing in a, non-increasing in b
SUBTRACTIVE = ("sub",)
# complex(a, b) = a + ib: additive in both operands, no order
COMPLEX = ("complex",)
# a * b: linear in each operand (the other Replicate); monotone in one when the other is a one-sign constant
MULTIPLICATIVE = ("mul",)
# a / b, inexact only (integer division rounds): linear in a; monotone in a when b is a one-sign constant
DIVISION = ("div",)
# x << k = x * 2**k, wrapping like integer sums do: linear (P(sum)) and non-decreasing in x
SHIFT_LEFT = ("shift_left",)
# non-decreasing in the first operand: nextafter(x, y); x >> k = floor(x / 2**k)
NON_DECREASING_IN_FIRST = ("nextafter", "shift_right_arithmetic")
# floor(x / 2**k) as well, but a logical shift orders only unsigned values
SHIFT_RIGHT_LOGICAL = ("shift_right_logical",)
# the reduction itself: max(P(max), P(max)) stays pending; non-decreasing in each operand
MAXIMUM = ("max",)
MINIMUM = ("min",)
# regularized incomplete gammas of (a, x), monotone in x on [0, inf) only: P(min) in x, igamma
# non-decreasing, igammac non-increasing
INCOMPLETE_GAMMA = ("igamma",)
INCOMPLETE_GAMMA_COMPLEMENT = ("igammac",)
# no algebra: shards only
BINARY_PLAIN = ("pow", "atan2", "rem", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
                "igamma_grad_a", "polygamma", "zeta", "regularized_incomplete_beta")


def _additive(increasing_in_b: bool) -> _Keeps:
    def keeps(ins, outs, params) -> list[tuple]:
        dtype = outs[0].dtype
        t = homomorphic(2, linear(dtype))
        if inexact(dtype):  # avg(a_i) + r = avg(a_i + r): no conversion of r needed
            t += [(AVG, AVG, R), (AVG, R, AVG)]
        return t + monotone(2, 0, True) + monotone(2, 1, increasing_in_b)

    return keeps


def _multiplicative(ins, outs, params) -> list[tuple]:
    lin = linear(outs[0].dtype)
    t = linear_in(2, 0, lin) + linear_in(2, 1, lin)
    for j in (0, 1):
        s = _const_sign(ins[1 - j])
        if s:
            t += monotone(2, j, s > 0)
    return t


def _division(ins, outs, params) -> list[tuple]:
    dtype, s = outs[0].dtype, _const_sign(ins[1])
    if not inexact(dtype):
        return []
    return linear_in(2, 0, linear(dtype)) + (monotone(2, 0, s > 0) if s else [])


def _own_reduction(own) -> _Keeps:
    return _always(homomorphic(2, [own]) + monotone(2, 0, True) + monotone(2, 1, True))


_BINARY: tuple[tuple[tuple[str, ...], _Keeps], ...] = (
    (ADDITIVE, _additive(True)),
    (SUBTRACTIVE, _additive(False)),
    (COMPLEX, lambda ins, outs, params: homomorphic(2, linear(outs[0].dtype))),
    (MULTIPLICATIVE, _multiplicative),
    (DIVISION, _division),
    (SHIFT_LEFT, _always(linear_in(2, 0, [SUM]) + monotone(2, 0, True))),
    (NON_DECREASING_IN_FIRST, _always(monotone(2, 0, True))),
    (SHIFT_RIGHT_LOGICAL, lambda ins, outs, params: (
        monotone(2, 0, True) if jnp.issubdtype(outs[0].dtype, jnp.unsignedinteger) else [])),
    (MAXIMUM, _own_reduction(MAX)),
    (MINIMUM, _own_reduction(MIN)),
    (INCOMPLETE_GAMMA, _always(monotone(2, 1, True, ops=(MIN,)))),
    (INCOMPLETE_GAMMA_COMPLEMENT, _always(monotone(2, 1, False, ops=(MIN,)))),
    (BINARY_PLAIN, _always([])),
)


# -- more operands, and casts ----------------------------------------------------------------------------


def _select_n(ins, outs, params) -> list[tuple]:
    # the predicate picks the same case on every device, so any pending reduction of all cases survives
    ops = (*linear(outs[0].dtype), *ORDER) if outs[0].dtype != np.bool_ else ()
    return [(p, R) + (p,) * (len(ins) - 1) for p in ops]


def _clamp(ins, outs, params) -> list[tuple]:
    # clamp(lo, x, hi) = min(max(x, lo), hi) is non-decreasing in each operand, and a max (min) over
    # devices passes through the max (min) inside it
    t = monotone(3, 0, True) + monotone(3, 1, True) + monotone(3, 2, True)
    return t + [(MAX, MAX, MAX, R), (MIN, R, MIN, MIN), (MIN, MIN, R, MIN)]


def _polynomial(ins, outs, params) -> list[tuple]:
    # p(x) = sum_k a_k x**k (a primitive since jax 0.12; erf's derivative emits one) is linear in its
    # coefficients together: with x Replicate, coefficients pending alike give p's pending sum or average;
    # and p is non-decreasing in its constant term a_0, so P(max) / P(min) pass there (in a_2 too for real x,
    # but not in IEEE: an infinite part times x**2 = 0 is NaN)
    n = len(ins)
    return [(p, R) + (p,) * (n - 1) for p in linear(outs[0].dtype)] + monotone(n, 1, True)


def _kind(dtype) -> str:
    """'b', 'i' (signed or unsigned), 'f' or 'c'; bfloat16 and the float8s are 'f' (numpy says 'V')."""
    families = (("b", jnp.bool_), ("i", jnp.integer), ("f", jnp.floating), ("c", jnp.complexfloating))
    for kind, family in families:
        if jnp.issubdtype(dtype, family):
            return kind
    return "?"


def _convert(ins, outs, params) -> list[tuple]:
    """A cast keeps a pending reduction only if it commutes with it: casting the reduced value must give what
    reducing the cast parts gives, for every value of the source dtype.

    - float -> float keeps ``P(sum|avg)``: a design decision, DTensor's dtype-cast linearity (each part rounds
      where the sum would round once, within the target's precision);
    - int -> float keeps neither: the parts round where their sum would not (``16777217 - 16777216`` is 1, its
      float32 parts cancel to 0), and an integer sum that wraps on one device does not wrap as floats;
    - int -> int keeps ``P(sum)`` into a target no wider than the source: both sums agree modulo
      ``2**bits(target)``, signed or not; a wider target would undo the wrap-around of the source's sum
      (``127 + 1`` is -128 in int8, 128 in int32). It keeps ``P(avg)`` (``floor`` of the exact mean, which is in
      range) only where every value converts exactly (``can_cast`` safe), so the parts' exact sum is unchanged.
    """
    src, dst = np.dtype(ins[0].dtype), np.dtype(params["new_dtype"])
    ks, kd = _kind(src), _kind(dst)
    if "b" in (ks, kd) or "?" in (ks, kd):
        return []
    if "c" in (ks, kd):
        return linear_in(1, 0, LINEAR) if ks == kd else []
    t = []
    if ks == "f" and kd == "f":
        t += linear_in(1, 0, LINEAR)
    elif ks == "i" and kd == "i":
        if dst.itemsize <= src.itemsize:
            t += [(SUM, SUM)]
        if np.can_cast(src, dst, casting="safe"):
            t += [(AVG, AVG)]
    # order survives rounding and float -> int truncation; integer narrowing or sign changes wrap around
    if ks != "i" or kd != "i" or np.can_cast(src, dst, casting="safe"):
        t += monotone(1, 0, True)
    return t


_OTHERS: tuple[tuple[tuple[str, ...], _Keeps], ...] = (
    (("select_n",), _select_n),
    (("clamp",), _clamp),
    (("convert_element_type",), _convert),
    (("polynomial",), _polynomial),
)


def _elementwise(keeps: _Keeps) -> Callable:
    """The rule of every primitive in a class: the shards, then what the class's algebra keeps."""

    def rule(ins, outs, params) -> list[tuple]:
        return pointwise(ins, outs) + keeps(ins, outs, params)

    return rule


for _names, _keeps in _UNARY + _BINARY + _OTHERS:
    register(*_names)(_elementwise(_keeps))

# every primitive ruled here: each output element made from its operands' at the same index
ELEMENTWISE = frozenset(name for names, _ in _UNARY + _BINARY + _OTHERS for name in names)


@register("bitcast_convert_type")
def _bitcast(ins, outs, params) -> list[tuple]:
    # bits reinterpreted: no algebra survives; a width change adds or drops a minor dim
    rank = min(len(ins[0].shape), len(outs[0].shape))
    return [(ShardPlaceholder(d), ShardPlaceholder(d)) for d in range(rank)]
