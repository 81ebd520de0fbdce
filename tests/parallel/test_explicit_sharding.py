"""Models written for JAX's explicit sharding (Flax's Gemma example: parameters annotated ``out_sharding``, calls
made with ``out_sharding=``) build, run and train under jshard with the mesh ``parallelize`` is given, without the
user's ``jax.set_mesh``: the annotations are the plan, the calls' ``out_sharding=`` are pins, and a loss written in
plain JAX needs no annotations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from modules import ExplicitGemma

import jshard
from conftest import make_mesh
from jshard import Replicate, Shard
from jshard.gpt import one_device_trainer
from jshard.parallel import TrainStep, parallelize, placements_of
from jshard.validate.tolerance import assert_within_ulps, curve_ratio
from oracle import assert_close, tree_scale

R = Replicate()
B, T, V = 8, 16, 64
N = 4000  # summed terms per step along the longest chain: two blocks of width 32, 64 hidden, 16 tokens, 64 words


def loss_fn(model, ids, labels):  # plain JAX: a gather on the logits, no annotation
    logp = jax.nn.log_softmax(model(ids), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def batches(n):
    rng = np.random.default_rng(0)
    return [(ids, np.roll(ids, -1, 1)) for ids in (rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(n))]


def test_the_annotations_are_the_plan_and_need_no_set_mesh():
    mesh = make_mesh((2, 4))
    assert jax.sharding.get_abstract_mesh().empty
    model = parallelize(lambda: ExplicitGemma(rngs=nnx.Rngs(0)), mesh)
    assert jax.sharding.get_abstract_mesh().empty  # the mesh was JAX's only while the model was built
    block = model.blocks[0]
    assert block.q.kernel.get_value().placements == (Shard(1), Shard(0))       # P(tp, dp, None)
    assert block.kv.kernel.get_value().placements == (Shard(2), Shard(1))      # P(None, tp, dp, None)
    assert block.down.kernel.get_value().placements == (Shard(1), Shard(0))    # P(tp, dp)
    assert model.embed.embedding.get_value().placements == (Shard(1), Shard(0))
    assert block.pre_attn.scale.get_value().placements == (R, Shard(0))
    # the values are those of the same model built on one device
    plain = ExplicitGemma(sharded=False, rngs=nnx.Rngs(0))
    for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(plain, nnx.Param)),
                         strict=True):
        assert_within_ulps(np.asarray(got), np.asarray(want))  # the sharded initialisers' few ulps (design.md)


def test_out_sharding_calls_are_pins_under_jshard_jit():
    mesh = make_mesh((2, 4))
    model = parallelize(lambda: ExplicitGemma(rngs=nnx.Rngs(0)), mesh)
    ids = jshard.distribute(batches(1)[0][0], mesh, (Shard(0), R))
    forward = jshard.jit(lambda m, ids: m(ids))
    logits = forward(model, ids)
    plain = ExplicitGemma(sharded=False, rngs=nnx.Rngs(0))
    assert_close(logits.full(), plain(batches(1)[0][0]), n=N)
    pinned = [r["outs"][0] for r in forward.explain(model, ids).rows if r["primitive"] == "jshard_constrain"]
    # q's out_sharding=P(dp, None, tp, None) on [batch, seq, heads, head_dim]: batch on dp, heads on tp
    assert any(s.shape == (B, T, 8, 4) and s.placements == (Shard(0), Shard(2)) for s in pinned)
    assert logits.placements == (Shard(0), Shard(2))  # attend's out_sharding: vocabulary on tp


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8), (1, 1)], ids=["2x4", "1x8", "1x1"])
def test_a_gemma_shaped_explicit_model_trains_like_one_device(mesh_shape):
    mesh = make_mesh(mesh_shape)
    tx = optax.adamw(1e-2, eps=1e-4)
    step = TrainStep(parallelize(lambda: ExplicitGemma(rngs=nnx.Rngs(0)), mesh), tx, loss_fn)
    before = placements_of(nnx.state(step.model, nnx.Param))
    ref = one_device_trainer(ExplicitGemma(sharded=False, rngs=nnx.Rngs(0)), tx, loss_fn)
    losses, want = [], []
    for ids, labels in batches(3):
        losses.append(float(step(*(jshard.distribute(a, mesh, (Shard(0), R)) for a in (ids, labels)))))
        want.append(ref(ids, labels))
    assert curve_ratio(losses, want, n_per_step=N) <= 1, (losses, want)
    assert placements_of(nnx.state(step.model, nnx.Param)) == before
    for got, w in zip(jax.tree.leaves(step.params), jax.tree.leaves(ref.params()), strict=True):
        assert_close(got.full(), w, n=N * 15, terms=tree_scale(ref.params()))


def test_the_users_own_set_mesh_still_works():
    mesh = make_mesh((2, 4))
    ids, labels = batches(1)[0]
    with jax.set_mesh(mesh):
        step = TrainStep(parallelize(lambda: ExplicitGemma(rngs=nnx.Rngs(0)), mesh), optax.sgd(0.1), loss_fn)
        got = float(step(*(jshard.distribute(a, mesh, (Shard(0), R)) for a in (ids, labels))))
    want = one_device_trainer(ExplicitGemma(sharded=False, rngs=nnx.Rngs(0)), optax.sgd(0.1), loss_fn)(ids, labels)
    assert got == pytest.approx(want, rel=1e-5)


def test_an_out_sharding_naming_an_axis_the_mesh_lacks_is_refused_by_name():
    mesh = make_mesh((2, 4))
    model = parallelize(lambda: ExplicitGemma(fsdp="data", tp="model", sharded=False, rngs=nnx.Rngs(0)), mesh)
    model.act["btd"] = jax.sharding.PartitionSpec("data", None, "model")  # written for another mesh
    ids = jshard.distribute(batches(1)[0][0], mesh, (Shard(0), R))
    with pytest.raises(ValueError, match=r"out_sharding=.*names mesh axis 'data', but the mesh is mesh\(dp=2, tp=4\)"):
        jshard.jit(lambda m, ids: m(ids))(model, ids)
