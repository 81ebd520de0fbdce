"""Pipeline parallelism against one device: ``pipeline_value_and_grad`` against ``jax.value_and_grad`` of the same
layers run one after another, and a pipelined GPT's ``TrainStep`` against the same model trained on one device
(losses step by step, parameters after); what the kernel sends (per tick, exactly the stage pairs the schedule
moves between) and how it is priced; the stacked parameters' placements and per-device size; the errors."""

from __future__ import annotations

import collections
import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard import Replicate, Shard
from jshard.engine.walk import plan_jaxpr
from jshard.gpt import GPT, cross_entropy
from jshard.gpt import plan as gpt_plan
from jshard.parallel import PipelineParallel, TrainStep, parallelize, pipeline
from jshard.parallel.pipeline import (
    _forward_and_backward,
    _lightened,
    _routes,
    _sends,
    pipeline_value_and_grad,
    value_and_grad_read,
)
from jshard.parallel.schedule import make_schedule
from jshard.spec import Spec

L, D, M, MB = 8, 16, 4, 6


def _layer(lp, x):
    return jnp.tanh(x @ lp["w"] + lp["b"])


def _tail(o, x, y):
    return jnp.mean((x @ o["h"] - y) ** 2)


def _toy():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(L, D, D)).astype(np.float32) * 0.3, rng.normal(size=(L, D)).astype(np.float32) * 0.1,
            rng.normal(size=(D, 5)).astype(np.float32), rng.normal(size=(M, MB, D)).astype(np.float32),
            rng.normal(size=(M, MB, 5)).astype(np.float32))


def _sequential(w, b, h, x, y):
    def total(w, b, h, x):
        losses = []
        for i in range(M):
            xi = x[i]
            for j in range(len(w)):
                xi = _layer({"w": w[j], "b": b[j]}, xi)
            losses.append(_tail({"h": h}, xi, y[i]))
        return jnp.mean(jnp.stack(losses))

    return jax.value_and_grad(total, argnums=(0, 1, 2, 3))(w, b, h, x)


@pytest.mark.parametrize("shape,names,schedule,virtual", [
    ((2, 4), ("pp", "tp"), "gpipe", 1),
    ((2, 4), ("pp", "tp"), "1f1b", 1),
    ((4, 2), ("pp", "tp"), "interleaved", 2),
    ((8,), ("pp",), "1f1b", 1),
    ((1, 8), ("pp", "tp"), "1f1b", 1),
    ((2, 1, 4), ("pp", "dp", "tp"), "1f1b", 1),
    ((1,), ("pp",), "1f1b", 1),
    ((1,), ("pp",), "interleaved", 2),  # a chunk's output reaches the next chunk on the same device
], ids=["pp2xtp4-gpipe", "pp2xtp4-1f1b", "pp4xtp2-interleaved", "pp8", "pp1xtp8", "pp2xdp1xtp4", "one-device",
        "one-device-interleaved"])
def test_pipeline_value_and_grad_equals_the_layers_run_one_after_another(shape, names, schedule, virtual):
    w, b, h, x, y = _toy()
    loss, grads = _sequential(w, b, h, x, y)
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
    rest = [Shard(2) if n == "tp" else Replicate() for n in names[1:]]
    split = jshard.StridedShard(0, virtual) if virtual > 1 else Shard(0)
    args = [jshard.distribute(w, mesh, [split] + rest),
            jshard.distribute(b, mesh, [split] + [Replicate()] * len(rest))]
    args += [jshard.distribute(a, mesh, [Replicate()] * len(names)) for a in (h, x, y)]

    def run(w, b, h, x, y):
        return pipeline_value_and_grad(_layer, _tail, {"w": w, "b": b}, {"h": h}, x, (y,), axis="pp",
                                       schedule=schedule, virtual_stages=virtual)

    got, (gs, go, gx) = jshard.jit(run)(*args)
    np.testing.assert_allclose(float(got.full()), float(loss), rtol=1e-5)
    for ours, theirs in ((gs["w"], grads[0]), (gs["b"], grads[1]), (go["h"], grads[2]), (gx, grads[3])):
        np.testing.assert_allclose(np.asarray(ours.full()), theirs, rtol=1e-4, atol=1e-6)
    assert gs["w"].placements[0] == split  # the layers' gradients lie like the layers


def test_remat_keeps_each_layers_input_alone_and_either_way_computes_the_same():
    w, b, h, x, y = _toy()
    loss, grads = _sequential(w, b, h, x, y)
    mesh = jax.make_mesh((2, 4), ("pp", "tp"))
    args = [jshard.distribute(w, mesh, [Shard(0), Shard(2)]), jshard.distribute(b, mesh, [Shard(0), Replicate()])]
    args += [jshard.distribute(a, mesh, [Replicate(), Replicate()]) for a in (h, x, y)]

    def run(w, b, h, x, y, remat):
        return pipeline_value_and_grad(_layer, _tail, {"w": w, "b": b}, {"h": h}, x, (y,), axis="pp", remat=remat)

    for remat in (True, False):
        got, (gs, go, gx) = jshard.jit(functools.partial(run, remat=remat))(*args)
        np.testing.assert_allclose(float(got.full()), float(loss), rtol=1e-5)
        for ours, theirs in ((gs["w"], grads[0]), (gs["b"], grads[1]), (go["h"], grads[2]), (gx, grads[3])):
            np.testing.assert_allclose(np.asarray(ours.full()), theirs, rtol=1e-4, atol=1e-6)
    kept = {}
    for remat in (False, True):
        plan = jshard.jit(functools.partial(run, remat=remat)).trace(*args).plan
        eqn = next(e.eqn for e in plan.equations if e.eqn.primitive.name == "jshard_pipeline")
        kept[remat] = [a.shape for a in eqn.params["fwd"].out_avals[1:]]  # kept besides the layer's output
    assert kept[True] == [(MB, D)]  # the layer's input alone
    assert len(kept[False]) > 1  # tanh's output too (its derivative), and the input


