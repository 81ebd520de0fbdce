"""``jshard.parallel`` on a Flax NNX GPT: placements by style, values and training against one device."""

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from conftest import make_mesh, mesh_params
from jshard import Replicate, Shard, StridedShard
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import (
    ColwiseParallel,
    DataParallel,
    FullyShard,
    ParallelStyle,
    RowwiseParallel,
    TrainStep,
    init_optimizer,
    layout,
    parallelize,
    placements_of,
)
from jshard.validate.tolerance import curve_ratio
from oracle import assert_close, stablehlo_collectives, tree_scale

R = Replicate()
V, D, H, L, T, B = 48, 16, 4, 2, 8, 4  # heads divisible by tp=4: attention stays head-parallel
N = summed_terms(V, D, L, T, B)  # a step's summation chain: what float differences from one device scale with


def gpt():
    return GPT(V, D, H, L, T, rngs=nnx.Rngs(0))


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)).astype(np.int32), rng.integers(0, V, (B, T)).astype(np.int32)


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def test_styles_place_parameters_per_mesh_axis():
    mesh = make_mesh((2, 4))
    p, _ = plan("tp")
    model = parallelize(gpt(), mesh, p, default=FullyShard("dp"))
    blk = model.blocks[0]
    assert blk.q.kernel.get_value().placements == (Shard(0), Shard(1))  # rows over dp (FSDP), columns over tp
    # where FSDP and TP cut the same dim, FSDP cuts inside each TP block (torch FSDP2 + TP, GSPMD's ('tp', 'dp'))
    assert blk.q.bias.get_value().placements == (StridedShard(0, 4), Shard(0))
    assert blk.o.kernel.get_value().placements == (StridedShard(0, 4), Shard(0))  # row parallel
    assert blk.o.bias.get_value().placements == (Shard(0), R)  # added once, after the reduction
    assert blk.ln1.scale.get_value().placements == (Shard(0), R)
    assert model.head.kernel.get_value().placements == (Shard(0), Shard(1))
    want = np.asarray(gpt().blocks[0].q.kernel[...])
    np.testing.assert_array_equal(np.asarray(blk.q.kernel.get_value().full()), want)
    flat = jax.tree.leaves(placements_of(nnx.state(model)), is_leaf=lambda a: isinstance(a, tuple))
    assert len(flat) == len(jax.tree.leaves(nnx.state(gpt())))  # every parameter is a DArray


