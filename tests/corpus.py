"""The engine's corpus of plain-JAX programs at global shapes, with their placement sets and arguments (as
DArrays and as the global values they hold): ``engine/test_corpus.py`` runs them through ``jshard.jit`` against
single device, ``rules/test_coverage.py`` checks every equation they make has a rule."""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard
from oracle import reference_indices

R = Replicate()

MESHES = [(8,), (2, 4), (2, 2, 2)]
STYLES = ["dp", "tp", "mixed"]

STABLEHLO = {"all_gather": "stablehlo.all_gather", "all_reduce": "stablehlo.all_reduce",
             "reduce_scatter": "stablehlo.reduce_scatter", "all_to_all": "stablehlo.all_to_all",
             "permute": "stablehlo.collective_permute", "exchange": "stablehlo.collective_permute"}

# ---------------------------------------------------------------------------------------------------
# placements: helpers per mesh shape (the last axis is the "tensor" axis, the others the "data" axes)


def rep(ms):
    return (R,) * len(ms)


def dp(ms, d):
    """Dim ``d`` sharded over the data axes (on a 1-D mesh: its only axis)."""
    if len(ms) == 1:
        return (Shard(d),)
    return (Shard(d),) * (len(ms) - 1) + (R,)


def dp_only(ms, d):
    """``dp`` where the mesh has data axes besides the tensor axis, else Replicate (a 1-D mesh in tp style)."""
    return dp(ms, d) if len(ms) > 1 else rep(ms)


def tp(ms, d):
    """Dim ``d`` sharded over the tensor (last) axis."""
    return (R,) * (len(ms) - 1) + (Shard(d),)


def dp_tp(ms, d, e):
    """Dim ``d`` over the data axes and dim ``e`` over the tensor axis (1-D: the tensor axis only)."""
    return dp(ms, d)[:-1] + (Shard(e),) if len(ms) > 1 else (Shard(e),)


def pdp(ms, d):
    """``Partial(sum)`` on axis 0, dim ``d`` sharded on the middle axes, Replicate on the last."""
    if len(ms) == 1:
        return (Partial(),)
    return (Partial(),) + (Shard(d),) * (len(ms) - 2) + (R,)


# ---------------------------------------------------------------------------------------------------
# the programs: ``fwd`` returns a tuple of arrays (ending with a scalar loss); ``loss`` is differentiated


@dataclass
class Program:
    fwd: Callable
    loss: Callable
    data: Callable  # rng -> list of global numpy arrays
    layouts: Callable  # mesh shape -> {style: [placements per argument]}
    argnums: tuple  # the float arguments the gradient is taken with respect to
    forward_mode: bool = False  # jax.jacfwd instead of jax.value_and_grad
    n: int = 1  # terms summed along the longest chain, forward (the backward pass sums as many): the tolerance
    masks: tuple = ()  # indices of forward outputs whose zeros must match exactly (dropout)


def normal(rng, *shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype(np.float32)


# 1. MLP --------------------------------------------------------------------------------------------
def mlp_fwd(x, w1, w2):
    y = jax.nn.gelu(x @ w1) @ w2
    return y, jnp.mean(y ** 2)


MLP = Program(
    fwd=mlp_fwd,
    loss=lambda *a: mlp_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 12, 8), normal(rng, 8, 10, scale=0.5), normal(rng, 10, 8, scale=0.5)],
    layouts=lambda ms: {"dp": [dp(ms, 0), rep(ms), rep(ms)],
                        "tp": [dp_only(ms, 0), tp(ms, 1), tp(ms, 0)],
                        "mixed": [pdp(ms, 0), tp(ms, 1), tp(ms, 0)]},
    argnums=(0, 1, 2),
    n=8 + 10 + 96,  # two contractions, the mean of 96 squares
)


# 2. causal multi-head attention ------------------------------------------------------------------------
HEADS, HEAD_DIM = 4, 3


