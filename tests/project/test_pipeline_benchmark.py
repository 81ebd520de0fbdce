"""The pipeline benchmark's measuring helpers (benchmarks/pipeline.py) against what they measure, counted by hand:
FLOPs and collective-permute bytes of compiled programs with loops and conditionals, the fit across microbatch
counts, and the blocks' per-device parameter bytes."""

from __future__ import annotations

import importlib
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jshard.gpt import GPT
from jshard.gpt import plan as gpt_plan
from jshard.parallel import parallelize

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
bench = importlib.import_module("pipeline")


def test_flops_count_a_loop_by_its_trip_count_and_every_branch_of_a_conditional():
    n, trips, b = 32, 6, 3

    def program(x, w, y, z):
        def body(i, x):
            # a conditional: its taken branch multiplies, the other does not; both count
            return jax.lax.cond(i % 2 == 0, lambda x: jnp.tanh(x @ w), lambda x: x + 1.0, x)

        x = jax.lax.fori_loop(0, trips, body, x)
        return x, jnp.einsum("bij,bjk->bik", y, z)  # a batched contraction, outside the loop

    args = (np.ones((n, n), np.float32), np.ones((n, n), np.float32) / n, np.ones((b, n, 2 * n), np.float32),
            np.ones((b, 2 * n, 5), np.float32))
    figures = bench._hlo_figures(jax.jit(program).lower(*args).compile().as_text(), 1)
    assert figures["flops"] == trips * 2 * n ** 3 + 2 * b * n * (2 * n) * 5
    assert figures["collectives"]["count"] == 0 and figures["permute"]["received_bytes"] == 0


@pytest.mark.parametrize("size", [4, 2, 1])
def test_collective_permutes_and_collectives_across_stages_are_counted_apart(size):
    trips, rows = 5, 3
    mesh = jax.make_mesh((size, 2), ("pp", "dp"), devices=jax.devices()[:2 * size])

    def local(x):
        def body(i, x):
            x = x + jax.lax.psum(x, "dp")  # within a stage, every trip
            return jax.lax.ppermute(x * 2.0, "pp", [(d, (d + 1) % size) for d in range(size)])

        x = jax.lax.fori_loop(0, trips, body, x)
        return jax.lax.psum(x, "pp")  # across the stages, once

    spec = PartitionSpec("pp", "dp")
    program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=PartitionSpec(None, "dp")))
    x = jax.device_put(np.ones((size * rows, 2 * 7), np.float32), NamedSharding(mesh, spec))
    figures = bench._hlo_figures(program.lower(x).compile().as_text(), 2 * size, ((size, 2), 0))
    block = rows * 7 * 4
    assert figures["permute"]["received_bytes"] == (trips * block if size > 1 else 0)
    assert figures["collectives"]["kinds"]["all-reduce"] == trips + 1
    assert figures["across_stages"]["kinds"] == ({"all-reduce": 1} if size > 1 else {})
    if size > 1:
        assert figures["permute"]["count"] == figures["collectives"]["kinds"]["collective-permute"] == trips
        assert figures["across_stages"]["received_bytes"] > 0


def _row(m, v, a, b, load):
    """A row whose pipeline step is ``a * v * m + b`` one-device microbatch times, both sides slowed by ``load``."""
    one = 3.0 * m * load
    return dict(config="c", schedule="s", microbatches=m, virtual_stages=v, schedule_theory=0.0, activation_bytes=8,
                pipeline=dict(step_ms=(a * v * m + b) * 3.0 * load, memory=dict(peak=1000 + 24 * m)),
                one_device=dict(step_ms=one))


@pytest.mark.parametrize("v", [1, 2])
def test_the_fit_across_microbatches_recovers_the_fixed_part_under_a_changing_load(v):
    a, b = 0.7, 2.5
    rows = [_row(m, v, a, b, load) for m, load in ((4, 1.0), (8, 1.9), (16, 1.3))]
    (s,) = bench.across_microbatches(rows)
    assert s["microbatches"] == [4, 8, 16]
    np.testing.assert_allclose([s["per_unit"], s["fixed"]], [a, b], atol=1e-3)
    np.testing.assert_allclose(s["measured_wasted"], [b / (a * v * m + b) for m in (4, 8, 16)], atol=1e-4)
    assert s["peak_growth_per_microbatch"] == 3.0  # 24 bytes a microbatch, in blocks of 8


def test_the_fit_needs_two_microbatch_counts():
    assert bench.across_microbatches([_row(4, 1, 1.0, 1.0, 1.0)]) == []


def _block_bytes(dim: int, tp: int) -> int:
    """One GPT block's parameter bytes a device holds under Megatron's plan on ``tp`` devices, counted by hand:
    q/k/v and up split (kernels and biases), o and down split but for their biases, the two norms whole."""
    split = 3 * (dim * dim + dim) + dim * dim + (4 * dim * dim + 4 * dim) + 4 * dim * dim
    whole = 2 * dim + 2 * 2 * dim
    return 4 * (split // tp + whole)


@pytest.mark.parametrize("shape,names,style", [
    pytest.param((4, 2), ("pp", "dp"), "pp+dp", id="pp4xdp2"),
    pytest.param((2, 4), ("pp", "tp"), "pp+tp", id="pp2xtp4"),
    pytest.param((1, 8), ("pp", "dp"), "pp+dp", id="pp1xdp8", marks=pytest.mark.slow),
    pytest.param((2, 4), ("dp", "tp"), "dp+tp", id="unpipelined", marks=pytest.mark.slow),
    pytest.param((1,), ("pp",), "pp", id="one-device"),
])
def test_blocks_memory_is_what_a_device_holds_of_the_blocks(shape, names, style):
    layers, dim = 4, 16
    make = lambda: GPT(32, dim, 2, layers, 8, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:math.prod(shape)])
    styles, default = gpt_plan(style, microbatches=2)
    figures = bench._blocks_memory(parallelize(make, mesh, styles, default=default), mesh)
    sizes = dict(zip(names, shape, strict=True))
    p = sizes.get("pp", 1)
    whole = sum(np.asarray(a).nbytes for a in jax.tree.leaves(nnx.state(make().blocks, nnx.Param)))
    assert figures["whole_bytes"] == whole == layers * _block_bytes(dim, 1)
    assert figures["without_pp_bytes"] == layers * _block_bytes(dim, sizes.get("tp", 1))
    assert figures["local_bytes"] == figures["without_pp_bytes"] // p
    assert figures["share"] == pytest.approx(1 / p)
