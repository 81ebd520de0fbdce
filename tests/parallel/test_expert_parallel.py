"""Expert parallelism: ``ExpertParallel`` places a mixture's expert weights ``Shard(0)`` on its axis and keeps them
there while the mixture runs (the tokens travel to the experts by all-to-all, the weights never move); composed with
data parallelism (on an axis of its own, or on the batch's axis), FSDP over the rest, tensor parallelism and a
pipeline, a mixture-of-experts GPT trains like one device on 8, 2x4, 1x8 and one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from conftest import make_mesh
from jshard import Replicate, Shard
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    TrainStep,
    UnplacedParameter,
    parallelize,
    placements_of,
)
from jshard.validate.tolerance import curve_ratio
from oracle import assert_close, train_alongside, tree_scale

R = Replicate()
V, D, H, L, T, B, E = 64, 32, 4, 2, 16, 8, 8
N = summed_terms(V, D, L, T, B, steps=3)


def moe_gpt():
    return GPT(vocab=V, dim=D, heads=H, layers=L, seq=T, rngs=nnx.Rngs(0), experts=E, top_k=2)


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def batches(n):
    rng = np.random.default_rng(0)
    return [(ids := rng.integers(0, V, (B, T)).astype(np.int32), np.roll(ids, -1, 1)) for _ in range(n)]


def test_the_experts_are_sharded_and_stay_where_they_are():
    mesh = make_mesh((2, 4))
    styles, default = plan("dp+ep", ep="tp")
    model = parallelize(moe_gpt, mesh, styles, default=default)
    moe = model.blocks[0].moe
    assert moe.w_up.get_value().placements == (R, Shard(0)) and moe.w_down.get_value().placements == (R, Shard(0))
    assert moe.router.kernel.get_value().placements == (R, R)  # the router as the other styles say: replicated
    assert moe.w_up.get_value().spec.local_block_shape == (E // 4, D, 2 * D)  # a quarter of the experts a device
    step = TrainStep(model, optax.sgd(0.1), loss_fn)
    ex = step.explain(*(jshard.distribute(a, mesh, (Shard(0), Shard(0))) for a in batches(1)[0]))
    experts = {tuple(v.get_value().shape) for v in (moe.w_up, moe.w_gate, moe.w_down)}
    moved = [(r["ins"][m[0]].shape, m[1]) for r in ex.rows for m in r["moves"]]
    # no expert weight is ever gathered (their gradients are summed over dp, where they are replicated)
    assert not [m for m in moved if tuple(m[0]) in experts and m[1] != "all_reduce"], moved
    assert ex.totals["all_to_all"][0] >= 2 * 3 * L  # a round's three out and home, forward and backward, a block


@pytest.mark.parametrize("shape,style,axes,data", [
    pytest.param((8,), "ep", dict(ep="x"), (Shard(0),), id="ep8"),  # experts on the batch's axis
    pytest.param((2, 4), "dp+ep", dict(ep="tp"), (Shard(0), Shard(0)), id="dp2xep4"),  # an axis of their own
    pytest.param((2, 4), "fsdp+ep", dict(ep="tp"), (Shard(0), Shard(0)), id="fsdp2xep4",  # FSDP over the rest
                 marks=pytest.mark.slow),
    pytest.param((2, 4), "ep+tp", dict(ep="dp"), (Shard(0), R), id="ep2xtp4",  # tensor parallelism beside them
                 marks=pytest.mark.slow),
    pytest.param((2, 4), "pp+ep", dict(pp="dp", ep="tp", microbatches=2), (R, Shard(0)), id="pp2xep4",
                 marks=pytest.mark.slow),  # inside pipeline stages
    pytest.param((1, 8), "dp+ep", dict(ep="tp"), (Shard(0), Shard(0)), id="dp1xep8"),
    pytest.param((1,), "ep", dict(ep="x"), (R,), id="one-device"),
])
def test_a_mixture_of_experts_gpt_trains_like_one_device(shape, style, axes, data):
    mesh = make_mesh(shape)
    styles, default = plan(style, **axes)
    model = parallelize(moe_gpt, mesh, styles, default=default)
    before = placements_of(nnx.state(model, nnx.Param))
    tx = optax.adamw(1e-2, eps=1e-4)
    step, ref = TrainStep(model, tx, loss_fn), one_device_trainer(moe_gpt(), tx, loss_fn)
    losses, want = train_alongside(step, ref, mesh, data, batches(3))
    assert curve_ratio(losses, want, n_per_step=N // 3) <= 1, (losses, want)
    assert placements_of(nnx.state(step.model, nnx.Param)) == before
    got, ref_params = nnx.state(step.model, nnx.Param), ref.params()
    if "pp" in style:  # a pipeline holds the blocks stacked: block i is slice i
        blocks = ref_params["blocks"]
        ref_params["blocks"] = {"layers": jax.tree.map(lambda *b: np.stack(b), *(blocks[i] for i in range(L)))}
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True):
        assert_close(g.full(), w, n=N * 5, terms=tree_scale(ref_params))


def balanced_gpt(layers=L):
    return GPT(vocab=V, dim=D, heads=H, layers=layers, seq=T, rngs=nnx.Rngs(0), experts=E, top_k=2, balance=1e-1)


@pytest.mark.parametrize("shape,axes,data,layers", [
    pytest.param((2, 4), dict(pp="dp", ep="tp", microbatches=2), (R, Shard(0)), L, id="pp2xep4"),
    pytest.param((2, 4), dict(pp="a", ep="b", microbatches=4), (R, Shard(0)), 3, id="pp2xep4-uneven",
                 marks=pytest.mark.slow),  # 3 layers over 2 stages: the second holds one and an idle row
    pytest.param((1, 8), dict(pp="dp", ep="tp", microbatches=2), (R, Shard(0)), L, id="pp1xep8",
                 marks=pytest.mark.slow),
    pytest.param((1, 1), dict(pp="a", ep="b", microbatches=2), (R, R), L, id="one-device"),
])
def test_a_balanced_mixture_in_pipeline_stages_trains_like_one_device(shape, axes, data, layers):
    """The routing bias and load (state, not parameters) of a mixture's blocks are carried through a pipelined
    step: every microbatch routes with the state as the step found it, the loads are summed over the microbatches,
    so the step's losses, parameters, bias and load are one device's on the whole batch."""
    mesh = jax.make_mesh(shape, ("dp", "tp") if "dp" in axes.values() else ("a", "b"),
                         devices=jax.devices()[:int(np.prod(shape))])
    styles, default = plan("pp+ep", **axes)
    make = functools.partial(balanced_gpt, layers)
    model = parallelize(make, mesh, styles, default=default)
    tx = optax.adamw(1e-2, eps=1e-4)
    step, ref = TrainStep(model, tx, loss_fn), one_device_trainer(make(), tx, loss_fn)
    losses, want = train_alongside(step, ref, mesh, data, batches(3))
    assert curve_ratio(losses, want, n_per_step=summed_terms(V, D, layers, T, B, steps=3) // 3) <= 1, (losses, want)
    moe, ref_blocks = step.model.blocks.layers.moe, ref.model().blocks
    for name in ("bias", "load"):
        got = np.asarray(getattr(moe, name).get_value().full())
        theirs = np.stack([np.asarray(getattr(ref_blocks[i].moe, name).get_value()) for i in range(layers)])
        np.testing.assert_allclose(got, theirs, atol=1e-6)
    assert np.abs(np.asarray(moe.bias.get_value().full())).max() > 0  # the bias moved: the state was carried
    # every layer's load counts each of the last batch's tokens top_k times, summed over the microbatches
    np.testing.assert_array_equal(np.asarray(moe.load.get_value().full()).sum(axis=1), [B * T * 2] * layers)


def test_expert_parallel_reads_the_expert_count_or_asks_for_it():
    class Odd(nnx.Module):
        def __init__(self):
            self.w_up, self.w_down = nnx.Param(np.zeros((8, 4, 6))), nnx.Param(np.zeros((6, 8, 4)))

    with pytest.raises(UnplacedParameter, match=r"leading dims are \[6, 8\]; pass experts=E"):
        ExpertParallel("ep").param(Odd(), "w_up", (8, 4, 6))
    assert ExpertParallel("ep", experts=8).param(Odd(), "w_up", (8, 4, 6)) == Shard(0)
    assert ExpertParallel("ep", experts=8).param(Odd(), "w_down", (6, 8, 4)) == R
    with pytest.raises(ValueError, match=r"experts must be the expert count"):
        ExpertParallel("ep", experts=0)


class GShard(nnx.Module):
    """A mixture written in plain JAX as GShard and Switch did: tokens in groups, top-1 routing, one-hot dispatch and
    combine einsums with a capacity per group (tokens past it dropped, by the layer's own design)."""

    def __init__(self, dim, experts, hidden, capacity_factor, rngs):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (experts, dim, hidden)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, hidden, dim)))
        self.capacity_factor = capacity_factor

    def __call__(self, x):  # [groups, tokens, dim]
        experts = self.w_in.shape[0]
        capacity = int(np.ceil(self.capacity_factor * x.shape[1] / experts))
        probs = jax.nn.softmax(self.router(x), axis=-1)
        chosen = jax.nn.one_hot(jnp.argmax(probs, axis=-1), experts)               # [g, s, e]
        slot = (jnp.cumsum(chosen, axis=1) * chosen - 1).astype(jnp.int32)          # place in its expert buffer
        dispatch = chosen[..., None] * jax.nn.one_hot(slot, capacity)                # [g, s, e, c]; past c: dropped
        combine = dispatch * jnp.max(probs, axis=-1)[..., None, None]
        xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)                               # tokens to their experts
        h = jax.nn.gelu(jnp.einsum("egcd,edh->egch", xe, self.w_in[...]))
        return x + jnp.einsum("gsec,egcd->gsd", combine, jnp.einsum("egch,ehd->egcd", h, self.w_out[...]))


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["ep8", "dp2xep4"])
def test_a_users_gshard_layer_keeps_its_experts_in_place_and_trains_like_one_device(shape):
    mesh = make_mesh(shape)
    ep = mesh.axis_names[-1]
    make = lambda: GShard(16, 8, 32, 1.25, nnx.Rngs(0))  # noqa: E731
    model = parallelize(make, mesh, {"": ExpertParallel(ep)})
    assert model.w_in.get_value().placements[-1] == Shard(0)
    mse = lambda m, x, y: jnp.mean((m(x) - y) ** 2)  # noqa: E731
    step, ref = TrainStep(model, optax.sgd(0.5), mse), one_device_trainer(make(), optax.sgd(0.5), mse)
    rng = np.random.default_rng(3)
    data = (Shard(0),) * len(shape)  # the groups over every axis: each device routes its own
    for _ in range(3):
        x, y = (rng.normal(size=(8, 16, 16)).astype(np.float32) for _ in range(2))
        got = float(step(*(jshard.distribute(a, mesh, data) for a in (x, y))))
        assert got == pytest.approx(ref(x, y), rel=1e-5)
    ex = step.explain(*(jshard.distribute(a, mesh, data) for a in (x, y)))
    moved = {m[1] for r in ex.rows for m in r["moves"] if tuple(r["ins"][m[0]].shape) in {(8, 16, 32), (8, 32, 16)}}
    assert moved <= {"all_reduce"}, moved  # the weights never gathered (their gradients summed over dp)
    assert ex.totals["all_to_all"][0] >= 2  # the dispatch and the combine move tokens


