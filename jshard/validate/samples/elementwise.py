"""Elementwise programs: every unary / binary / n-ary lax primitive, with Replicate scalars mixed in."""

import jax
import jax.numpy as jnp
import jax.scipy.special
import numpy as np
from jax import lax

from .values import arr

_SHAPES = [(5, 3), (4, 6)]

_UNARY = [lax.neg, lax.sign, lax.floor, lax.ceil, lax.round, lax.exp, lax.exp2, lax.expm1, lax.tanh,
          lax.logistic, lax.sin, lax.cos, lax.atan, lax.sinh, lax.cosh, lax.asinh, lax.erf, lax.erfc, lax.abs,
          lax.square, lax.cbrt, lax.is_finite, lax.stop_gradient, lambda x: lax.reduce_precision(x, 5, 10),
          lambda x: lax.integer_pow(x, 1), lambda x: lax.integer_pow(x, 2), lambda x: lax.integer_pow(x, 3),
          lambda x: lax.integer_pow(x, -1), lax.lgamma, lax.tan]
_POSITIVE = [lax.log, lax.log1p, lax.sqrt, lax.rsqrt, lax.digamma, lambda x: lax.acosh(x + 1.0),
             lambda x: lax.asin(x / 8.0), lambda x: lax.acos(x / 8.0), lambda x: lax.atanh(x / 8.0),
             lambda x: lax.erf_inv(x / 8.0)]
_BINARY = [lax.add, lax.sub, lax.mul, lax.div, lax.max, lax.min, lax.pow, lax.atan2, lax.rem, lax.nextafter,
           lax.eq, lax.ne, lax.lt, lax.le, lax.gt, lax.ge]
_INT_BINARY = [lax.add, lax.sub, lax.mul, lax.div, lax.rem, lax.max, lax.min, lax.bitwise_and, lax.bitwise_or,
               lax.bitwise_xor, lax.shift_left, lax.shift_right_logical, lax.shift_right_arithmetic]

# primitives of newer JAX releases (older ones emit other primitives for the same math)
_NEWER_UNARY = [getattr(lax, n) for n in ("one_minus_square",) if hasattr(lax, n)]
_NEWER_POSITIVE = [lax.log2] if hasattr(lax, "log2_p") else []
_POLYNOMIAL = getattr(lax, "polynomial", None)

PROGRAMS = []
for s in _SHAPES:
    x, y, p = arr(s), arr(s, salt=1), arr(s, positive=True)
    PROGRAMS += [(f, (x,)) for f in _UNARY + _NEWER_UNARY] + [(f, (p,)) for f in _NEWER_POSITIVE]
    if _POLYNOMIAL is not None:  # constant coefficients, and coefficients that are operands (Partial-able)
        PROGRAMS += [(lambda a: _POLYNOMIAL(a, [1.0, -0.5, 0.25, 2.0]), (x,)),
                     (lambda a, c0, c2: _POLYNOMIAL(a, [c0, 0.5, c2]), (x, y, p))]
    special = np.where(x > 3, np.inf, np.where(x < -4, np.nan, x)).astype(np.float32)
    PROGRAMS += [(lax.is_finite, (special,))] + [(f, (p,)) for f in _POSITIVE + [lax.log, lax.sqrt]]
    PROGRAMS += [(f, (x, y)) for f in _BINARY]
    PROGRAMS += [(lax.bessel_i0e, (x,)), (lax.bessel_i1e, (x,)), (lambda a: lax.conj(lax.complex(a, a * 2.0)), (x,)),
                 (jnp.copy, (x,))]
    PROGRAMS += [(f, (p, arr(s, positive=True, salt=4))) for f in (lax.igamma, lax.igammac, lax.igamma_grad_a)]
    PROGRAMS += [(lax.zeta, (p + 1.0, p)), (lax.polygamma, (np.ones(s, np.float32), p)),
                 (jax.scipy.special.betainc, (p, arr(s, positive=True, salt=5), np.full(s, 0.3, np.float32)))]
    # add_any: autodiff summing the cotangents of an input used twice
    PROGRAMS += [(lambda a: jax.grad(lambda z: jnp.sum(jnp.sin(z)) + jnp.sum(z * a))(a), (x,))]
    PROGRAMS += [(lambda a, b: a + b, (x, np.float32(2.5))), (lambda a: a * 2.0, (x,)), (lambda a: a * -3.0, (x,)),
                 (lambda a: a / 4.0, (x,)), (lambda a: a - 1.5, (x,)), (lambda a: 1.5 - a, (x,)),
                 (lambda a, b: lax.pow(a, b), (p, y))]
    i, j = arr(s, "int32"), arr(s, "int32", positive=True, hi=3, salt=2)
    PROGRAMS += [(f, (i, j)) for f in _INT_BINARY] + [(lax.neg, (i,)), (lax.bitwise_not, (i,)), (lax.sign, (i,)),
                                                      (lax.population_count, (i,)), (lax.clz, (i,))]
    b, c = arr(s, "bool"), arr(s, "bool", salt=3)
    PROGRAMS += [(f, (b, c)) for f in (lax.bitwise_and, lax.bitwise_or, lax.bitwise_xor)] + [(lax.bitwise_not, (b,))]
    PROGRAMS += [(lambda q, a, bb: lax.select_n(q, a, bb), (b, x, y)),
                 (lambda q, a, bb, cc: lax.select_n(q, a, bb, cc), (arr(s[:1], "int32", positive=True, hi=3) - 1,
                                                                    x[:, 0], y[:, 0], p[:, 0])),
                 (lambda lo, a, hi: lax.clamp(lo, a, hi), (np.float32(-2.0), x, np.float32(3.0))),
                 (lambda lo, a, hi: lax.clamp(lo, a, hi), (y - 2.0, x, y + 2.0)),
                 (lambda a, bb: lax.complex(a, bb), (x, y)),
                 (lambda a: lax.real(lax.complex(a, a * 2.0)), (x,)),
                 (lambda a: lax.imag(lax.complex(a, a * 2.0)), (x,))]
    for src in ("float32", "int32", "bool", "int8", "uint8"):
        v = arr(s, src) if src != "uint8" else arr(s, src, positive=True)
        for dst in ("float32", "bfloat16", "float16", "int32", "int8", "uint32", "bool"):
            if src != dst:
                PROGRAMS.append((lambda a, dst=dst: lax.convert_element_type(a, np.dtype(jnp.dtype(dst))), (v,)))
    PROGRAMS += [(lambda a: lax.bitcast_convert_type(a, jnp.int32), (x,)),
                 (lambda a: lax.bitcast_convert_type(a, jnp.uint8), (x,)),
                 (lambda a: lax.bitcast_convert_type(a, jnp.float32), (arr(s + (4,), "uint8"),))]
