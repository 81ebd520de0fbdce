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

>>> model = GPT(vocab=32, dim=16, heads=2, layers=1, seq=8, rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 8), jnp.int32)).shape
(2, 8, 32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

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

__all__ = ["GPT", "Balance", "MoE", "cross_entropy", "one_device_trainer", "plan", "summed_terms"]


class MoE(nnx.Module):
    """A mixture of ``experts`` gated SiLU MLPs (``jshard.experts``: ``w_up`` / ``w_gate`` ``[E, D, H]``, ``w_down``
    ``[E, H, D]``), each token to its ``top_k`` experts, routed by a linear ``router`` (softmax over the chosen
    logits). ``balance=rate`` balances the load as DeepSeek-V3 does, without an auxiliary loss: a routing ``bias``
    (a ``Balance`` variable, not a parameter) that only chooses, moved by ``rate`` after every call
    (``jshard.moe.balance_bias``), and the tokens each expert took in the last call kept in ``load``."""

    def __init__(self, dim: int, experts: int, top_k: int, rngs: nnx.Rngs, hidden: int | None = None,
                 balance: float | None = None):
        hidden = hidden or 2 * dim
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1,
                                                 batch_axis=(0,))
        self.top_k, self.balance = top_k, balance
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.w_up, self.w_gate = (nnx.Param(init(rngs.params(), (experts, dim, hidden))) for _ in range(2))
        self.w_down = nnx.Param(init(rngs.params(), (experts, hidden, dim)))
        if balance is not None:
            self.bias, self.load = Balance(jnp.zeros(experts)), Balance(jnp.zeros(experts, jnp.int32))

    def __call__(self, x):
        args = (x, self.router(x), self.w_up[...], self.w_down[...])
        if self.balance is None:
            return experts(*args, top_k=self.top_k, w_gate=self.w_gate[...])
        out, load = experts(*args, top_k=self.top_k, w_gate=self.w_gate[...], bias=self.bias[...], return_load=True)
        self.bias[...] = balance_bias(self.bias[...], load, self.balance)
        self.load[...] = load
        return out


class Balance(nnx.Variable):
    """A mixture's balancing state (its routing bias and last load): carried by ``TrainStep``, never trained."""


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs, experts: int | None = None, top_k: int = 2,
                 balance: float | None = None):
        self.heads = heads
        self.ln1, self.ln2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(dim, dim, rngs=rngs) for _ in range(4))
        if experts:
            self.moe = MoE(dim, experts, top_k, rngs, balance=balance)
        else:
            self.up, self.down = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)

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
    ``balance``) for its MLP."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int, rngs: nnx.Rngs, *,
                 scan: bool = False, experts: int | None = None, top_k: int = 2, balance: float | None = None):
        self.tok, self.pos = nnx.Embed(vocab, dim, rngs=rngs), nnx.Embed(seq, dim, rngs=rngs)
        self.scan = scan
        if scan:
            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs):
                return Block(dim, heads, rngs, experts, top_k, balance)

            self.blocks = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(dim, heads, rngs, experts, top_k, balance) for _ in range(layers)])
        self.ln = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
        if self.scan:
            x = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln(x))


def cross_entropy(logits, labels):
    """Mean token cross-entropy. With vocabulary-sharded logits the engine keeps them sharded: the max and
    the exp-sum reduce over the vocabulary as Partials of shape ``(batch, seq, 1)`` and the label's logit is
    a masked local lookup — the full logits are never gathered (DTensor's loss parallel)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
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
         scan: bool = False, ep: str = "ep", experts: bool | None = None) -> tuple[dict, tuple]:
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
    (``ExpertTensorParallel``).

    >>> plan("tp")[0]["blocks/*/o"]
    RowwiseParallel(axis='tp', input=None, output=R)
    >>> plan("fsdp+cp+tp", method="ring")[0][""].method, plan("fsdp+cp+tp")[1]
    ('ring', (FullyShard(axis='dp', input=None, output=None, dim=0),))
    >>> plan("pp+tp", microbatches=8)[0]["blocks"].microbatches
    8
    >>> plan("dp+ep")[0]
    {'blocks/*/moe': (ExpertParallel(axis='ep', input=None, output=None, experts=None),)}
    >>> [type(s).__name__ for s in plan("ep+tp")[0]["blocks/*/moe"]]
    ['ExpertParallel', 'ExpertTensorParallel']
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
        styles.update(_tensor_parallel(tp, "sp" in parts, blocks, "ep" in parts if experts is None else experts))
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


def _tensor_parallel(tp: str, sp: bool, blocks: str, experts: bool) -> dict:
    """Megatron's plan on ``tp``, with sequence parallelism's norms where ``sp``; ``blocks`` matches every block (its
    MLP a mixture of experts where ``experts``, left whole)."""
    row = RowwiseParallel(tp, output=Shard(1) if sp else RowwiseParallel.output)
    mlp = {f"{blocks}/moe": ExpertTensorParallel(tp)} if experts else {f"{blocks}/up": ColwiseParallel(tp),
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