def attention_fwd(x, wq, wk, wv, wo):
    b, s, _ = x.shape

    def heads(w):  # (b, s, h*d) -> (b, h, s, d)
        return (x @ w).reshape(b, s, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)

    q, k, v = heads(wq), heads(wk), heads(wv)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(HEAD_DIM).astype(np.float32)
    causal = jnp.tril(jnp.ones((s, s), bool))
    p = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, HEADS * HEAD_DIM) @ wo
    return out, jnp.mean(out ** 2)


ATTENTION = Program(
    fwd=attention_fwd,
    loss=lambda *a: attention_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 6, 8, 8)] + [normal(rng, 8, HEADS * HEAD_DIM, scale=0.5) for _ in range(3)]
    + [normal(rng, HEADS * HEAD_DIM, 8, scale=0.5)],
    layouts=lambda ms: {"dp": [dp(ms, 0)] + [rep(ms)] * 4,
                        "tp": [dp_only(ms, 0)] + [tp(ms, 1)] * 3 + [tp(ms, 0)],  # one head per tp device
                        "mixed": [pdp(ms, 0)] + [tp(ms, 1)] * 3 + [tp(ms, 0)]},
    argnums=(0, 1, 2, 3, 4),
    n=8 + 3 + 8 + 8 + 12 + 384,  # projection, scores, softmax, values, output projection, mean
)


# 3. LayerNorm and RMSNorm ----------------------------------------------------------------------------
def norms_fwd(x, g1, b1, g2, t):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    h = (x - mu) / jnp.sqrt(var + 1e-5) * g1 + b1
    z = h * jax.lax.rsqrt(jnp.mean(h ** 2, axis=-1, keepdims=True) + 1e-6) * g2
    return z, jnp.mean((z - t) ** 2)


NORMS = Program(
    fwd=norms_fwd,
    loss=lambda *a: norms_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 10, 12) * 2 + 1, 1 + normal(rng, 12, scale=0.1), normal(rng, 12, scale=0.1),
                      1 + normal(rng, 12, scale=0.1), normal(rng, 10, 12)],
    # tp: the feature dim (the normalized one) sharded, with the scales and the bias
    layouts=lambda ms: {"dp": [dp(ms, 0), rep(ms), rep(ms), rep(ms), dp(ms, 0)],
                        "tp": [dp_tp(ms, 0, 1), tp(ms, 0), tp(ms, 0), tp(ms, 0), dp_tp(ms, 0, 1)],
                        "mixed": [pdp(ms, 0), tp(ms, 0), rep(ms), tp(ms, 0), dp_tp(ms, 0, 1)]},
    argnums=(0, 1, 2, 3),
    n=3 * 12 + 120,  # mean, variance, mean square over 12 features; the mean over 120
)


# 4. embedding lookup and cross-entropy ---------------------------------------------------------------
VOCAB = 20


def embed_fwd(table, w_out, ids, labels):
    logits = table[ids] @ w_out  # (b, t, vocab)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return logp, jnp.mean(nll)


EMBED = Program(
    fwd=embed_fwd,
    loss=lambda *a: embed_fwd(*a)[-1],
    data=lambda rng: [normal(rng, VOCAB, 8), normal(rng, 8, VOCAB, scale=0.5),
                      rng.integers(0, VOCAB, (6, 5)).astype(np.int32), rng.integers(0, VOCAB, (6, 5)).astype(np.int32)],
    # tp: vocab-parallel table (rows) and output projection (columns): 20 rows over 8 or 4
    layouts=lambda ms: {"dp": [rep(ms), rep(ms), dp(ms, 0), dp(ms, 0)],
                        "tp": [tp(ms, 0), tp(ms, 1), dp_only(ms, 0), dp_only(ms, 0)],
                        "mixed": [pdp(ms, 1), tp(ms, 1), dp_only(ms, 1), dp_only(ms, 0)]},
    argnums=(0, 1),
    n=8 + VOCAB + 30,  # contraction, log-softmax, mean
)


# 5. scan RNN over a time-major xs --------------------------------------------------------------------
def rnn_fwd(h0, xs, w, u):
    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, jnp.sum(h, axis=-1)

    h, ys = jax.lax.scan(step, h0, xs)
    return ys, jnp.sum(h ** 2) + jnp.mean(ys)


