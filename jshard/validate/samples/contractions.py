"""Contraction programs: matmuls in every layout a training step uses, integer accumulation, and the
convolutions of a CNN step (NHWC, SAME / VALID, strides, dilations, groups) with both gradients.

bfloat16 operands are left to ``tests/rules/test_rules_contractions.py``: the validator has no padding sentinel
for them yet."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .values import arr


def _dot(dims, preferred=None):
    return lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=preferred)


_MATMUL = (((1,), (0,)), ((), ()))


def _with_grads(f, *args):
    """``f`` on ``args`` and its vjp with a random cotangent: the forward and backward contractions of a
    step (the program traces the forward once, then one contraction per gradient)."""
    g = arr(jax.eval_shape(f, *args).shape, salt=7)
    return [(lambda *a: jax.vjp(f, *a[:-1])[1](a[-1]), (*args, g))]


def _extremes(a: np.ndarray) -> np.ndarray:
    """``a`` with a row at its dtype's maximum and one at its minimum."""
    a = a.copy()
    a[0], a[-1] = np.iinfo(a.dtype).max, np.iinfo(a.dtype).min
    return a


PROGRAMS = []

# -- dot_general -----------------------------------------------------------------------------------
for m, k, n in [(5, 7, 3), (4, 6, 8)]:
    PROGRAMS += _with_grads(jnp.matmul, arr((m, k)), arr((k, n), salt=1))  # x @ w, g @ w.T, x.T @ g
PROGRAMS += [
    (jnp.matmul, (arr((5, 7)), arr((7,), salt=1))),  # matrix-vector
    (jnp.dot, (arr((7,)), arr((7,), salt=1))),  # vector dot: a scalar
    (jnp.dot, (arr((8,)), arr((8,), salt=1))),
    (_dot((((), ()), ((), ()))), (arr((5,)), arr((3,), salt=1))),  # outer product: nothing contracted
]
PROGRAMS += _with_grads(lambda q, kk: jnp.einsum("bhqd,bhkd->bhqk", q, kk),  # attention scores
                        arr((2, 3, 5, 4)), arr((2, 3, 7, 4), salt=1))
PROGRAMS += [
    (lambda p, v: jnp.einsum("bhqk,bhkd->bhqd", p, v), (arr((2, 3, 5, 7)), arr((2, 3, 7, 4), salt=1))),
    # batch dims away from the front, and two of them with a rank-5 operand (attention backward)
    (_dot((((2,), (1,)), ((1,), (0,)))), (arr((5, 2, 4)), arr((2, 4, 3), salt=1))),
    (_dot((((1,), (4,)), ((0, 2), (1, 2)))), (arr((2, 5, 3)), arr((4, 2, 3, 2, 5), salt=1))),
    # integer accumulation; int8 values at the ends of the range, so that parts which wrap around show
    (_dot(_MATMUL, jnp.int32), (_extremes(arr((5, 7), "int8", lo=-128, hi=127)),
                                _extremes(arr((7, 3), "int8", lo=-128, hi=127, salt=1)))),
    (_dot(_MATMUL), (arr((5, 7), "int32"), arr((7, 4), "int32", salt=1))),
]


# -- conv_general_dilated --------------------------------------------------------------------------
def _conv(strides, padding, lhs_dilation=None, rhs_dilation=None, groups=1, dims=("NHWC", "HWIO", "NHWC")):
    return lambda x, w: lax.conv_general_dilated(x, w, strides, padding, lhs_dilation, rhs_dilation, dims, groups)


PROGRAMS += _with_grads(_conv((1, 1), "SAME"), arr((3, 5, 5, 3)), arr((3, 3, 3, 4), salt=1))
PROGRAMS += _with_grads(_conv((2, 2), "VALID"), arr((2, 7, 6, 3)), arr((3, 3, 3, 5), salt=1))
PROGRAMS += _with_grads(_conv((1, 1), "SAME", groups=2), arr((3, 5, 5, 4)), arr((3, 3, 2, 6), salt=1))
# 1x1: spatial dims pointwise in the forward conv, contracted whole in the kernel gradient
PROGRAMS += _with_grads(_conv((1, 1), "VALID"), arr((3, 5, 4, 3)), arr((1, 1, 3, 5), salt=1))
PROGRAMS += [
    (_conv((1, 1), "SAME", rhs_dilation=(2, 2)), (arr((2, 6, 5, 3)), arr((3, 3, 3, 4), salt=1))),
    (_conv((1, 1), ((1, 1), (2, 0)), lhs_dilation=(2, 2)), (arr((2, 4, 3, 3)), arr((3, 2, 3, 5), salt=1))),
    (_conv((1, 1), "VALID", dims=None), (arr((2, 3, 5, 5)), arr((4, 3, 2, 2), salt=1))),  # NCHW / OIHW
    (_conv((2, 1), "SAME"), (arr((2, 5, 5, 3)), arr((3, 3, 3, 4), salt=1))),
]
