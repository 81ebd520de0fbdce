"""What a device knows about its own block at run time, inside ``shard_map``.

Block storage pads every local block to the largest local shape and the placements decide which global
indices a device holds; these helpers turn a spec's static layout tables into values a per-device
function can use: the global index of every position of its block along a dim (``-1`` on padding), the
mask of its real (non-padding) positions, and the block with its padding overwritten (by the identity of
a reduction before reading across a dim). Only the mesh axes a table varies along are read with
``axis_index``; a table equal on all devices is a constant.

Inside ``coordinates_read_once()`` (the engine runs every plan in one) each mesh axis's index is read once
and shared: a training step asks for it some 70 times, and each read is a few HLO instructions that every
XLA pass walks before CSE merges them (on a GPT step, a tenth of the module).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .spec import Spec

__all__ = ["PerDevice", "at_origin", "axis_index", "coordinates_read_once", "fill_padding", "global_index",
           "opaque_ints", "reduce_identity", "valid_mask"]

_read: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jshard_coordinates", default=None)


@contextlib.contextmanager
def coordinates_read_once() -> Iterator[None]:
    """Within it, ``axis_index(name)`` reads each axis once and hands every later caller that value.

    Enter it where one function body is traced (inside ``shard_map``), around code that traces no inner
    function except through another ``coordinates_read_once`` (a loop body's plan opens its own): a value
    read inside an inner trace must not be handed to the outer one.

    >>> import jax
    >>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    >>> def body():
    ...     with coordinates_read_once():
    ...         return (axis_index("x") + axis_index("x"))[None]
    >>> f = jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=jax.P("x"))
    >>> str(jax.make_jaxpr(f)()).count("axis_index")
    1
    >>> f()
    Array([0, 2], dtype=int32)
    """
    token = _read.set({})
    try:
        yield
    finally:
        _read.reset(token)


def axis_index(name: str):
    """This device's index along mesh axis ``name`` (``lax.axis_index``, read once per axis inside
    ``coordinates_read_once``)."""
    return _once(name, lambda: lax.axis_index(name))


def _once(key, make: Callable):
    """``make()``, made once per ``coordinates_read_once`` and shared (each time outside one)."""
    read = _read.get()
    if read is None:
        return make()
    if key not in read:
        read[key] = make()
    return read[key]


def at_origin(names: Sequence[str]):
    """Bool scalar: is this device at index 0 of every mesh axis in ``names``?"""
    first = np.bool_(True)
    for a in names:
        first = lax.bitwise_and(first, lax.eq(axis_index(a), np.int32(0)))
    return first


class PerDevice:
    """A static table with one row per device (shape ``mesh_shape + row``), read by the running device.

    >>> import numpy as np
    >>> PerDevice(np.array([[3, 4], [3, 4]]), ("x",))()   # equal on every device: a constant
    array([3, 4])
    """

    def __init__(self, values: np.ndarray, names: tuple[str, ...]):
        k = len(names)
        self.names = names
        self.axes = tuple(a for a in range(k) if not np.all(values == values.take([0], axis=a)))
        self.values = values[tuple(slice(None) if a in self.axes else 0 for a in range(k))]

    def __call__(self):
        if not self.axes:
            return self.values
        coords = [axis_index(self.names[a]) for a in self.axes]
        affine = self._affine()
        if affine is not None:  # offsets of even blocks: arithmetic on the coordinates, no table in the program
            base, steps = affine
            dtype = jax.dtypes.canonicalize_dtype(base.dtype)  # int64 tables run as int32 unless x64 is on
            out = None
            for c, step in zip(coords, steps, strict=True):  # no op for a unit step or a zero base; lax, not jitted jnp
                c = lax.broadcast(lax.convert_element_type(c, dtype), base.shape)
                term = c if np.all(step == 1) else lax.mul(c, step.astype(dtype))
                out = term if out is None else lax.add(out, term)
            return lax.add(out, base.astype(dtype)) if base.any() else out
        # one dynamic index into the flattened table: coordinates are never negative, so no wrap-around code
        sizes = self.values.shape[:len(self.axes)]
        flat = coords[0]
        for c, size in zip(coords[1:], sizes[1:], strict=True):
            flat = flat * size + c
        table = jnp.asarray(self.values.reshape((-1,) + self.values.shape[len(self.axes):]))
        return lax.dynamic_slice_in_dim(table, flat, 1, allow_negative_indices=False)[0]

    def _affine(self) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """``(base, steps)`` with ``values = base + sum(step * coordinate)``, for int tables within int32; else None."""
        v = self.values
        if v.dtype.kind != "i":
            return None
        k = len(self.axes)
        base = v[(0,) * k].astype(np.int64)
        steps = [v[tuple(1 if b == a else 0 for b in range(k))].astype(np.int64) - base for a in range(k)]
        grid = np.indices(v.shape[:k]).reshape((k,) + v.shape[:k] + (1,) * (v.ndim - k))
        if not np.array_equal(base + sum(s * g for s, g in zip(steps, grid, strict=True)), v):
            return None
        sizes = v.shape[:k]
        if (np.abs(base) + sum(np.abs(s) * (n - 1) for s, n in zip(steps, sizes, strict=True))).max(initial=0) >= 2**31:
            return None  # a partial sum could leave int32
        return base.astype(v.dtype), [s.astype(v.dtype) for s in steps]


def opaque_ints(values: Sequence[int], axis: str) -> list:
    """``values`` as int32 scalars that XLA cannot fold into the kernels using them (call inside ``shard_map``;
    ``axis``: any mesh axis).

    XLA:CPU compiles each distinct kernel once, some 20 ms apiece, and a constant makes a kernel distinct: a
    program cutting 70 arrays out of one buffer at 70 constant offsets compiles 70 kernels, while with opaque
    offsets the arrays of one shape share a kernel. The values come out of one variadic reduction of the pairs
    ``[value, 0] + zero``, ``zero`` being the device index shifted past its last bit, which XLA cannot prove
    zero: one small kernel, and one buffer per value.
    """
    zero = _once(("opaque zero", axis),
                 lambda: jnp.broadcast_to((axis_index(axis).astype(jnp.uint32) >> 31).astype(jnp.int32), (2,)))
    # lax, not jnp: a jnp operator is a jitted function, traced anew for each of a program's many offsets
    pairs = tuple(lax.add(zero, np.array([v, 0], np.int32)) for v in values)
    return list(lax.reduce(pairs, (np.int32(0),) * len(pairs), lambda a, b: tuple(map(lax.add, a, b)), (0,)))


def global_index(spec: Spec, dim: int):
    """Int32 vector: the global index of each position of this device's block along ``dim`` (-1: padding)."""
    return jnp.asarray(PerDevice(spec.layouts[dim].astype(np.int32), tuple(spec.mesh.axis_names))())


def valid_mask(spec: Spec, dim: int):
    """Bool vector: which positions of this device's block along ``dim`` hold data (not padding)."""
    return global_index(spec, dim) >= 0


def reduce_identity(op: str, dtype) -> np.generic:
    """The value that ``op`` ignores: 0 for sum, the lowest value for max, the highest for min."""
    dtype = np.dtype(dtype)
    if op in ("sum", "avg"):
        return dtype.type(0)
    if jnp.issubdtype(dtype, jnp.floating):
        return dtype.type(-np.inf if op == "max" else np.inf)
    info = jnp.iinfo(dtype)
    return dtype.type(info.min if op == "max" else info.max)


def fill_padding(x, spec: Spec, dims: Sequence[int], value):
    """``x`` (this device's block of ``spec``) with its padding along ``dims`` set to ``value``.

    Call it inside ``shard_map`` (or a named ``vmap``). Dims without padding on any device cost nothing.
    """
    for d in dims:
        if (spec.layouts[d] < 0).any():
            keep = lax.broadcast_in_dim(valid_mask(spec, d), x.shape, (d,))
            x = jnp.where(keep, x, jnp.asarray(value, x.dtype))
    return x
