"""How ``jshard.jit`` reads a call's arguments: argnums, the mesh, plain values and the names errors give them.

Argnums follow ``jax.jit``: negative ones count from the end, and out of range is a ValueError naming the
argnum and the arity (checked against the signature when it has a fixed arity, else at the call). Plain
leaves (numpy and JAX arrays, Python numbers) are distributed replicated; Python numbers are weakly typed as
in JAX; typed PRNG keys travel as their key data. Errors name the user's function as ``name (file.py:line)``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .darray import DArray, adopt, same_devices
from .engine import TRACED_DARRAY
from .spec import format_mesh

__all__ = ["argnums", "as_darray", "by_value", "function_name", "hashable", "is_darray", "is_plain_key", "is_weak",
           "mesh_of", "on_mesh", "parameter_names", "plain_dtype", "resolve_argnums"]


def argnums(nums: int | Sequence[int], name: str, fn: Callable) -> tuple[int, ...]:
    """``nums`` as a tuple of ints, checked against ``fn``'s positional parameters when it has a fixed number."""
    nums = (nums,) if isinstance(nums, int) else tuple(nums) if isinstance(nums, (tuple, list, range)) else nums
    if not isinstance(nums, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(f"jshard.jit: {name} must be an int or a sequence of ints, got {nums!r}")
    n = _arity(fn)
    if n is not None:
        resolve_argnums(nums, n, name, function_name(fn))
    return nums


def resolve_argnums(nums: tuple[int, ...], n: int, name: str, fn_name: str) -> frozenset:
    """Argnums of a call with ``n`` positional arguments, negative ones counted from the end (``jax.jit``'s rule)."""
    out = set()
    for i in nums:
        if not -n <= i < n:
            raise ValueError(f"jshard.jit: {name} {i} is out of range for {fn_name}, which takes {n} positional "
                             f"argument(s) here; argnums count from 0 (negative ones from the end)")
        out.add(i % n)
    return frozenset(out)


def parameter_names(fn: Callable, nums: tuple[int, ...]) -> frozenset:
    """The parameter names at positions ``nums`` (a static argument passed by keyword is refused by name)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(params[i].name for i in nums if -len(params) <= i < len(params))


def function_name(fn: Callable) -> str:
    """``name (file.py:line)`` of a user's function, for errors."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code is not None else name


def mesh_of(leaves: list, name: str, default: Mesh | None = None) -> Mesh:
    """The one mesh a call runs on: ``default`` (``jshard.jit(mesh=...)``) or the DArrays' mesh, else that of the
    sharded ``jax.Array`` arguments; a ValueError naming the meshes where they disagree."""
    meshes = list(dict.fromkeys(([default] if default is not None else [])
                                + [a.mesh for a in leaves if isinstance(a, DArray)]))
    if len(meshes) > 1:
        raise ValueError(f"jshard.jit: the DArray arguments of {name} live on different meshes, "
                         f"{_mesh_desc(meshes[0])} and {_mesh_desc(meshes[1])}"
                         + (" (the first is jshard.jit's mesh=)" if default is not None else "")
                         + "; one program runs on one mesh: redistribute onto one "
                         "(jshard.distribute(x.full(), mesh, placements))")
    if meshes:
        return meshes[0]
    on = [a.sharding.mesh for a in leaves if on_mesh(a)]
    if not on:
        raise ValueError(f"jshard.jit: no DArray (or jax.Array on a mesh) among the arguments of {name}, so there is "
                         "no mesh to run on; distribute one input with jshard.distribute(x, mesh, placements), or "
                         "name the mesh: jshard.jit(fn, mesh=mesh) (a function of no arrays, such as an initialiser)")
    other = next((m for m in on if not same_devices(m, on[0])), None)
    if other is not None:
        raise ValueError(f"jshard.jit: the jax.Array arguments of {name} live on different meshes, "
                         f"{_mesh_desc(on[0])} and {_mesh_desc(other)}; one program runs on one mesh: move them "
                         "onto one with jax.device_put(x, NamedSharding(mesh, spec))")
    return on[0]


def on_mesh(a: Any) -> bool:
    """Whether ``a`` is a concrete ``jax.Array`` laid out on a mesh (a ``NamedSharding``), which a call takes as
    it is (``from_jax``: no host transfer, no collective). Typed PRNG keys travel as key data instead."""
    return (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and isinstance(a.sharding, NamedSharding)
            and isinstance(a.sharding.mesh, Mesh) and not is_plain_key(a))


def as_darray(a: Any, mesh: Mesh, where: str) -> DArray | None:
    """A ``jax.Array`` on ``mesh``'s devices as a DArray (``from_jax``); None for a value the call distributes
    from the host (numbers, numpy arrays, single-device arrays). An array spanning other processes on another
    mesh can do neither, and is refused naming ``where``."""
    return adopt(a, mesh, where) if on_mesh(a) else None


def plain_dtype(a: Any, where: str) -> np.dtype:
    """The dtype JAX gives a plain argument (Python floats are float32 unless x64 is on); a TypeError naming
    ``where`` for anything that is not an array or a number."""
    if isinstance(a, jax.core.Tracer):
        raise TypeError(TRACED_DARRAY.format(what=f"{where} is a JAX tracer"))
    if not isinstance(a, (np.ndarray, np.generic, jax.Array, bool, int, float, complex)):
        raise TypeError(f"jshard.jit: {where} is a {type(a).__name__} ({a!r:.40}), not an array; pass arrays, "
                        "DArrays or numbers, or mark it static with static_argnums")
    return jax.dtypes.canonicalize_dtype(jnp.result_type(a))


def is_darray(a: Any) -> bool:
    return isinstance(a, DArray)


def is_weak(a: Any) -> bool:
    """Python numbers are weakly typed in JAX: ``x * 2.0`` keeps ``x``'s dtype."""
    return type(a) in (int, float, complex)


def is_plain_key(a: Any) -> bool:
    """A plain typed PRNG key array (``jax.random.key``), which travels as its key data (a DArray of keys, returned
    by an earlier call, is an argument like any other DArray)."""
    dtype = getattr(a, "dtype", None)
    return not isinstance(a, DArray) and dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def hashable(v: Any) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


def by_value(v: Any, owner: str) -> Any:
    """A hashable key equal for equal static values: arrays by shape, dtype and bytes; slices by their fields;
    a TypeError naming ``owner`` for a value that cannot be keyed."""
    if isinstance(v, np.ndarray):
        return ("ndarray", v.shape, v.dtype.str, v.tobytes())
    if isinstance(v, slice):
        return ("slice", by_value(v.start, owner), by_value(v.stop, owner), by_value(v.step, owner))
    if not hashable(v):
        raise TypeError(f"{owner}: static argument {v!r:.60} of type {type(v).__name__} is not hashable; pass a "
                        "tuple or an array")
    return (type(v), v)


def _arity(fn: Callable) -> int | None:
    """How many positional arguments ``fn`` takes, or None where that is open (``*args``, no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _mesh_desc(mesh: Mesh) -> str:
    return f"{format_mesh(mesh)} of devices {[d.id for d in mesh.devices.flat]}"