def _ep_step(shape, ep):
    mesh = make_mesh(shape)
    styles, default = plan("ep", ep=ep)
    make = lambda: GPT(vocab=V, dim=D, heads=H, layers=L, seq=T, rngs=nnx.Rngs(0), experts=E, top_k=2,  # noqa: E731
                       balance=1e-2)
    return TrainStep(parallelize(make, mesh, styles, default=default), optax.adamw(1e-2), loss_fn), mesh


@pytest.fixture(scope="module")
def saved_under_ep4(tmp_path_factory):
    """A mixture GPT trained 2 steps with its experts 4 ways, saved, and the losses of its next 2 steps."""
    step, mesh = _ep_step((2, 4), "tp")
    run = batches(4)
    for ids, labels in run[:2]:
        step(*(jshard.distribute(a, mesh, (R, Shard(0))) for a in (ids, labels)))
    path = tmp_path_factory.mktemp("moe") / "ep4"
    jshard.checkpoint.save(path, step.state)
    return path, [float(step(*(jshard.distribute(a, mesh, (R, Shard(0))) for a in b))) for b in run[2:]]


@pytest.mark.parametrize("shape,ep", [((4, 2), "b"), pytest.param((8,), "x", marks=pytest.mark.slow), ((1,), "x")],
                         ids=["ep2", "ep8", "one-device"])
