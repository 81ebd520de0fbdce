"""Per-call overhead: what ``TrainStep`` and ``jshard.jit`` cost per call next to ``jax.jit``'s own fast path.

Two measurements, each jshard against plain ``jax.jit`` with the same ``NamedSharding``s in one process,
interleaved round by round (a noisy machine slows both alike), median of the per-round ratios:

- one SGD(0.1) step of DTensor's own test Transformer (``docs/anchors.md``: vocab 32, sequence 16, width 32, 4
  heads, 2 layers, attention without bias, MLP with bias, untied output without bias: 27,776 parameters; batch
  4 x 16) under the Megatron plan, TP4 on a (4,) mesh and DP2 x TP4 on (2, 4): ``TrainStep`` against
  ``jax.jit`` of the same step with donated parameters and optimizer state (targets <= 1.05);
- a bare call of a 64x64 matmul + tanh, replicated, on 8 devices and on one (a second process without the
  emulated devices' flag) (target <= 1.10).

Besides time, each row counts the Python function calls one call makes (``cProfile``): jax.jit's C++ fast path
makes almost none, so the count is jshard's own Python work, free of the machine's noise. Prints a table and
writes JSON.

    python benchmarks/overhead.py [--rounds 15] [--steps 20] [--reps 200] [--out benchmarks/results/overhead.json]
"""

from __future__ import annotations

import os
import sys

# the one-device run is this script again, in a process that never sees the emulated devices' flag
ONE_DEVICE = "--one-device" in sys.argv
os.environ.setdefault("XLA_FLAGS", "" if ONE_DEVICE else "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import jshard  # noqa: E402
from jshard import Replicate, Shard  # noqa: E402
from jshard.gpt import cross_entropy  # noqa: E402
from jshard.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, TrainStep, parallelize  # noqa: E402
from report import write_json  # noqa: E402

VOCAB, SEQ, DIM, HEADS, LAYERS, BATCH = 32, 16, 32, 4, 2, 4
PARAMETERS = 27_776
SETUPS = {"tp4": ((4,), ("tp",)), "dp2xtp4": ((2, 4), ("dp", "tp"))}  # as train_step.py's


class Block(nnx.Module):
    """DTensor's TransformerBlock: LayerNorm -> causal attention (no bias) -> residual -> LayerNorm -> MLP."""

    def __init__(self, rngs: nnx.Rngs):
        self.attention_norm, self.ffn_norm = nnx.LayerNorm(DIM, rngs=rngs), nnx.LayerNorm(DIM, rngs=rngs)
        self.wq, self.wk, self.wv, self.wo = (nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs) for _ in range(4))
        self.w1, self.w2 = nnx.Linear(DIM, 4 * DIM, rngs=rngs), nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (f(h).reshape(b, t, HEADS, d // HEADS) for f in (self.wq, self.wk, self.wv))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(d // HEADS))
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(x.dtype).min)
        x = x + self.wo(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d))
        return x + self.w2(jax.nn.gelu(self.w1(self.ffn_norm(x)), approximate=False))


