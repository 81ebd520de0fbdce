"""A small GPT in Flax NNX, and the parallel plans for it (the model of the demo, the notebooks and the
benchmarks).

``GPT(vocab, dim, heads, layers, seq)``: token + position embeddings, pre-norm blocks of causal
multi-head attention (separate ``q``/``k``/``v``/``o`` projections) and a GELU MLP (``up``/``down``), a
final LayerNorm and an untied ``head``; attention is ``jshard.attention`` (causal), so the plans below run it
by whatever placements its inputs take. ``plan(style, dp, tp, cp)`` gives ``(plan, default)`` for
``jshard.parallel.parallelize``:

- ``"tp"``: Megatron — q/k/v/up column parallel, o/down row parallel (one all-reduce each per block
  forward), the head column parallel (loss-parallel cross-entropy: logits stay sharded on the vocabulary);
- ``"sp"``: ``"tp"`` plus sequence parallelism — o/down reduce-scatter onto the sequence dim, the norms run
  sequence-sharded, q/k/v/up gather the sequence back;
- ``"fsdp"``: every parameter sharded on the data axis (gathered for compute), no tensor parallelism;
- ``"dp"``: parameters replicated;
- ``"cp"``: context parallelism — the sequence sharded over ``cp`` (striped, so that causal attention balances),
  attention crossing it by ring, all-gather or all-to-all; it combines with the others: ``"dp+cp"``,
  ``"cp+tp"``, ``"fsdp+cp+tp"``.

``llama3(size, seq=..., rngs=...)``: Meta's Llama 3 / 3.1 (``"8b"``, ``"70b"``, ``"405b"``; ``Llama``) under the same
module names — RMSNorms, grouped-query attention with rotary positions, a SwiGLU MLP (``up``/``gate``/``down``) — so
the same plans place it (``plan(..., gated=True)`` splits ``gate`` as ``up``); keyword sizes make toy ones.

>>> model = GPT(vocab=32, dim=16, heads=2, layers=1, seq=8, rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 8), jnp.int32)).shape
(2, 8, 32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .jaxcompat import constructing
from .moe import balance_bias, experts
from .parallel.styles import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    ExpertTensorParallel,
    FullyShard,
    ParallelStyle,
    PipelineParallel,
    RowwiseParallel,
    SequenceParallel,
)
from .placements import Replicate, Shard
from .sharded_attention import attention

__all__ = ["GPT", "Balance", "Llama", "MoE", "cross_entropy", "llama3", "one_device_trainer", "plan", "summed_terms"]


class MoE(nnx.Module):
    """A mixture of ``experts`` gated SiLU MLPs (``jshard.experts``: ``w_up`` / ``w_gate`` ``[E, D, H]``, ``w_down``
    ``[E, H, D]``), each token to its ``top_k`` experts, routed by a linear ``router`` (softmax over the chosen
    logits). ``balance=rate`` balances the load as DeepSeek-V3 does, without an auxiliary loss: a routing ``bias``
    (a ``Balance`` variable, not a parameter) that only chooses, and the tokens each expert took in the last call kept
    in ``load``; each call first moves the bias by ``rate`` from the last call's load
    (``jshard.moe.balance_bias``), so that a pipelined step, whose microbatches run with the state as the step
    found it, routes as one call on the whole batch does (the load summed over them, the bias the same in each)."""

    def __init__(self, dim: int, experts: int, top_k: int, rngs: nnx.Rngs, hidden: int | None = None,
                 balance: float | None = None, dtype: jnp.dtype | None = None):
        hidden = hidden or 2 * dim
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                 batch_axis=(0,))
        self.top_k, self.balance = top_k, balance
        self.dtype = dtype
        self.router = nnx.Linear(dim, experts, use_bias=False, dtype=dtype, rngs=rngs)
        self.w_up, self.w_gate = (nnx.Param(init(rngs.params(), (experts, dim, hidden))) for _ in range(2))
        self.w_down = nnx.Param(init(rngs.params(), (experts, hidden, dim)))
        if balance is not None:
            self.bias = Balance(jnp.zeros(experts), merge="last")
            self.load = Balance(jnp.zeros(experts, jnp.int32), merge="sum")

    def __call__(self, x):
        up, gate, down = (w[...] if self.dtype is None else w[...].astype(self.dtype)
                          for w in (self.w_up, self.w_gate, self.w_down))
        args = (x, self.router(x), up, down)
        if self.balance is None:
            return experts(*args, top_k=self.top_k, w_gate=gate)
        self.bias[...] = balance_bias(self.bias[...], self.load[...], self.balance)  # a first call's zero load: none
        out, load = experts(*args, top_k=self.top_k, w_gate=gate, bias=self.bias[...], return_load=True)
        self.load[...] = load
        return out


class Balance(nnx.Variable):
    """A mixture's balancing state (its routing bias and last load): carried by ``TrainStep``, never trained.
    ``merge`` says how a pipelined step merges what each microbatch's call leaves: ``"sum"`` (a load),
    ``"last"`` (the bias, alike in every microbatch)."""


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs, experts: int | None = None, top_k: int = 2,
                 balance: float | None = None, dtype: jnp.dtype | None = None):
        self.heads = heads
        kw = dict(dtype=dtype, rngs=rngs)
        self.ln1, self.ln2 = nnx.LayerNorm(dim, **kw), nnx.LayerNorm(dim, **kw)
        self.q, self.k, self.v, self.o = (nnx.Linear(dim, dim, **kw) for _ in range(4))
        if experts:
            self.moe = MoE(dim, experts, top_k, rngs, balance=balance, dtype=dtype)
        else:
            self.up, self.down = nnx.Linear(dim, 4 * dim, **kw), nnx.Linear(4 * dim, dim, **kw)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).reshape(b, t, self.heads, d // self.heads) for f in (self.q, self.k, self.v))
        a = attention(q, k, v, is_causal=True).reshape(b, t, d)
        x = x + self.o(a)
        if hasattr(self, "moe"):
            return x + self.moe(self.ln2(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """``scan=True`` stacks the blocks (one ``Block`` built by ``nnx.vmap``, its parameters ``(layers, ...)``) and runs
    them with ``nnx.scan``, as deep JAX models keep their compile time flat (MaxText's ``scan_layers``).
    ``experts=E`` gives every block a mixture of ``E`` experts (``MoE``, each token to ``top_k``, balanced by
    ``balance``) for its MLP. ``dtype`` is what it computes in (``jnp.bfloat16``: mixed precision, the parameters
    kept in float32 and cast where used, as Megatron-LM and torchtitan train); None: the parameters' float32."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, rngs: nnx.Rngs, *,
                 scan: bool = False, experts: int | None = None, top_k: int = 2, balance: float | None = None,
                 dtype: jnp.dtype | None = None):
        kw = dict(dtype=dtype, rngs=rngs)
        self.tok, self.pos = nnx.Embed(vocab, dim, **kw), nnx.Embed(seq, dim, **kw)
        self.scan = scan
        self.blocks = _layers(lambda rngs: Block(dim, heads, rngs, experts, top_k, balance, dtype), layers, rngs,
                              scan)
        self.ln = nnx.LayerNorm(dim, **kw)
        self.head = nnx.Linear(dim, vocab, **kw)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
        return self.head(self.ln(_run(self.blocks, x, self.scan)))


