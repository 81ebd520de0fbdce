"""Scaled dot-product attention with rules for a sequence-sharded mesh axis.

``attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False)`` has the contract of
``jax.nn.dot_product_attention`` (arrays ``[batch, seq, heads, head_dim]``, grouped-query attention with fewer
key/value heads, ``bias`` and boolean ``mask`` broadcastable to ``[batch, heads, q_seq, kv_seq]``) and outside
``jshard.jit`` it *is* that function. Under ``jshard.jit`` it is one equation (``jshard.rules.function``) whose
rule offers, per mesh axis:

- **batch**: everything sharded on the batch dim (``bias`` / ``mask`` too where they are not broadcast there);
- **heads**: everything sharded on the heads dim; with fewer key/value heads both head counts must shard evenly,
  so that each device's query heads read its own key/value heads;
- **all-gather**: queries (and the output) sharded on the sequence, keys and values Replicate: the engine gathers
  them with its own move, and each device attends its queries block by block over the keys (a running max and
  log-sum-exp), so no ``[q_block, kv_seq]`` score matrix is ever whole;
- **ring**: queries, keys and values sharded on the sequence; the key/value blocks travel around the axis with
  ``ppermute`` (keys and values as one buffer: one permute a step) while each device folds them into its running
  softmax. Each step sends the next block on *before* folding the held one, so the transfer may overlap the
  computation; the backward pass rotates the blocks again with their gradients, each gradient a step behind its
  block (sent on as the next step begins, again before the computation), and one more step takes the gradients
  home. Its collectives are declared (``communicates``), so the selection weighs them against the all-gather's;
- **all-to-all** (Ulysses) needs no code of its own: from sequence-sharded inputs the heads tuple is reached by
  the engine's ``all_to_all`` moves (sequence -> heads, and back for the output), and the selection prices it
  like any other move.

Blocks and the causal skip: a device cuts its queries into square blocks (a quarter of its query block, at most
512 rows) and each key/value block it sees into chunks as long, and scores one (query block, key chunk) pair at
a time with the running max, sum and output kept per query row: no device holds more than a ``[block, block]``
score matrix per head. Every block knows its global positions (``jshard.local``), so causal masking compares
global positions and padding of unevenly sharded sequences is never attended; with ``is_causal`` and no
``mask``, a pair whose keys all come after its queries is skipped.

Layouts and load balance: with the sequence cut into contiguous blocks (``Shard(1)``), device ``i`` of ``N``
skips every key block after its own and computes every one before it, so under ``is_causal`` the last device
does about twice the average work (the one that sets the step time). ``balanced(length, N)`` is the striped
layout (``StridedShard``: token ``t`` on device ``t % N``): every device then holds early and late positions,
its query block against any key block is lower-triangular in local order, the pairs above the diagonal are
skipped and every device computes the same number of pairs. ``load(q_spec, k_spec, is_causal)`` counts them
per device with the kernel's own block size and skip rule. Position embeddings and masks see the striped
tokens' global positions (``jshard.local.global_index``).

``bias`` and ``mask`` are sharded along the query sequence with the queries (or Replicate where they broadcast
there); along the key sequence they stay whole and each device takes the columns of the key chunk it holds.
Gradients: the backward pass is a unit of its own with the same four ways to run, blockwise as the forward pass
is, ``bias`` / ``mask`` or not. ``bias`` gets its gradient there: each device's block of it (its queries' rows,
every key column), each chunk's score gradient added at its keys' columns as the key blocks visit, summed over
the dims the bias broadcasts on (a ``Partial`` over the devices that share it). A query whose keys are all masked
spreads over every key, as jax's does.

>>> import jax, numpy as np, jshard
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.normal(size=(2, 64, 4, 8)).astype(np.float32) for _ in range(3))
>>> mesh = jax.make_mesh((8,), ("sp",))
>>> args = [jshard.distribute(a, mesh, [balanced(64, 8)]) for a in (q, k, v)]
>>> out = jshard.jit(lambda q, k, v: attention(q, k, v, is_causal=True))(*args)
>>> bool(np.allclose(out.full(), jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
True
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from .cost import Communication
from .engine.constrain import aliased_axis, users_mesh
from .local import axis_index, global_index
from .placements import Partial, Placement, Replicate, Shard, StridedShard
from .rules.functions import function
from .rules.registry import ShardPlaceholder

if TYPE_CHECKING:
    from .darray import DArray
    from .spec import Spec

__all__ = ["METHODS", "attention", "attention_method", "balanced", "load"]

METHODS = ("auto", "ring", "all_gather", "all_to_all")
_METHOD: contextvars.ContextVar[str | tuple] = contextvars.ContextVar("jshard_attention_method", default="auto")


def attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None = None,
              mask: ArrayLike | None = None, *, scale: float | None = None, is_causal: bool = False,
              method: str | Mapping[str, str] | None = None) -> jax.Array:
    """Scaled dot-product attention, ``jax.nn.dot_product_attention``'s contract, with sequence-parallel rules.

    ``query`` is ``[batch, q_seq, heads, head_dim]``, ``key`` / ``value`` ``[batch, kv_seq, kv_heads, head_dim]``
    (``heads`` a multiple of ``kv_heads``; rank 3 drops the batch dim), ``bias`` / boolean ``mask`` broadcastable
    to ``[batch, heads, q_seq, kv_seq]``; ``scale`` defaults to ``1/sqrt(head_dim)``.

    ``method`` says how a sequence-sharded mesh axis is crossed under ``jshard.jit``: ``"ring"``,
    ``"all_gather"``, ``"all_to_all"`` (Ulysses: sequence -> heads and back) or ``"auto"`` (the cost model
    chooses). A string offers only that sequence method, beside the batch and heads placements (which any axis
    may still take, where they are cheaper); a mapping ``{axis: method}`` pins each named axis to its method,
    forward and backward. None takes the innermost ``attention_method`` context's (by default ``"auto"``). It
    never changes the result.

    >>> import numpy as np
    >>> q = np.ones((1, 4, 2, 8), np.float32)
    >>> attention(q, q[:, :, :1], q[:, :, :1]).shape
    (1, 4, 2, 8)
    """
    arrays = [jnp.asarray(a) if not hasattr(a, "shape") else a for a in (query, key, value)]
    if not all(a.ndim == arrays[0].ndim for a in arrays) or arrays[0].ndim not in (3, 4):
        raise _rank_error(*arrays)
    unbatched = arrays[0].ndim == 3
    q, k, v = (a[None] if unbatched else a for a in arrays)
    _check_shapes(q, k, v)
    extras = {name: _as_4d(name, a, q, k) for name, a in (("bias", bias), ("mask", mask)) if a is not None}
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scale, is_causal, method = float(scale), bool(is_causal), _checked_method(method)
    if extras:
        out = _attention_masked(q, k, v, extras.get("bias"), extras.get("mask"), scale=scale, is_causal=is_causal,
                                method=method, with_bias="bias" in extras, with_mask="mask" in extras)
    else:
        out = _attention(q, k, v, scale=scale, is_causal=is_causal, method=method)
    return out[0] if unbatched else out


@contextlib.contextmanager
def attention_method(method: str | Mapping[str, str]) -> Iterator[None]:
    """Within the block, ``attention`` calls that give no ``method`` cross sequence-sharded axes by ``method``
    (one of ``METHODS``, or ``{axis: method}``; see ``attention``). ``jshard.parallel.ContextParallel`` sets it
    around the module it is matched on. A mapping inside a mapping adds its axes to the outer one's.

    >>> with attention_method({"cp": "ring"}), attention_method({"sp": "all_gather"}):
    ...     _METHOD.get()
    (('cp', 'ring'), ('sp', 'all_gather'))
    """
    method, outer = _checked_method(method, "attention_method"), _METHOD.get()
    if isinstance(method, tuple) and isinstance(outer, tuple):
        method = tuple(sorted({**dict(outer), **dict(method)}.items()))
    token = _METHOD.set(method)
    try:
        yield
    finally:
        _METHOD.reset(token)


def balanced(length: int, size: int) -> Placement:
    """The causal load-balanced layout of a sequence dim (dim 1) of ``length`` over a mesh axis of ``size``
    devices: stripes of ``size`` tokens, token ``t`` on device ``t % size`` (``StridedShard(1, ceil(length /
    size))``; ``Shard(1)`` where that is one stripe). Every device then holds early and late positions alike, so
    under ``is_causal`` each one computes the same number of score blocks (see ``load``). Where ``size`` does
    not divide ``length`` the last stripe is short (for lengths under ``size * (size - 1)`` the stripes may be
    shorter than ``size``: ``StridedShard``'s blocks are cut like ``torch.chunk``).

    >>> balanced(4096, 8), balanced(30, 8), balanced(4096, 1)
    (SS(1,512), SS(1,4), S(1))
    """
    if not (isinstance(length, (int, np.integer)) and isinstance(size, (int, np.integer)) and length >= 1
            and size >= 1):
        raise ValueError(f"jshard.sharded_attention.balanced: length ({length!r}) and size ({size!r}) must be positive "
                         f"ints: the sequence length and the number of devices on the mesh axis")
    stripes = -(-int(length) // int(size))
    return Shard(1) if stripes == 1 or size == 1 else StridedShard(1, stripes)


def load(q_spec: Spec | DArray, k_spec: Spec | DArray, is_causal: bool) -> np.ndarray:
    """Per device (an array of the mesh's shape), the number of score blocks ``attention``'s kernel computes
    for queries laid out as ``q_spec`` and keys as ``k_spec`` (``DArray``s or their ``.spec``s, the sequence
    on dim 1, no user ``mask``): every (query block, key chunk) pair of every key block the device sees (the
    ring's blocks where the keys are sharded on the sequence, the whole keys where they are not), less the
    pairs the causal skip leaves out. It reads the kernel's own block size and skip rule.

    >>> import jax, jshard
    >>> mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    >>> x = np.zeros((1, 64, 2, 8), np.float32)
    >>> striped, blocks = (jshard.distribute(x, mesh, [p]) for p in (balanced(64, 4), Shard(1)))
    >>> load(striped, striped, is_causal=True), load(blocks, blocks, is_causal=True)
    (array([40, 40, 40, 40]), array([10, 26, 42, 58]))
    """
    q_spec, k_spec = (getattr(s, "spec", s) for s in (q_spec, k_spec))
    table = _key_table(k_spec)
    layout = q_spec.layouts[1]
    size = _block(layout.shape[-1])
    keys = np.stack([_cut(row, min(size, table.shape[1]), np) for row in table])  # [blocks, chunks, keys]
    counts = np.zeros(q_spec.mesh_shape, np.int64)
    for coords in np.ndindex(*q_spec.mesh_shape):
        queries = _cut(layout[coords], size, np)
        if is_causal:
            counts[coords] = np.sum(~_skipped(queries[None, :, None], keys[:, None], np))
        else:
            counts[coords] = queries.shape[0] * keys.shape[0] * keys.shape[1]
    return counts


# ---------------------------------------------------------------------------------------------------
# errors


def _checked_method(method: str | Mapping[str, str] | None, where: str = "attention") -> str | tuple:
    """``method`` as the equation carries it: a string, or ``{axis: method}`` as sorted pairs (hashable)."""
    if method is None:
        return _METHOD.get()
    pairs = sorted(method.items()) if isinstance(method, Mapping) else [(None, method)]
    for axis, m in pairs:
        if m not in METHODS or not (axis is None or isinstance(axis, str)):
            raise ValueError(f"jshard.{where}: method {method!r} must be one of {', '.join(map(repr, METHODS))}, "
                             f"or a dict of mesh axis names to them")
    return tuple(pairs) if isinstance(method, Mapping) else method


def _shapes(*arrays) -> str:
    return ", ".join(f"{n}{list(a.shape)}" for n, a in zip(("query", "key", "value"), arrays, strict=True))


def _rank_error(q, k, v) -> ValueError:
    return ValueError(f"jshard.attention: query, key and value must all be rank 4 [batch, seq, heads, head_dim] "
                      f"(or all rank 3 without the batch dim); got {_shapes(q, k, v)}. Add or drop the batch dim "
                      f"so that they agree")


def _check_shapes(q, k, v) -> None:
    if k.shape != v.shape:
        raise ValueError(f"jshard.attention: key and value must have the same shape [batch, kv_seq, kv_heads, "
                         f"head_dim]; got {_shapes(q, k, v)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"jshard.attention: query and key/value batch sizes differ ({q.shape[0]} vs "
                         f"{k.shape[0]}): {_shapes(q, k, v)}; give every array the same batch dim (dim 0)")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"jshard.attention: query and key head_dim differ ({q.shape[3]} vs {k.shape[3]}): "
                         f"{_shapes(q, k, v)}; project them to the same head_dim (dim 3)")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"jshard.attention: query heads ({q.shape[2]}) must be a multiple of key/value heads "
                         f"({k.shape[2]}) for grouped-query attention: {_shapes(q, k, v)}")
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"jshard.attention: query, key and value must share one floating dtype; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}; cast them first")


def _as_4d(name: str, a, q, k):
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    a = a if hasattr(a, "shape") else jnp.asarray(a)
    shape = (1,) * (4 - a.ndim) + tuple(a.shape)
    if len(shape) != 4 or any(s not in (1, f) for s, f in zip(shape, full, strict=True)):
        raise ValueError(f"jshard.attention: {name} of shape {list(a.shape)} does not broadcast to [batch, heads, "
                         f"q_seq, kv_seq] = {list(full)}; each dim must be 1 or the full size")
    if name == "mask" and a.dtype != jnp.bool_:
        raise TypeError(f"jshard.attention: mask must be boolean (True: attend), got {a.dtype}; use mask.astype(bool)"
                        f" or pass additive values as bias")
    return jnp.reshape(a, shape)


# ---------------------------------------------------------------------------------------------------
# strategies: roles of the arrays, in the order of the tuple (outputs, then inputs)
#
# "q": [batch, q_seq, heads, ...] (query, output, their gradients, the log-sum-exp), "kv": [batch, kv_seq,
# kv_heads, head_dim] (key, value, their gradients), "bias": [batch, heads, q_seq, kv_seq] (bias, mask).


def _tuples(roles: Sequence[str], arrays: Sequence, n_out: int, grouped: bool, method: str) -> list[tuple]:
    """The batch, heads, all-gather and ring tuples for arrays with these roles (outputs first, ``n_out`` of
    them), the sequence ones as ``method`` allows. Under the all-gather, a "kv" output is a gradient: each
    device's part of a sum over the axis."""
    R, Φ = Replicate(), ShardPlaceholder

    def tup(q, kv, kv_out, bias):
        row = []
        for i, (r, a) in enumerate(zip(roles, arrays, strict=True)):
            if r == "bias":  # broadcast on the dim: whole, and its gradient each device's part of a sum
                row.append(bias if a.shape[bias.dim] != 1 else Partial() if i < n_out else R)
            else:
                row.append(q if r == "q" else kv_out if i < n_out else kv)
        return tuple(row)

    heads = Φ(2, even=grouped)
    rows = []
    # a dim of length 1 is never worth sharding (one device would do all the work); where the model prices
    # moving to heads or to batch alike, heads (Ulysses) comes first
    if arrays[roles.index("kv")].shape[2] > 1:
        rows.append(tup(heads, heads, heads, Φ(1, even=grouped)))
    if arrays[0].shape[0] > 1:
        rows.append(tup(Φ(0), Φ(0), Φ(0), Φ(0)))
    if method in ("auto", "all_gather") or isinstance(method, tuple):  # pairs: _pinned vetoes per axis
        rows.append(tup(Φ(1), R, Partial(), Φ(2)))
    if method in ("auto", "ring") or isinstance(method, tuple):
        rows.append(tup(Φ(1), Φ(1), Φ(1), Φ(2)))
    return rows


def _grouped(q, k) -> bool:
    return q.shape[2] != k.shape[2]


def _forward_strategies(ins, outs, params):
    roles = ["q"] * len(outs) + ["q", "kv", "kv"] + ["bias"] * (len(ins) - 3)
    return _tuples(roles, list(outs) + list(ins), len(outs), _grouped(ins[0], ins[1]), params["method"])


def _backward_strategies(ins, outs, params):
    # outs: dq, dk, dv (and dbias); ins: q, k, v, (bias, mask,) out, lse, cotangent
    extras = len(ins) - 6
    roles = ["q", "kv", "kv"] + ["bias"] * (len(outs) - 3) + ["q", "kv", "kv"] + ["bias"] * extras + ["q"] * 3
    return _tuples(roles, list(outs) + list(ins), len(outs), _grouped(ins[0], ins[1]), params["method"])


def _pinned(params, ins, outs) -> bool:
    """Every axis that ``{axis: method}`` pins runs its method: ring (queries and keys sequence-sharded there),
    all-gather (queries sequence-sharded, keys whole) or all-to-all (heads sharded there)."""
    if not isinstance(params["method"], tuple):
        return True
    q, k = ins[0], ins[1]
    for name, m in params["method"]:
        axis = aliased_axis(name)  # the user's axis, under autoplan's renamed ones too
        if axis not in q.mesh.axis_names:
            raise ValueError(f"jshard.attention: method {dict(params['method'])!r} pins mesh axis {name!r}, but the "
                             f"mesh is {users_mesh(q.mesh)}; name one of its axes (or pass method={m!r} for every "
                             "axis)")
        if m == "auto" or q.mesh.shape[axis] == 1:
            continue
        qp, kp = (s.placements[s.mesh.axis_names.index(axis)] for s in (q, k))
        on = {"ring": qp.is_shard and qp.dim == 1 and kp.is_shard and kp.dim == 1,
              "all_gather": qp.is_shard and qp.dim == 1 and not kp.is_shard,
              "all_to_all": qp.is_shard and qp.dim == 2}[m]
        if not on:
            return False
    return True


def _forward_traffic(params, ins, outs) -> list[Communication]:
    axes, n = _ring(ins[1])
    return [Communication("permute", axes, 2 * ins[1].local_bytes, count=n - 1)] if n > 1 else []


def _backward_traffic(params, ins, outs) -> list[Communication]:
    # keys and values go round once more with their gradients (float32 sums), which take one more step home
    axes, n = _ring(ins[1])
    if n == 1:
        return []
    grads = 2 * math.prod(ins[1].local_block_shape) * 4
    return [Communication("permute", axes, 2 * ins[1].local_bytes, count=n - 1),
            Communication("permute", axes, grads, count=n)]


# ---------------------------------------------------------------------------------------------------
# the registered functions: one equation each; the plain one's backward pass is a unit too


def _attention_vjp_fwd(q, k, v, *, scale, is_causal, method):
    out, lse = _attention_fwd(q, k, v, scale=scale, is_causal=is_causal, method=method)
    return out, (q, k, v, out, lse)


def _attention_vjp_bwd(residuals, cotangent, *, scale, is_causal, method):
    return tuple(_attention_bwd(*residuals, cotangent, scale=scale, is_causal=is_causal, method=method))


def _forward_local(params, ins, outs):
    def run(q, k, v, *extras):
        it = iter(extras)
        bias = next(it) if params.get("with_bias") else None
        mask = next(it) if params.get("with_mask") else None
        out, lse = _forward_kernel(q, k, v, bias, mask, *_positions(ins[0], ins[1]), params["scale"],
                                   params["is_causal"])
        return [out, lse][: len(outs)]

    return run


def _masked_vjp_fwd(q, k, v, bias, mask, **static):
    out, lse = _attention_masked_fwd(q, k, v, bias, mask, **static)
    return out, (q, k, v, bias, mask, out, lse)


def _masked_vjp_bwd(residuals, cotangent, **static):
    grads = _attention_masked_bwd(*residuals, cotangent, **static)
    return (*grads[:3], grads[3] if static["with_bias"] else None, None)  # a mask has no gradient


def _backward_local(params, ins, outs):
    def run(q, k, v, *rest):
        *extras, out, lse, ct = rest
        it = iter(extras)
        bias = next(it) if params.get("with_bias") else None
        mask = next(it) if params.get("with_mask") else None
        return list(_backward_kernel(q, k, v, out, lse, ct, *_positions(ins[0], ins[1]), params["scale"],
                                     params["is_causal"], bias, mask))[: len(outs)]

    return run


def _flops(factor: float) -> Callable:
    """A unit's FLOPs on one device, in units of the forward's two matmuls (scores and values) of its local queries
    against every key (a ring or a gather brings the keys it does not hold), the causal half included: the
    backward recomputes the scores and runs four (2.5)."""
    return lambda params, ins, outs: factor * 4.0 * math.prod(ins[0].local_block_shape) * ins[1].shape[1]


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned,
          flops=_flops(1.0), name="attention_fwd")
def _attention_fwd(q, k, v, *, scale, is_causal, method):
    return _forward_kernel(q, k, v, None, None, *_whole(q, k), scale, is_causal)


@function(_backward_strategies, local=_backward_local, communicates=_backward_traffic, check=_pinned,
          flops=_flops(2.5), name="attention_bwd")
def _attention_bwd(q, k, v, out, lse, ct, *, scale, is_causal, method):
    return _backward_kernel(q, k, v, out, lse, ct, *_whole(q, k), scale, is_causal)


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned, name="attention",
          flops=_flops(1.0), vjp=(_attention_vjp_fwd, _attention_vjp_bwd))
def _attention(q, k, v, *, scale, is_causal, method):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned,
          flops=_flops(1.0), name="attention_masked", vjp=(_masked_vjp_fwd, _masked_vjp_bwd))
