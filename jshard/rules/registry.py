"""Rules as data: what a rule returns, how it is registered, and how its placeholders are filled.

A rule describes **one mesh axis** and never sees the mesh. Given the input and output avals and the
equation's params it lists the correct placement tuples ``(outputs..., inputs...)`` built from
``Replicate()``, ``Partial(op)`` and ``ShardPlaceholder(d)``. Matmul ``x[m,k] @ w[k,n]``:

>>> from jshard import Partial, Replicate
>>> R, Φ = Replicate(), ShardPlaceholder
>>> matmul = [(Φ(0), Φ(0), R), (Φ(1), R, Φ(1)), (Partial(), Φ(1, even=True), Φ(0, even=True))]

The all-Replicate tuple is added by the infrastructure, never by a rule (``fill`` asserts it). Why a
tuple is correct is the algebra of the function, stated once in ``jshard.rules.algebra``. ``fill`` turns
placeholders into the shard kinds found in the inputs (``Shard`` and each ``StridedShard`` split factor),
once per kind, so a rule written for ``Shard`` serves strided layouts too; without sharded inputs
placeholder tuples vanish:

>>> fill(matmul, (1, 2))[5]
Column(outs=(P(sum),), ins=(SS(1,2), SS(0,2)), even=frozenset({(1, 1), (2, 0)}))

``even=True`` marks a dim the operation reads across (a contraction, a reduction): the padding of an
unevenly sharded block would be read, so the tuple only applies to inputs that are evenly sharded there.

Tests swap a rule for the length of a ``with`` block with ``override(name, rule)`` (``None`` removes it).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from ..caches import clear_caches, memo
from ..placements import Placement, Shard, StridedShard

__all__ = [
    "ShardPlaceholder",
    "Column",
    "Rule",
    "register",
    "rule_for",
    "registered",
    "override",
    "fill",
    "sharded",
]


@dataclass(frozen=True, slots=True)
class ShardPlaceholder:
    """"Sharded on tensor dim ``dim`` by whatever shard kind the inputs use" (written Φd).

    ``even=True``: the operation reads across this dim, so the tuple needs an evenly sharded dim.

    >>> ShardPlaceholder(1), ShardPlaceholder(0, even=True)
    (Φ1, Φ0!)
    """

    dim: int
    even: bool = False
    is_replicate: ClassVar[bool] = False
    is_shard: ClassVar[bool] = True
    is_partial: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"Φ{self.dim}{'!' if self.even else ''}"


class Column(NamedTuple):
    """One filled single-axis strategy: output placements, input placements, and the ``(position, dim)``
    pairs (positions count outputs first, then inputs) that must be evenly sharded."""

    outs: tuple[Placement, ...]
    ins: tuple[Placement, ...]
    even: frozenset


@dataclass(frozen=True)
class Rule:
    """A registered rule: ``strategies(ins, outs, params)`` lists single-axis tuples; ``local(prim, params,
    in_specs, out_specs)`` (optional) builds the per-device function when binding the primitive with its
    params on local blocks would be wrong (global sizes in params, offsets, masks); ``check(params, in_specs,
    out_specs)`` (optional) rejects N-D combinations that single-axis tuples cannot rule out."""

    name: str
    strategies: Callable[[tuple, tuple, dict], Sequence[tuple]]
    local: Callable | None = None
    check: Callable | None = None


_RULES: dict[str, Rule] = {}
_WARNED: set[str] = set()


def _name(prim: Any) -> str:
    return prim if isinstance(prim, str) else prim.name


def register(*prims, local: Callable | None = None, check: Callable | None = None) -> Callable:
    """Decorator registering ``fn(ins, outs, params) -> [tuples]`` for primitives (objects or names).

    ``ins`` / ``outs`` are the avals (``.shape``, ``.dtype``); ``params`` the equation's params.
    """

    def deco(fn):
        for p in prims:
            _RULES[_name(p)] = Rule(_name(p), fn, local, check)
        return fn

    return deco


def rule_for(prim: Any, source: str | None = None) -> Rule | None:
    """The rule of a primitive, or None (one warning per primitive: it will run replicated). ``source`` (the
    user's line that made the equation) goes into the warning."""
    name = _name(prim)
    rule = _RULES.get(name)
    if rule is None and name not in _WARNED:
        _WARNED.add(name)
        where = f" (at {source})" if source else ""
        warnings.warn(
            f"jshard has no sharding rule for primitive '{name}'{where}: its inputs are replicated and it "
            "runs on every device (correct, but it may communicate more than needed)",
            stacklevel=3,
        )
    return rule


def has_rule(prim: Any) -> bool:
    return _name(prim) in _RULES


def registered() -> tuple[str, ...]:
    """Names of every primitive with a rule."""
    return tuple(sorted(_RULES))


@contextlib.contextmanager
def override(prim: Any, rule: Rule | None) -> Iterator[None]:
    """Install ``rule`` for ``prim`` (``None``: no rule at all) inside a ``with`` block, then put back what
    was there: a seam for tests (a deliberately wrong rule must be caught by the validator; a primitive
    without a rule must run replicated, with its warning).

    Selections and rule expansions are memoised, so every jshard cache is cleared on entry and on exit:
    nothing chosen under the override outlives it. Inside the block a primitive without a rule warns once,
    as if never seen before.

    >>> with override("exp", None):
    ...     has_rule("exp")
    False
    >>> has_rule("exp")
    True
    """
    name = _name(prim)
    before, warned = _RULES.get(name), name in _WARNED
    if rule is None:
        _RULES.pop(name, None)
    else:
        _RULES[name] = rule
    _WARNED.discard(name)
    clear_caches()
    try:
        yield
    finally:
        if before is None:
            _RULES.pop(name, None)
        else:
            _RULES[name] = before
        if warned:
            _WARNED.add(name)
        else:
            _WARNED.discard(name)
        clear_caches()


@memo(1024)
def sharded(dim: int, split_factor: int) -> Placement:
    """The shard kind with ``split_factor`` on ``dim``: ``Shard`` for 1, else ``StridedShard``."""
    return Shard(dim) if split_factor == 1 else StridedShard(dim, split_factor)


_NONE: frozenset = frozenset()


def _all_replicate(t: tuple) -> bool:
    # a loop that stops at the first sharded or pending entry: fill runs on every uncached selection
    for e in t:
        if not e.is_replicate:
            return False
    return True


def fill(strategies: Sequence[tuple], kinds: Sequence[int], n_out: int = 1) -> list[Column]:
    """Concrete single-axis columns: each placeholder tuple once per shard kind in ``kinds`` (split factors,
    1 = Shard), concrete tuples as they are; ``n_out`` entries of each tuple are outputs."""
    cols = []
    for t in strategies:
        holes = [i for i, e in enumerate(t) if type(e) is ShardPlaceholder]
        if not holes:
            assert not _all_replicate(t), f"a rule lists {t}: the all-Replicate tuple is the infrastructure's"
            t = tuple(sharded(e.dim, 1) if type(e) is StridedShard and e.split_factor == 1 else e for e in t)
            cols.append(Column(t[:n_out], t[n_out:], _NONE))
            continue
        even = frozenset((i, t[i].dim) for i in holes if t[i].even) or _NONE
        for sf in kinds:
            c = list(t)
            for i in holes:
                c[i] = sharded(t[i].dim, sf)
            cols.append(Column(tuple(c[:n_out]), tuple(c[n_out:]), even))
    return cols
