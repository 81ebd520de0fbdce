"""Checkpoints of pipelined training: a pipelined ``TrainStep``'s state (the blocks' parameters and optimizer
moments stacked along dim 0, split over the pipeline axis) saved under one pipeline restores under another (other
stage count, other axes beside it, a size-1 axis, one device) with ``like=step.state``, and training goes on with
the uninterrupted run's losses, which are one device's. A pipelined state restores into the same model not
pipelined (``blocks[i].*`` where the checkpoint holds ``blocks.layers.*`` stacked: block ``i`` is slice ``i``), and
back."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard import Replicate, Shard
from jshard.gpt import GPT, cross_entropy, one_device_trainer
from jshard.gpt import plan as gpt_plan
from jshard.parallel import TrainStep, parallelize

V, W, H, LAYERS, S, B, MICRO = 32, 16, 2, 4, 8, 8, 2
STEPS, SAVED_AFTER = 4, 2  # the checkpoint holds the state after SAVED_AFTER of STEPS steps

# name: (mesh shape, axis names, gpt.plan style); the pipelined ones cut the batch into MICRO microbatches
LAYOUTS = {
    "pp4xdp2": ((4, 2), ("pp", "dp"), "pp+dp"),
    "pp2xtp4": ((2, 4), ("pp", "tp"), "pp+tp"),
    "pp2xdp1xtp4": ((2, 1, 4), ("pp", "dp", "tp"), "pp+dp+tp"),
    "pp2xfsdp4": ((2, 4), ("pp", "dp"), "pp+fsdp"),
    "one-device": ((1,), ("pp",), "pp"),
    "dp2xtp4": ((2, 4), ("dp", "tp"), "tp"),  # not pipelined: the blocks are blocks[i]
}


def _make():
    return GPT(V, W, H, LAYERS, S, rngs=nnx.Rngs(0))


def _loss(model, ids, labels):
    return cross_entropy(model(ids), labels)


def _batches():
    rng = np.random.default_rng(3)
    return [tuple(rng.integers(0, V, (B, S)).astype(np.int32) for _ in range(2)) for _ in range(STEPS)]


def _step(name: str) -> tuple[TrainStep, jax.sharding.Mesh]:
    shape, names, style = LAYOUTS[name]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
    styles, default = gpt_plan(style, microbatches=MICRO)
    return TrainStep(parallelize(_make, mesh, styles, default=default), optax.adamw(1e-2), _loss), mesh


def _train(step: TrainStep, mesh, batches) -> list[float]:
    rows = [Shard(0) if n == "dp" else Replicate() for n in mesh.axis_names]
    return [float(step(*[jshard.distribute(a, mesh, rows) for a in batch]).full()) for batch in batches]


@pytest.fixture(scope="module")
def one_device() -> list[float]:
    """The oracle: the same model, optimizer and batches under plain ``jax.jit`` on one device."""
    step = one_device_trainer(_make(), optax.adamw(1e-2), _loss)
    return [step(*batch) for batch in _batches()]


def _host(state) -> dict[str, np.ndarray]:
    """Every leaf of a step's state on the host, by its path (``['params']['blocks']['layers']['q']...``)."""
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda a: isinstance(a, jshard.DArray))[0]
    return {jax.tree_util.keystr(k): np.asarray(v.full() if isinstance(v, jshard.DArray) else v) for k, v in leaves}


def _unstacked(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A pipelined state's leaves as the same model's not pipelined: ``blocks['layers']`` [L, ...] as
    ``blocks[i]`` [...] for each block ``i``."""
    out = {}
    for key, value in state.items():
        if "['blocks']['layers']" in key:
            out.update({key.replace("['layers']", f"[{i}]"): value[i] for i in range(value.shape[0])})
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``run(name)``: training under layout ``name`` for STEPS steps without a break, saved after SAVED_AFTER of
    them: its losses, the checkpoint's path and the saved state on the host (each layout run once per module)."""
    runs: dict = {}

    def run(name: str) -> tuple[list[float], object, dict[str, np.ndarray]]:
        if name not in runs:
            step, mesh = _step(name)
            path = tmp_path_factory.mktemp("pipeline") / f"{name}_step{SAVED_AFTER}"
            losses = _train(step, mesh, _batches()[:SAVED_AFTER])
            jshard.checkpoint.save(path, step.state)
            saved = _host(step.state)
            losses += _train(step, mesh, _batches()[SAVED_AFTER:])
            runs[name] = losses, path, saved
        return runs[name]

    return run


def _restore(path, name: str) -> tuple[TrainStep, jax.sharding.Mesh]:
    step, mesh = _step(name)
    step.state = jshard.checkpoint.restore(path, like=step.state)
    return step, mesh


@pytest.mark.parametrize("saved,restored", [
    ("pp4xdp2", "pp2xtp4"),
    pytest.param("pp2xtp4", "pp4xdp2", marks=pytest.mark.slow),
    pytest.param("pp4xdp2", "pp2xdp1xtp4", marks=pytest.mark.slow),
    pytest.param("pp4xdp2", "pp2xfsdp4", marks=pytest.mark.slow),
    pytest.param("pp4xdp2", "one-device", marks=pytest.mark.slow),
    pytest.param("one-device", "pp4xdp2", marks=pytest.mark.slow),
], ids=lambda name: name)
def test_a_pipelined_state_resumes_under_another_pipeline(uninterrupted, one_device, saved, restored):
    losses, path, state = uninterrupted(saved)
    np.testing.assert_allclose(losses, one_device, rtol=2e-5, err_msg=f"{saved}, uninterrupted")
    step, mesh = _restore(path, restored)
    got = _host(step.state)
    assert got.keys() == state.keys()
    for key, value in got.items():  # read back exactly, whatever the stages
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    kernel = step.model.blocks.layers.q.kernel.get_value()
    assert kernel.shape == (LAYERS, W, W)
    assert kernel.spec.local_block_shape[0] == LAYERS // kernel.mesh.shape["pp"]  # each stage reads its own blocks
    again = _train(step, mesh, _batches()[SAVED_AFTER:])
    # another stage count sums in another order (rtol 1e-6); both are one device's within its bound
    np.testing.assert_allclose(again, losses[SAVED_AFTER:], rtol=1e-6)
    np.testing.assert_allclose(again, one_device[SAVED_AFTER:], rtol=2e-5)


# -- pipelined <-> not pipelined: the conversion checkpoints do not make (yet) -------------------------------------

def test_a_pipelined_state_resumes_in_the_same_model_not_pipelined(uninterrupted):
    """Block ``i`` of the restored model (and its optimizer moments) is slice ``i`` of the saved stacks, and
    training goes on as the uninterrupted pipelined run did."""
    losses, path, state = uninterrupted("pp4xdp2")
    step, mesh = _restore(path, "dp2xtp4")
    got, want = _host(step.state), _unstacked(state)
    assert got.keys() == want.keys()
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)
    np.testing.assert_allclose(_train(step, mesh, _batches()[SAVED_AFTER:]), losses[SAVED_AFTER:], rtol=1e-6)


@pytest.mark.slow
def test_a_state_not_pipelined_resumes_pipelined(uninterrupted):
    """The other way: the saved blocks stacked into the pipeline's parameters (split over its stages)."""
    losses, path, state = uninterrupted("dp2xtp4")
    step, mesh = _restore(path, "pp4xdp2")
    got = _unstacked(_host(step.state))
    assert got.keys() == state.keys()
    for key, value in got.items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    np.testing.assert_allclose(_train(step, mesh, _batches()[SAVED_AFTER:]), losses[SAVED_AFTER:], rtol=1e-6)