def _attention_masked(q, k, v, bias, mask, *, scale, is_causal, method, with_bias, with_mask):
    # with_bias / with_mask tell the local form which of bias and mask its extra blocks are (a None has no leaf)
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal)


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned,
          flops=_flops(1.0), name="attention_masked_fwd")
def _attention_masked_fwd(q, k, v, bias, mask, *, scale, is_causal, method, with_bias, with_mask):
    return _forward_kernel(q, k, v, bias, mask, *_whole(q, k), scale, is_causal)


@function(_backward_strategies, local=_backward_local, communicates=_backward_traffic, check=_pinned,
          flops=_flops(2.5), name="attention_masked_bwd")
def _attention_masked_bwd(q, k, v, bias, mask, out, lse, ct, *, scale, is_causal, method, with_bias, with_mask):
    grads = _backward_kernel(q, k, v, out, lse, ct, *_whole(q, k), scale, is_causal, bias, mask)
    return grads if with_bias else grads[:3]


# ---------------------------------------------------------------------------------------------------
# internals: the per-device computation
#
# A device cuts its query block into square blocks of ``_block`` rows and every key/value block it visits into
# chunks of as many keys (fewer where the keys are shorter), and scores one (query block, key chunk) pair at a
# time: [batch, kv_heads, group, rows, keys] in float32. The running max, sum and accumulator live per query row,
# so a pair only reads and writes its rows. Keys and values travel as one [batch, kv_block, 2 * kv_heads,
# head_dim] buffer.