def test_fsdp_inside_tp_gathers_and_reduce_scatters_with_one_collective_each():
    """FSDP x TP: each FSDP gather is one all-gather over dp of the TP block, each FSDP gradient one
    reduce-scatter over dp; nothing is exchanged point to point, and the losses are the one-device ones."""
    mesh = make_mesh((2, 4))
    p, _ = plan("tp")
    model = parallelize(gpt(), mesh, p, default=FullyShard("dp"))
    step = TrainStep(model, optax.sgd(0.1), loss_fn)
    ids, labels = batch()
    data = [jshard.distribute(a, mesh, [Shard(0), R]) for a in (ids, labels)]
    moves = [(kind, tuple(axes)) for r in step.explain(*data).rows for _, kind, axes, _ in r["moves"]]
    assert not [m for m in moves if m[0] == "exchange"], moves
    assert ("all_gather", ("dp",)) in moves and ("reduce_scatter", ("dp",)) in moves
    assert all(axes == ("dp",) for kind, axes in moves if kind == "all_gather" and "dp" in axes)
    reference = one_device_trainer(gpt(), optax.sgd(0.1), loss_fn)
    ours = [float(step(*data)) for _ in range(2)]
    theirs = [reference(jnp.asarray(ids), jnp.asarray(labels)) for _ in range(2)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_a_module_own_style_replaces_the_default_on_its_axis():
    """``default=FullyShard("dp")`` with ``{"blocks/0*": DataParallel("dp")}``: block 0 keeps its parameters
    replicated on dp (never gathered), every other module is sharded there, and the step trains as one device."""
    mesh = make_mesh((2, 4))
    p, _ = plan("tp")
    model = parallelize(gpt(), mesh, {**p, "blocks/0*": DataParallel("dp")}, default=FullyShard("dp"))
    assert model.blocks[0].q.kernel.get_value().placements == (R, Shard(1))
    assert model.blocks[0].ln1.scale.get_value().placements == (R, R)
    assert model.blocks[1].q.kernel.get_value().placements == (Shard(0), Shard(1))
    assert model.tok.embedding.get_value().placements[0] != R  # FSDP inside the vocabulary split
    step = TrainStep(model, optax.sgd(0.1), loss_fn)
    ids, labels = batch()
    data = [jshard.distribute(a, mesh, [Shard(0), R]) for a in (ids, labels)]
    reference = one_device_trainer(gpt(), optax.sgd(0.1), loss_fn)
    ours = [float(step(*data)) for _ in range(2)]
    theirs = [reference(jnp.asarray(ids), jnp.asarray(labels)) for _ in range(2)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    with pytest.raises(ValueError, match=r"FullyShard.* and DataParallel.* both place default= on mesh axis 'dp'"):
        parallelize(gpt(), mesh, default=(FullyShard("dp"), DataParallel("dp")))
    with pytest.raises(ValueError, match=r"at default= names mesh axis 'model', but the mesh is mesh\(dp=2, tp=4\)"):
        parallelize(gpt(), mesh, default=FullyShard("model"))


@pytest.mark.parametrize("units,collectives", [("blocks", L), ("root and one block", 2),
                                               ("blocks, each other module by default", L + 4)])
def test_fully_shard_on_a_module_gathers_every_parameter_inside_it_together(units, collectives):
    """torch's fully_shard(block): a FullyShard matched on a module without parameters of its own shards every
    parameter inside it that no nearer FullyShard takes, and gathers them together when the module runs (one
    all-gather a unit); TP styles inside keep their axis, with FSDP cutting inside each TP block. Kernels are
    priced free, so that a unit of two small parameters shares one too (whether that pays is test_redistribute's)."""
    mesh = make_mesh((2, 4))
    p, _ = plan("tp")
    blocks = {f"blocks/{i}": FullyShard("dp") for i in range(L)}
    fsdp = {"": FullyShard("dp"), "blocks/1": FullyShard("dp")} if units == "root and one block" else blocks
    default = FullyShard("dp") if "default" in units else ()
    model = parallelize(gpt(), mesh, {**p, **fsdp}, default=default)
    blk = model.blocks[0]
    assert blk.q.kernel.get_value().placements == (Shard(0), Shard(1))
    assert blk.q.bias.get_value().placements == (StridedShard(0, 4), Shard(0))
    assert blk.ln1.scale.get_value().placements == (Shard(0), R)
    head = model.head.kernel.get_value().placements
    assert head == ((R, Shard(1)) if units == "blocks" else (Shard(0), Shard(1)))  # tok, pos, ln, head: no unit
    step = TrainStep(model, optax.sgd(0.1), loss_fn, cost_model=jshard.CostModel(kernel_us=0.0))
    ids, labels = batch()
    data = [jshard.distribute(a, mesh, [Shard(0), R]) for a in (ids, labels)]
    ex = step.explain(*data)
    moves = [(m, shared) for r in ex.rows for m, shared in zip(r["moves"], r["shared"]) if m[1] == "all_gather"]
    assert sum(m[2] == ("dp",) for m, _ in moves) > collectives  # the parameters' gathers share their unit's
    assert ex.totals["all_gather"][0] == sum(m[2] != ("dp",) for m, _ in moves) + collectives  # one a unit
    reference = one_device_trainer(gpt(), optax.sgd(0.1), loss_fn)
    ours = [float(step(*data)) for _ in range(2)]
    theirs = [reference(jnp.asarray(ids), jnp.asarray(labels)) for _ in range(2)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_default_fully_shard_of_a_module_never_called_gathers_where_its_parameters_are_used():
    # only a FullyShard matched on a module that is never called is refused: as a default, such a module's
    # parameters (held for a parent that reads them) are gathered where they are used, as before units
    class Scales(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(32.0).reshape(8, 4))

    class Holder(nnx.Module):
        def __init__(self):
            self.s = Scales()

        def __call__(self, x):
            return x @ self.s.w[...]

    mesh = make_mesh((8,))
    model = parallelize(Holder(), mesh, default=FullyShard(mesh.axis_names[0]))
    assert model.s.w.get_value().placements == (Shard(0),)
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(np.asarray(model(jnp.asarray(x)).full()), x @ np.arange(32.0).reshape(8, 4))


def test_mistakes_are_named():
    mesh = make_mesh((2, 4))
    with pytest.raises(ValueError, match=r"mesh axis 'model'.*mesh\(dp=2, tp=4\)"):
        parallelize(gpt(), mesh, {"head": ColwiseParallel("model")})
    with pytest.raises(ValueError, match=r"pattern\(s\) \['blocks/\*/mlp'\] match no module"):
        parallelize(gpt(), mesh, {"blocks/*/mlp": ColwiseParallel("tp")})
    with pytest.raises(ValueError, match="both place"):
        parallelize(gpt(), mesh, {"head": [ColwiseParallel("tp"), RowwiseParallel("tp")]})
    with pytest.raises(ValueError, match=r"FullyShard at blocks gathers .* List is called, and it is never called"):
        parallelize(gpt(), mesh, {"blocks": FullyShard("dp")})


def test_flax_sharding_annotations_become_placements():
    mesh = make_mesh((2, 4))
    init = nnx.initializers.lecun_normal()
    with nnx.use_eager_sharding(False):
        named = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, (None, "tp")))
        logical = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
    assert parallelize(named, mesh).kernel.get_value().placements == (R, Shard(1))
    out = parallelize(logical, mesh, rules=[("embed", "dp"), ("mlp", "tp")])
    assert out.kernel.get_value().placements == (Shard(0), Shard(1))
    with nnx.use_eager_sharding(False):
        again = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
    with pytest.raises(ValueError, match="'embed'.*neither a mesh axis"):
        parallelize(again, mesh)
    # a style overrides the annotation on its own axis only
    with nnx.use_eager_sharding(False):
        both = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, (None, "tp")))
    assert parallelize(both, mesh, default=FullyShard("dp")).kernel.get_value().placements == (Shard(0), Shard(1))


