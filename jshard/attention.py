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
  softmax; the backward pass rotates them again with their gradients, which end on their owners. Its collectives
  are declared (``communicates``), so the selection weighs them against the all-gather's moves;
- **all-to-all** (Ulysses) needs no code of its own: from sequence-sharded inputs the heads tuple is reached by
  the engine's ``all_to_all`` moves (sequence -> heads, and back for the output), and the selection prices it
  like any other move.

Sequence-sharded blocks know their global positions (``jshard.local``), so causal masking compares global
positions and padding of unevenly sharded sequences is never attended; with ``is_causal`` and no ``mask``, a key
block lying wholly after every query of the block is skipped. ``bias`` and ``mask`` are sharded along the query
sequence with the queries (or Replicate where they broadcast there); along the key sequence they stay whole and
each device takes the columns of the key block it holds. Gradients: without ``bias`` / ``mask`` the backward pass
is a unit of its own with the same four ways to run; with them JAX differentiates the body (``bias`` gets its
gradient), planned equation by equation.

>>> import jax, numpy as np, jshard
>>> from jshard import Shard
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.normal(size=(2, 64, 4, 8)).astype(np.float32) for _ in range(3))
>>> mesh = jax.make_mesh((8,), ("sp",))
>>> args = [jshard.distribute(a, mesh, [Shard(1)]) for a in (q, k, v)]
>>> out = jshard.jit(lambda q, k, v: attention(q, k, v, is_causal=True))(*args)
>>> bool(np.allclose(out.full(), jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
True
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from .cost import Communication
from .local import axis_index, global_index
from .placements import Partial, Replicate
from .rules.functions import function
from .rules.registry import ShardPlaceholder

__all__ = ["METHODS", "attention", "attention_method"]

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
    around the module it is matched on.

    >>> with attention_method({"cp": "ring"}):
    ...     _METHOD.get()
    (('cp', 'ring'),)
    """
    token = _METHOD.set(_checked_method(method, "attention_method"))
    try:
        yield
    finally:
        _METHOD.reset(token)


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
            if r == "bias":
                row.append(bias if a.shape[bias.dim] != 1 else R)
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
    # outs: dq, dk, dv; ins: q, k, v, out, lse, cotangent
    roles = ["q", "kv", "kv", "q", "kv", "kv", "q", "q", "q"]
    return _tuples(roles, list(outs) + list(ins), 3, _grouped(ins[0], ins[1]), params["method"])


def _pinned(params, ins, outs) -> bool:
    """Every axis that ``{axis: method}`` pins runs its method: ring (queries and keys sequence-sharded there),
    all-gather (queries sequence-sharded, keys whole) or all-to-all (heads sharded there)."""
    if not isinstance(params["method"], tuple):
        return True
    q, k = ins[0], ins[1]
    for axis, m in params["method"]:
        if m == "auto" or q.mesh.shape.get(axis, 1) == 1:
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


def _backward_local(params, ins, outs):
    def run(q, k, v, out, lse, ct):
        return list(_backward_kernel(q, k, v, out, lse, ct, *_positions(ins[0], ins[1]), params["scale"],
                                     params["is_causal"]))

    return run


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned,
          name="attention_fwd")
def _attention_fwd(q, k, v, *, scale, is_causal, method):
    return _forward_kernel(q, k, v, None, None, *_whole(q, k), scale, is_causal)


@function(_backward_strategies, local=_backward_local, communicates=_backward_traffic, check=_pinned,
          name="attention_bwd")
def _attention_bwd(q, k, v, out, lse, ct, *, scale, is_causal, method):
    return _backward_kernel(q, k, v, out, lse, ct, *_whole(q, k), scale, is_causal)


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned, name="attention",
          vjp=(_attention_vjp_fwd, _attention_vjp_bwd))
def _attention(q, k, v, *, scale, is_causal, method):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal)


@function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, check=_pinned,
          name="attention_masked")
def _attention_masked(q, k, v, bias, mask, *, scale, is_causal, method, with_bias, with_mask):
    # with_bias / with_mask tell the local form which of bias and mask its extra blocks are (a None has no leaf)
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal)


# ---------------------------------------------------------------------------------------------------
# internals: the per-device computation
#
# Scores are [batch, kv_heads, group, q_block, kv_chunk] in float32; a chunk is at most as long as the device's
# query block, so no device holds more than a [q_block, q_block] score block per head. Keys and values travel as
# one [batch, kv_block, 2 * kv_heads, head_dim] buffer.

_MASKED = np.float32(-0.7 * np.finfo(np.float32).max)  # what jax.nn.dot_product_attention gives masked scores


def _ring(spec) -> tuple[tuple[str, ...], int]:
    """The mesh axes cutting ``spec``'s sequence dim (1) into more than one block, and how many blocks."""
    axes = tuple(a for a, p in zip(spec.mesh.axis_names, spec.placements, strict=True)
                 if p.is_shard and p.dim == 1 and spec.mesh.shape[a] > 1)
    return axes, math.prod(spec.mesh.shape[a] for a in axes)


def _positions(q_spec, k_spec):
    """This device's query positions, the global positions of every key block (``[n, block]``, in ring order;
    ``-1``: padding), this device's place on the ring, and the ring's axes and length."""
    axes, n = _ring(k_spec)
    names = tuple(k_spec.mesh.axis_names)
    sizes = [k_spec.mesh.shape[a] for a in axes]
    layout = k_spec.layouts[1]  # mesh shape + (block,); it varies along the ring's axes only
    rows = []
    for r in range(n):
        coords = dict(zip(axes, np.unravel_index(r, sizes), strict=True)) if axes else {}
        rows.append(layout[tuple(int(coords.get(a, 0)) for a in names)])
    me = 0
    for a, size in zip(axes, sizes, strict=True):  # row-major over the axes, as ppermute numbers the devices
        me = me * size + axis_index(a)
    return global_index(q_spec, 1), jnp.asarray(np.stack(rows).astype(np.int32)), me, axes, n


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


def _columns(a, kpos, heads: int, kv_heads: int):
    """A bias or mask block [b, h, q, kv_seq] -> [b, kv_heads, group, q, chunk]: the chunk's key columns."""
    if a.shape[3] != 1:
        a = jnp.take(a, jnp.maximum(kpos, 0), axis=3)
    a = jnp.broadcast_to(a, (a.shape[0], heads) + a.shape[2:])
    return a.reshape((a.shape[0], kv_heads, heads // kv_heads) + a.shape[2:])


class _Chunk:
    """Scores of the device's queries against one key/value chunk, masked as jax.nn.dot_product_attention masks
    them; padding keys (position -1) get -inf, so they weigh nothing even in a row whose keys are all masked."""

    def __init__(self, ctx, kv, kpos):
        qg, qpos, bias, mask, scale, causal = ctx.qg, ctx.qpos, ctx.bias, ctx.mask, ctx.scale, ctx.causal
        kv_heads, heads = ctx.kv_heads, ctx.heads
        real = kpos >= 0
        kv = jnp.where(real[None, :, None, None], kv, jnp.zeros((), kv.dtype))  # padding may hold anything
        self.k, self.v = kv[:, :, :kv_heads], kv[:, :, kv_heads:]
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, self.k, preferred_element_type=jnp.float32) * np.float32(scale)
        if bias is not None:
            s = (s + _columns(bias, kpos, heads, kv_heads)).astype(jnp.float32)
        allowed = jnp.broadcast_to((qpos >= 0)[:, None], (qpos.shape[0], kpos.shape[0]))
        if causal:
            allowed = allowed & (kpos[None, :] <= qpos[:, None])
        if mask is not None:
            allowed = allowed & _columns(mask, kpos, heads, kv_heads)
        s = jnp.where(allowed, s, _MASKED)
        self.s = jnp.where(real, s, -jnp.inf)
        self.allowed = allowed & real


class _Context:
    def __init__(self, q, k, bias, mask, qpos, scale, causal):
        self.heads, self.kv_heads = q.shape[2], k.shape[2]
        self.qvalid = qpos >= 0
        self.qg = self.rows(q)
        self.bias, self.mask, self.qpos, self.scale, self.causal = bias, mask, qpos, scale, causal

    def rows(self, x):
        """A query-side block, grouped, with its padding rows zeroed (padding may hold anything)."""
        x = jnp.where(self.qvalid[None, :, None, None], x, jnp.zeros((), x.dtype))
        return _grouped_heads(x, self.kv_heads)

    def skip(self, kpos):
        """Is the chunk at ``kpos`` wholly after every query (causal masking, no user mask)? Then it is not
        computed: its scores would all be masked, and every query row has a key it may see."""
        if not self.causal or self.mask is not None:
            return None
        first = jnp.min(jnp.where(kpos >= 0, kpos, jnp.iinfo(jnp.int32).max))
        return first > jnp.max(self.qpos)

    def chunks(self, kv, kpos, visit, carry, grads=None):
        """Fold ``visit(carry, chunk) -> (carry, chunk gradient | None)`` over the held key/value block in chunks
        no longer than the query block; with ``grads`` (a float32 buffer like ``kv``), each chunk's gradient is
        added to its rows."""
        length = kv.shape[1]
        size = max(1, min(length, self.qpos.shape[0]))
        count = -(-length // size)

        def one(carry, grads, piece, pos, start):
            def run(carry):
                return visit(carry, _Chunk(self, piece, pos))

            skip = self.skip(pos)
            if skip is None:
                carry, g = run(carry)
            else:
                zero = None if grads is None else jnp.zeros(piece.shape, jnp.float32)
                carry, g = lax.cond(skip, lambda c: (c, zero), run, carry)
            if grads is not None:
                grads = lax.dynamic_update_slice_in_dim(
                    grads, lax.dynamic_slice_in_dim(grads, start, size, 1) + g, start, 1)
            return carry, grads

        if count == 1:
            return one(carry, grads, kv, kpos, 0)
        pad = count * size - length
        if pad:
            kv = jnp.pad(kv, ((0, 0), (0, pad), (0, 0), (0, 0)))
            kpos = jnp.pad(kpos, (0, pad), constant_values=-1)
            grads = None if grads is None else jnp.pad(grads, ((0, 0), (0, pad), (0, 0), (0, 0)))

        def step(j, state):
            start = j * size
            return one(*state, lax.dynamic_slice_in_dim(kv, start, size, 1),
                       lax.dynamic_slice_in_dim(kpos, start, size), start)

        carry, grads = lax.fori_loop(0, count, step, (carry, grads))
        return carry, None if grads is None else grads[:, :length]


def _forward_kernel(q, k, v, bias, mask, qpos, ktable, me, axes, n, scale, causal):
    """(output, log-sum-exp [batch, q, heads]) of this device's queries, the key/value blocks visiting it."""
    ctx = _Context(q, k, bias, mask, qpos, scale, causal)
    b, t, kh, g, d = ctx.qg.shape

    def fold(state, chunk):
        m, total, acc = state
        top = jnp.maximum(m, chunk.s.max(-1))
        shift = jnp.where(jnp.isneginf(top), 0.0, top)  # no real key yet: nothing to rescale
        p = jnp.exp(chunk.s - shift[..., None])
        keep = jnp.exp(m - shift)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p, chunk.v, preferred_element_type=jnp.float32)
        return (top, total * keep + p.sum(-1), acc * keep[..., None] + pv), None

    state = (jnp.full((b, kh, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
             jnp.zeros((b, kh, g, t, d), jnp.float32))
    kv = jnp.concatenate([k, v], axis=2)
    state = ctx.chunks(kv, _held(ktable, me, 0, n), fold, state)[0]
    if n > 1:
        def step(s, carry):
            state, kv = carry
            kv = _rotate(kv, axes, n)
            return ctx.chunks(kv, _held(ktable, me, s, n), fold, state)[0], kv

        state = lax.fori_loop(1, n, step, (state, kv))[0]
    m, total, acc = state
    some = total > 0
    total = jnp.where(some, total, 1.0)
    out = acc / total[..., None]
    lse = jnp.where(some, m + jnp.log(total), -jnp.inf)
    out = out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)
    return out, lse.transpose(0, 3, 1, 2).reshape(q.shape[:3])


def _backward_kernel(q, k, v, out, lse, ct, qpos, ktable, me, axes, n, scale, causal):
    """(dq, dk, dv): dq of this device's queries; dk, dv of the key/value block it owns (on the ring: gathered
    from every device's queries as the block and its gradient travel, then one step home), or, with the keys
    whole, this device's part of their sum."""
    ctx = _Context(q, k, None, None, qpos, scale, causal)
    dout = ctx.rows(ct).astype(jnp.float32)
    delta = jnp.sum(dout * ctx.rows(out).astype(jnp.float32), -1).transpose(0, 2, 3, 1)  # [b, kh, g, q]
    lse = _grouped_heads(jnp.where(ctx.qvalid[None, :, None], lse, 0.0), ctx.kv_heads).transpose(0, 2, 3, 1)
    scale = np.float32(scale)

    def visit(dq, chunk):
        p = jnp.where(ctx.qvalid[:, None], jnp.exp(chunk.s - lse[..., None]), 0.0)
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p, dout)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dout, chunk.v, preferred_element_type=jnp.float32)
        ds = jnp.where(chunk.allowed, p * (dp - delta[..., None]), 0.0) * scale
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, chunk.k, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, ctx.qg, preferred_element_type=jnp.float32)
        return dq, jnp.concatenate([dk, dv], axis=2)

    dq = jnp.zeros(ctx.qg.shape, jnp.float32)
    kv = jnp.concatenate([k, v], axis=2)
    grads = jnp.zeros(kv.shape, jnp.float32)
    if n == 1:
        dq, grads = ctx.chunks(kv, ktable[0], visit, dq, grads)
    else:
        def step(s, carry):
            dq, kv, grads = carry
            dq, grads = ctx.chunks(kv, _held(ktable, me, s, n), visit, dq, grads)
            return dq, _rotate(kv, axes, n), _rotate(grads, axes, n)

        dq, kv, grads = lax.fori_loop(0, n - 1, step, (dq, kv, grads))
        dq, grads = ctx.chunks(kv, _held(ktable, me, n - 1, n), visit, dq, grads)
        grads = _rotate(grads, axes, n)
    kh = ctx.kv_heads
    return (dq.reshape(q.shape).astype(q.dtype), grads[:, :, :kh].astype(k.dtype),
            grads[:, :, kh:].astype(v.dtype))