def test_a_state_saved_under_ep4_resumes_under_another_expert_split(saved_under_ep4, shape, ep):
    """The experts (and their optimizer moments, and the routing bias) saved split 4 ways are read into 2, 8 and 1
    ways, and training goes on with the losses it would have had."""
    path, want = saved_under_ep4
    resumed, mesh = _ep_step(shape, ep)
    resumed.state = jshard.checkpoint.restore(path, like=resumed.state)
    assert resumed.model.blocks[0].moe.w_up.get_value().spec.local_block_shape[0] == E // mesh.shape[ep]
    layout = tuple(Shard(0) if a == ep else R for a in mesh.axis_names) if mesh.size > 1 else (R,)
    got = [float(resumed(*(jshard.distribute(a, mesh, layout) for a in b))) for b in batches(4)[2:]]
    np.testing.assert_allclose(got, want, rtol=2e-5)


def test_autoplan_searches_an_expert_role():
    """autoplan offers ``ep`` where the model has mixtures: the experts split over the axis and the batch with them;
    the plan it builds keeps them there and trains like one device."""
    from jshard.parallel import autoplan

    mesh = make_mesh((2, 4))
    spec = jax.ShapeDtypeStruct((B, T), jnp.int32)
    found = autoplan(moe_gpt, mesh, loss_fn, spec, spec, styles=("dp", "ep"), runners_up=10)
    plans = {p.name: p for p in (found, *found.runners_up)}
    ep = plans["dp(dp)+ep(tp)"]
    assert ep.styles["blocks/*/moe"] == (ExpertParallel("tp"),) and ep.batch[0] == (Shard(0), Shard(0))
    assert ep.memory.params < plans["dp(dp)+dp(tp)"].memory.params  # a quarter of the experts a device
    step, ref = TrainStep(parallelize(moe_gpt, mesh, ep), optax.adamw(1e-2), loss_fn), one_device_trainer(
        moe_gpt(), optax.adamw(1e-2), loss_fn)
    for ids, labels in batches(2):
        got = float(step(*(jshard.distribute(a, mesh, ep.batch[i]) for i, a in enumerate((ids, labels)))))
        assert got == pytest.approx(ref(ids, labels), rel=1e-5)
    # a model without mixtures is offered no expert role
    dense = autoplan(lambda: GPT(V, D, H, 1, T, rngs=nnx.Rngs(0)), mesh, loss_fn, spec, spec, styles=("dp", "ep"))
    assert all("ep" not in p.roles.values() for p in (dense, *dense.runners_up))


