"""Styles on Flax's own layers: placed by what their dims mean, and trained like one device.

A transformer built from ``nnx.MultiHeadAttention`` (query, key, value and out are ``LinearGeneral``: kernels
``(in, heads, head_dim)`` and ``(heads, head_dim, out)``) is made tensor parallel over heads with the Megatron plan,
sequence parallel and FSDP; a model of the other layers (``Conv``, ``ConvTranspose``, ``Einsum``, ``LinearGeneral``,
``Embed``, the norms) runs column / row parallel pairs; a parameter a style cannot place is named with its module.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from modules import Gain

import jshard
from conftest import make_mesh, mesh_params
from jshard import Replicate, Shard, StridedShard
from jshard.gpt import cross_entropy, one_device_trainer, summed_terms
from jshard.parallel import (
    ColwiseParallel,
    FullyShard,
    RowwiseParallel,
    SequenceParallel,
    TrainStep,
    parallelize,
    placements_of,
)
from jshard.validate.tolerance import curve_ratio
from oracle import assert_close, tree_scale

R = Replicate()
V, D, H, L, T, B = 32, 32, 8, 2, 8, 4  # 8 heads: tp over 4 or 8 devices keeps whole heads on each
N = summed_terms(V, D, L, T, B)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    """Flax's own layers only: Embed, MultiHeadAttention, LayerNorm, Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def transformer() -> Transformer:
    return Transformer(nnx.Rngs(0))


def megatron(style: str, dp: str = "dp", tp: str = "tp") -> tuple[dict, tuple]:
    """``(plan, default)``: ``tp`` column parallel over heads for query/key/value and over the hidden features for
    up, row parallel for out and down; ``sp`` adds sequence parallel norms; ``fsdp`` shards everything over dp;
    ``fsdp+tp`` both."""
    if style == "fsdp":
        return {}, (FullyShard(dp),)
    row = RowwiseParallel(tp, output=Shard(1) if style == "sp" else R)
    plan = {**{f"blocks/*/attn/{n}": ColwiseParallel(tp) for n in ("query", "key", "value")},
            "blocks/*/attn/out": row, "blocks/*/up": ColwiseParallel(tp), "blocks/*/down": row,
            "head": ColwiseParallel(tp)}
    if style == "sp":
        plan.update({"blocks/*/ln[12]": SequenceParallel(tp), "ln": SequenceParallel(tp)})
    return plan, (FullyShard(dp),) if style == "fsdp+tp" else ()


def parallel(style: str, mesh) -> Transformer:
    plan, default = megatron(style, mesh.axis_names[0], mesh.axis_names[-1])
    return parallelize(transformer(), mesh, plan, default=default)


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(2))


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def one_device_training(tx: optax.GradientTransformation, steps: int) -> tuple[list[float], nnx.State]:
    step = one_device_trainer(transformer(), tx, loss_fn)
    return [step(*batch(0)) for _ in range(steps)], step.params()


