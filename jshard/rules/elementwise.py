"""Elementwise primitives: shards follow the output dim, Partials follow the algebra of the function.

Every elementwise primitive keeps a shard on any dim (rank-0 operands, the scalars a jaxpr broadcasts,
stay Replicate). Which pending reductions survive is the function's algebra, written once per class:

- **additive** (add, sub, neg, add_any, real parts, float casts, ...): ``P(sum)`` / ``P(avg)`` on every
  operand stays pending; a Replicate operand becomes ``P(sum)`` exactly (value on one coordinate);
- **multiplicative** (mul, div's numerator, shift_left): one ``P(sum|avg)`` operand times Replicate ones;
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
>>> [t for t in _rules_for("exp")((f,), (f,), {}) if t[0].is_partial]
[(P(max), P(max)), (P(min), P(min))]
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from .registry import LINEAR, ORDER, R, ShardPlaceholder, register

__all__: list[str] = []

_MAX, _MIN = ORDER
_SWAP = {_MAX: _MIN, _MIN: _MAX}


def _kind_unsigned(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.unsignedinteger)


def _inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _linear_ops(dtype) -> tuple:
    """The Partials that distribute over + for ``dtype``: sum always (integers wrap consistently), avg
    only for inexact dtypes."""
    return LINEAR if _inexact(dtype) else LINEAR[:1]


def _shards(ins, outs) -> list[tuple]:
    # an operand broadcasting along d (rank 0, or size 1 where the output is longer) stays Replicate
    shape = outs[0].shape
    return [tuple([ShardPlaceholder(d)] * len(outs))
            + tuple(ShardPlaceholder(d) if a.shape and a.shape[d] == shape[d] else R for a in ins)
            for d in range(len(shape))]


def _at(n: int, j: int, p, rest=R) -> tuple:
    return tuple(p if i == j else rest for i in range(n))


def _monotone(n: int, j: int, increasing: bool, ops=ORDER) -> list[tuple]:
    """``f`` monotone in operand ``j`` (others Replicate): max/min pass, swapped if decreasing."""
    return [(p if increasing else _SWAP[p],) + _at(n, j, p) for p in ops]


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


# -- classes -----------------------------------------------------------------------------------------

_INCREASING = {  # non-decreasing on their whole domain
    "exp", "exp2", "expm1", "tanh", "logistic", "sinh", "asinh", "atan", "erf", "cbrt",
    "floor", "ceil", "round", "sign", "reduce_precision",
}
_INCREASING_UPWARD = {"log", "log1p", "sqrt", "acosh"}  # non-decreasing on [a, inf): P(min) only
_DECREASING = {"erfc"}
_IDENTITY = {"copy", "stop_gradient"}
_PLAIN = {  # no Partial survives
    "abs", "square", "sin", "cos", "tan", "asin", "acos", "atanh", "cosh", "lgamma", "digamma", "erf_inv",
    "is_finite", "population_count", "clz", "bessel_i0e", "bessel_i1e",
}
_BINARY_PLAIN = {
    "pow", "atan2", "rem", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "igamma_grad_a", "polygamma", "zeta",
    "regularized_incomplete_beta",
}


def _unary(name):
    def rule(ins, outs, params):
        t = _shards(ins, outs)
        dtype = ins[0].dtype
        if name in _IDENTITY or name in ("real", "imag", "conj"):
            ops = (*_linear_ops(dtype), *ORDER) if name in _IDENTITY else _linear_ops(dtype)
            t += [(p, p) for p in ops]
        elif name == "neg":
            t += [(p, p) for p in _linear_ops(dtype)] + _monotone(1, 0, False)
        elif name == "not":
            if dtype != np.bool_:  # ~x = -x - 1 on integers: order-reversing
                t += _monotone(1, 0, False)
        elif name in _INCREASING:
            t += _monotone(1, 0, True)
        elif name in _INCREASING_UPWARD:
            t += _monotone(1, 0, True, ops=(_MIN,))
        elif name in _DECREASING:
            t += _monotone(1, 0, False)
        elif name == "rsqrt":  # decreasing on (0, inf)
            t += _monotone(1, 0, False, ops=(_MIN,))
        elif name == "integer_pow":
            y = params["y"]
            if y == 1:
                t += [(p, p) for p in (*_linear_ops(dtype), *ORDER)]
            elif y > 0 and y % 2 == 1:
                t += _monotone(1, 0, True)
        return t

    return rule


def _binary(name):
    def rule(ins, outs, params):
        t = _shards(ins, outs)
        dtype = outs[0].dtype
        lin = _linear_ops(dtype)
        if name in ("add", "add_any", "sub"):
            t += [(p, p, p) for p in lin]
            if _inexact(dtype):  # avg(a_i) + r = avg(a_i + r): no conversion of r needed
                t += [(LINEAR[1], LINEAR[1], R), (LINEAR[1], R, LINEAR[1])]
            t += _monotone(2, 0, True) + _monotone(2, 1, name != "sub")
        elif name == "mul":
            t += [(p, p, R) for p in lin] + [(p, R, p) for p in lin]
            for j in (0, 1):
                s = _const_sign(ins[1 - j])
                if s:
                    t += _monotone(2, j, s > 0)
        elif name == "div":
            if _inexact(dtype):
                t += [(p, p, R) for p in lin]
            s = _const_sign(ins[1])
            if s and _inexact(dtype):
                t += _monotone(2, 0, s > 0)
        elif name == "shift_left":  # x << k = x * 2**k, wrapping like integer sums do
            t += [(LINEAR[0], LINEAR[0], R)] + _monotone(2, 0, True)
        elif name == "shift_right_arithmetic" or (name == "shift_right_logical" and _kind_unsigned(dtype)):
            t += _monotone(2, 0, True)  # floor(x / 2**k); a logical shift only orders unsigned values
        elif name in ("max", "min"):
            own = _MAX if name == "max" else _MIN
            t += [(own, own, own)] + _monotone(2, 0, True) + _monotone(2, 1, True)
        elif name == "nextafter":
            t += _monotone(2, 0, True)
        elif name in ("igamma", "igammac"):  # regularized incomplete gammas: monotone in x on [0, inf)
            t += _monotone(2, 1, name == "igamma", ops=(_MIN,))
        elif name == "complex":
            t += [(p, p, p) for p in lin]
        return t

    return rule


def _select_n(ins, outs, params):
    # the predicate picks the same case on every device, so any pending reduction of all cases survives
    t = _shards(ins, outs)
    n = len(ins)
    ops = (*_linear_ops(outs[0].dtype), *ORDER) if outs[0].dtype != np.bool_ else ()
    t += [(p, R) + (p,) * (n - 1) for p in ops]
    return t


def _clamp(ins, outs, params):
    # clamp(lo, x, hi) = min(max(x, lo), hi) is non-decreasing in each operand, and a max (min) over
    # devices passes through the max (min) inside it
    t = _shards(ins, outs)
    for j in range(3):
        t += _monotone(3, j, True)
    return t + [(_MAX, _MAX, _MAX, R), (_MIN, R, _MIN, _MIN), (_MIN, _MIN, R, _MIN)]


def _kind(dtype) -> str:
    """'b', 'i' (signed or unsigned), 'f' or 'c'; bfloat16 and the float8s are 'f' (numpy says 'V')."""
    for kind, family in (("b", jnp.bool_), ("i", jnp.integer), ("f", jnp.floating), ("c", jnp.complexfloating)):
        if jnp.issubdtype(dtype, family):
            return kind
    return "?"


def _convert(ins, outs, params):
    """Seed 000: a cast keeps a pending reduction only if it commutes with it."""
    t = _shards(ins, outs)
    src, dst = np.dtype(ins[0].dtype), np.dtype(params["new_dtype"])
    ks, kd = _kind(src), _kind(dst)
    if "b" in (ks, kd) or "?" in (ks, kd):
        return t
    if "c" in (ks, kd):
        return t + ([(p, p) for p in LINEAR] if ks == kd else [])
    if ks == "f" and kd == "f":
        t += [(p, p) for p in LINEAR]
    elif ks == "i" and kd == "f" and src.itemsize >= 4:
        # parts of a narrow integer sum wrap around (250 + 12 is 6 in uint8, 262 as floats); 32-bit parts
        # wrap only where the integer sum itself overflows
        t += [(LINEAR[0], LINEAR[0])]
    elif ks == "i" and kd == "i":
        # a sum agrees modulo 2**bits of a target no wider than the source; widening a narrow sum would
        # undo the wrap-around of its parts
        if dst.itemsize <= src.itemsize or src.itemsize >= 4:
            t += [(LINEAR[0], LINEAR[0])]
        if np.can_cast(src, dst, casting="safe") and src.itemsize >= 4:
            t += [(LINEAR[1], LINEAR[1])]
    # order survives rounding and float -> int truncation; integer narrowing or sign changes wrap around
    if ks != "i" or kd != "i" or np.can_cast(src, dst, casting="safe"):
        t += _monotone(1, 0, True)
    return t


def _bitcast(ins, outs, params):
    # bits reinterpreted: no algebra survives; a width change adds or drops a minor dim
    rank = min(len(ins[0].shape), len(outs[0].shape))
    return [(ShardPlaceholder(d), ShardPlaceholder(d)) for d in range(rank)]


_UNARY = _INCREASING | _INCREASING_UPWARD | _DECREASING | _IDENTITY | _PLAIN | {
    "neg", "not", "rsqrt", "integer_pow", "real", "imag", "conj"}
_BINARY = _BINARY_PLAIN | {"add", "add_any", "sub", "mul", "div", "shift_left", "shift_right_arithmetic",
                           "igamma", "igammac", "shift_right_logical", "max", "min", "nextafter", "complex"}

_TABLE = {n: _unary(n) for n in _UNARY} | {n: _binary(n) for n in _BINARY}
_TABLE.update(select_n=_select_n, clamp=_clamp, convert_element_type=_convert, bitcast_convert_type=_bitcast)


def _rules_for(name: str):
    return _TABLE[name]


for _n, _fn in _TABLE.items():
    register(_n)(_fn)