def test_a_weight_the_layer_casts_enters_the_stage_cast_its_gradient_summed_in_its_own_dtype(monkeypatch):
    """A float32 weight every use of which is a cast to bf16 (a layer computing in bf16) enters the pipeline cast:
    the stage holds it (whole, where it is gathered) and reads it in bf16; its gradient is summed over the
    microbatches in float32. The numbers are those of the stage casting it itself, and of ``jax.grad`` of the
    layers run one after another (to bf16's precision: XLA rounds a whole program's bf16 work its own way)."""
    def layer(lp, x):
        return jnp.tanh(x.astype(jnp.bfloat16) @ lp["w"].astype(jnp.bfloat16)).astype(jnp.float32) + lp["b"]

    w, b, h, x, y = _toy()

    def total(w, b, h, x):
        losses = []
        for i in range(M):
            xi = x[i]
            for j in range(L):
                xi = layer({"w": w[j], "b": b[j]}, xi)
            losses.append(_tail({"h": h}, xi, y[i]))
        return jnp.mean(jnp.stack(losses))

    loss, grads = jax.value_and_grad(total, argnums=(0, 1, 2, 3))(w, b, h, x)
    mesh = jax.make_mesh((2, 4), ("pp", "tp"))
    args = [jshard.distribute(w, mesh, [Shard(0), Shard(2)]), jshard.distribute(b, mesh, [Shard(0), Replicate()])]
    args += [jshard.distribute(a, mesh, [Replicate(), Replicate()]) for a in (h, x, y)]

    def run(w, b, h, x, y):
        return pipeline_value_and_grad(layer, _tail, {"w": w, "b": b}, {"h": h}, x, (y,), axis="pp", remat=False)

    got, (gs, go, gx) = jshard.jit(run)(*args)
    np.testing.assert_allclose(float(got.full()), float(loss), rtol=1e-2)
    for ours, theirs in ((gs["w"], grads[0]), (gs["b"], grads[1]), (go["h"], grads[2]), (gx, grads[3])):
        assert ours.dtype == theirs.dtype == np.float32
        assert np.linalg.norm(np.asarray(ours.full()) - theirs) <= 2e-2 * np.linalg.norm(theirs)
    plan = jshard.jit(run).trace(*args).plan
    monkeypatch.setattr(pipeline, "_narrowed", lambda closed, n: [None] * n)  # the stage casts w itself
    before, (bs, bo, bx) = jshard.jit(run)(*args)
    np.testing.assert_array_equal(np.asarray(got.full()), np.asarray(before.full()))
    for ours, theirs in ((gs["w"], bs["w"]), (gs["b"], bs["b"]), (go["h"], bo["h"]), (gx, bx)):
        np.testing.assert_allclose(np.asarray(ours.full()), np.asarray(theirs.full()), rtol=1e-6, atol=1e-7)
    eqn = next(e.eqn for e in plan.equations if e.eqn.primitive.name == "jshard_pipeline")
    assert [v.aval.dtype for v in eqn.invars[:2]] == [np.float32, jnp.bfloat16]  # b as stored, w cast before
    assert eqn.params["sums"] == (np.float32, np.float32)


def test_a_pipelines_state_is_checked_by_name():
    """State given a pipeline needs a merge for each array, stacked like the layers; a layer must leave its state
    shaped as it found it. Each refused naming what it got."""
    w, b, h, x, y = _toy()
    mesh = jax.make_mesh((2, 4), ("pp", "tp"))
    args = [jshard.distribute(a, mesh, [Shard(0), Replicate()]) for a in (w, b)]
    args += [jshard.distribute(a, mesh, [Replicate(), Replicate()]) for a in (h, x, y)]
    count = jshard.distribute(np.zeros((L, 3), np.float32), mesh, [Shard(0), Replicate()])

    def run(layer, merges, w, b, h, x, y, s):
        return value_and_grad_read(layer, _tail, {"w": w, "b": b}, {"h": h}, x, (y,), axis="pp", state=[s],
                                   merges=merges)[0]

    def counting(lp, ls, x):
        return _layer(lp, x), [ls[0] + 1]

    def growing(lp, ls, x):
        return _layer(lp, x), [jnp.zeros(4)]

    with pytest.raises(ValueError, match=r"pipeline: state takes one array a layer stacked along dim 0 \(8 layers\) "
                                         r"and merges one of \('sum', 'last'\) for each; got state shapes \[\(8, 3\)\] "
                                         r"and merges \('mean',\)"):
        jshard.jit(functools.partial(run, counting, ("mean",)))(*args, count)
    with pytest.raises(TypeError, match=r"pipeline: a layer leaves its state as \['float32\[4\]'\] where it takes "
                                        r"\['float32\[3\]'\]"):
        jshard.jit(functools.partial(run, growing, ("sum",)))(*args, count)
    left = jshard.jit(lambda *a: value_and_grad_read(counting, _tail, {"w": a[0], "b": a[1]}, {"h": a[2]}, a[3],
                                                     (a[4],), axis="pp", state=[a[5]], merges=("sum",))[4])(
        *args, count)
    np.testing.assert_array_equal(np.asarray(left[0].full()), np.full((L, 3), M))  # one a call, summed over M


