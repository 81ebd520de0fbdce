"""Reductions, scans and sorts: a dim the operation reads across, and the dims it leaves alone.

Each of these primitives singles out some dims of its operand (the reduced ``axes``, the scan ``axis``,
the sort ``dimension``) and treats every other dim as a batch: rows along the other dims never meet. So
on one mesh axis:

- **a kept dim follows its shard**: the output is sharded on the same dim, renumbered when reduced dims
  before it disappear. Uneven shards are fine: a padding row only produces a padding row.
- **a reduced dim may be split** when the reduction is one of the pending kinds: a device reduces its
  own part and the output is ``P(sum)`` / ``P(max)`` / ``P(min)``. Here the padding *would* be read, so
  the local function first overwrites it with the reduction's identity (0, -inf, +inf), which makes
  uneven and empty shards fine too. Product, and/or/xor and argmax/argmin have no pending kind: their
  reduced dims stay Replicate (argmax would need a (value, index) pair to combine).
- **a pending reduction passes** when it is the same monoid as the operation: a sum of sums is a sum
  (``P(sum)``, and ``P(avg)`` for inexact dtypes: integer averages round), a max of maxima a max.
  ``P(min)`` never passes a max, and nothing passes a product.
- **scans** (cumsum, cummax, ...) cannot split their axis: a prefix needs every earlier element. Their
  Partials follow the same algebra as the reductions, because each prefix is one reduction:
  ``cummax(max_i x_i) = max_i cummax(x_i)``. ``cumprod`` and ``cumlogsumexp`` keep none.
- **sorts** permute along their dim, the same permutation on every device as long as the keys are
  Replicate. A permutation commutes with any elementwise reduction, so the non-key operands (the
  payloads: the iota of an argsort) may be pending reductions of any kind. ``top_k`` likewise keeps
  its other dims sharded.

A reduction or scan over a dim of size 1 (and a sort along one) moves nothing: it is a reshape, and every
Partial passes.

``x[m, n, k].sum(axis=1)`` (``Φd``: sharded on dim ``d``, in any shard kind the inputs use):

>>> import jax.numpy as jnp; from jax.core import ShapedArray
>>> x, y = ShapedArray((6, 5, 3), jnp.float32), ShapedArray((6, 3), jnp.float32)
>>> _reduction("sum")((x,), (y,), {"axes": (1,)})
[(Φ0, Φ0), (Φ1, Φ2), (P(sum), Φ1), (P(sum), P(sum)), (P(avg), P(avg))]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from ..local import fill_padding, reduce_identity
from ..placements import Partial
from ..spec import Spec
from .algebra import MAX, MIN, PARTIALS, R, linear
from .registry import ShardPlaceholder as Φ
from .registry import register

__all__: list[str] = []


def _kept(rank: int, axes: Sequence[int]) -> list[tuple]:
    """``(Φ out dim, Φ in dim)`` for every dim a reduction over ``axes`` keeps."""
    kept = [d for d in range(rank) if d not in axes]
    return [(Φ(o), Φ(d)) for o, d in enumerate(kept)]


def _passing(op: str | None, dtype) -> tuple[Partial, ...]:
    """The pending reductions that pass a reduction (or scan) with monoid ``op`` (None: none does)."""
    if op == "sum":
        return linear(dtype)
    return {"max": (MAX,), "min": (MIN,)}.get(op, ())


def _axes(params: dict) -> tuple[int, ...]:
    return tuple(int(a) for a in params["axes"])  # jaxprs may hold numpy integers


# -- reductions -------------------------------------------------------------------------------------


def _reduction(op: str | None) -> Callable:
    """The rule of a reduction whose monoid is the pending kind ``op`` (sum, max, min) or None."""

    def rule(ins, outs, params) -> list[tuple]:
        x, axes = ins[0], _axes(params)
        t = _kept(len(x.shape), axes)
        if op is not None:
            t += [(Partial(op), Φ(a)) for a in axes]
        moves_nothing = all(x.shape[a] == 1 for a in axes)
        return t + [(p, p) for p in (PARTIALS if moves_nothing else _passing(op, x.dtype))]

    return rule


def _identity_padding(op: str) -> Callable:
    """A ``local=`` that sets the padding along the reduced dims to ``op``'s identity, then binds."""

    def local(prim, params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> Callable:
        spec, axes = in_specs[0], _axes(params)
        bind = prim.get_bind_params(params)
        # only a split reduced dim has padding; an unsharded one never calls reduce_identity (bool max)
        split = [a for a in axes if spec.chain(a)]

        def run(x):
            if split:
                x = fill_padding(x, spec, split, reduce_identity(op, x.dtype))
            return [prim.bind(x, **bind)]

        return run

    return local


for _op in ("sum", "max", "min"):
    register(f"reduce_{_op}", local=_identity_padding(_op))(_reduction(_op))
register("reduce_prod", "reduce_and", "reduce_or", "reduce_xor")(_reduction(None))


@register("argmax", "argmin")
def _arg_reduction(ins, outs, params) -> list[tuple]:
    # the winner's index is not a pending reduction of per-device indices: the reduced dim stays whole
    return _kept(len(ins[0].shape), _axes(params))


# -- scans ------------------------------------------------------------------------------------------


def _scan(op: str | None) -> Callable:
    """The rule of a cumulative op along ``axis``; ``op`` is its monoid's pending kind, if any."""

    def rule(ins, outs, params) -> list[tuple]:
        x, axis = ins[0], int(params["axis"])
        t = [(Φ(d), Φ(d)) for d in range(len(x.shape)) if d != axis]
        moves_nothing = x.shape[axis] <= 1
        return t + [(p, p) for p in (PARTIALS if moves_nothing else _passing(op, x.dtype))]

    return rule


for _name, _op in (("cumsum", "sum"), ("cummax", "max"), ("cummin", "min"), ("cumprod", None),
                   ("cumlogsumexp", None)):
    register(_name)(_scan(_op))


# -- sorts ------------------------------------------------------------------------------------------

_MAX_PAYLOAD_PRODUCT = 3  # beyond this many payloads, do not list every mix of their Partials


@register("sort")
def sort_strategies(ins, outs, params) -> list[tuple]:
    n, dim = len(ins), int(params["dimension"])
    t = [(Φ(d),) * (2 * n) for d in range(len(ins[0].shape)) if d != dim]
    # operands that only follow the permutation: the payloads, or all of them when nothing moves
    free = range(n) if ins[0].shape[dim] <= 1 else range(int(params["num_keys"]), n)
    if len(free) <= _MAX_PAYLOAD_PRODUCT:
        mixes = itertools.product((R, *PARTIALS), repeat=len(free))
    else:  # one payload pending, or all of them with the same kind
        mixes = [tuple(p if i == j else R for i in range(len(free)))
                 for j in range(len(free)) for p in PARTIALS]
        mixes += [(p,) * len(free) for p in PARTIALS]
    for mix in mixes:
        if any(p.is_partial for p in mix):
            col = [R] * n
            for j, p in zip(free, mix, strict=True):
                col[j] = p
            t.append(tuple(col) * 2)
    return t


@register("top_k")
def _top_k(ins, outs, params) -> list[tuple]:
    rank = len(ins[0].shape)
    axis = int(params.get("axis", rank - 1))  # older JAX: always the last dim
    return [(Φ(d), Φ(d), Φ(d)) for d in range(rank) if d != axis]