def _layers(make, layers: int, rngs: nnx.Rngs, scan: bool):
    """``layers`` blocks, each ``make(rngs)``: an ``nnx.List`` of them, or with ``scan`` one block built by ``nnx.vmap``
    whose parameters stack every layer's (``(layers, ...)``), its keys split per layer. Traced (``nnx.eval_shape``,
    ``parallelize``'s constructor), in time linear in ``layers`` on every JAX (``jaxcompat.constructing``)."""
    with constructing():
        if not scan:
            return nnx.List([make(rngs) for _ in range(layers)])

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs):
            return make(rngs)

        return stacked(rngs)


def _run(blocks, x, scan: bool):
    """``x`` through the blocks ``_layers`` made, in order: a loop (``for block in blocks: x = block(x)``, the chain
    ``PipelineParallel`` cuts), or ``nnx.scan`` over the stacked one."""
    if scan:
        return nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks)
    for block in blocks:
        x = block(x)
    return x


# Meta's Llama 3 / 3.1 shapes (the model cards and params.json of each release): the transformer's width, depth,
# query and key/value heads, the SwiGLU MLP's hidden width, and the vocabulary (tiktoken's 128,000 + 256 special)
LLAMA3 = {"8b": dict(dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, vocab=128256),
          "70b": dict(dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, vocab=128256),
          "405b": dict(dim=16384, layers=126, heads=128, kv_heads=8, hidden=53248, vocab=128256)}


