"""Size-1 mesh axes and one-device meshes, equal to one device through every entry point.

They are what users have: one GPU (a mesh of one device), a ``dp x tp`` configuration scaled down to one host
(``dp=1``), a configuration naming more axes than it splits. A size-1 axis holds the whole value whatever its
placement (one chunk, one part), so moving between placements that differ only there is free, and a program
whose gradient or plan names such an axis must run as on any other mesh. The meshes below are the matrix's
(``conftest.MESH_SHAPES``); the heavier cases are ``slow``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jshard
from conftest import make_mesh, mesh_params
from jshard import Partial, Replicate, Shard, StridedShard
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import (
    ColwiseParallel,
    DataParallel,
    FullyShard,
    RowwiseParallel,
    SequenceParallel,
    TrainStep,
    parallelize,
    placements_of,
)
from jshard.validate.tolerance import curve_ratio
from oracle import assert_close, check_darray, local_blocks

R = Replicate()
SIZE_ONE = [(1, 8), (8, 1), (2, 1, 4), (1,), (1, 1)]
DEFAULT = ((1, 8), (8, 1), (1,))
# every kind of placement, for a rank-2 value
EVERY = [R, Shard(0), Shard(1), StridedShard(0, 2), StridedShard(1, 3), Partial("sum"), Partial("avg"),
         Partial("max"), Partial("min")]


def size_one_axis(mesh_shape) -> int:
    return mesh_shape.index(1)


def around(mesh_shape, axis: int, p, others) -> tuple:
    """Placements with ``p`` on ``axis`` and ``others`` (a shard) on every other axis."""
    return tuple(p if a == axis else others for a in range(len(mesh_shape)))


@pytest.mark.parametrize("mesh_shape", mesh_params(SIZE_ONE, ((2, 1, 4), (1,))))
def test_every_placement_on_a_size_one_axis_moves_for_free(mesh_shape):
    """Every (src, dst) of every placement kind on the size-1 axis, next to shards on the others: the value on
    every device as one device has it, and no step spent on the size-1 axis (a relabel where nothing else
    changes)."""
    mesh, axis = make_mesh(mesh_shape), size_one_axis(mesh_shape)
    name = mesh.axis_names[axis]
    rng = np.random.default_rng(0)
    value = rng.integers(-30, 30, size=(6, 9)).astype(np.float32)
    for p in EVERY:
        src = around(mesh_shape, axis, p, Shard(1))
        x = jshard.from_local(local_blocks(value, mesh_shape, src, rng), mesh, src, shape=value.shape)
        check_darray(x, value)
        check_darray(jshard.distribute(value, mesh, src), value)
        for i, q in enumerate(EVERY):
            others = (Shard(1), Shard(0))[i % 2]  # every other target also moves the shards around it
            dst = around(mesh_shape, axis, q, others)
            plan = jshard.plan_redistribute(x, dst)
            assert not [s for s in plan.steps if name in s.axes], (str(plan), name)
            if others == Shard(1):
                assert plan.steps == (), str(plan)  # only the size-1 axis differs: a relabel
            y = x.redistribute(dst)
            assert y.placements == dst
            check_darray(y, value)


def rnn(h0, w, xs):
    def step(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum()

    return lax.scan(step, h0, xs)


def loop(h, w):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, h))[1]


def branch(h, w):
    return lax.cond(h.sum() > 0, lambda a: a @ w, lambda a: -a, h)


@pytest.mark.parametrize("mesh_shape", mesh_params(SIZE_ONE, DEFAULT))
def test_programs_gradients_and_control_flow_match_one_device(mesh_shape):
    """A gradient (whose moves name the size-1 axis: the crash of issue 37), scan / while / cond, and a donated
    argument, each against the same function on one device."""
    mesh, axis = make_mesh(mesh_shape), size_one_axis(mesh_shape)
    rng = np.random.default_rng(1)
    X, W = rng.normal(size=(8, 16)).astype(np.float32), (rng.normal(size=(16, 16)) * 0.3).astype(np.float32)
    XS = rng.normal(size=(5, 8, 16)).astype(np.float32)
    last = len(mesh_shape) - 1  # a tensor-parallel axis where the mesh has one (else the size-1 axis itself)
    x = jshard.distribute(X, mesh, tuple(Shard(0) if a == axis else R for a in range(len(mesh_shape))))
    w = jshard.distribute(W, mesh, tuple(Shard(1) if a == last else R for a in range(len(mesh_shape))))
    xs = jshard.distribute(XS, mesh, tuple(Shard(2) if a == last else R for a in range(len(mesh_shape))))

    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    g = jshard.jit(jax.grad(loss))(w, x)
    assert g.shape == W.shape
    assert_close(g.full(), jax.grad(loss)(W, X), n=16 + 8)

    h, ys = jshard.jit(rnn)(x, w, xs)
    want_h, want_ys = rnn(X, W, XS)
    assert isinstance(h, jshard.DArray) and (h.shape, ys.shape) == (want_h.shape, want_ys.shape)
    assert_close(h.full(), want_h, n=16 * 5)
    assert_close(ys.full(), want_ys, n=16 * 5 + 128)
    gw = jshard.jit(jax.grad(lambda w, x, xs: rnn(x, w, xs)[1].sum()))(w, x, xs)
    assert_close(gw.full(), jax.grad(lambda w: rnn(X, w, XS)[1].sum())(W), n=16 * 5 + 128)
    assert_close(jshard.jit(loop)(x, w).full(), loop(X, W), n=16 * 3)
    assert_close(jshard.jit(branch)(x, w).full(), branch(X, W), n=16)

    step = jshard.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x), out_placements=jshard.same_as(0),
                      donate_argnums=0)
    new = step(w, x)
    assert new.placements == tuple(w.spec.placements) and w.block.is_deleted()
    assert_close(new.full(), W - 0.1 * jax.grad(loss)(W, X), n=16 + 8)


def test_one_device_explain_and_visualize():
    mesh = make_mesh((1,))
    x = jshard.distribute(np.arange(12.0, dtype=np.float32).reshape(3, 4), mesh, [Shard(0)])
    ex = jshard.explain(lambda x: jnp.exp(x).sum(0), x)
    assert ex.totals == {}  # nothing communicates on one device
    table = jshard.visualize(x)
    assert table.splitlines()[0] == "f32[3,4] (S(0)) on mesh(x=1)" and "(3, 4)" in table
    y = jshard.distribute(np.ones((4, 6), np.float32), make_mesh((1, 8)), [Partial(), Shard(1)])
    assert "sum over dp" in jshard.visualize(y)
    assert jshard.explain(lambda y: y @ y.T, y).totals.keys() <= {"all_reduce"}  # only the tp contraction


V, D, H, L, T, B = 48, 16, 4, 2, 8, 4
N = summed_terms(V, D, L, T, B)


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


@pytest.mark.parametrize("mesh_shape,style", [
    ((1,), "dp"), ((1, 8), "tp"), pytest.param((8, 1), "tp", marks=pytest.mark.slow),
    pytest.param((1,), "fsdp", marks=pytest.mark.slow), pytest.param((1, 8), "sp", marks=pytest.mark.slow),
    pytest.param((1, 1), "tp", marks=pytest.mark.slow), pytest.param((1, 1), "sp", marks=pytest.mark.slow),
    pytest.param((2, 1, 4), "tp", marks=pytest.mark.slow),
])
def test_a_gpt_trains_on_size_one_axes_as_on_one_device(mesh_shape, style):
    """``TrainStep`` of the GPT with the batch split on the data axis (size 1 here): the crash of issue 37 on one
    GPU; the losses are those of plain ``jax.jit`` on one device and the placements stay as planned."""
    mesh = make_mesh(mesh_shape)
    dp, tp = mesh.axis_names[0], mesh.axis_names[-1]
    styles, default = plan(style, dp=dp, tp=tp)
    model = parallelize(GPT(V, D, H, L, T, rngs=nnx.Rngs(0)), mesh, styles, default=default)
    before = placements_of(nnx.state(model, nnx.Param))
    tx = optax.sgd(0.1)
    step = TrainStep(model, tx, loss_fn)
    want = one_device_trainer(GPT(V, D, H, L, T, rngs=nnx.Rngs(0)), tx, loss_fn)
    rng = np.random.default_rng(0)
    rows = tuple(Shard(0) if a == 0 else R for a in range(len(mesh_shape)))
    got, ref = [], []
    for _ in range(3):
        ids, labels = (rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(2))
        got.append(float(step(*(jshard.distribute(a, mesh, rows) for a in (ids, labels)))))
        ref.append(want(ids, labels))
    assert curve_ratio(got, ref, n_per_step=N) <= 1, (got, ref)
    assert placements_of(nnx.state(step.model, nnx.Param)) == before


@pytest.mark.parametrize("saved_on,restored_on", [((1, 8), (2, 4)), ((2, 4), (1,)), ((1,), (8, 1))])
def test_checkpoints_saved_on_or_restored_onto_size_one_axes(tmp_path, saved_on, restored_on):
    rng = np.random.default_rng(3)
    value = rng.normal(size=(6, 10)).astype(np.float32)
    src_mesh, dst_mesh = make_mesh(saved_on), make_mesh(restored_on)
    placements = (Partial(), Shard(1)) if len(saved_on) == 2 else (Shard(0),)
    x = jshard.from_local(local_blocks(value, saved_on, placements, rng), src_mesh, placements, shape=value.shape)
    jshard.checkpoint.save(tmp_path / "c", {"x": x})
    target = tuple(Shard(a % 2) for a in range(len(restored_on)))
    like = {"x": jshard.Spec.create(dst_mesh, target, value.shape, value.dtype)}
    back = jshard.checkpoint.restore(tmp_path / "c", like=like)["x"]
    assert back.placements == target
    check_darray(back, np.asarray(x.full()))
    np.testing.assert_allclose(np.asarray(back.full()), value, rtol=1e-6, atol=1e-5)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.up, self.down = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, ids):
        x = self.norm(self.embed(ids))
        return x + self.down(jax.nn.gelu(self.up(x)))


@pytest.mark.parametrize("mesh_shape", mesh_params(((1, 8), (8, 1), (1, 1)), ((1, 8), (8, 1))))
def test_every_style_on_a_size_one_axis_matches_one_device(mesh_shape):
    """Every parallel style on each axis (one of them of size 1), forward and gradients as on one device."""
    mesh = make_mesh(mesh_shape)
    dp, tp = mesh.axis_names
    styles = {"embed": RowwiseParallel(tp), "norm": SequenceParallel(tp), "up": ColwiseParallel(tp),
              "down": RowwiseParallel(tp, output=Shard(1)), "": DataParallel(dp)}
    ids = np.random.default_rng(4).integers(0, 16, (4, 6)).astype(np.int32)
    loss = lambda m, ids: jnp.mean(m(ids) ** 2)
    for plan_, default in ((styles, ()), ({}, (FullyShard(dp),)), ({}, (FullyShard(tp),))):
        model = parallelize(MLP(nnx.Rngs(0)), mesh, plan_, default=default)
        x = jshard.distribute(ids, mesh, (Shard(0), R))
        ref = MLP(nnx.Rngs(0))
        n = 8 + 32 + 4 * 6 * 8
        assert_close(jshard.jit(loss)(model, x).full(), loss(ref, ids), n=n)
        grads = jax.tree.leaves(jshard.jit(nnx.grad(loss))(model, x), is_leaf=lambda a: isinstance(a, jshard.DArray))
        for g, w in zip(grads, jax.tree.leaves(nnx.grad(loss)(ref, ids))):
            assert_close(g.full(), w, n=n)