RNN = Program(
    fwd=rnn_fwd,
    loss=lambda *a: rnn_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 6, 8, scale=0.5), normal(rng, 6, 6, 4), normal(rng, 8, 8, scale=0.4),
                      normal(rng, 4, 8, scale=0.4)],
    # mixed: the time dim (6) sharded on the tensor axis too
    layouts=lambda ms: {"dp": [dp(ms, 0), dp(ms, 1), rep(ms), rep(ms)],
                        "tp": [dp_only(ms, 0), dp_only(ms, 1), tp(ms, 1), tp(ms, 1)],
                        "mixed": [pdp(ms, 0), tp(ms, 0), tp(ms, 0), rep(ms)]},
    argnums=(0, 1, 2, 3),
    n=6 * (8 + 4) + 48 + 36,  # six steps, then the sums
)


# 5b. a scan whose carry settles uneven: 4 rows over 8 devices (empty shards), the hidden state's features
# column-sharded like its weights (the layout of an issue report: h (S(0), R), W (R, S(1)), xs (R, S(1)))
def uneven_scan_fwd(h0, w, xs):
    h, ys = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x),) * 2, h0, xs)
    return h, ys, jnp.mean(h ** 2) + jnp.mean(ys)


def every_axis(ms, d):
    """Dim ``d`` sharded over every mesh axis (4 rows over 8 devices: half the devices hold none)."""
    return (Shard(d),) * len(ms)


UNEVEN_SCAN = Program(
    fwd=uneven_scan_fwd,
    loss=lambda *a: uneven_scan_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 4, 16, scale=0.5), normal(rng, 16, 16, scale=0.3), normal(rng, 5, 4, 16)],
    layouts=lambda ms: {"dp": [every_axis(ms, 0), rep(ms), every_axis(ms, 1)],
                        "tp": [dp_only(ms, 0), tp(ms, 1), tp(ms, 1)],
                        "mixed": [pdp(ms, 0), tp(ms, 1), dp(ms, 1)]},
    argnums=(0, 1, 2),
    n=5 * 16 + 64 + 320,  # five steps contracting 16, the means
)


# 6. while loop with a counter and a data-dependent condition ---------------------------------------------
WHILE_LIMIT = 8


def while_fwd(x, w):
    def cond(c):
        i, h = c
        return (i < WHILE_LIMIT) & (jnp.sum(h * h) < 4000.0)

    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ w) * 3.0 + h

    n, h = jax.lax.while_loop(cond, body, (0, x))
    return n, h, jnp.mean(h ** 2)


WHILE = Program(
    fwd=while_fwd,
    loss=lambda *a: while_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 6, 8), normal(rng, 8, 8, scale=0.5)],
    layouts=lambda ms: {"dp": [dp(ms, 0), rep(ms)],
                        "tp": [dp_only(ms, 0), tp(ms, 1)],
                        "mixed": [pdp(ms, 0), tp(ms, 0)]},
    argnums=(0, 1),
    forward_mode=True,  # reverse-mode of a while loop does not exist in JAX: jacfwd
    n=WHILE_LIMIT * 8 + 48 + 48,  # up to eight steps, the condition's and the loss's sums
)


# 7. cond on a data-dependent predicate (two conds: one takes each branch) --------------------------------
def cond_fwd(x, w):
    h = jnp.tanh(x @ w)
    pos = jnp.sum(h) > 0
    a = jax.lax.cond(pos, lambda t: (t * 2.0) @ w.T, lambda t: jnp.sin(t) - 1.0, h)
    b = jax.lax.cond(jnp.logical_not(pos), lambda t: (t * 2.0) @ w.T, lambda t: jnp.sin(t) - 1.0, h)
    return pos, a, b, jnp.mean((a + b) ** 2)


COND = Program(
    fwd=cond_fwd,
    loss=lambda *a: cond_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 10, 8), normal(rng, 8, 8, scale=0.5)],
    layouts=lambda ms: {"dp": [dp(ms, 0), rep(ms)],
                        "tp": [dp_only(ms, 0), tp(ms, 1)],
                        "mixed": [pdp(ms, 0), tp(ms, 0)]},
    argnums=(0, 1),
    n=8 + 80 + 8 + 80,  # contraction, predicate sum, branch contraction, mean
)