def rotary(x, theta: float):
    """Rotary position embeddings (RoFormer's, as Meta's Llama applies them) on ``x`` ``[batch, seq, heads,
    head_dim]``: each adjacent pair ``(x[2i], x[2i+1])`` of a head at position ``t`` turned by the angle
    ``t * theta ** (-2i / head_dim)``; the positions are ``0 ... seq - 1``, the angles computed in float32 here (no
    parameters, no state).

    >>> y = rotary(jnp.ones((1, 3, 1, 2)), 10_000.0)[0, :, 0]  # the pair (1, 1) turned by 0, 1 and 2 radians
    >>> t = jnp.arange(3.0)[:, None]
    >>> bool(jnp.allclose(y, jnp.concatenate([jnp.cos(t) - jnp.sin(t), jnp.sin(t) + jnp.cos(t)], axis=1)))
    True
    """
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # [seq, head_dim / 2]
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]  # broadcast over the heads
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], half, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape).astype(x.dtype)


class LlamaBlock(nnx.Module):
    """Llama's pre-norm block: RMSNorm ``ln1``, grouped-query attention (``q`` to ``heads``, ``k`` / ``v`` to
    ``kv_heads`` heads of ``dim // heads``, rotary positions on ``q`` and ``k``, causal) and ``o``; RMSNorm ``ln2``
    and the SwiGLU MLP ``down(silu(gate(x)) * up(x))``; each added to the residual. No biases."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, rngs: nnx.Rngs, *, theta: float,
                 eps: float, dtype: jnp.dtype | None = None):
        self.heads, self.kv_heads, self.theta = heads, kv_heads, theta
        hd = dim // heads
        kw = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.ln1, self.ln2 = (nnx.RMSNorm(dim, epsilon=eps, dtype=dtype, rngs=rngs) for _ in range(2))
        self.q = nnx.Linear(dim, heads * hd, **kw)
        self.k, self.v = (nnx.Linear(dim, kv_heads * hd, **kw) for _ in range(2))
        self.o = nnx.Linear(heads * hd, dim, **kw)
        self.up, self.gate = (nnx.Linear(dim, hidden, **kw) for _ in range(2))
        self.down = nnx.Linear(hidden, dim, **kw)

    def __call__(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).reshape(b, t, self.heads, -1)
        k, v = (f(h).reshape(b, t, self.kv_heads, -1) for f in (self.k, self.v))
        a = attention(rotary(q, self.theta), rotary(k, self.theta), v, is_causal=True)
        x = x + self.o(a.reshape(b, t, -1))
        h = self.ln2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    """Meta's Llama 3 transformer (``llama3`` builds it by size): the ``tok`` embedding, ``layers`` ``LlamaBlock``s,
    a final RMSNorm ``ln`` and an untied ``head``. ``seq`` is the longest sequence it takes (rotary positions have no
    table, so it only checks). ``scan=True`` stacks the blocks and runs them by ``nnx.scan``, as ``GPT``'s;
    ``dtype`` is what it computes in, as ``GPT``'s."""

    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int, hidden: int, seq: int,
                 rngs: nnx.Rngs, *, theta: float = 500_000.0, eps: float = 1e-5, scan: bool = False,
                 dtype: jnp.dtype | None = None):
        if dim % heads:
            raise ValueError(f"Llama: dim ({dim}) is not a multiple of heads ({heads}): each head is dim / heads wide")
        if heads % kv_heads:
            raise ValueError(f"Llama: heads ({heads}) is not a multiple of kv_heads ({kv_heads}): each key/value head "
                             "serves heads / kv_heads query heads")
        self.seq, self.scan = seq, scan
        self.tok = nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs)
        self.blocks = _layers(lambda rngs: LlamaBlock(dim, heads, kv_heads, hidden, rngs, theta=theta, eps=eps,
                                                      dtype=dtype), layers, rngs, scan)
        self.ln = nnx.RMSNorm(dim, epsilon=eps, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, ids):
        if ids.shape[1] > self.seq:
            raise ValueError(f"Llama: {ids.shape[1]} tokens, and the model was built for seq={self.seq} at most")
        return self.head(self.ln(_run(self.blocks, self.tok(ids), self.scan)))


