"""Choosing a placement for one equation: expand single-axis rules to the mesh, take the cheapest.

``select`` answers, for a primitive, its params and the specs its inputs currently have: which input
specs the equation should run on (the redistributions to pay) and which specs its outputs get. It is a
priority-queue search over per-axis choices that **starts from the current placements**: on each mesh
axis the filled rule columns are sorted by what moving the inputs there costs (alpha-beta, from
``jshard.cost``), and combinations are popped cheapest first; the first one that is valid on the whole
mesh (no mixed Partial kinds, evenly sharded where a rule reads across a dim, the rule's own check) is
the answer, and nothing cheaper exists. Usually it is the very first pop: the inputs already match a
rule on every axis and nothing moves. Size-1 axes are skipped; ties go to fewer changed inputs, then to
outputs that keep more of their inputs' sharding. Results are memoised per (primitive, params, input specs).

>>> import jax, jax.numpy as jnp
>>> from jshard import Spec, Shard, Partial, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> x = Spec.create(mesh, [Shard(0), Partial()], (8, 16), "float32")
>>> y = Spec.create(mesh, [Replicate(), Replicate()], (8, 16), "float32")
>>> out = [jax.core.ShapedArray((8, 16), jnp.float32)]
>>> c = select(jax.lax.add_p, {}, [x, y], out)
>>> c.outs[0].placements, c.ins[1].placements, c.cost
((S(0), P(sum)), (S(0), P(sum)), 0.0)
>>> select(jax.lax.exp_p, {}, [x], out).ins[0].placements   # exp needs the sum: all-reduced over tp
(S(0), R)
>>> split = [Spec.create(mesh, [Shard(0), Shard(0)], (8, 16), "float32")]
>>> select(jax.lax.exp_p, {}, [x], out, want=split).ins[0].placements   # wanted split: reduce-scattered
(S(0), S(0))
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh

from .caches import Cache, memo
from .cost import CostModel
from .placements import Placement, Replicate, partial_ops_mix
from .planner import model_in_force
from .rules.registry import Column, Rule, fill, rule_for
from .spec import Spec, dim_layout, format_mesh

__all__ = ["Aval", "Choice", "alternatives", "select", "offered"]

_R = Replicate()


@dataclass(frozen=True)
class Choice:
    """The decision for one equation: the specs its inputs must have, its output specs, the estimated
    redistribution cost (µs) and the rule that justified it (None: no rule, everything replicated)."""

    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    cost: float
    rule: Rule | None

    def __str__(self) -> str:
        return (", ".join(map(str, self.outs)) + " <- " + ", ".join(map(str, self.ins))
                + f"  ({self.cost:.1f} µs)")


def select(prim: Any, params: dict, in_specs: Sequence[Spec], out_avals: Sequence[Any], *,
           consts: Sequence[Any] | None = None, mesh: Mesh | None = None,
           cost_model: CostModel | None = None, want: Sequence[Spec | None] | None = None) -> Choice:
    """The cheapest correct strategy for ``prim`` with ``params`` on inputs that have ``in_specs``.

    ``out_avals`` are the outputs' abstract values (``.shape``, ``.dtype``), as in a jaxpr equation.
    ``consts`` gives, per input, its value when it is a known constant (a jaxpr literal) or None: rules
    may use it (multiplying a ``P(max)`` by a positive constant keeps it). ``mesh`` is needed only when
    there are no inputs. ``want`` gives, per output, the spec its consumers need (or None): moving an
    output there is priced with the strategy, so an equation can produce what is needed directly.

    A pending reduction of an input is completed onto a shard (a reduce-scatter) only where another input, or
    ``want``, has that shard on the mesh axis; else to Replicate (``alternatives`` still offers the scatter, for a
    planner that weighs the consumers).
    """
    model = cost_model or model_in_force()
    name = prim if isinstance(prim, str) else prim.name
    consts = _consts_key(consts, len(in_specs))
    frozen, outs_key = params_key(params), _avals_key(out_avals)
    want = tuple(want) if want is not None and any(w is not None for w in want) else None
    key = (name, frozen, tuple(in_specs), outs_key, consts, mesh, model, want)
    hit = _SELECTED.get(key)
    if hit is None:
        sel = Selection(name, params, tuple(in_specs), tuple(out_avals), model, consts, mesh, (frozen, outs_key),
                         want)
        hit = sel.run()
        _SELECTED.put(key, hit)
    return hit


def alternatives(prim: Any, params: dict, in_specs: Sequence[Spec], out_avals: Sequence[Any], *,
                 consts: Sequence[Any] | None = None, mesh: Mesh | None = None, limit: int = 4) -> list[Choice]:
    """Up to ``limit`` correct strategies with distinct output specs, cheapest first (the first is ``select``'s
    when nothing ties): what a planner that looks past one equation weighs against the greedy choice.

    >>> import jax, jax.numpy as jnp
    >>> from jshard import Spec, Shard
    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    >>> x = Spec.create(mesh, [Shard(0), Shard(1)], (8, 16), "float32")
    >>> [c.outs[0].placements for c in alternatives(jax.lax.exp_p, {}, [x], [x], limit=2)]
    [(S(0), S(1)), (S(1), S(1))]
    """
    name = prim if isinstance(prim, str) else prim.name
    consts = _consts_key(consts, len(in_specs))
    frozen, outs_key = params_key(params), _avals_key(out_avals)
    model = model_in_force()
    key = (name, frozen, tuple(in_specs), outs_key, consts, mesh, model, limit)
    hit = _ALTERNATIVES.get(key)
    if hit is None:
        sel = Selection(name, params, tuple(in_specs), tuple(out_avals), model, consts, mesh,
                        (frozen, outs_key), follow=False)
        hit = []
        for choice in sel.search(pops=64):
            if all(choice.outs != c.outs for c in hit):
                hit.append(choice)
                if len(hit) == limit:
                    break
        _ALTERNATIVES.put(key, hit)
    return list(hit)


def offered(prim: Any, params: dict, in_specs: Sequence[Spec], out_avals: Sequence[Any], *,
            consts: Sequence[Any] | None = None, mesh: Mesh | None = None) -> list[tuple]:
    """Every output placement tuple (one per output) the rules allow for inputs exactly as they are."""
    name = prim if isinstance(prim, str) else prim.name
    sel = Selection(name, params, tuple(in_specs), tuple(out_avals), model_in_force(),
                     _consts_key(consts, len(in_specs)), mesh)
    per_axis = [sel.lookup.get(sel.current(m), []) for m in sel.active]
    found = []
    for combo in per_axis_product(per_axis):
        cand = sel.candidate(combo, keep_inputs=True)
        if cand is not None:
            outs = tuple(s.placements for s in cand[1])
            if outs not in found:
                found.append(outs)
    return found


# ---------------------------------------------------------------------------------------------------
# internals

# combinations a rule that communicates itself looks at (its own cost is known only per N-D strategy)
COMMUNICATING_POPS = 256
_SELECTED = Cache(65536)  # (primitive, params, input specs, ...) -> Choice
_ALTERNATIVES = Cache(16384)  # (primitive, params, input specs, ...) -> [Choice, ...]
_COLUMNS = Cache(16384)  # a rule's strategies expanded for (primitive, params, shapes, shard kinds)


def _hashable(v):
    try:
        hash(v)
        return v
    except TypeError:
        if isinstance(v, (list, tuple)):
            return tuple(map(_hashable, v))
        if isinstance(v, dict):
            return params_key(v)
        if isinstance(v, np.ndarray):
            return ("ndarray", v.shape, str(v.dtype), v.tobytes())
        return _Held(v)


class _Held:
    """A key for a value that has neither a hash nor a content to compare: the object itself, compared by
    identity. Holding it keeps its id from being recycled while the key is cached."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return id(self.value)

    def __eq__(self, other):
        return isinstance(other, _Held) and other.value is self.value