_MASKED = np.float32(-0.7 * np.finfo(np.float32).max)  # what jax.nn.dot_product_attention gives masked scores
_MAX_BLOCK = 512  # rows (and keys) of a score block at most: [512, 512] float32 is 1 MiB per head
_CUTS = 4  # query blocks are cut at least this many ways where they are long enough: the finer, the more of a
#            causal triangle is skipped (a striped block computes (c + 1) / 2c of its pairs), the coarser, the
#            fewer steps


def _block(length: int) -> int:
    """Rows of a score block for a local query block of ``length`` (padding included)."""
    return max(1, min(_MAX_BLOCK, -(-length // _CUTS)))


def _cut(pos, size: int, xp):
    """Positions ``[length]`` -> ``[blocks, size]``, the last block padded with -1 (``xp``: numpy or jax.numpy)."""
    count = -(-pos.shape[0] // size)
    return xp.pad(pos, (0, count * size - pos.shape[0]), constant_values=-1).reshape(count, size)


def _skipped(qpos, kpos, xp):
    """Causal, no user mask: is every key of a chunk after every query of a block? Positions on the last axis
    (-1: padding), the other axes broadcast: ``[q_blocks, 1, size]`` against ``[1, chunks, size]`` gives the
    ``[q_blocks, chunks]`` table. Such a pair's scores are all masked, and a causal row always sees another key
    (its own position, or key 0), so leaving it out changes nothing."""
    first = xp.min(xp.where(kpos >= 0, kpos, np.iinfo(np.int32).max), axis=-1)
    return first > xp.max(qpos, axis=-1)


def _key_table(k_spec) -> np.ndarray:
    """Global positions of every key block along the ring (``[n, block]``, in ring order; -1: padding)."""
    axes, n = _ring(k_spec)
    names = tuple(k_spec.mesh.axis_names)
    sizes = [k_spec.mesh.shape[a] for a in axes]
    layout = k_spec.layouts[1]  # mesh shape + (block,); it varies along the ring's axes only
    rows = []
    for r in range(n):
        coords = dict(zip(axes, np.unravel_index(r, sizes), strict=True)) if axes else {}
        rows.append(layout[tuple(int(coords.get(a, 0)) for a in names)])
    return np.stack(rows).astype(np.int32)


def _ring(spec) -> tuple[tuple[str, ...], int]:
    """The mesh axes cutting ``spec``'s sequence dim (1) into more than one block, and how many blocks."""
    axes = tuple(a for a, p in zip(spec.mesh.axis_names, spec.placements, strict=True)
                 if p.is_shard and p.dim == 1 and spec.mesh.shape[a] > 1)
    return axes, math.prod(spec.mesh.shape[a] for a in axes)


def _positions(q_spec, k_spec):
    """This device's query positions, the key block table (``_key_table``), this device's place on the ring, and
    the ring's axes and length."""
    axes, n = _ring(k_spec)
    me = 0
    for a in axes:  # row-major over the axes, as ppermute numbers the devices
        me = me * k_spec.mesh.shape[a] + axis_index(a)
    return global_index(q_spec, 1), jnp.asarray(_key_table(k_spec)), me, axes, n


def _whole(q, k):
    return jnp.arange(q.shape[1], dtype=jnp.int32), jnp.arange(k.shape[1], dtype=jnp.int32)[None], 0, (), 1


def _held(ktable, me, s, n):
    """Global positions of the key block a device holds at ring step ``s``: the one ``s`` places before it."""
    return ktable[0] if n == 1 else lax.dynamic_index_in_dim(ktable, (me - s) % n, keepdims=False)


def _grouped_heads(x, kv_heads: int):
    """[batch, seq, heads, ...] -> [batch, seq, kv_heads, group, ...]"""
    return x.reshape(x.shape[:2] + (kv_heads, x.shape[2] // kv_heads) + x.shape[3:])


def _rotate(x, axes, n):
    return lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])


def _loop(count: int, body, carry):
    """``lax.fori_loop(0, count, body, carry)``, inline when there is one step."""
    return body(0, carry) if count == 1 else lax.fori_loop(0, count, body, carry)


def _columns(a, kpos, heads: int, kv_heads: int):
    """A bias or mask block [b, h, rows, kv_seq] -> [b, kv_heads, group, rows, chunk]: the chunk's key columns."""
    if a.shape[3] != 1:
        a = jnp.take(a, jnp.maximum(kpos, 0), axis=3)
    a = jnp.broadcast_to(a, (a.shape[0], heads) + a.shape[2:])
    return a.reshape((a.shape[0], kv_heads, heads // kv_heads) + a.shape[2:])


class _Chunk:
    """Scores of a query block against one key/value chunk, masked as jax.nn.dot_product_attention masks them;
    padding keys (position -1) get -inf, so they weigh nothing even in a row whose keys are all masked."""

    def __init__(self, ctx, rows, kv, kpos):
        self.kpos, real = kpos, kpos >= 0
        kv = jnp.where(real[None, :, None, None], kv, jnp.zeros((), kv.dtype))  # padding may hold anything
        self.k, self.v = kv[:, :, :ctx.kv_heads], kv[:, :, ctx.kv_heads:]
        qpos, bias, mask = rows["qpos"], rows.get("bias"), rows.get("mask")
        s = jnp.einsum("bqkgd,bskd->bkgqs", rows["q"], self.k, preferred_element_type=jnp.float32)
        s = s * np.float32(ctx.scale)
        if bias is not None:
            s = (s + _columns(bias, kpos, ctx.heads, ctx.kv_heads)).astype(jnp.float32)
        allowed = jnp.broadcast_to((qpos >= 0)[:, None], (qpos.shape[0], kpos.shape[0]))
        if ctx.causal:
            allowed = allowed & (kpos[None, :] <= qpos[:, None])
        if mask is not None:
            allowed = allowed & _columns(mask, kpos, ctx.heads, ctx.kv_heads)
        s = jnp.where(allowed, s, _MASKED)
        self.s = jnp.where(real, s, -jnp.inf)
        self.allowed = allowed & real


class _Context:
    """A device's query side, cut into blocks of ``size`` rows: every array with a query axis (``rows``: name ->
    (array, axis)) is padded to whole blocks once, and ``pairs`` hands each (block, chunk) pair its slices."""

    def __init__(self, q, k, bias, mask, qpos, scale, causal, **rows):
        self.heads, self.kv_heads, self.scale, self.causal = q.shape[2], k.shape[2], scale, causal
        self.skips = causal and mask is None
        self.length, self.valid = q.shape[1], qpos >= 0
        self.size = _block(self.length)
        self.qpos = _cut(qpos, self.size, jnp)  # [blocks, size]
        self.count = self.qpos.shape[0]
        self.rows = {"qpos": (self.qpos.reshape(-1), 0)}
        for name, (a, axis) in dict(rows, q=(self.grouped(q), 1), bias=(bias, 2), mask=(mask, 2)).items():
            if a is not None:
                self.rows[name] = (self.padded(a, axis), axis)

    def grouped(self, x):
        """A [batch, q, heads, ...] array, grouped, its padding rows zeroed (padding may hold anything)."""
        x = jnp.where(self.valid[None, :, None, None], x, jnp.zeros((), x.dtype))
        return _grouped_heads(x, self.kv_heads)

    def padded(self, a, axis: int):
        """``a`` with its query axis padded to whole blocks (a broadcast axis of length 1 stays)."""
        if a.shape[axis] == 1:
            return a
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, self.count * self.size - a.shape[axis])
        return jnp.pad(a, pad)

    def state(self, *shapes_and_fills):
        """Per-row running state, rows on axis 3 ([batch, kv_heads, group, rows, ...]), padded to whole blocks."""
        b, _, kh, g = self.rows["q"][0].shape[:4]
        return tuple(jnp.full((b, kh, g, self.count * self.size) + tail, fill, jnp.float32)
                     for tail, fill in shapes_and_fills)

    def unpadded(self, x):
        """A per-row state array without its padding rows."""
        return x[:, :, :, : self.length]

    def pairs(self, kv, kpos, visit, state, grads=None):
        """Fold ``visit(rows, state, chunk) -> (state, chunk gradient | None)`` over every (query block, key
        chunk) pair of the held key/value block, skipping the pairs ``_skipped`` names. ``state`` is per-row
        (made by ``state``; a pair sees its block's rows, as ``rows`` its slices of the query-side arrays); with
        ``grads`` (a float32 buffer like ``kv``) each chunk's gradient is added to its keys."""
        size, length = self.size, kv.shape[1]
        width = min(size, length)
        kcut = _cut(kpos, width, jnp)
        chunks = kcut.shape[0]
        if chunks * width != length:
            kv = jnp.pad(kv, ((0, 0), (0, chunks * width - length), (0, 0), (0, 0)))
            grads = None if grads is None else jnp.pad(grads, ((0, 0), (0, chunks * width - length), (0, 0), (0, 0)))
        skip = _skipped(self.qpos[:, None], kcut[None], jnp) if self.skips else None

        def block(i, carry):
            state, grads = carry
            rows = {name: a if a.shape[axis] == 1 else lax.dynamic_slice_in_dim(a, i * size, size, axis)
                    for name, (a, axis) in self.rows.items()}
            mine = tuple(lax.dynamic_slice_in_dim(x, i * size, size, 3) for x in state)

            def chunk(j, carry):
                mine, grads = carry
                piece = lax.dynamic_slice_in_dim(kv, j * width, width, 1)

                def run(mine):
                    return visit(rows, mine, _Chunk(self, rows, piece, kcut[j]))

                if skip is None:
                    mine, g = run(mine)
                else:
                    zero = None if grads is None else jnp.zeros(piece.shape, jnp.float32)
                    mine, g = lax.cond(skip[i, j], lambda m: (m, zero), run, mine)
                if grads is not None:
                    grads = lax.dynamic_update_slice_in_dim(
                        grads, lax.dynamic_slice_in_dim(grads, j * width, width, 1) + g, j * width, 1)
                return mine, grads

            mine, grads = _loop(chunks, chunk, (mine, grads))
            state = tuple(lax.dynamic_update_slice_in_dim(x, m, i * size, 3) for x, m in zip(state, mine, strict=True))
            return state, grads

        state, grads = _loop(self.count, block, (state, grads))
        return state, None if grads is None else grads[:, :length]


def _forward_kernel(q, k, v, bias, mask, qpos, ktable, me, axes, n, scale, causal):
    """(output, log-sum-exp [batch, q, heads]) of this device's queries, the key/value blocks visiting it. On the
    ring the next block is sent on before the held one is folded, so the transfer may overlap the folding."""
    ctx = _Context(q, k, bias, mask, qpos, scale, causal)
    d = q.shape[3]

    def fold(rows, state, chunk):
        m, total, acc = state
        top = jnp.maximum(m, chunk.s.max(-1))
        shift = jnp.where(jnp.isneginf(top), 0.0, top)  # no real key yet: nothing to rescale
        p = jnp.exp(chunk.s - shift[..., None])
        keep = jnp.exp(m - shift)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p, chunk.v, preferred_element_type=jnp.float32)
        return (top, total * keep + p.sum(-1), acc * keep[..., None] + pv), None

    state = ctx.state(((), -jnp.inf), ((), 0.0), ((d,), 0.0))
    kv = jnp.concatenate([k, v], axis=2)
    if n > 1:
        def step(s, carry):
            state, kv = carry
            following = _rotate(kv, axes, n)
            return ctx.pairs(kv, _held(ktable, me, s, n), fold, state)[0], following

        state, kv = lax.fori_loop(0, n - 1, step, (state, kv))
    m, total, acc = (ctx.unpadded(x) for x in ctx.pairs(kv, _held(ktable, me, n - 1, n), fold, state)[0])
    some = total > 0
    total = jnp.where(some, total, 1.0)
    out = acc / total[..., None]
    lse = jnp.where(some, m + jnp.log(total), -jnp.inf)
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)
    return out, lse.transpose(0, 3, 1, 2).reshape(q.shape[:3])


def _backward_kernel(q, k, v, out, lse, ct, qpos, ktable, me, axes, n, scale, causal, bias=None, mask=None):
    """(dq, dk, dv), and dbias where there is a ``bias``: dq of this device's queries; dk, dv of the key/value block
    it owns, or, with the keys whole, this device's part of their sum; dbias of its bias block (the rows of its
    queries, every key column: each chunk's score gradient added at its keys' columns), summed over the dims the
    bias broadcasts on.

    On the ring the gradient of a block trails it by one step: at each step a device sends on the block it holds
    and the gradient it finished a step ago (plus what arrived for it), both before computing its share of the
    held block's gradient; the last one takes one more step home. The sends never wait for the computation."""
    kh = k.shape[2]
    qvalid = qpos >= 0
    delta = jnp.sum(ct.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [b, q, heads]
    row_major = lambda x: _grouped_heads(jnp.where(qvalid[None, :, None], x, 0.0), kh).transpose(0, 2, 3, 1)
    ctx = _Context(q, k, bias, mask, qpos, scale, causal, lse=(row_major(lse), 3), delta=(row_major(delta), 3))
    ctx.rows["dout"] = (ctx.padded(ctx.grouped(ct).astype(jnp.float32), 1), 1)
    scale = np.float32(scale)
    heads, keys = q.shape[2], jnp.sum(ktable >= 0).astype(jnp.float32)

    def visit(rows, state, chunk):
        dq, lse, delta, dout = state[0], rows["lse"], rows["delta"], rows["dout"]
        p = jnp.exp(chunk.s - lse[..., None])
        # a row whose keys are all masked (only a mask does that): jax spreads it evenly over every key, and its
        # log-sum-exp, the masked value plus log(keys), is the masked value in float32
        p = jnp.where((lse <= _MASKED / 2)[..., None], jnp.where(chunk.kpos >= 0, 1.0 / keys, 0.0), p)
        p = jnp.where((rows["qpos"] >= 0)[:, None], p, 0.0)
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p, dout)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dout, chunk.v, preferred_element_type=jnp.float32)
        dscore = jnp.where(chunk.allowed, p * (dp - delta[..., None]), 0.0)  # the gradient of a score and its bias
        ds = dscore * scale
        dq = dq + jnp.einsum("bkgqs,bskd->bkgqd", ds, chunk.k, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, rows["q"], preferred_element_type=jnp.float32)
        if bias is None:
            return (dq,), jnp.concatenate([dk, dv], axis=2)
        return (dq, _bias_columns(state[1], dscore, chunk.kpos, bias.shape, heads)), jnp.concatenate([dk, dv], axis=2)

    def share(kv, s, state):
        """This device's queries' gradients of the block held at step ``s``: added to ``state`` (dq, and dbias), and
        the held block's."""
        return ctx.pairs(kv, _held(ktable, me, s, n), visit, state, jnp.zeros(kv.shape, jnp.float32))

    state = ctx.state(((q.shape[3],), 0.0))  # dq, and dbias below
    if bias is not None:  # [batch or 1, 1, heads or 1, query rows, keys or 1]: rows on axis 3, as the state's
        b, h, _, columns = bias.shape
        state += (jnp.zeros((b, 1, h, ctx.count * ctx.size, columns), jnp.float32),)
    kv = jnp.concatenate([k, v], axis=2)
    if n == 1:
        state, grads = share(kv, 0, state)
    else:
        following = _rotate(kv, axes, n)
        state, done = share(kv, 0, state)  # the own block: nobody has added to its gradient yet

        def step(s, carry):
            state, kv, done = carry
            following, arrived = _rotate(kv, axes, n), _rotate(done, axes, n)
            state, g = share(kv, s, state)
            return state, following, arrived + g

        state, kv, done = lax.fori_loop(1, n - 1, step, (state, following, done))
        arrived = _rotate(done, axes, n)
        state, g = share(kv, n - 1, state)
        grads = _rotate(arrived + g, axes, n)
    out = [ctx.unpadded(state[0]).transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype),
           grads[:, :, :kh].astype(k.dtype), grads[:, :, kh:].astype(v.dtype)]
    if bias is not None:
        dbias = ctx.unpadded(state[1])[:, 0]  # [b, h, rows, keys]
        out.append((dbias if bias.shape[2] != 1 else dbias.sum(2, keepdims=True)).astype(bias.dtype))
    return tuple(out)


def _bias_columns(dbias, dscore, kpos, shape, heads: int):
    """A chunk's score gradient [b, kv_heads, group, rows, chunk] added to the bias gradient's block [b', 1, h',
    rows, keys'] at the chunk's key columns (padding keys carry none), summed over the dims the bias broadcasts on."""
    b, _, g, rows, chunk = dscore.shape
    d = dscore.reshape(b, 1, heads, rows, chunk)
    if shape[0] == 1:
        d = d.sum(0, keepdims=True)
    if shape[1] == 1:
        d = d.sum(2, keepdims=True)
    if shape[3] == 1:
        return dbias + d.sum(4, keepdims=True)
    return dbias.at[..., jnp.maximum(kpos, 0)].add(jnp.where(kpos >= 0, d, 0.0))