@pytest.mark.parametrize("mesh_shape,style", [((2, 4), "tp"), ((2, 4), "sp"), ((2, 4), "fsdp"), ((2, 4), "dp"),
                                              ((8,), "tp"), ((2, 2, 2), "sp"), ((1, 8), "tp"), ((8, 1), "sp"),
                                              ((1,), "fsdp"),
                                              pytest.param((1, 1), "tp", marks=pytest.mark.slow),
                                              pytest.param((2, 1, 4), "sp", marks=pytest.mark.slow)])
def test_loss_and_gradients_match_one_device(mesh_shape, style):
    mesh = make_mesh(mesh_shape)
    dp, tp = mesh.axis_names[0], mesh.axis_names[-1]
    p, default = plan(style, dp=dp, tp=tp)
    model = parallelize(gpt(), mesh, p, default=default)
    ids, labels = batch()
    data = tuple(Shard(0) if a != tp or len(mesh_shape) == 1 and style in ("dp", "fsdp") else R
                 for a in mesh.axis_names)
    args = [jshard.distribute(a, mesh, data) for a in (ids, labels)]
    ref = gpt()
    loss = jshard.jit(loss_fn, out_placements=(R,) * len(mesh_shape))(model, *args)
    assert_close(loss.full(), loss_fn(ref, ids, labels), n=N)
    grads = jshard.jit(nnx.grad(loss_fn))(model, *args)
    want = nnx.grad(loss_fn)(ref, ids, labels)
    for g, w in zip(jax.tree.leaves(grads, is_leaf=lambda a: isinstance(a, jshard.DArray)), jax.tree.leaves(want)):
        assert_close(g.full(), w, n=N, terms=tree_scale(want))


@pytest.mark.parametrize("style,kind", [("tp", "all_reduce"), ("sp", "reduce_scatter")])
def test_row_parallel_outputs_reduce_once_per_attention_and_mlp(style, kind):
    mesh = make_mesh((2, 4))
    p, _ = plan(style)
    model = parallelize(gpt(), mesh, p)
    ids, _ = batch()
    x = jshard.distribute(ids, mesh, (Shard(0), R))
    ex = jshard.explain(lambda m, x: m(x), model, x)
    # the partial outputs of the vocabulary-parallel embedding, o and down, (batch, seq, features) Partial(sum)
    # on tp, are reduced by one collective each
    outs = [m for r in ex.rows for m in r["moves"] if m[1] == kind and m[2] == ("tp",)
            and r["ins"][m[0]].shape == (B, T, D)]
    assert len(outs) == 2 * L + 1
    if style == "tp":  # and nothing else in the forward pass communicates (Megatron's count)
        assert len([m for r in ex.rows for m in r["moves"]]) == 2 * L + 1
        lowered = jshard.jit(lambda m, x: m(x)).lower(model, x).as_text()
        assert stablehlo_collectives(lowered) == {"all_reduce": 2 * L + 1}