def _units(layer, lp, x):
    """A layer's forward and backward units, as ``pipeline_value_and_grad`` splits its vjp."""
    saved = {}

    def saving(lp, x):
        y, pull = jax.vjp(layer, lp, x)
        res, saved["tree"] = jax.tree.flatten(pull)
        return (y, *res)

    return _forward_and_backward(jax.make_jaxpr(saving)(lp, x), saved["tree"], len(lp))


def test_a_layer_runs_forward_once_keeping_the_residuals_that_depend_on_its_input():
    """Each layer's forward runs once per microbatch (as ``jax.grad`` runs it): its forward unit returns the vjp's
    residuals made from the layer's input, which the stage keeps for the backward unit; a residual made of the
    parameters alone (the weight cast to bfloat16) is made again there, never kept per microbatch."""
    w, b, _, x, _ = _toy()
    lp = [jnp.asarray(w[0]), jnp.asarray(b[0])]

    def cast(lp, x):  # the weight cast to the compute dtype: a residual of the parameters alone
        return jnp.tanh((x.astype(jnp.bfloat16) @ lp[0].astype(jnp.bfloat16)).astype(jnp.float32) + lp[1])

    fwd, bwd = _units(cast, lp, x[0])
    y, *kept = jax.core.eval_jaxpr(fwd.jaxpr, fwd.consts, *lp, x[0])
    assert kept and all(k.shape[:1] == (MB,) for k in kept)  # per token: nothing of the weight's [D, D] shape
    dy = jnp.ones_like(y)
    got = jax.core.eval_jaxpr(bwd.jaxpr, bwd.consts, *lp, *kept, dy)
    want_y, pull = jax.vjp(cast, lp, x[0])
    (dw, db), dx = pull(dy)
    for ours, theirs in zip(got, (dw, db, dx), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y))
    # in the program: every layer's forward unit runs once per microbatch, as its backward unit does
    mesh = jax.make_mesh((2, 4), ("pp", "dp"))
    args = [jshard.distribute(a, mesh, [Shard(0), Replicate()]) for a in (w, b)]
    args += [jshard.distribute(a, mesh, [Replicate(), Replicate()]) for a in _toy()[2:]]

    def run(w, b, h, x, y):
        return pipeline_value_and_grad(lambda lp, x: cast([lp["w"], lp["b"]], x), _tail, {"w": w, "b": b},
                                       {"h": h}, x, (y,), axis="pp")

    explained = jshard.jit(run).explain(*args)
    runs = {r["primitive"].split(" | ")[0]: r["runs"] for r in explained.rows if " | " in r["primitive"]}
    assert runs["jshard_pipeline layer forward"] == runs["jshard_pipeline layer backward"] == M * L // 2


def test_a_value_the_layer_makes_twice_alike_is_kept_once():
    """Each ``nnx.Linear`` casts its input to the compute dtype itself: two projections of one input made two casts,
    each kept per microbatch in the stash. Equations that repeat an earlier one are merged first: one copy kept, and
    the backward unit still computes the vjp."""
    w, b, _, x, _ = _toy()
    lp = [jnp.asarray(w[0]), jnp.asarray(b[0])]

    def two(lp, x):
        first = x.astype(jnp.bfloat16) @ lp[0].astype(jnp.bfloat16)
        second = x.astype(jnp.bfloat16) @ lp[0].T.astype(jnp.bfloat16)
        return jnp.tanh((first * second).astype(jnp.float32) + lp[1])

    fwd, bwd = _units(two, lp, x[0])
    y, *kept = jax.core.eval_jaxpr(fwd.jaxpr, fwd.consts, *lp, x[0])
    cast = np.asarray(x[0].astype(jnp.bfloat16))
    assert sum(k.shape == cast.shape and k.dtype == cast.dtype and np.array_equal(np.asarray(k), cast)
               for k in kept) == 1
    dy = jnp.ones_like(y)
    got = jax.core.eval_jaxpr(bwd.jaxpr, bwd.consts, *lp, *kept, dy)
    (dw, db), dx = jax.vjp(two, lp, x[0])[1](dy)
    for ours, theirs in zip(got, (dw, db, dx), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)


