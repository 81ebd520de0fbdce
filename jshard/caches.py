"""One cache policy for all of jshard: every memo is bounded, keyed by value (never by ``id``, which Python
recycles), and forgotten by one call, ``jshard.clear_caches()``.

Two forms: ``Cache(maxsize)``, a dict-like memo for keys built by hand, and ``memo(maxsize)``, a decorator
(``functools.lru_cache``) for pure functions of hashable arguments. Both register themselves here.

>>> square = memo(8)(lambda n: n * n)
>>> square(3), square.cache_info().currsize
(9, 1)
>>> clear_caches()
>>> square.cache_info().currsize
0
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Cache", "clear_caches", "memo"]

_CACHES: weakref.WeakSet = weakref.WeakSet()  # Cache objects (a jitted function's own cache dies with it)
_MEMOS: list = []  # lru_cache-wrapped functions (module level, alive for good)


class Cache:
    """A bounded memo: ``get(key)`` (None when absent; a TypeError for an unhashable key, like a dict) and
    ``put(key, value)``; past ``maxsize`` entries the oldest is dropped. ``get`` is one dict lookup: the
    steady-state call of a jitted function looks up its program here, with a key (a tree structure holding
    every argument's spec) that is costly to compare twice, as a least-recently-used order would."""

    __slots__ = ("maxsize", "_data", "get", "last", "__weakref__")

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._data: dict = {}
        self.get: Callable[[Any], Any] = self._data.get  # the dict's own method: no Python frame per lookup
        # (key, value) of the latest hit, for a caller to compare first: a key of the same objects again (a
        # training loop's specs) compares equal by identity, with no hash computed
        self.last: tuple = (None, None)
        _CACHES.add(self)

    def put(self, key, value) -> None:
        self._data[key] = value
        if len(self._data) > self.maxsize:
            del self._data[next(iter(self._data))]

    def clear(self) -> None:
        self._data.clear()
        self.last = (None, None)

    def __len__(self) -> int:
        return len(self._data)


def memo(maxsize: int) -> Callable[[Callable], Callable]:
    """``functools.lru_cache(maxsize)``, forgotten by ``clear_caches()``."""

    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _MEMOS.append(cached)
        return cached

    return wrap


def clear_caches() -> None:
    """Forget every memoised plan, selection, rule expansion and compiled program (say, for a benchmark of the
    uncached path, or to free their memory). Nothing changes but the time the next call takes."""
    for cache in list(_CACHES):
        cache.clear()
    for fn in _MEMOS:
        fn.cache_clear()