def test_autoplan_plans_a_balanced_mixture_with_its_state():
    """A mixture carrying its balancing state (bias and load, not parameters) is priced with that state as the step
    carries it, on a mesh and on a chip count, pipelines included; the pipelined expert plan found trains like one
    device."""
    from jshard.parallel import Hardware, autoplan

    mesh = make_mesh((2, 4))
    spec = jax.ShapeDtypeStruct((B, T), jnp.int32)
    found = autoplan(balanced_gpt, mesh, loss_fn, spec, spec, styles=("dp", "ep", "pp"), runners_up=20)
    plans = {p.name: p for p in (found, *found.runners_up)}
    assert "pp(dp)+ep(tp) m=2" in plans, sorted(plans)
    chips = autoplan(balanced_gpt, 8, loss_fn, spec, spec, styles=("fsdp", "ep", "pp"), hardware=Hardware.h100(),
                     runners_up=20)
    assert {"ep", "pp"} <= {r for p in (chips, *chips.runners_up) for r in p.roles.values()}
    plan = plans["pp(dp)+ep(tp) m=2"]
    tx = optax.adamw(1e-2)
    step, ref = TrainStep(parallelize(balanced_gpt, mesh, plan), tx, loss_fn), one_device_trainer(balanced_gpt(), tx,
                                                                                                   loss_fn)
    for ids, labels in batches(2):
        got = float(step(*(jshard.distribute(a, mesh, plan.batch[i]) for i, a in enumerate((ids, labels)))))
        assert got == pytest.approx(ref(ids, labels), rel=1e-5)