def _reference_training(tx, steps):
    step = one_device_trainer(gpt(), tx, loss_fn)
    return [step(*batch(i)) for i in range(steps)], step.params()


@pytest.mark.parametrize("style", ["tp", pytest.param("sp", marks=pytest.mark.slow), "fsdp",
                                   pytest.param("dp", marks=pytest.mark.slow)])  # every style's gradients: above
def test_training_matches_one_device_and_keeps_placements(style):
    mesh = make_mesh((2, 4))
    p, default = plan(style)
    model = parallelize(gpt(), mesh, p, default=default)
    before = placements_of(nnx.state(model, nnx.Param))
    tx = optax.adamw(1e-2, eps=1e-4)  # the key bias's gradient is 0 up to rounding: Adam must not amplify it
    step = TrainStep(model, tx, loss_fn)
    losses = []
    for i in range(4):
        ids, labels = batch(i)
        losses.append(float(step(*(jshard.distribute(a, mesh, (Shard(0), R)) for a in (ids, labels)))))
    want, want_params = _reference_training(tx, 4)
    assert curve_ratio(losses, want, n_per_step=N) <= 1, (losses, want)
    assert losses[-1] < losses[0]
    assert placements_of(nnx.state(step.model, nnx.Param)) == before
    mu = step.opt_state[0].mu  # adamw: (ScaleByAdamState(count, mu, nu), ...)
    assert placements_of(mu) == placements_of(step.params)
    for got, w in zip(jax.tree.leaves(step.params, is_leaf=lambda a: isinstance(a, jshard.DArray)),
                      jax.tree.leaves(want_params)):
        assert_close(got.full(), w, n=N * 5, terms=tree_scale(want_params))


def test_optimizer_state_mirrors_parameter_placements():
    mesh = make_mesh((2, 4))
    model = parallelize(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), mesh, {"": ColwiseParallel("tp")},
                        default=FullyShard("dp"))
    params = nnx.state(model, nnx.Param)
    state = init_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), params)
    adam = state[1][0]
    assert placements_of(adam.mu) == placements_of(params) == placements_of(adam.nu)
    assert adam.count.placements == (R, R)
    assert float(jnp.abs(adam.mu["kernel"].get_value().full()).max()) == 0.0


def test_sequence_parallel_keeps_norms_sequence_sharded():
    mesh = make_mesh((2, 4))
    p, _ = plan("sp")
    model = parallelize(gpt(), mesh, p)
    x = jshard.distribute(batch()[0], mesh, (Shard(0), R))
    ex = jshard.explain(lambda m, x: m(x), model, x)
    norms = [r for r in ex.rows if "layer_norm" in r["source"] or "normalization" in r["source"]]
    acts = [o for r in norms for o in r["outs"] if o.shape[:2] == (B, T)]  # not the (1, 1, D) scale and bias
    assert len(acts) > 10 * L and all(o.placements == (Shard(0), Shard(1)) for o in acts)
    assert not [m for r in norms for m in r["moves"]]  # the norms themselves never communicate


def test_sequence_parallel_backward_keeps_the_mlp_hidden_dim_sharded():
    # down's input gradient is computed from the all-gathered output gradient, so it comes out sharded on the
    # hidden dim like the GELU's saved inputs; the greedy per-equation choice gathered down's weight instead and
    # moved every GELU intermediate (batch, seq, 4 * features) with an all-to-all (the planner's look-ahead)
    mesh = make_mesh((2, 4))
    p, _ = plan("sp")
    model = parallelize(gpt(), mesh, p)
    args = [jshard.distribute(a, mesh, (Shard(0), R)) for a in batch()]
    ex = jshard.explain(nnx.grad(loss_fn), model, *args)
    hidden = [(r["source"], m[1]) for r in ex.rows for m in r["moves"] if r["ins"][m[0]].shape == (B, T, 4 * D)]
    assert hidden == []


