"""Indexing programs: embedding lookups and their gradients, take / take_along_axis, ``.at[]`` updates.

Ids cover negative values (normalised by jnp), out-of-range values for the ``fill`` / ``drop`` / ``clip``
modes, and repeats (several updates to one row). Shapes mix dims that 2, 3 and 4 divide and that they
do not; float and int32 tables.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .values import arr

_IDS = np.array([[3, 0, 6, 3], [-1, 5, 2, 0], [4, -7, 1, 6]], np.int32)  # rows of a 7-row table, repeats
_OOB = np.array([2, 9, -1, 6, -9, 0], np.int32)  # 9 and -9 are out of range for 7 rows
_ROWS = np.array([1, 4, 6], np.int32)  # distinct rows
_DUP = np.array([5, 1, 5, 2], np.int32)  # row 5 twice


def _windows(x, i):
    """Windows of 2 rows at each start (an explicit gather, slice_sizes (2, ...))."""
    dn = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,))
    return lax.gather(x, i[:, None], dn, (2, x.shape[1]), mode="clip")


t, ti = arr((7, 5)), arr((7, 5), "int32")  # 7 rows, 5 columns: uneven on 2, 3 and 4 devices
PROGRAMS = [
    (lambda a, i: a[i], (t, _IDS)),  # embedding lookup: PROMISE_IN_BOUNDS after normalising negatives
    (lambda a, i: jnp.take(a, i, axis=0, mode="fill"), (t, _OOB)),  # FILL_OR_DROP, fill nan
    (lambda a, i: jnp.take(a, i, axis=0, mode="fill"), (ti, _OOB)),  # int fill: the lowest int32
    (lambda a, i: jnp.take(a, i, axis=0, mode="clip"), (ti, _OOB)),
    (lambda a, i: jnp.take(a, i, axis=1, mode="fill", fill_value=-1), (t, _OOB % 5)),
    (lambda a, i, j: a[i, j], (t, _ROWS, np.array([0, 4, 3], np.int32))),
    (_windows, (t, np.array([0, 5, 6, 2], np.int32))),
    # the scatter-add of a lookup's gradient, into a table that is not zero (zeros hide wrong Partials)
    (lambda a, i, u: a.at[i].add(u), (t, _IDS, arr((3, 4, 5), salt=10))),
    # the gradient itself (jnp.take: FILL_OR_DROP): scatter-add of (ids..., 5) updates into zeros
    (jax.grad(lambda a, i: (jnp.take(a, i, axis=0) * jnp.arange(5)).sum()), (t, _IDS)),
    (lambda a, i, u: a.at[i].set(u), (t, _ROWS, arr((3, 5), salt=1))),
    (lambda a, i, u: a.at[i].set(u), (ti, _ROWS, arr((3, 5), "int32", salt=1))),
    (lambda a, i, u: a.at[:, i].set(u), (t, np.array([3, 0], np.int32), arr((7, 2), salt=9))),
    (lambda a, i, u: a.at[i].add(u), (t, _DUP, arr((4, 5), salt=2))),
    (lambda a, i, u: a.at[i].add(u), (ti, _DUP, arr((4, 5), "int32", salt=2))),
    (lambda a, i, u: a.at[i].add(u, mode="drop"), (t, _OOB, arr((6, 5), salt=3))),
    (lambda a, i, u: a.at[i].add(u, mode="clip"), (t, _OOB, arr((6, 5), salt=3))),
    (lambda a, i, u: a.at[i].add(u, unique_indices=True), (t, _ROWS, arr((3, 5), salt=4))),
    (lambda a, i, u: a.at[i].subtract(u), (t, _DUP, arr((4, 5), salt=5))),
    (lambda a, i, u: a.at[i].multiply(u), (t, _DUP, arr((4, 5), salt=6))),
    (lambda a, i, u: a.at[i].min(u), (t, _DUP, arr((4, 5), salt=7))),
    (lambda a, i, u: a.at[i].max(u), (ti, _DUP, arr((4, 5), "int32", salt=7))),
    (lambda a, i, u: a.at[i].max(u, unique_indices=True), (t, _ROWS, arr((3, 5), salt=8))),
]
t8, ids8 = arr((8, 6)), _IDS % 8  # a table that 2 and 4 divide evenly
PROGRAMS += [
    (lambda a, i: a[i], (t8, ids8)),
    (lambda a, i: jnp.take(a, i, axis=0), (t8, ids8)),
    (lambda a, i, u: a.at[i].min(u), (t8, _DUP, arr((4, 6), salt=7))),
]
for shape, axis in [((5, 6), 1), ((4, 7), 0), ((2, 5, 7), 2)]:
    idx_shape = list(shape)
    idx_shape[axis] = 3
    idx = arr(tuple(idx_shape), "int32", lo=-2, hi=shape[axis] + 1, salt=axis)  # a few out of range: fill / drop
    # the gradient program holds the forward gather (operand_batching_dims) and its scatter-add
    PROGRAMS.append((jax.grad(lambda a, i, axis=axis: jnp.take_along_axis(a, i, axis=axis).sum()), (arr(shape), idx)))
PROGRAMS.append(  # the cross-entropy pattern: one label per row of logits
    (lambda a, i: jnp.take_along_axis(a, i[..., None], axis=-1), (arr((2, 5, 7)), arr((2, 5), "int32", lo=0, hi=6))))