class Transformer(nnx.Module):
    """DTensor's test Transformer (``ModelArgs(vocab_size=32, dim=32)``, weight tying off, dropout 0)."""

    def __init__(self, rngs: nnx.Rngs):
        self.tok_embeddings, self.pos_embeddings = nnx.Embed(VOCAB, DIM, rngs=rngs), nnx.Embed(SEQ, DIM, rngs=rngs)
        self.layers = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.output = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.tok_embeddings(ids) + self.pos_embeddings(jnp.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def megatron(tp: str) -> dict:
    """DTensor's test plan: embedding vocabulary-sharded, wq/wk/wv/w1 column, wo/w2 row, the output column
    parallel with replicated logits, norms replicated."""
    col, row, norm = ColwiseParallel(tp), RowwiseParallel(tp), ParallelStyle(tp, output=Replicate())
    return {"tok_embeddings": row, "layers/*/wq": col, "layers/*/wk": col, "layers/*/wv": col, "layers/*/w1": col,
            "layers/*/wo": row, "layers/*/w2": row, "layers/*/attention_norm": norm, "layers/*/ffn_norm": norm,
            "norm": norm, "output": ColwiseParallel(tp, output=Replicate())}


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def python_calls(call, n: int = 50) -> float:
    """Python function calls (cProfile's count, C functions included) per call of ``call``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    return pstats.Stats(prof).total_calls / n


def interleaved(calls: dict, rounds: int, reps: int, ready) -> dict:
    """Median µs per call of each side, the median of the per-round ratios (first side over second), and the
    calling thread's CPU µs per call (dispatch and Python, the devices' threads left out: steadier than wall time
    where other work shares the cores)."""
    times, cpu = {name: [] for name in calls}, {name: [] for name in calls}
    for name, call in calls.items():  # warm up
        ready(call())
    for _ in range(rounds):
        for name, call in calls.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(reps):
                r = call()
            c1 = time.thread_time()
            ready(r)
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
            cpu[name].append((c1 - c0) / reps * 1e6)
    (a, ta), (b, tb) = times.items()
    ratios = sorted(x / y for x, y in zip(ta, tb, strict=True))
    return {f"{a}_us": round(statistics.median(ta), 1), f"{b}_us": round(statistics.median(tb), 1),
            "ratio": round(statistics.median(ratios), 3), "ratio_min": round(ratios[0], 3),
            "ratio_max": round(ratios[-1], 3),
            **{f"{name}_thread_cpu_us": round(statistics.median(c), 1) for name, c in cpu.items()},
            **{f"{name}_python_calls": python_calls(call) for name, call in calls.items()}}


def ready(r):
    jax.block_until_ready(r.block if isinstance(r, jshard.DArray) else r)


def train_step(setup: str, rounds: int, steps: int) -> dict:
    """``TrainStep`` against ``jax.jit`` of the same step on the same placements (as ``train_step.py`` builds it:
    the parallelized model's specs as ``PartitionSpec``s on an Auto mesh)."""
    shape, names = SETUPS[setup]
    n = int(np.prod(shape))
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:n])
    tx = optax.sgd(0.1)
    model = parallelize(lambda: Transformer(nnx.Rngs(0)), mesh, megatron(names[-1]))
    params = nnx.state(model, nnx.Param)
    assert sum(d.size for d in jax.tree.leaves(nnx.state(Transformer(nnx.Rngs(0)), nnx.Param))) == PARAMETERS
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32) for _ in range(2)]
    data = tuple(Shard(0) if a == "dp" else Replicate() for a in names)
    step = TrainStep(model, tx, loss_fn)
    dbatch = [jshard.distribute(a, mesh, data) for a in batch]

    auto = jax.make_mesh(shape, names, devices=jax.devices()[:n], axis_types=(AxisType.Auto,) * len(shape))
    graphdef, plain, rest = nnx.split(Transformer(nnx.Rngs(0)), nnx.Param, ...)
    specs = jax.tree.map(lambda d: d.spec.to_partition_spec(), params, is_leaf=lambda a: isinstance(a, jshard.DArray))
    state = [jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(auto, s)), plain, specs)]
    state.append(jax.jit(tx.init)(state[0]))
    jbatch = [jax.device_put(a, NamedSharding(auto, PartitionSpec(*(("dp",) if "dp" in names else ())))) for a in batch]

    def plain_step(params, opt_state, ids, labels):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), ids, labels))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jstep = jax.jit(plain_step, out_shardings=(jax.tree.map(lambda a: a.sharding, state[0]), None, None),
                    donate_argnums=(0, 1))

    def theirs():
        state[0], state[1], loss = jstep(state[0], state[1], *jbatch)
        return loss

    losses = float(step(*dbatch)), float(theirs())
    row = interleaved({"jshard": lambda: step(*dbatch), "jax.jit": theirs}, rounds, steps, ready)
    return dict(setup=setup, parameters=PARAMETERS, first_loss_jshard=losses[0], first_loss_jax=losses[1], **row)


def bare_call(rounds: int, reps: int) -> dict:
    """A 64x64 matmul + tanh on every device of a one-axis mesh, replicated: ``jshard.jit`` against ``jax.jit``."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices())
    a = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    x, w = (jshard.distribute(a, mesh, [Replicate()]) for _ in range(2))
    f = jshard.jit(lambda x, w: jnp.tanh(x @ w))
    replicated = NamedSharding(mesh, PartitionSpec())
    xj, wj = (jax.device_put(a, replicated) for _ in range(2))
    g = jax.jit(lambda x, w: jnp.tanh(x @ w))
    return dict(devices=n, **interleaved({"jshard": lambda: f(x, w), "jax.jit": lambda: g(xj, wj)}, rounds, reps,
                                         ready))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20, help="train steps per round")
    ap.add_argument("--reps", type=int, default=200, help="bare calls per round")
    ap.add_argument("--setups", default="tp4,dp2xtp4")
    ap.add_argument("--one-device", action="store_true", help="(internal) the bare call alone, printed as JSON")
    ap.add_argument("--out", default="benchmarks/results/overhead.json")
    args = ap.parse_args()
    if args.one_device:
        print(json.dumps(bare_call(args.rounds, args.reps)))
        return
    steps = [train_step(s, args.rounds, args.steps) for s in args.setups.split(",") if s]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    one = subprocess.run([sys.executable, __file__, "--one-device", "--rounds", str(args.rounds), "--reps",
                          str(args.reps)], env=env, check=True, capture_output=True, text=True)
    bare = [json.loads(one.stdout.strip().splitlines()[-1]), bare_call(args.rounds, args.reps)]
    print(f"{'case':<22} {'jshard µs':>10} {'jax.jit µs':>11} {'ratio med (min-max)':>20} {'target':>7} "
          f"{'thread CPU µs':>14} {'jax.jit':>8} {'Python calls':>13} {'jax.jit':>8}")
    for name, r, target in ([(f"step {r['setup']}", r, 1.05) for r in steps]
                            + [(f"bare call, {r['devices']} dev", r, 1.10) for r in bare]):
        print(f"{name:<22} {r['jshard_us']:>10.1f} {r['jax.jit_us']:>11.1f} {r['ratio']:>8.3f} "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) {target:>7.2f} {r['jshard_thread_cpu_us']:>14.1f} "
              f"{r['jax.jit_thread_cpu_us']:>8.1f} {r['jshard_python_calls']:>13.0f} {r['jax.jit_python_calls']:>8.0f}")
    print("thread CPU: the calling thread's CPU time per call; Python calls: cProfile's count per call")
    write_json(args.out, steps=steps, bare_calls=bare)


if __name__ == "__main__":
    main()