def test_multi_head_attention_is_placed_over_heads():
    mesh = make_mesh((2, 4))
    model = parallel("fsdp+tp", mesh)
    attn = model.blocks[0].attn
    for proj in (attn.query, attn.key, attn.value):  # kernel (in, heads, head_dim): heads over tp, rows over dp
        assert proj.kernel.get_value().placements == (Shard(0), Shard(1))
        assert proj.bias.get_value().placements == (StridedShard(0, 4), Shard(0))  # (heads, head_dim)
    # out's kernel (heads, head_dim, out): heads over tp, FSDP cutting inside each tp block; its bias added once
    assert attn.out.kernel.get_value().placements == (StridedShard(0, 4), Shard(0))
    assert attn.out.bias.get_value().placements == (Shard(0), R)
    assert model.blocks[0].ln1.scale.get_value().placements == (Shard(0), R)
    tp_only = parallel("tp", mesh).blocks[0].attn
    assert tp_only.query.kernel.get_value().placements == (R, Shard(1))
    assert tp_only.out.kernel.get_value().placements == (R, Shard(0))
    np.testing.assert_array_equal(np.asarray(attn.query.kernel.get_value().full()),
                                  np.asarray(transformer().blocks[0].attn.query.kernel[...]))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_tensor_parallel_attention_reduces_once_like_megatron(mesh_shape):
    """The forward pass of the tp plan: one all-reduce for the attention (out's partial sums) and one for the MLP
    (down's) per block, nothing else; the logits equal one device's."""
    mesh = make_mesh(mesh_shape)
    model = parallel("tp", mesh)
    ids, _ = batch(0)
    x = jshard.distribute(ids, mesh, (Shard(0), R))
    ex = jshard.explain(lambda m, x: m(x), model, x)
    moves = [(m[1], m[2]) for r in ex.rows for m in r["moves"]]
    assert moves == [("all_reduce", ("tp",))] * (2 * L)
    forward = jshard.jit(lambda m, x: m(x))
    text = forward.lower(model, x).as_text()
    assert collections.Counter(re.findall(r"stablehlo\.(all_reduce|reduce_scatter|all_gather|all_to_all)", text)) \
        == {"all_reduce": 2 * L}
    assert_close(forward(model, x).full(), transformer()(ids), n=N // 2)


@pytest.mark.parametrize("mesh_shape,style", [
    ((2, 4), "tp"), ((2, 4), "sp"), ((2, 4), "fsdp"), ((1, 8), "tp"), ((1,), "tp"),
    pytest.param((2, 4), "fsdp+tp", marks=pytest.mark.slow), pytest.param((1, 8), "sp", marks=pytest.mark.slow),
    pytest.param((1, 8), "fsdp", marks=pytest.mark.slow)])
def test_multi_head_attention_transformer_trains_like_one_device(mesh_shape, style):
    mesh = make_mesh(mesh_shape)
    model = parallel(style, mesh)
    before = placements_of(nnx.state(model, nnx.Param))
    tx = optax.adamw(1e-2, eps=1e-4)  # a key bias's gradient is 0 up to rounding: Adam must not amplify it
    step = TrainStep(model, tx, loss_fn)
    data = (Shard(0),) + (R,) * (len(mesh_shape) - 1)
    # one batch, fitted: the loss must fall
    losses = [float(step(*(jshard.distribute(a, mesh, data) for a in batch(0)))) for _ in range(3)]
    want, want_params = one_device_training(tx, 3)
    assert curve_ratio(losses, want, n_per_step=N) <= 1, (losses, want)
    assert losses[-1] < losses[0]
    assert placements_of(nnx.state(step.model, nnx.Param)) == before
    scale = tree_scale(want_params)
    got_leaves = jax.tree.leaves(step.params, is_leaf=lambda a: isinstance(a, jshard.DArray))
    for got, w in zip(got_leaves, jax.tree.leaves(want_params), strict=True):
        assert_close(got.full(), w, n=N * 5, terms=scale)


class Layers(nnx.Module):
    """Flax's other layers in column / row parallel pairs: Embed, Conv, ConvTranspose, Einsum, LinearGeneral and
    the norms."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 16, (3,), rngs=rngs)  # kernel (window, in, out)
        self.deconv = nnx.ConvTranspose(16, 8, (3,), rngs=rngs)  # kernel (window, in, out)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.expand = nnx.Einsum("btd,dhk->bthk", (8, 4, 2), (4, 2), rngs=rngs)  # kernel (d, heads, k)
        self.contract = nnx.Einsum("bthk,hkd->btd", (4, 2, 8), (8,), rngs=rngs)
        self.rms = nnx.RMSNorm(8, rngs=rngs)
        self.split = nnx.LinearGeneral(8, (4, 2), rngs=rngs)  # (in, heads, k)
        self.merge = nnx.LinearGeneral((4, 2), 8, axis=(-2, -1), rngs=rngs)  # (heads, k, out)

    def __call__(self, ids):
        x = self.embed(ids)
        x = x + self.deconv(jax.nn.gelu(self.conv(x)))
        x = x + self.contract(jax.nn.gelu(self.expand(self.norm(x))))
        return x + self.merge(jax.nn.gelu(self.split(self.rms(x))))


def layers() -> Layers:
    return Layers(nnx.Rngs(0))


# module, style, then per parameter the dim its style cuts (None: replicated)
LAYER_PLAN = [
    ("embed", RowwiseParallel, {"embedding": 0}),  # the vocabulary
    ("conv", ColwiseParallel, {"kernel": 2, "bias": 0}),  # output channels
    ("deconv", RowwiseParallel, {"kernel": 1, "bias": None}),  # input channels
    ("norm", ColwiseParallel, {"scale": None, "bias": None}),
    ("expand", ColwiseParallel, {"kernel": 1, "bias": 0}),  # heads, the first dim only the output has
    ("contract", RowwiseParallel, {"kernel": 0, "bias": None}),  # heads, the first contracted dim
    ("rms", RowwiseParallel, {"scale": None}),
    ("split", ColwiseParallel, {"kernel": 1, "bias": 0}),
    ("merge", RowwiseParallel, {"kernel": 0, "bias": None}),
]


@pytest.mark.parametrize("mesh_shape", mesh_params([(2, 4), (1, 8), (1,)]))
def test_flax_layers_are_placed_by_what_their_dims_mean(mesh_shape):
    mesh = make_mesh(mesh_shape)
    tp = mesh.axis_names[-1]
    model = parallelize(layers(), mesh, {name: style(tp) for name, style, _ in LAYER_PLAN})
    for name, _, dims in LAYER_PLAN:
        for param, dim in dims.items():
            want = (R,) * (len(mesh_shape) - 1) + (R if dim is None else Shard(dim),)
            assert getattr(getattr(model, name), param).get_value().placements == want, (name, param)
    ids = (np.arange(B * T, dtype=np.int32).reshape(B, T) * 7) % V
    x = jshard.distribute(ids, mesh, (Shard(0),) + (R,) * (len(mesh_shape) - 1))
    n = 8 + 3 * 16 + 8 + 8 + 8  # the longest chain of sums: conv, deconv, the norms, the contractions
    assert_close(jshard.jit(lambda m, x: m(x))(model, x).full(), layers()(ids), n=n)
    mse = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    grads = jshard.jit(nnx.grad(mse))(model, x)
    want = nnx.grad(mse)(layers(), ids)
    for g, w in zip(jax.tree.leaves(grads, is_leaf=lambda a: isinstance(a, jshard.DArray)), jax.tree.leaves(want),
                    strict=True):
        assert_close(g.full(), w, n=2 * n + B * T * 8, terms=tree_scale(want))


REFUSALS = [
    ("own-module", lambda: nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), Gain(8)), "layers/1",
     ColwiseParallel, r"ColwiseParallel\('tp'\): no placement for parameter 'gain' \(8,\) of Gain at layers/1; it "
                      r"places Flax's Linear, LinearGeneral, Einsum, Conv, .* by what their dims mean"),
    ("grouped-conv", lambda: nnx.Conv(4, 8, (3,), feature_group_count=2, rngs=nnx.Rngs(0)), "", RowwiseParallel,
     r"parameter 'kernel' \(3, 2, 8\) of Conv at the root module; a grouped Conv's kernel holds each group's input "
     r"channels.*use ColwiseParallel"),
    ("einsum-no-output-features", lambda: nnx.Einsum("bd,dk->b", (8, 2), rngs=nnx.Rngs(0)), "", ColwiseParallel,
     r"parameter 'kernel' \(8, 2\) of Einsum at the root module; its dims are Layout\(kind='weight', inputs=\(0,\), "
     r"outputs=\(\), stack=0\), none of them over the output features"),
]


@pytest.mark.parametrize("make,where,style,match", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_a_parameter_no_style_can_place_is_named_with_its_module(make, where, style, match):
    with pytest.raises(ValueError, match=match + r".*Give this module another style"):
        parallelize(make(), make_mesh((2, 4)), {where: style("tp")})
