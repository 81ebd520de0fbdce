"""Scanned layers: blocks built by ``nnx.vmap`` (parameters ``(layers, ...)``) and run by ``nnx.scan``, as deep JAX
models keep their compile time flat. Every style places a stacked parameter as it places one layer's, the stack
dim whole; FSDP cuts inside each layer and gathers one layer per scan step; training matches one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from conftest import make_mesh
from jshard import Replicate, Shard, StridedShard
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import (
    ColwiseParallel,
    FullyShard,
    PipelineParallel,
    RowwiseParallel,
    SequenceParallel,
    TrainStep,
    autoplan,
    layout,
    parallelize,
    placements_of,
)
from jshard.validate.tolerance import curve_ratio
from oracle import assert_close, token_batches, train_alongside, tree_scale

R = Replicate()
V, D, H, L, T, B = 64, 32, 4, 3, 16, 8
N = summed_terms(V, D, L, T, B, steps=3)


def scanned():
    return GPT(vocab=V, dim=D, heads=H, layers=L, seq=T, rngs=nnx.Rngs(0), scan=True)


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def batches(n):
    return token_batches(n, V, B, T)


def test_flax_layers_read_past_their_stack():
    lin, gen = nnx.Linear(8, 32, rngs=nnx.Rngs(0)), nnx.LinearGeneral(8, (4, 2), rngs=nnx.Rngs(0))
    assert layout(lin, "kernel", (5, 8, 32)) == ("weight", (1,), (2,), 1)
    assert layout(lin, "bias", (5, 32)) == ("bias", (), (1,), 1)
    assert layout(gen, "kernel", (2, 5, 8, 4, 2)) == ("weight", (2,), (3, 4), 2)
    assert layout(nnx.LayerNorm(8, rngs=nnx.Rngs(0)), "scale", (5, 8)).stack == 1
    assert ColwiseParallel("tp").param(lin, "kernel", (5, 8, 32)) == Shard(2)
    assert RowwiseParallel("tp").param(lin, "kernel", (5, 8, 32)) == Shard(1)
    assert RowwiseParallel("tp").param(lin, "bias", (5, 32)) == R
    assert FullyShard("dp").param(lin, "kernel", (5, 8, 32)) == Shard(1)   # inside each layer, not across layers
    assert FullyShard("dp", dim=-1).param(lin, "bias", (5, 32)) == Shard(1)
    assert SequenceParallel("tp").param(lin, "kernel", (5, 8, 32)) == R


def test_every_style_places_a_stack_of_layers_as_one_layer():
    mesh = make_mesh((2, 4))
    styles, default = plan("fsdp+tp", scan=True)
    model = parallelize(scanned, mesh, styles, default=default)
    blocks = {"/".join(map(str, path)): v.placements for path, v in nnx.to_flat_state(nnx.state(model.blocks,
                                                                                           nnx.Param))}
    # the stack dim (0) is whole on every axis: a scan step reads its layer where it is
    assert all(p.dim != 0 for ps in blocks.values() for p in ps if p.is_shard), blocks
    assert blocks["q/kernel"] == (Shard(1), Shard(2)) and blocks["q/bias"] == (StridedShard(1, 4), Shard(1))
    assert blocks["down/kernel"] == (StridedShard(1, 4), Shard(1))  # FSDP inside the TP block, as for one layer
    assert blocks["ln1/scale"] == (Shard(1), R)
    assert model.blocks.q.kernel.get_value().shape == (L, D, D)


@pytest.mark.parametrize("mesh_shape,style", [((2, 4), "fsdp+tp"), ((2, 4), "sp"), ((1, 8), "tp"), ((8,), "fsdp"),
                                              ((1,), "tp"), ((2, 4), "dp+cp")])
def test_a_scanned_model_trains_like_one_device(mesh_shape, style):
    mesh = make_mesh(mesh_shape)
    names = mesh.axis_names
    styles, default = plan(style, dp=names[0], tp=names[-1], cp=names[-1], scan=True)
    model = parallelize(scanned, mesh, styles, default=default)
    before = placements_of(nnx.state(model, nnx.Param))
    tx = optax.adamw(1e-2, eps=1e-4)
    step, ref = TrainStep(model, tx, loss_fn), one_device_trainer(scanned(), tx, loss_fn)
    if "cp" in style:
        data = (Shard(0), styles[""].on(mesh).sequence(T, mesh.shape[names[-1]]))
    else:
        data = (Shard(0),) + (R,) * (len(mesh_shape) - 1)
    losses, want = train_alongside(step, ref, mesh, data, batches(3))
    assert curve_ratio(losses, want, n_per_step=N // 3) <= 1, (losses, want)
    assert placements_of(nnx.state(step.model, nnx.Param)) == before
    got, ref_params = nnx.state(step.model, nnx.Param), ref.params()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True):
        assert g.shape == w.shape
        assert_close(g.full(), w, n=N * 5, terms=tree_scale(ref_params))


def test_fsdp_gathers_one_layer_per_scan_step():
    mesh = make_mesh((8,))
    styles, default = plan("fsdp", dp="x", scan=True)
    model = parallelize(scanned, mesh, styles, default=default)
    step = TrainStep(model, optax.sgd(0.1), loss_fn)
    ids, labels = batches(1)[0]
    ex = step.explain(*(jshard.distribute(a, mesh, (Shard(0),)) for a in (ids, labels)))
    stacked = {tuple(v.shape) for v in jax.tree.leaves(nnx.state(model.blocks, nnx.Param))}
    gathered = [(r["primitive"], r["ins"][m[0]].shape) for r in ex.rows for m in r["moves"] if m[1] == "all_gather"]
    in_loop = [shape for where, shape in gathered if "scan body" in where]
    # the blocks' parameters are gathered inside the scan, a layer at a time, and never whole as a stack
    assert len(in_loop) >= len(stacked)
    assert not [shape for _, shape in gathered if tuple(shape) in stacked]
    assert ex.per_call["all_gather"][0] >= L * len(stacked)


def test_a_users_scan_over_layers_model_takes_styles_by_path():
    """The pattern of Flax's ``nnx_toy_examples/06_scan_over_layers.py``: blocks made by ``nnx.split_rngs`` and
    ``nnx.vmap``, run by ``nnx.scan``; styles name the layers inside the stack as for one block."""

    class Block(nnx.Module):
        def __init__(self, dim, rngs):
            self.norm = nnx.LayerNorm(dim, rngs=rngs)
            self.up, self.down = nnx.Linear(dim, 4 * dim, rngs=rngs), nnx.Linear(4 * dim, dim, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.gelu(self.up(self.norm(x))))

    class ScanMLP(nnx.Module):
        def __init__(self, dim, n_layers, rngs):
            @nnx.split_rngs(splits=n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create_block(rngs):
                return Block(dim, rngs)

            self.layers = create_block(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x, block):
                return block(x)

            return forward(x, self.layers)

    mesh = make_mesh((2, 4))
    make = lambda: ScanMLP(16, 4, nnx.Rngs(0))
    model = parallelize(make, mesh, {"layers/up": ColwiseParallel("tp"), "layers/down": RowwiseParallel("tp")},
                        default=FullyShard("dp"))
    assert model.layers.down.bias.get_value().placements == (Shard(1), R)
    mse = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
    step, ref = TrainStep(model, optax.sgd(0.1), mse), one_device_trainer(make(), optax.sgd(0.1), mse)
    rng = np.random.default_rng(1)
    for _ in range(2):
        x, y = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
        got = float(step(*(jshard.distribute(a, mesh, (Shard(0), R)) for a in (x, y))))
        assert got == pytest.approx(ref(x, y), rel=1e-5)


def test_autoplan_plans_a_scanned_model():
    mesh = make_mesh((2, 4))
    spec = jax.ShapeDtypeStruct((B, T), jnp.int32)
    found = autoplan(scanned, mesh, loss_fn, spec, spec, styles=("dp", "fsdp", "tp"), runners_up=30)
    # tensor parallelism reads the layers inside the scan: the stacked q is column parallel, o row parallel
    tp = next(p for p in (found, *found.runners_up) if p.roles == {"dp": "dp", "tp": "tp"})
    assert isinstance(tp.styles["blocks/q"][0], ColwiseParallel) and isinstance(tp.styles["blocks/o"][0],
                                                                                 RowwiseParallel)
    model = parallelize(scanned, mesh, tp)
    assert model.blocks.q.kernel.get_value().placements[1] == Shard(2)
    step, ref = TrainStep(model, optax.adamw(1e-2), loss_fn), one_device_trainer(scanned(), optax.adamw(1e-2), loss_fn)
    for ids, labels in batches(2):
        got = float(step(*(jshard.distribute(a, mesh, tp.batch[i]) for i, a in enumerate((ids, labels)))))
        assert got == pytest.approx(ref(ids, labels), rel=1e-5)


def four_layers():
    return GPT(vocab=V, dim=D, heads=H, layers=4, seq=T, rngs=nnx.Rngs(0), scan=True)


@pytest.mark.parametrize("mesh_shape,style,schedule,virtual", [
    ((2, 4), "pp+tp", "1f1b", 1), pytest.param((2, 4), "pp+fsdp", "interleaved", 2, marks=pytest.mark.slow),
    pytest.param((1, 8), "pp+tp", "gpipe", 1, marks=pytest.mark.slow), ((1,), "pp", "1f1b", 1)])
def test_a_pipelined_stack_of_layers_trains_like_one_device(mesh_shape, style, schedule, virtual):
    """PipelineParallel matched on the module nnx.vmap built: its layer dim is split into stages, the model's own
    nnx.scan is cut into what comes before, the layer and the tail, and the step runs by the schedule."""
    mesh = make_mesh(mesh_shape)
    names = mesh.axis_names
    styles, default = plan(style, pp=names[0], dp=names[-1], tp=names[-1], microbatches=2, schedule=schedule,
                           virtual_stages=virtual, scan=True)
    model = parallelize(four_layers, mesh, styles, default=default)
    kernel = model.blocks.q.kernel.get_value()
    assert kernel.shape == (4, D, D) and kernel.placements[0] == (Shard(0) if virtual == 1 else StridedShard(0, 2))
    assert model.blocks.q.kernel.get_value() is kernel  # the stacked module stays where it was, paths unchanged
    tx = optax.adamw(1e-2, eps=1e-4)
    step, ref = TrainStep(model, tx, loss_fn), one_device_trainer(four_layers(), tx, loss_fn)
    data = (R,) * len(mesh_shape) if "fsdp" not in style else (R, Shard(0))
    losses, want = train_alongside(step, ref, mesh, data, batches(3))
    n = summed_terms(V, D, 4, T, B, steps=3)
    assert curve_ratio(losses, want, n_per_step=n // 3) <= 1, (losses, want)
    got, ref_params = nnx.state(step.model, nnx.Param), ref.params()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True):
        assert_close(g.full(), w, n=n * 5, terms=tree_scale(ref_params))
    if mesh_shape == (2, 4):  # called outside the step, the model runs its scan over the split stack
        ids = batches(1)[0][0]
        assert_close(step.model(ids).full(), nnx.merge(nnx.graphdef(four_layers()), ref.params())(ids), n=n * 5)


@pytest.mark.slow  # 17 s in each release's suite; uneven stages are trained by default in test_pipeline
def test_a_stack_the_stages_do_not_divide_trains_like_one_device():
    """Five scanned layers over two stages (3 and 2, the padding row idle), the stack split unevenly as it stands."""
    def five_layers():
        return GPT(vocab=V, dim=D, heads=H, layers=5, seq=T, rngs=nnx.Rngs(0), scan=True)

    mesh = make_mesh((2, 4))
    names = mesh.axis_names
    styles, default = plan("pp+tp", pp=names[0], tp=names[-1], microbatches=2, scan=True)
    model = parallelize(five_layers, mesh, styles, default=default)
    kernel = model.blocks.q.kernel.get_value()
    assert kernel.shape == (5, D, D) and kernel.spec.local_block_shape[0] == 3
    tx = optax.adamw(1e-2, eps=1e-4)
    step, ref = TrainStep(model, tx, loss_fn), one_device_trainer(five_layers(), tx, loss_fn)
    losses, want = train_alongside(step, ref, mesh, (R, R), batches(3))
    n = summed_terms(V, D, 5, T, B, steps=3)
    assert curve_ratio(losses, want, n_per_step=n // 3) <= 1, (losses, want)
    for g, w in zip(jax.tree.leaves(nnx.state(step.model, nnx.Param)), jax.tree.leaves(ref.params()), strict=True):
        assert_close(g.full(), w, n=n * 5, terms=tree_scale(ref.params()))


def test_a_pipelined_stack_is_refused_where_its_scan_is_not_a_chain_of_layers():
    """The scan over the stack must carry the activation alone: a per-layer input (here the batch's mask) or a
    module that is no stack is refused naming what to change."""

    class Masked(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return nnx.Linear(8, 8, rngs=rngs)

            self.layers = make(rngs)

        def __call__(self, x, mask):
            body = nnx.scan(lambda x, layer: layer(x) * mask, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            return body(x, self.layers)

    mesh = make_mesh((2, 4))
    model = parallelize(lambda: Masked(nnx.Rngs(0)), mesh, {"layers": PipelineParallel("dp", microbatches=2)})
    step = TrainStep(model, optax.sgd(0.1), lambda m, x, mask: jnp.mean(m(x, mask) ** 2))
    x = jshard.distribute(np.ones((4, 8), np.float32), mesh, (R, R))
    with pytest.raises(ValueError, match=r"the layers read a value computed from the batch .* a pipelined layer takes "
                                         r"only the activation it carries"):
        step(x, x)
    with pytest.raises(ValueError, match=r"match it on a list of identical blocks .* or on a module stacking its "
                                         r"layers"):
        parallelize(lambda: GPT(V, D, H, 2, T, nnx.Rngs(0)), mesh, {"head": PipelineParallel("dp")})
    # a scanned mixture's balancing state: carried through a pipeline of listed blocks, refused by name here
    balanced = lambda: GPT(V, D, H, 2, T, nnx.Rngs(0), scan=True, experts=4, balance=1e-2)  # noqa: E731
    with pytest.raises(ValueError, match=r"hold state besides parameters \(Balance.*a stack run by nnx.scan does not "
                                         r"carry through a pipeline.*nnx.List"):
        parallelize(balanced, mesh, {"blocks": PipelineParallel("dp", microbatches=2)})