def test_tensor_parallel_backward_reduces_once_per_attention_and_mlp():
    # forward: o and down all-reduce; backward: the residual gradient is all-reduced once at each of them
    # (q/k/v input gradients are summed while Partial, never reduced one by one)
    mesh = make_mesh((2, 4))
    p, _ = plan("tp")
    model = parallelize(gpt(), mesh, p)
    ids, labels = batch()
    args = [jshard.distribute(a, mesh, (Shard(0), R)) for a in (ids, labels)]
    ex = jshard.explain(nnx.grad(loss_fn), model, *args)
    blocks = [m for r in ex.rows if ("Block.__call__" in r["source"] or "linear.py" in r["source"])
              and not any(V in s.shape for s in r["ins"])  # the head and the loss are another matter
              for m in r["moves"] if "tp" in m[2]]
    assert [m[1] for m in blocks] == ["all_reduce"] * (4 * L)
    assert all(m[3] == B * T * D * 4 // 2 for m in blocks)  # (batch/dp, seq, features) float32 each


@pytest.mark.parametrize("style,kernel_us,want", [
    ("dp", 4.0, {"all_reduce": "params+1"}),  # one all-reduce per gradient, and the loss
    # the gradients' reduce-scatters, made together at the end, share one collective; a module's parameters are
    # gathered together, in one collective where packing them is free, one by one where it does not pay (a
    # module holds one or two parameters, and two small all-gathers over two devices do not by the default model)
    ("fsdp", 0.0, {"all_gather": "modules", "reduce_scatter": 1, "all_reduce": 1}),
    ("fsdp", 4.0, {"all_gather": "params", "reduce_scatter": 1, "all_reduce": 1}),
], ids=["dp", "fsdp-free-kernels", "fsdp"])
def test_a_training_step_moves_each_parameter_once(style, kernel_us, want):
    mesh = make_mesh((2, 4))
    p, default = plan(style)
    model = parallelize(gpt(), mesh, p, default=default)
    n = len(jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda a: isinstance(a, jshard.DArray)))
    modules = len({path[:-1] for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)})
    step = TrainStep(model, optax.adamw(1e-2), loss_fn, cost_model=jshard.CostModel(kernel_us=kernel_us))
    args = [jshard.distribute(a, mesh, (Shard(0), R)) for a in batch()]
    ex = step.explain(*args)
    counts = {k: c for k, (c, _) in ex.totals.items()}
    assert counts == {k: {"modules": modules, "params": n, "params+1": n + 1}.get(v, v) for k, v in want.items()}
    moves = [(m[1], shared) for r in ex.rows for m, shared in zip(r["moves"], r["shared"])]
    assert sum(shared for kind, shared in moves if kind == "reduce_scatter") == (n if style == "fsdp" else 0)
    lowered = stablehlo_collectives(step.lower(*args).as_text())
    assert {k: v for k, v in lowered.items() if v} == {k: v for k, v in counts.items() if k in lowered}


def test_vocabulary_parallel_embedding_looks_up_locally_and_reduces_once():
    mesh = make_mesh((2, 4))
    p, _ = plan("tp")
    model = parallelize(gpt(), mesh, {**p, "tok": RowwiseParallel("tp")})
    assert model.tok.embedding.get_value().placements == (R, Shard(0))  # rows of the vocabulary per device
    ids, labels = batch()
    args = [jshard.distribute(a, mesh, (Shard(0), R)) for a in (ids, labels)]
    ex = jshard.explain(lambda m, x: m.tok(x), model, args[0])
    assert [(m[1], m[2]) for r in ex.rows for m in r["moves"]] == [("all_reduce", ("tp",))]  # masked lookups summed
    loss = jshard.jit(loss_fn, out_placements=(R, R))(model, *args)
    assert_close(loss.full(), loss_fn(gpt(), ids, labels), n=N)
    grads = jshard.jit(nnx.grad(loss_fn))(model, *args)
    want = nnx.grad(loss_fn)(gpt(), ids, labels).tok.embedding.get_value()
    assert_close(grads.tok.embedding.get_value().full(), want, n=N)


