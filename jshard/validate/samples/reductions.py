"""Reduction, scan and sort programs: every reduced / scanned / sorted dim of uneven and even shapes,
float and integer operands, multi-operand sorts with payloads (argsort's iota) and top_k on either dim."""

import jax.numpy as jnp
from jax import lax

from .values import arr

_SHAPES = [(5, 3), (4, 6)]

_REDUCTIONS = [jnp.sum, jnp.max, jnp.min, jnp.prod, jnp.argmax, jnp.argmin]
_SCANS = [lax.cumsum, lax.cumprod, lax.cummax, lax.cummin, lax.cumlogsumexp]

PROGRAMS = []
for s in _SHAPES:
    x, i = arr(s), arr(s, "int32", lo=-3, hi=3)
    b = arr(s, "bool")
    for axis in (0, 1):
        PROGRAMS += [(lambda a, f=f, axis=axis: f(a, axis=axis), (v,)) for f in _REDUCTIONS for v in (x, i)]
        PROGRAMS += [(lambda a, axis=axis: lax.reduce_xor(a, (axis,)), (i,)),
                     (lambda a, axis=axis: lax.reduce_or(a, (axis,)), (i,)),
                     (lambda a, axis=axis: jnp.all(a, axis=axis), (b,)),
                     (lambda a, axis=axis: jnp.any(a, axis=axis), (b,))]
        for rev in (False, True):
            PROGRAMS += [(lambda a, f=f, axis=axis, rev=rev: f(a, axis=axis, reverse=rev), (x,)) for f in _SCANS]
        PROGRAMS += [(lambda a, f=f, axis=axis: f(a, axis=axis), (i,)) for f in (lax.cumsum, lax.cummax, lax.cummin)]
        y = arr(s, salt=1)
        PROGRAMS += [(lambda a, axis=axis: jnp.sort(a, axis=axis), (x,)),
                     (lambda a, axis=axis: jnp.argsort(a, axis=axis), (x,)),  # sort(x, iota), iota a payload
                     (lambda a, c, axis=axis: lax.sort((a, c), dimension=axis, num_keys=1), (x, y)),
                     (lambda a, c, axis=axis: lax.sort((a, c), dimension=axis, num_keys=2), (i, y)),
                     (lambda a, axis=axis: lax.top_k(a, 2, axis=axis), (x,))]
    PROGRAMS += [(lambda a: jnp.sum(a), (x,)), (lambda a: jnp.max(a), (i,)), (lambda a: jnp.min(a), (x,))]

# three dims: a reduction over two separated dims renumbers the kept one
z = arr((3, 4, 5))
PROGRAMS += [(lambda a: jnp.sum(a, axis=(0, 2)), (z,)), (lambda a: jnp.max(a, axis=(0, 2)), (z,)),
             (lambda a: jnp.argmin(a, axis=1), (z,)), (lambda a: lax.cumsum(a, axis=1), (z,))]
# size-1 reduced / scanned / sorted dims: nothing moves, every Partial passes
w = arr((5, 1))
PROGRAMS += [(lambda a: jnp.sum(a, axis=1), (w,)), (lambda a: jnp.prod(a, axis=1), (w,)),
             (lambda a: lax.cumsum(a, axis=1), (w,)), (lambda a: lax.cumprod(a, axis=1), (w,)),
             (lambda a, c: lax.sort((a, c), dimension=1, num_keys=1), (w, arr((5, 1), salt=1)))]
