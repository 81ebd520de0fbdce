"""Eager use: ``jshard.apply(f, *args)`` and the DArray operators, each a cached single-call ``jshard.jit`` program.

In a notebook, ``x + y``, ``x @ w``, ``x[1:4]``, ``x.T``, ``x.sum(0)`` or ``x.astype(jnp.int32)`` on DArrays run
right away and return DArrays laid out as the engine chose. The operators are attached to ``DArray`` here,
above the engine (as JAX attaches array methods from its numpy layer), so ``jshard.darray`` depends on nothing
above it.

>>> import jax, numpy as np, jshard
>>> from jshard import Shard
>>> x = jshard.distribute(np.arange(8.0), jax.make_mesh((8,), ("x",)), [Shard(0)])
>>> (x * 2 + 1).full().tolist()[:3], x[2:5].full().tolist()
([1.0, 3.0, 5.0], [2.0, 3.0, 4.0])
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .api import jit
from .arguments import by_value, function_name
from .caches import Cache
from .darray import DArray
from .jaxcompat import source_info_util

__all__ = ["apply"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))

_APPLIED = Cache(512)


def apply(f: Callable, *args, **static) -> Any:
    """Run ``f`` (any JAX function at global shapes) on DArrays eagerly, through a cached single-call program;
    ``static`` keyword arguments (axes, dtypes, indices) are fixed at trace time, arrays among them are keyed
    by their contents (boolean masks stay static; their shapes decide the result's). DArray operators use it.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard
    >>> x = jshard.distribute(np.arange(8.0).reshape(4, 2), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.apply(jnp.sum, x, axis=0).full().tolist()
    [12.0, 16.0]
    """
    leaves, tree = jax.tree.flatten(static)
    dynamic = tuple(i for i, v in enumerate(leaves) if isinstance(v, (DArray, jax.Array)) or
                    isinstance(v, np.ndarray) and v.dtype != np.bool_)
    key = (f, tree, dynamic, tuple(None if i in dynamic else by_value(v, f"apply({function_name(f)})")
                                   for i, v in enumerate(leaves)))
    program = _APPLIED.get(key)
    if program is None:
        fixed = [None if i in dynamic else v for i, v in enumerate(leaves)]

        @functools.wraps(f)  # errors name f, not this wrapper
        def call(*a):
            vals, it = list(fixed), iter(a[len(a) - len(dynamic):])
            for i in dynamic:
                vals[i] = next(it)
            return f(*a[:len(a) - len(dynamic)], **jax.tree.unflatten(tree, vals))

        call.__qualname__ = getattr(f, "__qualname__", getattr(call, "__name__", "apply"))  # a jnp ufunc has none
        program = jit(call)
        _APPLIED.put(key, program)
    return program(*args, *[leaves[i] for i in dynamic])


def _getitem(x, *, idx):
    return x[idx]


def _astype(x, *, dtype):
    return x.astype(dtype)


def _reshape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


def _binary(f: Callable, reflected: bool = False) -> Callable:
    return (lambda self, o: apply(f, o, self)) if reflected else (lambda self, o: apply(f, self, o))


_METHODS = {
    "__add__": _binary(jnp.add), "__radd__": _binary(jnp.add, True),
    "__sub__": _binary(jnp.subtract), "__rsub__": _binary(jnp.subtract, True),
    "__mul__": _binary(jnp.multiply), "__rmul__": _binary(jnp.multiply, True),
    "__truediv__": _binary(jnp.true_divide), "__rtruediv__": _binary(jnp.true_divide, True),
    "__pow__": _binary(jnp.power), "__matmul__": _binary(jnp.matmul), "__rmatmul__": _binary(jnp.matmul, True),
    "__lt__": _binary(jnp.less), "__le__": _binary(jnp.less_equal),
    "__gt__": _binary(jnp.greater), "__ge__": _binary(jnp.greater_equal),
    "__neg__": lambda self: apply(jnp.negative, self),
    "__getitem__": lambda self, idx: apply(_getitem, self, idx=idx),
    "T": property(lambda self: apply(jnp.transpose, self), doc="The transpose (numpy's ``.T``)."),
    "sum": lambda self, axis=None: apply(jnp.sum, self, axis=axis),
    "mean": lambda self, axis=None: apply(jnp.mean, self, axis=axis),
    "max": lambda self, axis=None: apply(jnp.max, self, axis=axis),
    "min": lambda self, axis=None: apply(jnp.min, self, axis=axis),
    "astype": lambda self, dtype: apply(_astype, self, dtype=np.dtype(dtype)),
    "reshape": lambda self, *shape: apply(jnp.reshape, self, shape=_reshape_args(shape)),
}
for _name, _method in _METHODS.items():
    setattr(DArray, _name, _method)
