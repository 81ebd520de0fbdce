"""Eager use: ``jshard.apply(f, *args)`` and the DArray operators, each a cached single-call ``jshard.jit`` program.

In a notebook, ``x + y``, ``x @ w``, ``x[1:4]``, ``x.T``, ``x.sum(0)`` or ``x.astype(jnp.int32)`` on DArrays run
right away and return DArrays laid out as the engine chose. The operators are attached to ``DArray`` here,
above the engine (as JAX attaches array methods from its numpy layer), so ``jshard.darray`` depends on nothing
above it. They take, compute and refuse what ``jax.Array``'s do: ``x == 3`` is elementwise (so a DArray is
unhashable), a numpy array on the left gives a DArray, ``x ** 3`` is JAX's exact ``lax.integer_pow``, and
iteration goes over dim 0.

>>> import jax, numpy as np, jshard
>>> from jshard import Shard
>>> x = jshard.distribute(np.arange(8.0), jax.make_mesh((8,), ("x",)), [Shard(0)])
>>> (x * 2 + 1).full().tolist()[:3], x[2:5].full().tolist()
([1.0, 3.0, 5.0], [2.0, 3.0, 4.0])
>>> bool(x[7] == 7), [float(r) for r in x[:3]], np.ones(8) - x
(True, [0.0, 1.0, 2.0], DArray(f32[8] (S(0)) on mesh(x=8)))
"""

from __future__ import annotations

import functools
import math
import operator
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

__all__ = ["apply", "stack", "unstack"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))

_APPLIED = Cache(512)


def apply(f: Callable, *args, **static) -> Any:
    """Run ``f`` (any JAX function at global shapes) on DArrays eagerly, through a cached single-call program;
    ``static`` keyword arguments (axes, dtypes, indices) are fixed at trace time, arrays among them are keyed
    by their contents (boolean masks stay static; their shapes decide the result's). DArray operators use it. Beside
    a JAX tracer (``x @ w`` inside ``jax.grad`` of ``w``) it is ``f`` itself on the arrays JAX sees
    (``DArray.as_jax``).

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> from jshard import Shard
    >>> x = jshard.distribute(np.arange(8.0).reshape(4, 2), jax.make_mesh((8,), ("x",)), [Shard(0)])
    >>> jshard.apply(jnp.sum, x, axis=0).full().tolist()
    [12.0, 16.0]
    """
    if any(isinstance(a, jax.core.Tracer) for a in args):  # inside a JAX transformation: plain JAX on the arrays
        return f(*[a.as_jax() if isinstance(a, DArray) else a for a in args], **static)
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


def stack(arrays: list[DArray], placements: tuple) -> DArray:
    """``arrays`` (DArrays of one shape) stacked along a new dim 0, laid out by ``placements``: each device computes
    only its own block of the stack.

    >>> import jax, numpy as np, jshard
    >>> from jshard import Replicate, Shard
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> parts = [jshard.distribute(np.full(3, i, np.float32), mesh, [Replicate()]) for i in range(8)]
    >>> s = stack(parts, (Shard(0),)); s.shape, s.spec.local_block_shape
    ((8, 3), (1, 3))
    """
    return _stacker(tuple(placements))(*arrays)