def test_a_stage_keeps_what_makes_its_residuals_again_cheaply():
    """A GELU's intermediates (each as large as its input) are made again in the backward unit from the matmul's
    output they come from, which the stage keeps alone: a third of the bytes, and the same gradients."""
    rng = np.random.default_rng(0)
    lp = [jnp.asarray(rng.normal(size=(8, 32)), jnp.float32), jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)]
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)

    def mlp(lp, x):
        return jax.nn.gelu(x @ lp[0], approximate=True) @ lp[1]

    fwd, bwd = _units(mlp, lp, x)
    mesh = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
    specs = [Spec.create(mesh, [Replicate()], a.shape, a.dtype) for a in (*lp, x)]
    lean, again, placements = _lightened(fwd, plan_jaxpr(fwd, specs, mesh), specs, bwd, 2)
    y, *kept = jax.core.eval_jaxpr(fwd.jaxpr, fwd.consts, *lp, x)
    y_lean, *fewer = jax.core.eval_jaxpr(lean.jaxpr, lean.consts, *lp, x)
    assert len(placements) == len(fewer)
    assert 3 * sum(a.nbytes for a in fewer) <= sum(a.nbytes for a in kept), ([a.shape for a in kept],
                                                                            [a.shape for a in fewer])
    dy = jnp.ones_like(y)
    got = jax.core.eval_jaxpr(again.jaxpr, again.consts, *lp, *fewer, dy)
    (dw1, dw2), dx = jax.vjp(mlp, lp, x)[1](dy)
    np.testing.assert_array_equal(np.asarray(y_lean), np.asarray(y))
    for ours, theirs in zip(got, (dw1, dw2, dx), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6)


# -- what the kernel sends ----------------------------------------------------------------------------------------

def _moves(s) -> list[tuple[set, set]]:
    """Per tick of schedule ``s``, read off its tables: the (source, destination) devices an activation moves
    between (a forward unit's output, but the last virtual stage's) and a gradient (a backward unit's, but the
    first's)."""
    p, last = s.stages, s.stages * s.virtual_stages - 1
    return [({(d, (d + 1) % p) for d in range(p) if s.forward[t, d] >= 0 and s.forward_chunk[t, d] * p + d < last},
             {(d, (d - 1) % p) for d in range(p) if s.backward[t, d] >= 0 and s.backward_chunk[t, d] * p + d > 0})
            for t in range(s.ticks)]


SENDING = [("gpipe", 4, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1), ("1f1b", 3, 5, 1), ("interleaved", 4, 8, 2),
           ("interleaved", 2, 4, 2), ("interleaved", 2, 6, 3), ("1f1b", 1, 2, 1), ("1f1b", 16, 32, 1)]


@pytest.mark.parametrize("kind,p,m,v", SENDING, ids=["-".join(map(str, c)) for c in SENDING])
def test_each_tick_sends_along_exactly_the_pairs_the_schedule_moves_between(kind, p, m, v):
    s = make_schedule(kind, p, m, v)
    routes = _routes(s)
    moves = _moves(s)
    for t, (ahead, back) in enumerate(moves):
        for (sets, index), needed in ((routes["f"], ahead), (routes["b"], back)):
            assert set(sets[index[t]]) == needed, (t, sets[index[t]], needed)
    for sets, _ in routes.values():
        assert len(set(sets)) == len(sets) <= 2 * p  # one branch a set: ramp-up, steady state, ramp-down
    # priced as sent: a permute a tick and direction with something to send, k pairs moving k / p of a block per
    # device, in all the m (p v - 1) hops of each microbatch each way
    block = 3 * 4096
    sends = _sends(s, "pp", types.SimpleNamespace(local_bytes=block))
    assert sum(c.count for c in sends) == sum(bool(a) + bool(b) for a, b in moves)
    assert sum(c.nbytes * c.count for c in sends) == pytest.approx(2 * m * (p * v - 1) * block / p)
    assert all(c.kind == "permute" and c.axes == ("pp",) for c in sends)


@pytest.mark.parametrize("shape,schedule,virtual", [((4, 2), "1f1b", 1), ((2, 4), "interleaved", 2)],
                         ids=["pp4xdp2-1f1b", "pp2xdp4-interleaved"])
def test_the_program_permutes_only_the_pairs_that_send(shape, schedule, virtual):
    # the compiled program's collective-permutes: in each direction one per set of stage pairs the schedule moves
    # between on some tick (a branch of the tick's switch), none over a pair with nothing to send (permuting
    # between every stage and the next on every tick would show one a direction, over all the pairs)
    w, b, h, x, y = _toy()
    mesh = jax.make_mesh(shape, ("pp", "dp"))
    split = jshard.StridedShard(0, virtual) if virtual > 1 else Shard(0)
    args = [jshard.distribute(w, mesh, [split, Replicate()]), jshard.distribute(b, mesh, [split, Replicate()])]
    args += [jshard.distribute(a, mesh, [Replicate(), Replicate()]) for a in (h, x, y)]

    def run(w, b, h, x, y):
        return pipeline_value_and_grad(_layer, _tail, {"w": w, "b": b}, {"h": h}, x, (y,), axis="pp",
                                       schedule=schedule, virtual_stages=virtual)

    hlo = jshard.jit(run).lower(*args).compile().as_text()
    permuted = collections.Counter()
    for pairs in re.findall(r"collective-permute(?:-start)?\(.*source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", hlo):
        stages = {tuple(int(np.unravel_index(int(d), shape)[0]) for d in pair)
                  for pair in re.findall(r"\{(\d+),(\d+)\}", pairs)}
        permuted[frozenset(stages)] += 1
    moves = _moves(make_schedule(schedule, shape[0], M, virtual))
    needed = collections.Counter()
    for way in (0, 1):  # forward, back
        needed.update({frozenset(tick[way]) for tick in moves} - {frozenset()})
    assert permuted == needed