def test_loss_parallel_cross_entropy_never_gathers_the_logits():
    # with a vocabulary large enough that moving logits costs more than reducing (batch, seq, 1) statistics,
    # the column-parallel head's logits stay sharded: max and exp-sum are reduced, the label's logit is a
    # masked local lookup
    mesh = make_mesh((2, 4))
    vocab = 4096
    make = lambda: GPT(vocab, D, H, 1, T, rngs=nnx.Rngs(0))
    model = parallelize(make(), mesh, plan("tp")[0])
    rng = np.random.default_rng(3)
    ids, labels = (rng.integers(0, vocab, (B, T)).astype(np.int32) for _ in range(2))
    args = [jshard.distribute(a, mesh, (Shard(0), R)) for a in (ids, labels)]
    for f in (loss_fn, nnx.grad(loss_fn)):
        rows = jshard.explain(f, model, *args).rows
        moves = [m for r in rows for m in r["moves"] if r["ins"][m[0]].shape == (B, T, vocab)]
        assert not [m for m in moves if m[1] in ("all_gather", "all_reduce")]
    loss = jshard.jit(loss_fn, out_placements=(R, R))(model, *args)
    assert_close(loss.full(), loss_fn(make(), ids, labels), n=summed_terms(vocab, D, 1, T, B))


@dataclass(frozen=True)
class FeaturesGathered(ParallelStyle):
    """A style defined here, not in jshard: ZeRO-3 over features. Each kernel and bias is stored cut on its first
    ``dim`` features ("outputs" or "inputs": a dim that is not an int, which only the styles defining an int one
    check), gathered while the module runs, the modules inside the one matched gathered together; every positional
    input and the output are batch-sharded."""

    axis: str = "dp"
    dim: str = "outputs"
    compute: ClassVar = R

    def param(self, module, name, shape):
        dims = getattr(layout(module, name, shape), self.dim, ())
        return Shard(dims[0]) if dims else R

    def inputs(self, args, kwargs):
        return tuple(Shard(0) for _ in args), {}

    def outputs(self, out):
        return Shard(0)


class Bilinear(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(4, 8, rngs=rngs)

    def __call__(self, x, y):
        return self.a(x) * self.b(y)


@pytest.mark.parametrize("mesh_shape", mesh_params([(2, 4), (1, 8), (1,)]))
@pytest.mark.parametrize("dim", ["outputs", "inputs"])
def test_a_style_defined_outside_jshard_carries_its_whole_behaviour(mesh_shape, dim):
    """A new style is one class: parallelize places its parameters, constrains both inputs and the output, and
    gathers the unit, with no edit to jshard; forward and gradients are one device's."""
    mesh = make_mesh(mesh_shape)
    axis = mesh.axis_names[0]
    model = parallelize(Bilinear(nnx.Rngs(0)), mesh, {"": FeaturesGathered(axis, dim=dim)})
    rest = (R,) * (len(mesh_shape) - 1)
    assert model.a.kernel.get_value().placements == (Shard(1 if dim == "outputs" else 0),) + rest
    assert model.b.bias.get_value().placements == ((Shard(0) if dim == "outputs" else R),) + rest
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    y = x[::-1] * 2
    rows = jshard.explain(lambda m, x, y: m(x, y), model, x, y).rows
    batch = (Shard(0) if mesh.shape[axis] > 1 else R,) + rest  # a size-1 axis holds values whole: R
    dots = [r["ins"][0].placements for r in rows if "Linear.__call__" in r["source"] and r["ins"][0].shape == (8, 4)]
    assert dots == [batch] * 2  # both inputs, not only the first, arrive batch-sharded
    gathers = [m for r in rows for m in r["moves"] if m[1] == "all_gather"]
    assert len(gathers) == (4 if dim == "outputs" else 2) * (mesh.shape[axis] > 1)  # every cut parameter, whole
    out = jshard.jit(lambda m, x, y: m(x, y))(model, x, y)
    assert out.placements == (Shard(0),) + rest
    plain = Bilinear(nnx.Rngs(0))
    assert_close(out.full(), plain(x, y), n=4)
    loss = lambda m, x, y: jnp.mean(m(x, y) ** 2)  # noqa: E731
    grads = jshard.jit(nnx.grad(loss))(model, x, y)
    want = nnx.grad(loss)(plain, x, y)
    for g, w in zip(jax.tree.leaves(grads, is_leaf=lambda a: isinstance(a, jshard.DArray)), jax.tree.leaves(want),
                    strict=True):
        assert_close(g.full(), w, n=4 + 64, terms=tree_scale(want))


def test_the_styles_an_error_offers_are_those_defined():
    with pytest.raises(TypeError, match=r"use one of ColwiseParallel, RowwiseParallel, SequenceParallel, "
                                        r"DataParallel, FullyShard, .*FeaturesGathered"):
        parallelize(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), make_mesh((2, 4)), {"": "gathered"})
