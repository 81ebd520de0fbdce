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

**Registration** (``register``) names each primitive by its object or by its name in a jaxpr, and is checked
when the rule module is imported: a name the running JAX does not know is an error (a typo would leave the
primitive silently replicated), unless ``INTRODUCED`` lists it with a newer JAX release, whose rule is then
skipped (that JAX cannot emit it); a second rule for one primitive is an error, not a silent replacement. Tests
swap a rule for the length of a ``with`` block with ``override(name, rule)`` (``None`` removes it). Every
change of the registry clears jshard's caches, so no selection made by an earlier rule outlives it.
"""

from __future__ import annotations

import contextlib
import difflib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import jax
from jax import lax

from ..caches import clear_caches, memo
from ..jaxcompat import jc
from ..placements import Placement, Shard, StridedShard

if TYPE_CHECKING:
    from ..spec import Spec

__all__ = [
    "ShardPlaceholder",
    "Column",
    "Strategies",
    "LocalHook",
    "CheckHook",
    "CommunicatesHook",
    "Rule",
    "INTRODUCED",
    "register",
    "rule_for",
    "has_rule",
    "registered",
    "override",
    "fill",
    "sharded",
]

# Primitives that jshard has rules for but only newer JAX releases have, by the release that introduced them
# (older ones emit other primitives for the same math): on an older JAX their rules are skipped; on this release
# or a later one a name missing from JAX is an error (renamed or removed: the rule would never apply).
INTRODUCED: dict[str, tuple[int, int, int]] = {
    "one_minus_square": (0, 11, 2),  # tanh's derivative under jax.grad
    "log2": (0, 11, 2),  # jnp.log2, before: log(x) / log(2)
    "polynomial": (0, 12, 0),  # erf's derivative
}


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


class Strategies(Protocol):
    """A rule's strategy function: the correct single-axis tuples ``(outputs..., inputs...)`` of placements
    (``Replicate``, ``Partial(op)``, ``ShardPlaceholder``; never all-Replicate). ``ins`` / ``outs`` are avals
    (``.shape``, ``.dtype``; an input's ``.value`` when it is a known constant), ``params`` the equation's."""

    def __call__(self, ins: tuple[Any, ...], outs: tuple[Any, ...], params: dict[str, Any], /) -> Sequence[tuple]:
        ...


class LocalHook(Protocol):
    """A rule's own per-device function, for primitives whose params hold global sizes or whose blocks need
    their offsets: given the primitive, params and the chosen specs, a function of the local blocks returning
    the list of output blocks."""

    def __call__(self, prim: jc.Primitive, params: dict[str, Any], in_specs: tuple[Spec, ...],
                 out_specs: tuple[Spec, ...], /) -> Callable[..., Sequence[Any]]: ...


class CheckHook(Protocol):
    """A rule's veto on an N-D combination of specs that its single-axis tuples cannot rule out: True where
    the combination holds."""

    def __call__(self, params: dict[str, Any], in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...], /) -> bool:
        ...


class CommunicatesHook(Protocol):
    """The collectives a rule's local form runs itself for the chosen specs (``jshard.cost.Communication``
    records; none where it runs alone)."""

    def __call__(self, params: dict[str, Any], in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...],
                 /) -> Sequence[Any]: ...


@dataclass(frozen=True)
class Rule:
    """A registered rule: ``strategies`` lists single-axis tuples; ``local`` (optional) builds the per-device
    function when binding the primitive with its params on local blocks would be wrong (global sizes in params,
    offsets, masks); ``check`` (optional) rejects N-D combinations that single-axis tuples cannot rule out;
    ``communicates`` (optional) lists the collectives the local form itself runs (a ring of ``ppermute`` steps):
    the selection adds their cost to the moves it prices, ``explain`` and XLA:CPU's in-flight limit see them;
    ``describe`` (optional) is a text ``explain`` prints under the equation (a pipeline's schedule); ``flops``
    (optional) the FLOPs one device's local form runs, given the params and the strategy's specs (its matmuls at
    their local shapes), which pricing adds to the step's compute: a unit whose matmuls are inside it (attention,
    a mixture of experts) declares them, as it declares its collectives."""

    name: str
    strategies: Strategies
    local: LocalHook | None = None
    check: CheckHook | None = None
    communicates: CommunicatesHook | None = None
    describe: Callable[[dict, tuple, tuple], str] | None = None  # text explain prints under the equation
    flops: Callable[[dict, tuple, tuple], float] | None = None


_RULES: dict[str, Rule] = {}
_WARNED: set[str] = set()


def register(*prims: jc.Primitive | str, local: LocalHook | None = None, check: CheckHook | None = None,
             communicates: CommunicatesHook | None = None, replace: bool = False,
             flops: Callable[[dict, tuple, tuple], float] | None = None) -> Callable[[Strategies], Strategies]:
    """Decorator registering a strategy function ``fn(ins, outs, params) -> [tuples]`` for primitives, each
    given as its object or by its name in a jaxpr.

    Checked here, when the rule module is imported: a name the running JAX lacks is a ``ValueError`` (a
    primitive of a newer JAX listed in ``INTRODUCED`` is skipped instead), and so is a primitive that already
    has a rule (swap one with ``override``), unless ``replace=True`` says the replacement is meant (a function
    of ``jshard.rules.function`` defined again, as a notebook cell run twice does). Nothing is registered unless
    every primitive is accepted. Clears jshard's caches.

    >>> @register("expm1")
    ... def again(ins, outs, params):
    ...     return []
    Traceback (most recent call last):
    ValueError: register('expm1'): primitive 'expm1' already has a rule, ...; a second one, ...again, would ...
    """
    if not prims:
        raise TypeError("register() needs the primitives the rule is for, e.g. @register('exp', 'log')")

    names = [n for n in (_checked_name(p, "register") for p in prims) if n is not None]

    def deco(fn: Strategies) -> Strategies:
        for i, n in enumerate(names):
            if (n in _RULES and not replace) or n in names[:i]:
                raise _duplicate_error(n, _RULES[n].strategies if n in _RULES else fn, fn)
        for n in names:
            _RULES[n] = Rule(n, fn, local, check, communicates, flops=flops)
        clear_caches()
        return fn

    return deco


def rule_for(prim: jc.Primitive | str, source: str | None = None) -> Rule | None:
    """The rule of a primitive, or None (one warning per primitive: it will run replicated). ``source`` (the
    user's line that made the equation) goes into the warning.

    >>> rule_for("exp").name
    'exp'
    """
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


def has_rule(prim: jc.Primitive | str) -> bool:
    """Whether a primitive (object or name) has a rule.

    >>> has_rule("exp"), has_rule("while")
    (True, False)
    """
    return _name(prim) in _RULES


def registered() -> tuple[str, ...]:
    """Names of every primitive with a rule.

    >>> "dot_general" in registered()
    True
    """
    return tuple(sorted(_RULES))


@contextlib.contextmanager
def override(prim: jc.Primitive | str, rule: Rule | None) -> Iterator[None]:
    """Install ``rule`` for ``prim`` (``None``: no rule at all) inside a ``with`` block, then put back what
    was there: a seam for tests (a deliberately wrong rule must be caught by the validator; a primitive
    without a rule must run replicated, with its warning). ``prim`` is checked as ``register`` checks it, and
    must exist in the running JAX.

    Selections and rule expansions are memoised, so every jshard cache is cleared on entry and on exit:
    nothing chosen under the override outlives it. Inside the block a primitive without a rule warns once,
    as if never seen before.

    >>> with override("exp", None):
    ...     has_rule("exp")
    False
    >>> has_rule("exp")
    True
    """
    name = _checked_name(prim, "override")
    if name is None:
        raise _absent_error("override", prim)
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

# ---------------------------------------------------------------------------------------------------
# error builders


def _duplicate_error(name: str, first: Callable, second: Callable) -> ValueError:
    return ValueError(
        f"register('{name}'): primitive '{name}' already has a rule, {_qualified(first)}; a second one, "
        f"{_qualified(second)}, would silently replace it. Extend the first rule (or give the primitive to one "
        f"of the two), or swap it for a test with `with override('{name}', Rule('{name}', ...))`")


def _unknown_error(where: str, name: str) -> ValueError:
    near = difflib.get_close_matches(name, _jax_names(), n=3)
    hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
    return ValueError(
        f"{where}('{name}'): jax {jax.__version__} has no primitive named '{name}'{hint}. Name a primitive as "
        "it prints in a jaxpr (`jax.make_jaxpr(fn)(*args)`) or pass the primitive object itself; for a "
        f"primitive of a newer JAX release, add '{name}' to jshard.rules.registry.INTRODUCED with that release")


def _removed_error(where: str, name: str) -> ValueError:
    since = ".".join(map(str, INTRODUCED[name]))
    return ValueError(
        f"{where}('{name}'): jax {jax.__version__} has no primitive named '{name}', though INTRODUCED lists it "
        f"since jax {since}: JAX renamed or removed it. Find its new name in a jaxpr (`jax.make_jaxpr`) and "
        "register the rule under that name, or correct the release in jshard.rules.registry.INTRODUCED")


def _absent_error(where: str, prim: str) -> ValueError:
    since = ".".join(map(str, INTRODUCED[prim]))
    return ValueError(f"{where}('{prim}'): primitive '{prim}' is new in jax {since}; jax {jax.__version__} "
                      "cannot emit it, so no rule of it can apply here. Skip this case on older JAX releases")


def _type_error(where: str, prim: Any) -> TypeError:
    return TypeError(f"{where}(): a primitive is a jax.extend.core.Primitive or its name (a str), not "
                     f"{type(prim).__name__} {prim!r}")


# ---------------------------------------------------------------------------------------------------
# internals


def _name(prim: Any) -> str:
    return prim if isinstance(prim, str) else prim.name


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _checked_name(prim: Any, where: str) -> str | None:
    """The registry's key of ``prim``, None for a primitive of a newer JAX (see ``INTRODUCED``); raises for
    anything else that the running JAX lacks."""
    if isinstance(prim, jc.Primitive):
        return prim.name
    if not isinstance(prim, str):
        raise _type_error(where, prim)
    if prim in _jax_names():
        return prim
    if prim not in INTRODUCED:
        raise _unknown_error(where, prim)
    if jax.__version_info__[:3] >= INTRODUCED[prim]:
        raise _removed_error(where, prim)
    return None


_JAX_NAMES: set[str] = set()


def _jax_names() -> set[str]:
    """Names of the primitives the running JAX exports (``jax.extend.core.primitives`` and ``jax.lax``; the
    few it exports nowhere are registered by their objects). Read once: a release's primitives are fixed."""
    if not _JAX_NAMES:
        for module in (jc.primitives, lax):
            _JAX_NAMES.update(v.name for v in vars(module).values() if isinstance(v, jc.Primitive))
    return _JAX_NAMES


_NONE: frozenset = frozenset()


def _all_replicate(t: tuple) -> bool:
    # a loop that stops at the first sharded or pending entry: fill runs on every uncached selection
    for e in t:
        if not e.is_replicate:
            return False
    return True