# 8. dropout: a wrapped key (jax.random.wrap_key_data) and a raw uint32 key, passed as an argument --------------
def dropout_fwd(x, w1, w2, key_data):
    key = jax.random.wrap_key_data(key_data)
    h = x @ w1
    y1 = jnp.where(jax.random.bernoulli(key, 0.7, h.shape), h / 0.7, 0.0)
    raw = jax.random.key_data(jax.random.fold_in(key, 1))  # a raw uint32[2] key
    g = jnp.tanh(y1) @ w2
    y2 = jnp.where(jax.random.bernoulli(raw, 0.6, g.shape), g / 0.6, 0.0)
    return y1, y2, jnp.mean(y2 ** 2)


DROPOUT = Program(
    fwd=dropout_fwd,
    loss=lambda *a: dropout_fwd(*a)[-1],
    data=lambda rng: [normal(rng, 10, 8), normal(rng, 8, 12), normal(rng, 12, 6),
                      np.asarray(jax.random.key_data(jax.random.key(int(rng.integers(1 << 30)))))],
    layouts=lambda ms: {"dp": [dp(ms, 0), rep(ms), rep(ms), rep(ms)],
                        "tp": [dp_only(ms, 0), tp(ms, 1), tp(ms, 0), rep(ms)],
                        "mixed": [pdp(ms, 0), tp(ms, 1), tp(ms, 0), rep(ms)]},
    argnums=(0, 1, 2),
    n=8 + 12 + 60,
    masks=(0, 1),
)


PROGRAMS = {"mlp": MLP, "attention": ATTENTION, "norms": NORMS, "embed_xent": EMBED, "scan_rnn": RNN,
            "uneven_scan": UNEVEN_SCAN, "while": WHILE, "cond": COND, "dropout": DROPOUT}


# ---------------------------------------------------------------------------------------------------
# arguments: DArrays and the global values they hold


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def partial_darray(value: np.ndarray, mesh, placements, rng):
    """A DArray whose Partial(sum) axes hold parts that differ per coordinate (value/n plus integer noise
    that cancels), and the global value those parts sum to (what single device must compute with)."""
    ms = tuple(mesh.devices.shape)
    axes = [a for a, p in enumerate(placements) if p.is_partial]
    keys = list(itertools.product(*[range(ms[a]) for a in axes]))
    noise = [rng.integers(-3, 4, size=value.shape).astype(np.float32) for _ in keys[1:]]
    noise.insert(0, -np.sum(noise, axis=0, dtype=np.float32))
    parts = {k: (value / len(keys) + n).astype(np.float32) for k, n in zip(keys, noise)}
    total = np.sum([parts[k].astype(np.float64) for k in keys], axis=0).astype(np.float32)
    assert not all(np.array_equal(parts[keys[0]], parts[k]) for k in keys)  # the parts differ
    blocks = []
    for coords in itertools.product(*map(range, ms)):
        part = parts[tuple(coords[a] for a in axes)]
        idx = reference_indices(value.shape, ms, placements, coords)
        blocks.append(part[np.ix_(*idx)])
    return jshard.from_local(blocks, mesh, placements, shape=value.shape), total


def make_args(name, mesh_shape, style):
    prog = PROGRAMS[name]
    rng = np.random.default_rng(_seed(name, mesh_shape, style))
    values = prog.data(rng)
    layout = prog.layouts(mesh_shape)[style]
    assert len(layout) == len(values)
    mesh = make_mesh(mesh_shape)
    args, globals_ = [], []
    for v, p in zip(values, layout):
        if any(q.is_partial for q in p):
            a, v = partial_darray(v, mesh, p, rng)
        else:
            a = jshard.distribute(v, mesh, p)
        args.append(a)
        globals_.append(v)
    if style == "mixed":
        assert any(q.is_partial for a in args for q in a.placements)
    return args, globals_


def grad_fn(prog):
    if prog.forward_mode:
        return jax.jacfwd(prog.loss, argnums=prog.argnums)
    return jax.value_and_grad(prog.loss, argnums=prog.argnums)