@pytest.mark.parametrize("layers,stages", [(5, 2), (6, 4), (9, 8)], ids=["5-over-2", "6-over-4", "9-over-8"])
def test_uneven_stages_compute_the_layers_run_one_after_another(layers, stages):
    """Layers the stages do not divide: the rows past ``L`` of the last stages' blocks (padding) run no layer, so a
    layer that is not the identity on zeros (``tanh(x @ 0 + 0)`` is 0) leaves the result alone; 9 over 8 (two a
    stage) leaves three stages none at all."""
    w, b, h, x, y = _toy()
    w, b = w[:layers], b[:layers]
    loss, grads = _sequential(w, b, h, x, y)
    mesh = jax.make_mesh((stages,), ("pp",), devices=jax.devices()[:stages])
    args = [jshard.distribute(a, mesh, [Shard(0)]) for a in (w, b)]
    args += [jshard.distribute(a, mesh, [Replicate()]) for a in (h, x, y)]

    def run(w, b, h, x, y):
        return pipeline_value_and_grad(_layer, _tail, {"w": w, "b": b}, {"h": h}, x, (y,), axis="pp")

    got, (gs, go, gx) = jshard.jit(run)(*args)
    np.testing.assert_allclose(float(got.full()), float(loss), rtol=1e-5)
    for ours, theirs in ((gs["w"], grads[0]), (gs["b"], grads[1]), (go["h"], grads[2]), (gx, grads[3])):
        np.testing.assert_allclose(np.asarray(ours.full()), theirs, rtol=1e-4, atol=1e-6)


# -- the GPT, trained ---------------------------------------------------------------------------------------------

V, W, H, LAYERS, S, B = 64, 32, 4, 4, 16, 8


def _make():
    return GPT(V, W, H, LAYERS, S, rngs=nnx.Rngs(0))


def _loss(model, ids, labels):
    return cross_entropy(model(ids), labels)


def _batches(n=2):
    rng = np.random.default_rng(1)
    return [tuple(rng.integers(0, V, (B, S)).astype(np.int32) for _ in range(2)) for _ in range(n)]


@pytest.fixture(scope="module")
def one_device():
    mesh = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
    step = TrainStep(parallelize(_make, mesh, {}), optax.adamw(1e-2), _loss)
    losses = [float(step(*[jshard.distribute(a, mesh, [Replicate()]) for a in b]).full()) for b in _batches()]
    params = {k: np.asarray(v.full()) for k, v in _flat(step.params).items()}
    return losses, params


def _flat(state):
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda a: isinstance(a, jshard.DArray))[0]
    return {jax.tree_util.keystr(k): v for k, v in leaves}


def _stacked_equivalent(params: dict, reference: dict) -> None:
    """Pipelined parameters (``blocks.layers...`` stacked) against a one-device model's (``blocks[i]...``). The key
    projection's bias is left out: softmax does not see it, so its gradient is rounding noise, which AdamW scales
    up to full steps on either side."""
    for key, value in params.items():
        if "['k']['bias']" in key:
            continue
        if "['layers']" in key:
            for i in range(value.shape[0]):
                ref = reference[key.replace("['layers']", f"[{i}]")]
                np.testing.assert_allclose(value[i], ref, rtol=2e-4, atol=2e-5, err_msg=f"{key}[{i}]")
        else:
            np.testing.assert_allclose(value, reference[key], rtol=2e-4, atol=2e-5, err_msg=key)