@pytest.mark.slow
def test_expert_parallelism_beside_context_parallelism_trains_like_one_device():
    mesh = make_mesh((2, 4))
    styles, default = plan("cp+ep", cp="dp", ep="tp")
    layout = (styles[""].on(mesh).sequence(T, 2), Shard(0))  # the sequence over cp, the batch over ep
    step = TrainStep(parallelize(moe_gpt, mesh, styles, default=default), optax.adamw(1e-2), loss_fn)
    ref = one_device_trainer(moe_gpt(), optax.adamw(1e-2), loss_fn)
    for ids, labels in batches(2):
        got = float(step(*(jshard.distribute(a, mesh, layout) for a in (ids, labels))))
        assert got == pytest.approx(ref(ids, labels), rel=1e-5)


def test_expert_tensor_parallel_splits_the_hidden_dim_beside_the_expert_split():
    mesh = make_mesh((2, 4))
    styles, default = plan("ep+tp", ep="dp", tp="tp")
    model = parallelize(moe_gpt, mesh, styles, default=default)
    moe = model.blocks[0].moe
    assert moe.w_up.get_value().placements == (Shard(0), Shard(2)) == moe.w_gate.get_value().placements
    assert moe.w_down.get_value().placements == (Shard(0), Shard(1))
    step = TrainStep(model, optax.sgd(0.1), loss_fn)
    ex = step.explain(*(jshard.distribute(a, mesh, (Shard(0), R)) for a in batches(1)[0]))
    experts = {tuple(v.get_value().shape) for v in (moe.w_up, moe.w_down)}
    assert not [m for r in ex.rows for m in r["moves"] if tuple(r["ins"][m[0]].shape) in experts]
    units = [r for r in ex.rows if r["primitive"] == "jshard.experts_fwd"]
    assert units and all(r["outs"][0].placements[1].is_partial for r in units)  # a partial sum over tp

    class Unnamed(nnx.Module):  # one weight each way, and names that do not say which is which
        def __init__(self):
            self.a, self.b = nnx.Param(np.zeros((8, 4, 6))), nnx.Param(np.zeros((8, 6, 4)))

    class Named(Unnamed):
        def __init__(self):
            self.w1, self.w2 = nnx.Param(np.zeros((8, 4, 6))), nnx.Param(np.zeros((8, 6, 4)))

    assert ExpertTensorParallel("tp").param(Named(), "w2", (8, 6, 4)) == Shard(1)  # torchtitan's names
    assert ExpertTensorParallel("tp").param(Named(), "w1", (8, 4, 6)) == Shard(2)
    with pytest.raises(UnplacedParameter, match=r"name says which weight comes out of the hidden dim"):
        ExpertTensorParallel("tp").param(Unnamed(), "b", (8, 6, 4))
