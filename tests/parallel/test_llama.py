"""``jshard.gpt.llama3``: Meta's Llama 3 shapes (their parameter counts, traced abstractly), the model's math against
a reference written here, and a toy size trained by ``jshard.gpt.plan``'s styles as on one device."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import make_mesh
from jshard import Replicate, Shard
from jshard.gpt import GPT, Llama, cross_entropy, llama3, one_device_trainer, plan, summed_terms
from jshard.parallel import ColwiseParallel, TrainStep, parallelize, placements_of
from jshard.validate.tolerance import curve_ratio
from oracle import assert_close, token_batches, train_alongside, tree_scale

R = Replicate()
V, D, H, KV, F, L, T, B = 64, 64, 4, 2, 128, 2, 16, 8  # the toy: 4 query heads sharing 2 key/value heads
TOY = dict(dim=D, layers=L, heads=H, kv_heads=KV, hidden=F, vocab=V)
# a block's longest summation chain: two RMSNorms, q/k/v, o, gate/up over dim, down over F = 2 * dim, softmax and
# attention over seq; no longer than GPT's (whose MLP is 4 * dim wide), so GPT's count bounds it
N = summed_terms(V, D, L, T, B, steps=3)
FORWARD = summed_terms(V, D, L, T, B) // 2  # one forward pass: half a step's chain

# Meta's published counts (the model cards; sums of every tensor in the released checkpoints)
META = {"8b": 8_030_261_248, "70b": 70_553_706_496, "405b": 405_853_388_800}


def toy(scan=False):
    return llama3("8b", seq=T, rngs=nnx.Rngs(0), scan=scan, **TOY)


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def batches(n):
    return token_batches(n, V, B, T)


def parameter_count(make) -> int:
    """The parameters of the module ``make()`` builds, from its abstract state (shapes only, nothing allocated)."""
    state = nnx.state(nnx.eval_shape(make), nnx.Param)
    leaves = jax.tree.leaves(state)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves), {type(a) for a in leaves}
    return sum(math.prod(a.shape) for a in leaves)


@pytest.mark.parametrize("size", list(META))
def test_parameter_counts_are_metas(size):
    assert parameter_count(lambda: llama3(size, seq=8192, rngs=nnx.Rngs(0))) == META[size]
    # stacked for nnx.scan: the same parameters, each with a leading layer dim
    assert parameter_count(lambda: llama3(size, seq=8192, rngs=nnx.Rngs(0), scan=True)) == META[size]


def test_shapes_and_mistakes_are_named():
    model = nnx.eval_shape(lambda: llama3("70b", seq=8192, rngs=nnx.Rngs(0)))
    blk = model.blocks[0]
    assert blk.q.kernel.shape == (8192, 8192) and blk.k.kernel.shape == blk.v.kernel.shape == (8192, 1024)
    assert blk.gate.kernel.shape == blk.up.kernel.shape == (8192, 28672) and blk.down.kernel.shape == (28672, 8192)
    assert model.tok.embedding.shape == (128256, 8192) and model.head.kernel.shape == (8192, 128256)
    assert len(model.blocks) == 80 and blk.ln1.epsilon == 1e-5 and blk.theta == 500_000.0
    assert not hasattr(blk.q, "bias") or blk.q.bias is None
    with pytest.raises(ValueError, match=r"size '7b' is not one of '8b', '70b', '405b'"):
        llama3("7b", seq=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"unknown size override\(s\) width; the sizes are dim, layers, heads, "
                                         r"kv_heads, hidden, vocab"):
        llama3("8b", seq=8, rngs=nnx.Rngs(0), width=8)
    with pytest.raises(ValueError, match=r"heads \(4\) is not a multiple of kv_heads \(3\)"):
        llama3("8b", seq=8, rngs=nnx.Rngs(0), **{**TOY, "kv_heads": 3})
    with pytest.raises(ValueError, match=r"32 tokens.*seq=16"):
        nnx.eval_shape(toy)(jnp.zeros((1, 32), jnp.int32))


def reference_logits(params, ids, *, heads, kv_heads, theta=500_000.0, eps=1e-5):
    """Llama's forward pass in float64 NumPy, as Meta's reference code writes it: rotary positions as complex
    rotations of each head's adjacent pairs, each key/value head repeated for its group of query heads."""
    f = {k: np.asarray(v, np.float64) for k, v in params.items()}

    def norm(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    def rope(x):  # [b, t, h, hd]
        hd = x.shape[-1]
        freqs = 1.0 / theta ** (np.arange(0, hd, 2)[: hd // 2] / hd)
        cis = np.exp(1j * np.outer(np.arange(x.shape[1]), freqs))  # torch.polar(ones, angles)
        z = x.reshape(*x.shape[:-1], hd // 2, 2)
        z = (z[..., 0] + 1j * z[..., 1]) * cis[None, :, None, :]
        return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)

    x = f["tok"][ids]
    b, t, d = x.shape
    hd, layers = d // heads, 1 + max(int(k.split("/")[1]) for k in f if k.startswith("blocks/"))
    causal = np.tril(np.ones((t, t), bool))
    for i in range(layers):
        p = {k.split("/", 2)[2]: v for k, v in f.items() if k.startswith(f"blocks/{i}/")}
        h = norm(x, p["ln1"])
        q = rope((h @ p["q"]).reshape(b, t, heads, hd))
        k = np.repeat(rope((h @ p["k"]).reshape(b, t, kv_heads, hd)), heads // kv_heads, axis=2)
        v = np.repeat((h @ p["v"]).reshape(b, t, kv_heads, hd), heads // kv_heads, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        x = x + np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d) @ p["o"]
        h = norm(x, p["ln2"])
        gate = h @ p["gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p["up"])) @ p["down"]
    return norm(x, f["ln"]) @ f["head"]


def random_parameters(model, seed=1):
    """``model`` (abstract or built) with every parameter drawn afresh: kernels and embeddings at the scale of their
    inputs, the norms' scales around one but not one, so that a parameter read in the wrong place shows."""
    rng = np.random.default_rng(seed)

    def draw(name, a):
        if name == "scale":
            return jnp.asarray(1 + 0.5 * rng.standard_normal(a.shape), a.dtype)
        fan_in = a.shape[-2] if name == "kernel" else 1
        return jnp.asarray(rng.standard_normal(a.shape) / np.sqrt(fan_in), a.dtype)

    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    nnx.update(model, nnx.from_flat_state([(path, var.replace(draw(path[-1], var.get_value()))) for path, var in flat]))
    return model


def test_logits_match_a_reference_llama():
    # built abstractly, its parameters drawn here: nothing is initialised eagerly
    model = random_parameters(nnx.eval_shape(toy))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {"/".join(map(str, path[:-1])): var.get_value() for path, var in flat}
    ids = batches(1)[0][0]
    want = reference_logits(params, ids, heads=H, kv_heads=KV).astype(np.float32)
    forward = nnx.jit(lambda m, ids: m(ids))
    got = forward(model, jnp.asarray(ids))
    assert got.dtype == jnp.float32
    assert_close(np.asarray(got), want, n=FORWARD)
    # the scanned model is the same function of the same parameters, stacked
    scanned = nnx.eval_shape(lambda: toy(scan=True))
    nnx.update(scanned.blocks, jax.tree.map(lambda *a: jnp.stack(a),
                                            *(nnx.state(blk, nnx.Param) for blk in model.blocks)))
    for name in ("tok", "ln", "head"):
        nnx.update(getattr(scanned, name), nnx.state(getattr(model, name), nnx.Param))
    assert_close(np.asarray(forward(scanned, jnp.asarray(ids))), want, n=FORWARD)


def test_plan_splits_the_gate_only_when_asked():
    for style in ("tp", "sp", "fsdp+tp", "cp+tp"):
        styles, _ = plan(style)
        assert not [k for k in styles if k.endswith("gate")], styles  # GPT's plans: as before, no gate
        gated, _ = plan(style, gated=True)
        assert gated == {**styles, "blocks/*/gate": styles["blocks/*/up"]}
    assert plan("tp", scan=True, gated=True)[0]["blocks/gate"] == ColwiseParallel("tp")
    assert plan("fsdp", gated=True) == plan("fsdp")  # no tensor parallelism: nothing to split
    # a GPT has no gate: the gated plan would name a module it lacks, which parallelize refuses
    with pytest.raises(ValueError, match=r"\['blocks/\*/gate'\] match no module"):
        parallelize(lambda: GPT(V, D, H, L, T, rngs=nnx.Rngs(0)), make_mesh((2, 4)), plan("tp", gated=True)[0])


def _trains_like_one_device(mesh_shape, style, scan):
    mesh = make_mesh(mesh_shape)
    names = mesh.axis_names
    styles, default = plan(style, dp=names[0], tp=names[-1], cp=names[-1], scan=scan, gated=True)
    model = parallelize(lambda: toy(scan), mesh, styles, default=default)
    assert isinstance(model, Llama)
    before = placements_of(nnx.state(model, nnx.Param))
    # Adam divides by each gradient's root mean square: eps bounds what that does to a tiny gradient's rounding
    tx = optax.adamw(1e-3, eps=1e-4)
    step, ref = TrainStep(model, tx, loss_fn), one_device_trainer(toy(scan), tx, loss_fn)
    if "cp" in style:  # the sequence striped over cp: the rotary positions are each token's own, wherever it is
        data = (Shard(0), styles[""].on(mesh).sequence(T, mesh.shape[names[-1]]))
    else:
        data = (Shard(0),) + (R,) * (len(mesh_shape) - 1)
    losses, want = train_alongside(step, ref, mesh, data, batches(3))
    assert curve_ratio(losses, want, n_per_step=N // 3) <= 1, (losses, want)
    assert losses[-1] < losses[0]
    assert placements_of(nnx.state(step.model, nnx.Param)) == before
    got, ref_params = nnx.state(step.model, nnx.Param), ref.params()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True):
        assert g.shape == w.shape
        assert_close(g.full(), w, n=N * 5, terms=tree_scale(ref_params))
    return model


def test_fsdp_tp_trains_like_one_device():
    model = _trains_like_one_device((2, 4), "fsdp+tp", scan=False)
    blk = model.blocks[0]
    # Megatron on tp (gate and up by columns, down by rows, k/v's columns too), FSDP on dp inside each block
    assert blk.gate.kernel.get_value().placements == blk.up.kernel.get_value().placements == (Shard(0), Shard(1))
    assert blk.k.kernel.get_value().placements == (Shard(0), Shard(1))
    assert blk.down.kernel.get_value().placements[1] == Shard(0)
    assert blk.ln1.scale.get_value().placements == (Shard(0), R)


@pytest.mark.slow
def test_scanned_tp_trains_like_one_device():
    model = _trains_like_one_device((1, 8), "tp", scan=True)
    assert model.blocks.gate.kernel.get_value().placements == (R, Shard(2))  # the layer dim (0) whole
    assert model.blocks.q.kernel.get_value().shape == (L, D, D)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,style,scan", [((2, 4), "sp", False), ((8,), "fsdp", True),
                                                   ((1,), "tp", False), ((2, 4), "fsdp+tp", True),
                                                   ((2, 4), "dp+cp", False)])
def test_more_plans_train_like_one_device(mesh_shape, style, scan):
    _trains_like_one_device(mesh_shape, style, scan)


def test_mixed_precision_computes_in_bf16_and_trains_like_one_device():
    """``dtype=jnp.bfloat16``: float32 parameters, bf16 activations and logits (the loss in float32), trained under
    fsdp+tp as on one device with the same precision (bf16 rounding: the curves agree to a percent)."""
    make = lambda: llama3("8b", seq=T, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, **TOY)  # noqa: E731
    model = make()
    assert {a.dtype for a in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}
    assert model(jnp.zeros((B, T), jnp.int32)).dtype == jnp.bfloat16
    mesh = make_mesh((2, 4))
    tx = optax.adamw(1e-3, eps=1e-4)
    styles, default = plan("fsdp+tp", gated=True)
    step = TrainStep(parallelize(make, mesh, styles, default=default), tx, loss_fn)
    ref = one_device_trainer(make(), tx, loss_fn)
    ours, theirs = [], []
    for ids, labels in batches(3):
        ours.append(float(step(ids, labels)))
        theirs.append(ref(ids, labels))
    assert np.allclose(ours, theirs, rtol=2e-2), (ours, theirs)
    assert theirs[-1] < theirs[0]


def test_fsdp_gathers_in_the_param_dtype():
    """``FullyShard(axis, param_dtype=jnp.bfloat16)``: each parameter cast on its shard, then gathered: the same
    training as gathering float32 and casting in the layer (the model computes in bf16 either way), with the
    parameters' gathers moving half the bytes; the parameters stay float32."""
    from jshard.parallel import FullyShard

    make = lambda: llama3("8b", seq=T, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, **TOY)  # noqa: E731
    mesh = make_mesh((8,))
    tx = optax.adamw(1e-3, eps=1e-4)
    steps, moved = [], []
    for style in (FullyShard("x"), FullyShard("x", param_dtype=jnp.bfloat16)):
        model = parallelize(make, mesh, {}, default=(style,))
        steps.append(TrainStep(model, tx, loss_fn))
        ids, labels = batches(1)[0]
        moved.append(sum(n for _, n in steps[-1].explain(ids, labels).per_call.values()))
    assert moved[1] < 0.75 * moved[0], moved
    losses = [[float(s(ids, labels)) for ids, labels in batches(3)] for s in steps]
    assert np.allclose(losses[0], losses[1], rtol=1e-2), losses
    assert {a.dtype for a in jax.tree.leaves(nnx.state(steps[1].model, nnx.Param))} == {jnp.dtype(jnp.float32)}
    with pytest.raises(ValueError, match="param_dtype is the floating dtype"):
        FullyShard("x", param_dtype=jnp.int8)