PIPELINED = [
    pytest.param((2, 4), ("pp", "tp"), "tp", "1f1b", 1, 2, id="pp2xtp4-1f1b", marks=pytest.mark.slow),
    pytest.param((2, 2, 2), ("pp", "dp", "tp"), "dp+tp", "gpipe", 1, 4, id="pp2xdp2xtp2-gpipe"),
    pytest.param((4, 2), ("pp", "dp"), "fsdp", "1f1b", 1, 4, id="pp4xfsdp2-1f1b"),
    pytest.param((2, 4), ("pp", "tp"), "sp", "interleaved", 2, 4, id="pp2xsp4-interleaved", marks=pytest.mark.slow),
    pytest.param((1, 8), ("pp", "dp"), "dp", "1f1b", 1, 2, id="pp1xdp8", marks=pytest.mark.slow),
    pytest.param((1,), ("pp",), None, "1f1b", 1, 2, id="one-device", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,names,style,schedule,virtual,micro", PIPELINED)
def test_a_pipelined_gpt_trains_like_one_device(one_device, shape, names, style, schedule, virtual, micro):
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
    plan, default = gpt_plan(style) if style else ({}, ())
    plan = {**plan, "blocks": PipelineParallel("pp", microbatches=micro, schedule=schedule, virtual_stages=virtual)}
    step = TrainStep(parallelize(_make, mesh, plan, default=default), optax.adamw(1e-2), _loss)
    batch = [Shard(0) if n == "dp" else Replicate() for n in names]
    losses = [float(step(*[jshard.distribute(a, mesh, batch) for a in b]).full()) for b in _batches()]
    np.testing.assert_allclose(losses, one_device[0], rtol=2e-5)
    _stacked_equivalent({k: np.asarray(v.full()) for k, v in _flat(step.params).items()}, one_device[1])
    kernel = step.model.blocks.layers.q.kernel.get_value()
    p = mesh.shape["pp"]
    assert kernel.shape == (LAYERS, W, W)
    assert kernel.spec.local_block_shape[0] == LAYERS // p  # a stage holds its own blocks, no other's


@pytest.mark.parametrize("shape,names,style,layers", [
    pytest.param((2, 2, 2), ("pp", "dp", "tp"), "dp+tp", 5, id="5-over-2"),
    pytest.param((4, 2), ("pp", "dp"), "dp", 6, id="6-over-4", marks=pytest.mark.slow)])
def test_uneven_stages_train_like_one_device(shape, names, style, layers):
    """Layers the stages do not divide (Llama 3 405B's 126 over 16): each stage holds ``ceil(L / p)`` layers, the
    last ones fewer (5 over 2: 3 and 2; 6 over 4: 2, 2, 2 and none), their rows past ``L`` idle; training as one
    device trains the same layers (by SGD: AdamW's first steps blow a gradient's rounding up to a whole step)."""
    make = lambda: GPT(V, W, H, layers, S, rngs=nnx.Rngs(0))  # noqa: E731
    one = jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])
    ref = TrainStep(parallelize(make, one, {}), optax.sgd(0.5), _loss)
    want = [float(ref(*[jshard.distribute(a, one, [Replicate()]) for a in b]).full()) for b in _batches()]
    reference = {k: np.asarray(v.full()) for k, v in _flat(ref.params).items()}
    mesh = jax.make_mesh(shape, names)
    plan, default = gpt_plan(style)
    plan = {**plan, "blocks": PipelineParallel("pp", microbatches=4)}
    step = TrainStep(parallelize(make, mesh, plan, default=default), optax.sgd(0.5), _loss)
    batch = [Shard(0) if n == "dp" else Replicate() for n in names]
    losses = [float(step(*[jshard.distribute(a, mesh, batch) for a in b]).full()) for b in _batches()]
    np.testing.assert_allclose(losses, want, rtol=2e-5)
    _stacked_equivalent({k: np.asarray(v.full()) for k, v in _flat(step.params).items()}, reference)
    kernel = step.model.blocks.layers.q.kernel.get_value()
    assert kernel.shape == (layers, W, W) and kernel.spec.local_block_shape[0] == -(-layers // shape[0])


def test_a_sequence_parallel_stage_keeping_every_activation_trains_like_one_device(one_device):
    """``remat=False`` (every residual kept, each forward run once) trains like one device; and a sequence-parallel
    stage keeps its residual stream split on the sequence inside the layer's forward unit (it arrived split over the
    batch on the tensor axis, which cost the layer an all-to-all in and out)."""
    mesh = jax.make_mesh((2, 4), ("pp", "tp"))
    plan, default = gpt_plan("sp")
    plan = {**plan, "blocks": PipelineParallel("pp", microbatches=2, remat=False)}
    step = TrainStep(parallelize(_make, mesh, plan, default=default), optax.adamw(1e-2), _loss)
    batches = [[jshard.distribute(a, mesh, [Replicate(), Replicate()]) for a in b] for b in _batches()]
    np.testing.assert_allclose([float(step(*b).full()) for b in batches], one_device[0], rtol=2e-5)
    _stacked_equivalent({k: np.asarray(v.full()) for k, v in _flat(step.params).items()}, one_device[1])
    rows = step.explain(*batches[0]).rows
    forward = [kind for r in rows if r["primitive"].startswith("jshard_pipeline layer forward")
               for _, kind, _, _ in r["moves"]]
    assert forward and "all_to_all" not in forward
    # the stage accumulates each layer's gradients split as its parameters are: a weight split on the tensor axis
    # never accumulates as a pending sum of the whole matrix (4x its block here, for every layer of the stage)
    (pipeline,) = [r for r in rows if r["primitive"] == "jshard_pipeline"]
    n = len(jax.tree.leaves(nnx.state(step.model.blocks.layers, nnx.Param)))
    for param, grad in zip(pipeline["ins"][:n], pipeline["outs"][1:1 + n], strict=True):
        assert grad.local_block_shape == param.local_block_shape, (param, grad)
    # the tail (final norm, head, loss) never reads the embeddings: the pipeline takes them not, nor makes their
    # gradient (zeros of the whole table, accumulated microbatch by microbatch)
    tables = {tuple(t.shape) for t in (step.model.tok.embedding.get_value(), step.model.pos.embedding.get_value())}
    assert not tables & {tuple(sp.shape) for sp in pipeline["ins"][n:]}, pipeline["ins"][n:]


@pytest.mark.slow
def test_a_pipelined_model_called_outside_the_step_computes_the_same_logits():
    mesh = jax.make_mesh((4, 2), ("pp", "tp"))
    plan, _ = gpt_plan("tp")
    model = parallelize(_make, mesh, {**plan, "blocks": PipelineParallel("pp", microbatches=2)})
    ids = _batches(1)[0][0]
    np.testing.assert_allclose(np.asarray(model(jshard.distribute(ids, mesh, [Replicate()] * 2)).full()),
                               np.asarray(_make()(ids)), rtol=1e-4, atol=1e-5)


# -- errors -------------------------------------------------------------------------------------------------------

class _Uneven(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs),
                                nnx.Linear(8, 8, use_bias=False, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _Chain(nnx.Module):
    """Four identical blocks, called as ``how`` says."""

    def __init__(self, how, rngs):
        self.how = how
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
            if self.how == "between":
                x = jnp.tanh(x)
        return x + outs[1] if self.how == "residual" else x


def _mse(model, x):
    return jnp.mean(model(x) ** 2)


def _step(how, micro=2):
    mesh = jax.make_mesh((2, 4), ("pp", "dp"))
    model = parallelize(lambda: _Chain(how, nnx.Rngs(0)), mesh, {"blocks": PipelineParallel("pp", microbatches=micro)})
    return TrainStep(model, optax.sgd(0.1), _mse), mesh


@pytest.mark.parametrize("make,plan,match", [
    (lambda: _Uneven(nnx.Rngs(0)), {"blocks": PipelineParallel("pp")}, r"block 2 \(Linear\) differs from block 0"),
    (lambda: _Chain("plain", nnx.Rngs(0)), {"blocks": PipelineParallel("pp", virtual_stages=2,
                                                                        schedule="interleaved")},
     r"4 blocks of blocks into 4 stages x 2 virtual stages; use a block count that is a multiple of 8"),
    (lambda: _Chain("plain", nnx.Rngs(0)), {"blocks/0": PipelineParallel("pp")}, r"match it on a list of identical"),
], ids=["not-identical", "too-few-blocks", "not-a-list"])
def test_parallelize_refuses_blocks_it_cannot_pipeline(make, plan, match):
    mesh = jax.make_mesh((4, 2), ("pp", "dp"))
    with pytest.raises(ValueError, match=match):
        parallelize(make, mesh, plan)


@pytest.mark.parametrize("kwargs,match", [
    (dict(microbatches=0), r"microbatches must be an int >= 1"),
    (dict(schedule="zb"), r"schedule 'zb' is not one of"),
    (dict(virtual_stages=2), r"virtual_stages=2 needs schedule='interleaved'"),
    (dict(whole="dp"), r"whole is a tuple of the mesh axes .* say \('dp',\); got 'dp'"),
    (dict(whole=("pp",)), r"other than the pipeline's 'pp'"),
])
def test_pipeline_parallel_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineParallel("pp", **kwargs)
    with pytest.raises(TypeError, match=r"remat must be True or False, got 'yes'"):
        PipelineParallel("pp", remat="yes")


def test_a_pipeline_refuses_whole_axes_the_mesh_lacks():
    mesh = jax.make_mesh((2, 4), ("pp", "dp"))
    plan, default = gpt_plan("dp")
    plan = {**plan, "blocks": PipelineParallel("pp", microbatches=2, whole=("zero",))}
    step = TrainStep(parallelize(_make, mesh, plan, default=default), optax.adamw(1e-2), _loss)
    ids = jshard.distribute(_batches(1)[0][0], mesh, [Replicate(), Shard(0)])
    with pytest.raises(ValueError, match=r"whole=\('zero',\) names axes that are not the other axes of the mesh"):
        step(ids, ids)


@pytest.mark.parametrize("how,match", [
    ("between", r"nothing computed between them; block 1 was called on a value other than block 0's output"),
    ("residual", r"reads the output of pipelined block 1 outside the chain"),
])
def test_train_step_refuses_blocks_that_are_not_one_chain(how, match):
    step, mesh = _step(how)
    x = jshard.distribute(np.ones((8, 8), np.float32), mesh, [Replicate(), Shard(0)])
    with pytest.raises(ValueError, match=match):
        step(x)


def test_train_step_refuses_a_batch_the_microbatches_do_not_split():
    step, mesh = _step("plain", micro=3)
    x = jshard.distribute(np.ones((8, 8), np.float32), mesh, [Replicate(), Shard(0)])
    with pytest.raises(ValueError, match=r"cuts the batch into 3 microbatches along dim 0, and a batch input has "
                                         r"shape \(8, 8\)"):
        step(x)


def test_explain_shows_the_schedule_and_the_sends_the_program_runs():
    from jshard.parallel.schedule import make_schedule

    mesh = jax.make_mesh((4, 2), ("pp", "dp"))
    plan, default = gpt_plan("pp+fsdp", microbatches=4)
    step = TrainStep(parallelize(_make, mesh, plan, default=default), optax.sgd(0.1), _loss)
    ids = jshard.distribute(_batches(1)[0][0], mesh, [Replicate(), Shard(0)])
    explained = step.explain(ids, ids)
    schedule = make_schedule("1f1b", 4, 4)
    row = next(r for r in explained.rows if r["primitive"] == "jshard_pipeline")
    assert schedule.table() in row["note"] and "      stage 3  ." in str(explained)
    activation = (B // 4 // 2) * S * W * 4  # one microbatch's activation block on a device: batch over dp
    # a tick sends forward where a stage but the last ran a forward unit, back where one but the first a backward:
    # one permute over the stages that send, k of the 4 moving k / 4 of a block per device
    sends = int((schedule.forward[:, :-1] >= 0).any(axis=1).sum() + (schedule.backward[:, 1:] >= 0).any(axis=1).sum())
    assert sends < 2 * schedule.ticks
    assert [(kind, axes) for kind, axes, _, _ in row["own"]] == [("permute", ("pp",))] * 3
    assert [nbytes for _, _, nbytes, _ in row["own"]] == [activation * k // 4 for k in (1, 2, 3)]
    assert sum(n for *_, n in row["own"]) == sends
    assert sum(nbytes * n for *_, nbytes, n in row["own"]) == 2 * 4 * 3 * activation // 4  # m (p - 1) hops each way
    # a call runs each layer's forward and backward once per microbatch and layer, the tail once per microbatch:
    # their FSDP gathers as many times
    per = LAYERS // 4
    runs = {r["primitive"].split(" | ")[0]: r["runs"] for r in explained.rows if " | " in r["primitive"]}
    assert runs == {"jshard_pipeline layer forward": 4 * per, "jshard_pipeline layer backward": 4 * per,
                    "jshard_pipeline tail": 4}
    counted = {}
    for r in explained.rows:
        collectives = [(k, b) for _, k, _, b in r["moves"]] + [(k, b * c) for k, _, b, c in r.get("own", ())]
        for kind, nbytes in collectives:
            counted[kind] = counted.get(kind, 0) + nbytes * r["runs"]
    moved = {kind: nbytes for kind, (_, nbytes) in explained.per_call.items()}  # moves sharing a collective: one
    assert moved == counted
    assert explained.per_call["all_gather"][0] > explained.totals["all_gather"][0]


def test_pipelined_blocks_are_drawn_stacked_each_stage_drawing_its_own(monkeypatch):
    import jshard.parallel.initialise as initialise

    plans, real = [], initialise.jit

    def spy(fn, **kwargs):
        program = real(fn, **kwargs)

        def call(*args):
            plans.append((kwargs["out_placements"], program.trace(*args).plan))
            return program(*args)

        return call

    monkeypatch.setattr(initialise, "jit", spy)
    mesh = jax.make_mesh((4, 2), ("pp", "tp"))
    plan, _ = gpt_plan("pp+tp", microbatches=2)
    model = parallelize(_make, mesh, plan)
    eager = _make()
    for name in ("q", "up", "ln1"):
        for param in ("kernel", "bias") if name != "ln1" else ("scale", "bias"):
            stacked = np.asarray(getattr(getattr(model.blocks.layers, name), param).get_value().full())
            each = np.stack([np.asarray(getattr(getattr(eager.blocks[i], name), param).get_value())
                             for i in range(LAYERS)])
            np.testing.assert_array_equal(stacked, each)  # the eager construction's values, bit for bit
    stacked_programs = [p for placements, p in plans if placements[0][0] == Shard(0)]
    draws = [eq for p in stacked_programs for eq in p.equations if eq.eqn.primitive.name == "random_bits"]
    assert draws and all(eq.choice.outs[0].placements[0] == Shard(0) for eq in draws)  # each stage its own blocks


class _Heads(nnx.Module):
    """Four blocks with parameters of one shape and a setting that differs in one of them."""

    def __init__(self, rngs):
        self.blocks = nnx.List([_Scaled(8, 2.0 if i == 3 else 1.0, rngs) for i in range(4)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _Scaled(nnx.Module):
    def __init__(self, dim, scale, rngs):
        self.scale = scale
        self.linear = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        return self.scale * self.linear(x)


def test_parallelize_refuses_blocks_that_differ_only_in_a_setting():
    # one block's graph runs every block: a block with another setting would silently run as block 0
    with pytest.raises(ValueError, match=r"block 3 \(_Scaled\) differs from block 0 .* settings"):
        parallelize(lambda: _Heads(nnx.Rngs(0)), jax.make_mesh((4, 2), ("pp", "dp")),
                    {"blocks": PipelineParallel("pp")})


class _Dropping(nnx.Module):
    def __init__(self, rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_train_step_refuses_a_pipelined_model_with_state_besides_parameters():
    mesh = jax.make_mesh((2, 4), ("pp", "dp"))
    model = parallelize(lambda: _Dropping(nnx.Rngs(0)), mesh, {"blocks": PipelineParallel("pp", microbatches=2)})
    with pytest.raises(ValueError, match=r"takes its step by PipelineParallel\(.pp.\) and holds state besides its "
                                         r"parameters \(Rng"):
        TrainStep(model, optax.sgd(0.1), _mse)