def params_key(params: dict) -> tuple:
    """A hashable key for an equation's params (unhashable values by content, else by the object itself)."""
    items = tuple(params.items())  # an equation's params keep their order
    try:
        hash(items)
        return items
    except TypeError:
        return tuple((k, _hashable(v)) for k, v in items)


def _consts_key(consts, n: int) -> tuple:
    if consts is None:
        return (None,) * n
    return tuple(None if c is None else _Const(np.asarray(c)) for c in consts)


class _Const:
    """A known constant input, hashable by value."""

    __slots__ = ("value", "_key")

    def __init__(self, value: np.ndarray):
        self.value = value
        self._key = (value.shape, value.dtype, value.tobytes())

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Const) and self._key == other._key


class Aval:
    """What a rule sees of an input: ``.shape``, ``.dtype``, ``.ndim`` and ``.value`` (the value of a known
    constant, else None)."""

    __slots__ = ("shape", "dtype", "value")

    def __init__(self, shape, dtype, value=None):
        self.shape, self.dtype, self.value = shape, dtype, value

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Aval({self.shape}, {self.dtype}{'' if self.value is None else ', const'})"


def _avals_key(avals) -> tuple:
    return tuple((tuple(a.shape), a.dtype) for a in avals)


@memo(65536)
def _even(length: int, mesh_shape: tuple[int, ...], chain: tuple) -> bool:
    return bool((dim_layout(length, mesh_shape, chain) >= 0).all())


