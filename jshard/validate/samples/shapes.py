"""Shape programs: the reshapes, broadcasts, transposes, slices and joins of a training step (attention
heads split and merged, keepdims statistics broadcast back, x[i], x[:1], q/k/v split and concatenated),
plus flattens whose chunk boundaries do and do not line up, unit dims and integer / bool dtypes."""

import jax.numpy as jnp
import numpy as np
from jax import lax

from .values import arr

PROGRAMS = []

# -- broadcast_in_dim -----------------------------------------------------------------------------
PROGRAMS += [
    (lambda a: jnp.broadcast_to(a, (4, 5, 3)), (arr((5, 3)),)),  # a new leading dim
    (lambda a: jnp.broadcast_to(a[:, None, :], (5, 4, 3)), (arr((5, 3)),)),  # expand_dims, then broadcast from 1
    (lambda a: jnp.broadcast_to(a, (5, 6)), (arr((5, 1)),)),  # keepdims statistic back to full width
    (lambda a: jnp.broadcast_to(a, (2, 4, 6)), (arr((2, 4, 1), "int32"),)),
    (lambda a: lax.broadcast_in_dim(a, (3, 6, 1), (1,)), (arr((6,), "bool"),)),
    (lambda a: lax.broadcast_in_dim(a, (1,), ()), (arr(()),)),  # scalars, as in the training step
    (lambda a: lax.broadcast_in_dim(a, (4, 7), ()), (arr(()),)),
    (lambda a: lax.broadcast_in_dim(a, (1, 3, 1, 4), (1, 2, 3)), (arr((3, 1, 4)),)),  # unit dims both sides
]

# -- reshape ---------------------------------------------------------------------------------------
_RESHAPES = [
    ((6, 4), (24,)), ((24,), (6, 4)), ((5, 3), (15,)), ((15,), (5, 3)), ((4, 6), (2, 2, 6)),
    ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, 12)), ((2, 3, 4), (3, 8)), ((8,), (2, 4)), ((4, 6), (6, 4)),
    ((2, 6), (4, 3)), ((7, 2), (14,)), ((1, 16), (16,)), ((16,), (1, 16)), ((5, 3, 1), (15,)),
    ((3, 1, 4), (12, 1)), ((1, 4), (4, 1)), ((2, 8, 12), (2, 8, 3, 4)), ((2, 8, 3, 4), (2, 8, 12)),
    ((2, 8, 6), (16, 6)), ((16, 6), (2, 8, 6)), ((9, 4), (3, 3, 4)),
]
PROGRAMS += [(lambda a, s=dst: a.reshape(s), (arr(src),)) for src, dst in _RESHAPES]
PROGRAMS += [(lambda a: a.reshape(15), (arr((5, 3), "int32"),)), (lambda a: a.reshape(2, 3), (arr((6,), "bool"),))]
# a transpose fused into the reshape (conv gradients with feature groups emit these)
PROGRAMS += [(lambda a: lax.reshape(a, (2, 4, 15), dimensions=(0, 2, 1, 3)), (arr((2, 3, 4, 5)),)),
             (lambda a: lax.reshape(a, (6, 5), dimensions=(1, 0)), (arr((5, 6)),))]

# -- transpose, squeeze, rev -------------------------------------------------------------------------
PROGRAMS += [(lambda a: a.T, (arr((5, 3)),)), (lambda a: a.T, (arr((4, 6), "int32"),))]
PROGRAMS += [(lambda a, p=p: jnp.transpose(a, p), (arr((2, 3, 5)),)) for p in [(1, 2, 0), (0, 2, 1), (2, 0, 1)]]
PROGRAMS += [(lambda a: jnp.transpose(a, (0, 2, 1, 3)), (arr((2, 3, 1, 4)),))]  # heads <-> sequence
PROGRAMS += [
    (lambda a: jnp.squeeze(a, 1), (arr((5, 1, 3)),)),
    (lambda a: jnp.squeeze(a, 0), (arr((1, 6)),)),
    (lambda a: jnp.squeeze(a, (0, 2)), (arr((1, 3, 1)),)),
    (lambda a: jnp.squeeze(a, 2), (arr((2, 4, 1), "int32"),)),
]
PROGRAMS += [(lambda a, d=d: lax.rev(a, d), (arr((5, 3)),)) for d in [(0,), (1,), (0, 1)]]
PROGRAMS += [(lambda a: lax.rev(a, (1,)), (arr((3, 1, 4)),)), (lambda a: lax.rev(a, (0,)), (arr((4, 6), "int32"),))]