def llama3(size: str, *, seq: int, rngs: nnx.Rngs, scan: bool = False, dtype: jnp.dtype | None = None,
           **sizes: int) -> Llama:
    """Meta's Llama 3 / 3.1 of ``size`` (``"8b"``, ``"70b"`` or ``"405b"``: ``LLAMA3``'s shapes, rotary theta
    500,000, RMSNorm eps 1e-5, no biases, untied embedding and head), its parameters as many as Meta's
    (8,030,261,248; 70,553,706,496; 405,853,388,800). ``sizes`` override any of ``dim``, ``layers``, ``heads``,
    ``kv_heads``, ``hidden``, ``vocab`` (a toy to train); ``dtype``: what it computes in (``jnp.bfloat16``: mixed
    precision, float32 parameters). Build the large ones abstractly
    (``nnx.eval_shape(lambda: llama3("405b", ...))``) or through ``parallelize(lambda: llama3(...), mesh, ...)``,
    which never holds a sharded parameter whole. The rotary positions are Llama 3's: Llama 3.1's rescaling of their
    low frequencies for long contexts (``rope_scaling``, factor 8) is not applied.

    >>> model = llama3("8b", dim=32, layers=2, heads=4, kv_heads=2, hidden=64, vocab=50, seq=8, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 50)
    >>> model.blocks[0].k.kernel.shape, model.blocks[0].gate.kernel.shape
    ((32, 16), (32, 64))
    >>> llama3("7b", seq=8, rngs=nnx.Rngs(0))
    Traceback (most recent call last):
    ...
    ValueError: llama3: size '7b' is not one of '8b', '70b', '405b'
    """
    if size not in LLAMA3:
        raise ValueError(f"llama3: size {size!r} is not one of {', '.join(map(repr, LLAMA3))}")
    unknown = sorted(set(sizes) - set(LLAMA3[size]))
    if unknown:
        raise ValueError(f"llama3: unknown size override(s) {', '.join(unknown)}; the sizes are "
                         f"{', '.join(LLAMA3[size])}")
    shape = {**LLAMA3[size], **sizes}
    return Llama(shape["vocab"], shape["dim"], shape["heads"], shape["kv_heads"], shape["layers"], shape["hidden"],
                 seq, rngs, scan=scan, dtype=dtype)