def _partial_ok(dtype, op: str) -> bool:
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys) are never pending reductions
        return False
    return dtype != np.bool_ and not (dtype.kind == "c" and op in ("max", "min"))  # complex numbers have no order


def _kept_shards(col: Column) -> int:
    """The outputs ``col`` keeps sharded, the tie-break between equally cheap columns. A pending reduction is not
    memory saved, and a shard made from whole inputs (a broadcast's new dim) is a slice, not sharding kept: it
    is made where the consumers ask for it (the walk's look back), never preferred on its own."""
    if all(p.is_replicate for p in col.ins):
        return 0
    return sum(1 for p in col.outs if p.is_shard)


def per_axis_product(lists):
    """Every combination taking one item from each list, in order (``itertools.product`` for the per-axis
    options of a selection, lazily)."""
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for tail in per_axis_product(lists[1:]):
            yield (head,) + tail


class Selection:
    """One selection problem: the filled columns, the per-axis options and the search over them."""

    def __init__(self, name: str, params: dict, in_specs: tuple[Spec, ...], out_avals: tuple,
                 model: CostModel, consts: tuple, mesh: Mesh | None, keys: tuple | None = None,
                 want: tuple | None = None, follow: bool = True):
        self.name, self.params, self.in_specs, self.out_avals = name, params, in_specs, out_avals
        self.model, self.consts, self.want, self.follow = model, consts, want, follow
        mesh = in_specs[0].mesh if in_specs else mesh
        if mesh is None:
            raise ValueError(f"select('{name}'): an equation without inputs needs mesh=")
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.axis_sizes)
        self.active = tuple(m for m, n in enumerate(self.mesh_shape) if n > 1)
        self.rule = rule_for(name)
        # the shard kinds to fill placeholders with: the inputs' and those consumers want (an input-free draw
        # such as random_bits or iota can then be made sharded where its consumers are)
        # and plain Shard always: a rule whose inputs are all strided on one dim may still shard another plainly
        kinds = sorted({1} | {p.split_factor for s in in_specs + tuple(w for w in want or () if w is not None)
                              for p in s.placements if p.is_shard})
        frozen, outs_key = keys if keys is not None else (params_key(params), _avals_key(out_avals))
        ckey = (name, frozen, tuple((s.shape, s.dtype) for s in in_specs), outs_key, consts, tuple(kinds))
        cached = _COLUMNS.get(ckey)
        if cached is None:
            cached = self._columns(kinds)
            _COLUMNS.put(ckey, cached)
        self.columns, self.lookup = cached

    def _columns(self, kinds):
        n_in, n_out = len(self.in_specs), len(self.out_avals)
        cols = [Column((_R,) * n_out, (_R,) * n_in, frozenset())]
        if self.rule is not None:
            in_avals = tuple(Aval(s.shape, s.dtype, None if c is None else c.value)
                             for s, c in zip(self.in_specs, self.consts, strict=True))
            dtypes = [a.dtype for a in self.out_avals] + [s.dtype for s in self.in_specs]
            # bool, PRNG keys (no Partial at all), complex (no max/min)
            limited = [(i, dt) for i, dt in enumerate(dtypes) if not _partial_ok(dt, "max")]
            for c in fill(self.rule.strategies(in_avals, self.out_avals, self.params), kinds, n_out):
                if len(c.outs) != n_out or len(c.ins) != n_in:
                    raise ValueError(f"rule for '{self.name}' returned {c} for {n_out} outputs and {n_in} "
                                     "inputs")
                if limited:
                    both = c.outs + c.ins
                    if any(both[i].is_partial and not _partial_ok(dt, both[i].op) for i, dt in limited):
                        continue
                cols.append(c)
        lookup: dict = {}
        for c in cols:
            lookup.setdefault(c.ins, []).append(c)
            # a Replicate block already is a P(avg|max|min) block (every device holds the value): a column
            # taking those Partials also takes Replicate there, with nothing to convert
            loose = [i for i, p in enumerate(c.ins) if p.is_partial and p.op != "sum"]
            for k in range(1, len(loose) + 1):
                for subset in itertools.combinations(loose, k):
                    ins = tuple(_R if i in subset else p for i, p in enumerate(c.ins))
                    lookup.setdefault(ins, []).append(Column(c.outs, ins, c.even))
        for v in lookup.values():
            if len(v) > 1:
                v.sort(key=lambda c: -_kept_shards(c))
        return cols, lookup

    def current(self, m: int) -> tuple[Placement, ...]:
        return tuple(s.placements[m] for s in self.in_specs)

    # -- validity of one N-D combination --------------------------------------------------------------
    def candidate(self, combo: Sequence[Column], keep_inputs: bool = False):
        """``(in_specs, out_specs)`` for per-active-axis ``combo``, or None if invalid on the mesh."""
        k = len(self.mesh_shape)
        ins = [[_R] * k for _ in self.in_specs]
        outs = [[_R] * k for _ in self.out_avals]
        if keep_inputs:  # report the inputs exactly as given (size-1 axes included)
            ins = [list(s.placements) for s in self.in_specs]
        for m, col in zip(self.active, combo, strict=True):
            for i, p in enumerate(col.ins):
                ins[i][m] = p
            for j, p in enumerate(col.outs):
                outs[j][m] = p
        in_specs = tuple(s if s.placements == tuple(pl) else Spec(s.mesh, tuple(pl), s.shape, s.dtype)
                         for s, pl in zip(self.in_specs, ins, strict=True))
        out_specs = tuple(Spec(self.mesh, tuple(pl), tuple(a.shape), a.dtype)
                          for a, pl in zip(self.out_avals, outs, strict=True))
        specs = out_specs + in_specs
        for s in specs:
            if not partial_ops_mix({p.op for p in s.placements if p.is_partial}):
                return None
        for col in combo:
            for pos, d in col.even:
                s = specs[pos]
                if not _even(s.shape[d], self.mesh_shape, s.chain(d)):
                    return None
        if self.rule is not None and self.rule.check is not None:
            if not self.rule.check(self.params, in_specs, out_specs):
                return None
        return in_specs, out_specs

    # -- costs ---------------------------------------------------------------------------------------
    def _made_bytes(self, want: Spec, made: Placement, m: int) -> float:
        """The bytes a device holds of an output made as ``made`` on axis ``m`` (and as ``want`` on the others):
        what moving it to ``want`` starts from."""
        n = self.mesh_shape[m]
        return want.local_bytes * (n if want.placements[m].is_shard else 1) / (n if made.is_shard else 1)

    def _hop(self, src: Placement, dst: Placement, nbytes: float, m: int) -> tuple[float, int]:
        if src == dst:
            return 0.0, 0
        names, n = (self.mesh.axis_names[m],), self.mesh_shape[m]
        if src.is_replicate:
            return 0.0, 1  # a local slice, or R -> P: the value on one coordinate, the identity elsewhere
        if dst.is_partial and src.is_shard:
            return math.inf, 1  # never spread a shard into a full-size pending reduction
        if dst.is_replicate:
            kind = "all_gather" if src.is_shard else "all_reduce"
        elif dst.is_shard:
            kind = "all_to_all" if src.is_shard else "reduce_scatter"
        else:  # P(op) -> P(op'): reduce, then the free R -> P(op'): two changes
            return self.model.collective("all_reduce", names, n, nbytes), 2
        return self.model.collective(kind, names, n, nbytes), 1

    def options(self, m: int, follow: bool) -> list[tuple[tuple, Column]]:
        cur = self.current(m)
        nbytes = [s.local_bytes for s in self.in_specs]
        opts = []
        for col in self.columns:
            if follow and self._scatters_alone(col, cur, m):
                continue
            cost, changes = 0.0, 0
            for i, (a, b) in enumerate(zip(cur, col.ins, strict=True)):
                c, ch = self._hop(a, b, nbytes[i], m)
                cost += c
                changes += ch
            for j, w in enumerate(self.want or ()):  # what consumers would pay to move the output
                if w is not None and col.outs[j] != w.placements[m]:
                    cost += self._hop(col.outs[j], w.placements[m], self._made_bytes(w, col.outs[j], m), m)[0]
                    changes += 1  # at equal cost, producing what is wanted beats leaving the inputs alone
            if cost < math.inf:
                opts.append(((cost, changes, -_kept_shards(col)), col))
        opts.sort(key=lambda o: o[0])
        return opts

    def _scatters_alone(self, col: Column, cur: tuple, m: int) -> bool:
        """Does ``col`` reduce-scatter a pending reduction onto a shard that no other input and no consumer has
        on axis ``m``? The greedy choice completes such a reduction to Replicate instead, as DTensor's pointwise
        strategies follow their inputs: a row statistic scattered over rows on its own (half an all-reduce's
        bytes) then meets the logits, sharded by vocabulary, it is broadcast against, and the logits move.
        A scatter that makes an output its consumers want is not alone, whichever dim it lands on (a transpose
        scatters its input on the dim that becomes the wanted one)."""
        wants = [w.placements[m] for w in self.want or () if w is not None]
        wanted = self.want or (None,) * len(col.outs)
        if any(w is not None and w.placements[m] == o and o.is_shard for w, o in zip(wanted, col.outs, strict=True)):
            return False
        return any(a.is_partial and b.is_shard and b not in cur[:i] + cur[i + 1:] and b not in wants
                   for i, (a, b) in enumerate(zip(cur, col.ins, strict=True)))

    # -- the search ----------------------------------------------------------------------------------
    def run(self) -> Choice:
        if self.rule is not None and self.rule.communicates is not None:
            # its own collectives are priced per N-D strategy, after the per-axis search: the cheapest of the
            # first combinations, whose moves cost least, wins
            found = list(self.search(pops=COMMUNICATING_POPS)) or self._unfiltered()
            return min(found, key=lambda c: c.cost)
        # fast path: the inputs already match a rule on every axis (and no consumer asks for more)
        firsts = []
        for m in self.active:
            hits = self.lookup.get(self.current(m)) if self.want is None else None
            if not hits:
                break
            firsts.append(hits[0])
        else:
            cand = self.candidate(firsts)
            if cand is not None:
                return Choice(cand[0], cand[1], 0.0, self.rule)
        for choice in self.search():
            return choice
        return self._unfiltered()[0]

    def _unfiltered(self) -> list[Choice]:
        """The search again without the filter on lone scatters, where with it the rule's check left nothing (a
        pending sum whose only way on is scattered onto a dim the check asks for); raise if still nothing."""
        found = list(self.search(pops=COMMUNICATING_POPS, follow=False)) if self.follow else []
        if not found:
            raise self._vetoed()
        return found

    def _vetoed(self) -> ValueError:
        """No combination holds: only a rule's own check can veto them all (all-Replicate is always offered)."""
        check = getattr(self.rule, "check", None)
        why = " ".join((check.__doc__ or "").split("\n\n")[0].split()) if check is not None else ""
        return ValueError(
            f"{self.name}: no placement on {format_mesh(self.mesh)} satisfies the rule for inputs "
            f"{', '.join(map(str, self.in_specs))}: its check ({getattr(check, '__qualname__', check)}) vetoes every "
            f"combination{f' ({why})' if why else ''}. The call asks for what these shapes cannot do on this mesh: "
            "loosen what the check enforces, or change the shapes or the mesh")

    def search(self, pops: float = math.inf, follow: bool | None = None):
        """The valid combinations, cheapest first, as Choices (at most ``pops`` combinations are looked at);
        ``follow``: whether lone scatters are left out (by default as the selection was made)."""
        per_axis = [self.options(m, self.follow if follow is None else follow) for m in self.active]
        start = (0,) * len(per_axis)
        heap = [(self._key(per_axis, start), start)]
        seen = {start}
        while heap and pops > 0:
            pops -= 1
            key, idx = heapq.heappop(heap)
            cand = self.candidate([per_axis[a][i][1] for a, i in enumerate(idx)])
            if cand is not None:
                yield Choice(cand[0], cand[1], key[0] + self.own_cost(*cand), self.rule)
            for a in range(len(idx)):
                if idx[a] + 1 < len(per_axis[a]):
                    nxt = idx[:a] + (idx[a] + 1,) + idx[a + 1:]
                    if nxt not in seen:
                        seen.add(nxt)
                        heapq.heappush(heap, (self._key(per_axis, nxt), nxt))

    def own_cost(self, ins: tuple[Spec, ...], outs: tuple[Spec, ...]) -> float:
        """µs of the collectives the rule's local form runs itself for this strategy (0 for most rules)."""
        if self.rule is None or self.rule.communicates is None:
            return 0.0
        sizes = dict(zip(self.mesh.axis_names, self.mesh_shape, strict=True))
        return sum(c.cost(self.model, sizes) for c in self.rule.communicates(self.params, ins, outs))

    @staticmethod
    def _key(per_axis, idx):
        keys = [per_axis[a][i][0] for a, i in enumerate(idx)]
        return (sum(k[0] for k in keys), sum(k[1] for k in keys), sum(k[2] for k in keys))