def unstack(x: DArray, placements: tuple) -> list[DArray]:
    """``x``'s slices along dim 0, each laid out by ``placements`` (``stack`` undone).

    >>> import jax, numpy as np, jshard
    >>> from jshard import Replicate
    >>> x = jshard.distribute(np.arange(6.0).reshape(3, 2), jax.make_mesh((8,), ("x",)), [Replicate()])
    >>> [p.full().tolist() for p in unstack(x, (Replicate(),))]
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    return _unstacker(tuple(placements), x.shape[0])(x)


@functools.lru_cache(maxsize=64)
def _stacker(placements: tuple) -> Callable:
    return jit(lambda *xs: jnp.concatenate([x[None] for x in xs]), out_placements=placements)


@functools.lru_cache(maxsize=64)
def _unstacker(placements: tuple, n: int) -> Callable:
    return jit(lambda x: [x[i] for i in range(n)], out_placements=[placements] * n)


def _getitem(x, *, idx):
    return x[idx]


def _astype(x, *, dtype):
    return x.astype(dtype)


def _reshape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


# What jax.Array's operators take. Anything else gives Python's NotImplemented, so that ``x == None`` is False and
# an object that knows DArrays gets its turn; containers are refused (``x == [1, 2]`` would be a silent False).
_OPERANDS = (DArray, jax.Array, np.ndarray, np.generic, int, float, complex)
_CONTAINERS = (dict, list, set, tuple)


def _binary(f: Callable, symbol: str, reflected: bool = False) -> Callable:
    def method(self, other):
        if isinstance(other, _OPERANDS):
            return apply(f, other, self) if reflected else apply(f, self, other)
        if type(other) in _CONTAINERS:
            names = (type(other).__name__, "DArray") if reflected else ("DArray", type(other).__name__)
            raise TypeError(f"unsupported operand type(s) for {symbol}: {names[0]!r} and {names[1]!r}")
        return NotImplemented

    return method


def _integer_pow(x, *, exponent: int):
    return jnp.power(x, exponent)


_power = _binary(jnp.power, "**")


def _pow(self, other):
    """``x ** n``: a concrete integer exponent is static, so JAX computes ``lax.integer_pow`` (exact repeated
    multiplication, and its error for integers raised to negative powers) as ``jax_array ** n`` does; any
    other exponent is an operand."""
    try:
        exponent = operator.index(other)
    except TypeError:
        return _power(self, other)
    return apply(_integer_pow, self, exponent=exponent)


def _contains(x, query):
    return x.__contains__(query)  # jax.Array's ``in``: a 1-D x, a scalar query


def _in(self, query) -> bool:
    if not isinstance(query, _OPERANDS):
        raise TypeError(f"DArray.__contains__: unsupported operand type {type(query)}.")
    return bool(apply(_contains, self, query))


_ROWS_PER_PROGRAM = 100  # as jax.Array iterates: one program slices up to 100 rows


def _rows(x, *, start: int, stop: int):
    return tuple(x[i] for i in range(start, stop))


def _iterate(self, reverse: bool = False):
    """The rows along dim 0, a program per 100 rows (run as the iteration reaches them)."""
    if not self.ndim:
        raise TypeError("iteration over a 0-d array")  # jax.Array's error, raised by iter() itself
    n = self.shape[0]
    starts = range(0, n, _ROWS_PER_PROGRAM)
    chunks = (apply(_rows, self, start=s, stop=min(s + _ROWS_PER_PROGRAM, n))
              for s in (reversed(starts) if reverse else starts))
    return (row for chunk in chunks for row in (reversed(chunk) if reverse else chunk))


def _method(x, *, name: str, args: tuple, kwargs: dict):
    return getattr(x, name)(*args, **kwargs)


def _attribute(x, *, name: str):
    return getattr(x, name)


# jax.Array's numpy methods and array-valued properties that have no operator of their own above: each runs as
# jax.Array's does, through ``apply`` (a DArray out, laid out as the engine chose)
_NUMPY_METHODS = ("all", "any", "argmax", "argmin", "argpartition", "argsort", "choose", "clip", "compress", "conj",
                  "conjugate", "cumprod", "cumsum", "diagonal", "dot", "flatten", "nonzero", "prod", "ptp", "ravel",
                  "repeat", "round", "searchsorted", "sort", "squeeze", "std", "swapaxes", "take", "trace",
                  "transpose", "var", "view")
_NUMPY_PROPERTIES = ("real", "imag", "mT")


def _property(self, name: str):
    return apply(_attribute, self, name=name)


def _numpy_method(name: str) -> Callable:
    def method(self, *args, **kwargs):
        return apply(_method, self, name=name, args=args, kwargs=kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"``jax.Array.{name}``, run on the DArray (``jshard.apply``)."
    return method


# operator name -> (jnp function, symbol); each gets its reflection (``2 - x``, ``np_array @ x``) too
_ARITHMETIC = {
    "add": (jnp.add, "+"), "sub": (jnp.subtract, "-"), "mul": (jnp.multiply, "*"), "truediv": (jnp.true_divide, "/"),
    "floordiv": (jnp.floor_divide, "//"), "mod": (jnp.remainder, "%"), "divmod": (jnp.divmod, "divmod()"),
    "matmul": (jnp.matmul, "@"), "and": (jnp.bitwise_and, "&"), "or": (jnp.bitwise_or, "|"),
    "xor": (jnp.bitwise_xor, "^"), "lshift": (jnp.left_shift, "<<"), "rshift": (jnp.right_shift, ">>"),
}
# Python reflects a comparison by swapping it (``3 < x`` is ``x > 3``)
_COMPARISONS = {"eq": (jnp.equal, "=="), "ne": (jnp.not_equal, "!="), "lt": (jnp.less, "<"),
                "le": (jnp.less_equal, "<="), "gt": (jnp.greater, ">"), "ge": (jnp.greater_equal, ">=")}

_METHODS = {
    **{f"__{name}__": _binary(f, symbol) for name, (f, symbol) in {**_ARITHMETIC, **_COMPARISONS}.items()},
    **{f"__r{name}__": _binary(f, symbol, True) for name, (f, symbol) in _ARITHMETIC.items()},
    "__pow__": _pow, "__rpow__": _binary(jnp.power, "**", True),
    # elementwise == leaves no hash consistent with it: unhashable, as a jax.Array
    "__hash__": None,
    # numpy's binary operators defer to an operand of higher priority that has no __array_ufunc__, so
    # ``np_array + x`` is ``x.__radd__(np_array)``, while numpy functions take x through __array__ (jax.Array's 100)
    "__array_priority__": 100,
    "__neg__": lambda self: apply(jnp.negative, self), "__pos__": lambda self: apply(jnp.positive, self),
    "__abs__": lambda self: apply(jnp.abs, self), "__invert__": lambda self: apply(jnp.invert, self),
    "__iter__": _iterate, "__reversed__": lambda self: _iterate(self, reverse=True), "__contains__": _in,
    "__getitem__": lambda self, idx: apply(_getitem, self, idx=idx),
    "T": property(lambda self: apply(jnp.transpose, self), doc="The transpose (numpy's ``.T``)."),
    "sum": lambda self, axis=None: apply(jnp.sum, self, axis=axis),
    "mean": lambda self, axis=None: apply(jnp.mean, self, axis=axis),
    "max": lambda self, axis=None: apply(jnp.max, self, axis=axis),
    "min": lambda self, axis=None: apply(jnp.min, self, axis=axis),
    "astype": lambda self, dtype: apply(_astype, self, dtype=np.dtype(dtype)),
    "reshape": lambda self, *shape: apply(jnp.reshape, self, shape=_reshape_args(shape)),
}
_METHODS.update({name: _numpy_method(name) for name in _NUMPY_METHODS})
_METHODS.update({name: property(functools.partial(_property, name=name), doc=f"``jax.Array.{name}``.")
                 for name in _NUMPY_PROPERTIES})
_METHODS.update(size=property(lambda self: math.prod(self.shape), doc="The number of elements, as ``jax.Array``'s."),
                itemsize=property(lambda self: self.dtype.itemsize, doc="Bytes per element."),
                nbytes=property(lambda self: math.prod(self.shape) * self.dtype.itemsize,
                                doc="Bytes of the global value (the logical array, not the blocks)."),
                item=lambda self, *args: np.asarray(self).item(*args),
                tolist=lambda self: np.asarray(self).tolist(),
                at=property(lambda self: self.as_jax().at, doc="``jax.Array.at`` on ``as_jax()``: a jax.Array out."),
                block_until_ready=lambda self: (self.block.block_until_ready(), self)[1],
                is_deleted=lambda self: self.block.is_deleted())
for _name, _value in _METHODS.items():
    setattr(DArray, _name, _value)