# -- concatenate, split ------------------------------------------------------------------------------
PROGRAMS += [
    (lambda a, b: jnp.concatenate([a, b], 0), (arr((5, 3)), arr((2, 3), salt=1))),
    (lambda a, b: jnp.concatenate([a, b], 1), (arr((5, 3)), arr((5, 2), salt=1))),
    (lambda a, b, c: jnp.concatenate([a, b, c], 2), (arr((2, 4, 1)), arr((2, 4, 1), salt=1), arr((2, 4, 1), salt=2))),
    (lambda a, b: jnp.concatenate([a, b], 0), (arr((3, 4), "int32"), arr((2, 4), "int32", salt=1))),
    (lambda a: jnp.split(a, [1, 3], axis=0), (arr((5, 3)),)),
    (lambda a: jnp.split(a, [2], axis=1), (arr((4, 6)),)),
    (lambda a: jnp.split(a, 3, axis=2), (arr((2, 4, 3)),)),  # q, k, v
    (lambda a: jnp.split(a, [1], axis=1), (arr((5, 3), "int32"),)),
    (lambda a: lax.unstack(a, axis=1), (arr((5, 3)),)),
    (lambda a: lax.unstack(a, axis=0), (arr((2, 4, 3), "int32"),)),
    (lambda a, b: lax.stack([a, b], axis=0), (arr((5, 3)), arr((5, 3), salt=1))),
    (lambda a, b, c: lax.stack([a, b, c], axis=2), (arr((2, 4, 3)), arr((2, 4, 3), salt=1), arr((2, 4, 3), salt=2))),
    (lambda a, b: lax.stack([a, b], axis=1), (arr((4, 6), "int32"), arr((4, 6), "int32", salt=1))),
]

# -- pad, slice -------------------------------------------------------------------------------------
_PADS = [((1, 2, 0), (0, 0, 0)), ((0, 0, 0), (2, 1, 1)), ((-1, 1, 0), (0, 0, 0)), ((0, 0, 1), (0, 0, 0)),
         ((1, 0, 0), (0, -1, 0))]
PROGRAMS += [(lambda a, v, c=c: lax.pad(a, v, c), (arr((5, 3)), arr((), salt=1))) for c in _PADS]
PROGRAMS += [(lambda a, c=c: lax.pad(a, np.float32(0), c), (arr((4, 6)),)) for c in _PADS[:2]]
PROGRAMS += [(lambda a, v: lax.pad(a, v, ((0, 0, 0), (1, 1, 0), (0, 0, 0))), (arr((2, 3, 1), dt), arr((), dt)))
             for dt in ("int32", "float32")]
_SLICES = [np.s_[1:4], np.s_[:, ::2], np.s_[:1], np.s_[2:3], np.s_[3:4, 1:], np.s_[::2, 1:2], np.s_[:, :1]]
PROGRAMS += [(lambda a, s=s: a[s], (arr((5, 3)),)) for s in _SLICES]
PROGRAMS += [(lambda a, s=s: a[s], (arr((6, 4), "int32"),)) for s in _SLICES[:3]]
PROGRAMS += [(lambda a: a[:, :, 1:3], (arr((3, 1, 4)),)), (lambda a: a[:1, :, 0:1], (arr((4, 1, 3)),))]

# -- dynamic_slice, dynamic_update_slice --------------------------------------------------------------
_I, _J = np.int32(2), np.int32(1)
PROGRAMS += [
    (lambda a, i: a[i], (arr((5, 3)), _I)),  # x[i]: a traced start for the whole dim too
    (lambda a, i: a[i], (arr((6, 4), "int32"), _J + 2)),
    (lambda a, i: lax.dynamic_slice_in_dim(a, i, 2, 0), (arr((5, 3)), _I)),
    (lambda a, i: lax.dynamic_slice_in_dim(a, i, 2, 1), (arr((4, 6)), _J)),
    (lambda a, i, j: lax.dynamic_slice(a, (i, j), (2, 2)), (arr((5, 3)), _I, _J)),
    (lambda a, i: lax.dynamic_slice(a, (i, 0, 0), (1, 3, 4)), (arr((5, 3, 4)), _I)),
    (lambda a, u, i: lax.dynamic_update_slice_in_dim(a, u, i, 0), (arr((5, 3)), arr((2, 3), salt=1), _I)),
    (lambda a, u, i, j: lax.dynamic_update_slice(a, u, (i, j)), (arr((5, 3)), arr((2, 2), salt=1), _I, _J)),
    (lambda a, u, i: lax.dynamic_update_slice_in_dim(a, u, i, 1),
     (arr((4, 6), "int32"), arr((4, 2), "int32", salt=1), _J)),
    (lambda a, u, i: lax.dynamic_update_slice_in_dim(a, u, i, 0), (arr((5, 1, 3)), arr((1, 1, 3), salt=1), _I)),
    (lambda a, u, i: lax.dynamic_update_slice_in_dim(a, u, i, 0), (arr((6, 1, 4)), arr((2, 1, 4), salt=1), _J + 2)),
]

# -- iota (no inputs: the validator only sees it replicated; tests check sharded outputs) -----------
PROGRAMS += [(lambda: lax.iota(jnp.int32, 7), ()), (lambda: lax.broadcasted_iota(jnp.float32, (5, 3), 1), ())]