def cross_entropy(logits, labels):
    """Mean token cross-entropy. With vocabulary-sharded logits the engine keeps them sharded: the max and
    the exp-sum reduce over the vocabulary as Partials of shape ``(batch, seq, 1)`` and the label's logit is
    a masked local lookup — the full logits are never gathered (DTensor's loss parallel). Computed in float32
    whatever the logits' dtype (bf16 logits of a mixed-precision model)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def summed_terms(vocab: int, dim: int, layers: int, seq: int, batch: int, *, steps: int = 1) -> int:
    """How many terms the loss of ``steps`` training steps sums along its longest chain: the ``n`` of
    ``jshard.validate.tolerance`` (the rounding of a reordered program grows with its square root).

    Per block: two LayerNorms (mean and variance over ``dim``), the q/k/v, score, o and up contractions
    (``dim`` each at most), softmax and attention over ``seq``, down over ``4 * dim``; then the final norm,
    the head, the log-softmax over ``vocab`` and the mean over the batch's tokens. The backward pass sums as
    many again, and each step's rounding adds to the previous steps' (a random walk over the steps).

    >>> summed_terms(vocab=64, dim=64, layers=2, seq=32, batch=8)
    4352
    """
    forward = layers * (12 * dim + 2 * seq) + 3 * dim + vocab + batch * seq
    return 2 * forward * steps


def plan(style: str, dp: str = "dp", tp: str = "tp", cp: str = "cp", method: str = "auto", pp: str = "pp",
         microbatches: int = 4, schedule: str = "1f1b", virtual_stages: int = 1, *,
         scan: bool = False, ep: str = "ep", experts: bool | None = None, gated: bool = False) -> tuple[dict, tuple]:
    """``(plan, default)`` for ``parallelize`` in one of the styles ``tp``, ``sp``, ``fsdp``, ``dp``, ``cp``,
    ``pp``, or a ``+``-joined combination of them with at most one of ``dp`` / ``fsdp`` (the data axis ``dp``) and
    at most one of ``tp`` / ``sp`` (the tensor axis ``tp``), in any order: ``"dp+cp"``, ``"cp+tp"``, ``"fsdp+cp+tp"``.
    ``cp`` is context parallelism on axis ``cp`` (``ContextParallel`` on the model: the sequence sharded there, its
    attention crossing the axis by ``method``); ``dp`` leaves the parameters replicated (the batch is sharded by
    the caller), so ``"dp+cp"`` is ``"cp"`` with the batch on ``dp``. ``pp`` is pipeline parallelism on axis
    ``pp`` (``PipelineParallel`` on the blocks, with ``microbatches``, ``schedule`` and ``virtual_stages``).
    ``scan=True``: the plan of ``GPT(..., scan=True)``, whose stacked blocks are one module (``blocks/q``, not
    ``blocks/*/q``); each style places a stacked parameter as it places one layer's. ``ep`` is expert parallelism
    on axis ``ep`` (``ExpertParallel`` on every block's ``moe``; the axis may also be the data axis, ``ep="dp"``);
    ``experts`` says the model's blocks hold mixtures of experts (``GPT(..., experts=E)``; by default, when the
    style has ``ep``), whose expert weights tensor parallelism splits on their hidden dim
    (``ExpertTensorParallel``). ``gated=True``: the plan of a model whose MLP is gated (``Llama``'s SwiGLU, a
    ``gate`` beside ``up``), tensor parallelism splitting ``gate`` by columns as ``up`` (only then: a pattern matching
    no module is refused by ``parallelize``).

    >>> plan("tp")[0]["blocks/*/o"]
    RowwiseParallel(axis='tp', input=None, output=R)
    >>> plan("fsdp+cp+tp", method="ring")[0][""].method, plan("fsdp+cp+tp")[1]
    ('ring', (FullyShard(axis='dp', input=None, output=None, dim=0, param_dtype=None),))
    >>> plan("pp+tp", microbatches=8)[0]["blocks"].microbatches
    8
    >>> plan("dp+ep")[0]
    {'blocks/*/moe': (ExpertParallel(axis='ep', input=None, output=None, experts=None),)}
    >>> [type(s).__name__ for s in plan("ep+tp")[0]["blocks/*/moe"]]
    ['ExpertParallel', 'ExpertTensorParallel']
    >>> plan("fsdp+tp", gated=True, scan=True)[0]["blocks/gate"]
    ColwiseParallel(axis='tp', input=R, output=None)
    """
    parts = style.split("+") if isinstance(style, str) else []
    known = ("tp", "sp", "fsdp", "dp", "cp", "pp", "ep")
    clash = [pair for pair in (("dp", "fsdp"), ("tp", "sp")) if set(pair) <= set(parts)]
    if not parts or any(p not in known for p in parts) or len(set(parts)) != len(parts) or clash:
        why = f" ({' and '.join(clash[0])} both use one axis)" if clash else ""
        raise ValueError(f"plan: style {style!r} is not one of {', '.join(map(repr, known))} or a '+'-joined "
                         f"combination with at most one of 'dp'/'fsdp' and one of 'tp'/'sp'{why}, such as 'dp+cp', "
                         "'cp+tp', 'fsdp+cp+tp', 'fsdp+tp', 'pp+dp+tp', 'dp+ep'")
    if method != "auto" and "cp" not in parts:
        raise ValueError(f"plan: method={method!r} is how context parallelism crosses its axis, and style {style!r} "
                         "has none; add 'cp' to the style (say 'dp+cp') or leave method='auto'")
    styles: dict = {}
    blocks = "blocks" if scan else "blocks/*"
    if "tp" in parts or "sp" in parts:
        styles.update(_tensor_parallel(tp, "sp" in parts, blocks, "ep" in parts if experts is None else experts,
                                       gated))
    if "ep" in parts:
        styles[f"{blocks}/moe"] = (ExpertParallel(ep), *([styles[f"{blocks}/moe"]] if f"{blocks}/moe" in styles
                                                         else []))
    if "cp" in parts:
        # the model's ids in, its logits out: sequence-sharded on cp, every attention inside crossing cp by method
        styles[""] = ContextParallel(cp, method=method)
    if "pp" in parts:
        styles["blocks"] = PipelineParallel(pp, microbatches=microbatches, schedule=schedule,
                                            virtual_stages=virtual_stages)
    return styles, (FullyShard(dp),) if "fsdp" in parts else ()


def one_device_trainer(model: nnx.Module, tx: optax.GradientTransformation, loss_fn):
    """The same training with plain ``jax.jit`` on one device (the reference the demo and the notebooks
    compare with): returns ``step(*batch) -> loss`` as a float; ``step.params()`` are the parameters so far,
    ``step.model()`` the model.

    >>> step = one_device_trainer(GPT(32, 16, 2, 1, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1),
    ...                           lambda m, ids: cross_entropy(m(ids), ids))
    >>> ids = jnp.zeros((2, 8), jnp.int32)
    >>> step(ids) > step(ids)
    True
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = [params, tx.init(params), rest]

    @jax.jit
    def update(params, opt_state, rest, *batch):
        def loss_of(p):  # the state the forward pass updates (a mixture's balancing bias) carried, as TrainStep does
            m = nnx.merge(graphdef, p, rest, copy=True)
            return loss_fn(m, *batch), nnx.split(m, nnx.Param, ...)[2]

        (loss, rest), g = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rest, loss

    def step(*batch) -> float:
        state[0], state[1], state[2], loss = update(*state, *batch)
        return float(loss)

    step.params = lambda: state[0]
    step.model = lambda: nnx.merge(graphdef, state[0], state[2])
    return step


def _tensor_parallel(tp: str, sp: bool, blocks: str, experts: bool, gated: bool = False) -> dict:
    """Megatron's plan on ``tp``, with sequence parallelism's norms where ``sp``; ``blocks`` matches every block (its
    MLP a mixture of experts where ``experts``, left whole; a gated one, ``gate`` beside ``up``, where ``gated``)."""
    row = RowwiseParallel(tp, output=Shard(1) if sp else RowwiseParallel.output)
    mlp = {f"{blocks}/moe": ExpertTensorParallel(tp)} if experts else {
        f"{blocks}/up": ColwiseParallel(tp), **({f"{blocks}/gate": ColwiseParallel(tp)} if gated else {}),
        f"{blocks}/down": row}
    styles = {**{f"{blocks}/{name}": ColwiseParallel(tp) for name in ("q", "k", "v")}, **mlp,
              f"{blocks}/o": row,
              "head": ColwiseParallel(tp),
              # the vocabulary-parallel embedding (torchtitan's and Megatron's): the table, the largest parameter
              # of a small GPT, is split on tp; each device looks up the ids it owns and one reduction joins them
              "tok": row}
    if sp:
        styles.update({f"{blocks}/ln1": SequenceParallel(tp), f"{blocks}/ln2": SequenceParallel(tp),
                       "ln": SequenceParallel(tp)})
    else:
        # the norms' outputs are replicated on tp (they are already): pinning them there makes the gradients
        # of the column-parallel layers they feed (q, k, v; up; head) sum as Partials and reduce once, before
        # the norm's backward pass, instead of running that backward pass on pending sums
        norm_out = ParallelStyle(tp, output=Replicate())
        styles.update({f"{blocks}/ln1": norm_out, f"{blocks}/ln2": norm_out, "ln": norm_out})
    return styles
