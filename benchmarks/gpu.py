"""One device, the GPU where there is one (else the CPU): what jshard costs where there is nothing to shard.

On a mesh of one device (``jax.make_mesh((1,), ("dp",))``) every placement is Replicate and no collective runs,
so whatever separates a jshard program from the same program under ``jax.jit`` is jshard's own cost:

- dispatch: µs per call of a small program (a 64x64 matmul), ``jshard.jit`` next to ``jax.jit``, interleaved
  round by round (a noisy machine slows both alike), the median of each and of the per-round ratios;
- step: the GPT of ``jshard.gpt`` trained with AdamW, ``TrainStep`` on ``parallelize(make, mesh, {}, default=())``
  next to ``one_device_trainer`` (plain ``jax.jit``), at a small and a larger size, interleaved rounds; every step
  reads its loss, as a loop that logs it does, so a step's dispatch counts rather than hiding behind the device's
  queue;
- build: eager construction, ``nnx.jit(make)`` and ``parallelize(make, ...)`` (built abstractly, then the
  initialisers run as one program), parameters ready on the device;
- first call: making the step and taking its first step (trace, plan, compile, run), ``jax.jit`` after the eager
  build and jshard after ``parallelize``. Builds and first calls each run in a fresh process, so none pays
  another's warm-up (JAX's persistent compilation cache is off);
- losses: the first steps' losses of both sides agree within the rounding bound (``curve_ratio`` <= 1).

No XLA flag is set: on a CPU-only machine this runs on one CPU device, unchanged on a machine with one GPU.
Prints a table and writes JSON.

    python benchmarks/gpu.py [--quick | --full] [--out benchmarks/results/gpu.json]

Sizes: ``--full`` is the pair for an accelerator (the larger: width 1024, 8 layers, vocabulary 32768, sequence 512,
about 170M parameters), ``--quick`` a pair for a CPU (the whole run takes a few minutes on 2 cores); the default is
``--full`` on an accelerator and ``--quick`` on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jshard
from jshard import Replicate, Shard
from jshard.gpt import GPT, cross_entropy, one_device_trainer, summed_terms
from jshard.parallel import TrainStep, parallelize
from jshard.validate.tolerance import curve_ratio
from report import write_json

# a first call must compile, not read a program an earlier run left on disk
jax.config.update("jax_enable_compilation_cache", False)

# {size: {--quick / --full: (vocab, width, heads, layers, sequence, batch)}}
SIZES = {"small": {"quick": (256, 64, 4, 2, 64, 8), "full": (256, 128, 4, 2, 64, 16)},
         "large": {"quick": (2048, 256, 8, 4, 128, 8), "full": (32768, 1024, 16, 8, 512, 8)}}
# by --quick / --full: (steps per round, interleaved rounds); the losses compared are those of an untimed pass over
# the round's batches before the rounds
ROUNDS = {"quick": (5, 5), "full": (10, 10)}
BUILDS = ("eager", "nnx.jit", "parallelize")


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def sizes(args) -> str:
    """``quick`` or ``full``: as asked, else by the platform of the device this process sees."""
    return args.sizes or ("quick" if jax.default_backend() == "cpu" else "full")


def one_device_mesh():
    return jax.make_mesh((1,), ("dp",), devices=jax.devices()[:1])


def maker(vocab, dim, heads, layers, seq, batch):
    return lambda: GPT(vocab, dim, heads, layers, seq, rngs=nnx.Rngs(0))


def batches(dims, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    vocab, _, _, _, seq, batch = dims
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, vocab, (batch, seq)).astype(np.int32) for _ in range(2)) for _ in range(steps)]


def on_device(batch, mesh, jshard_side: bool):
    """A batch where each side's step takes it: DArrays sharded on dp for jshard, arrays on the device for jax.jit
    (data loading is no part of a step)."""
    if jshard_side:
        return [jshard.distribute(a, mesh, [Shard(0)]) for a in batch]
    return [jax.device_put(a, mesh.devices.flat[0]) for a in batch]


def child(build: str, dims) -> dict:
    """Build the model one way in this fresh process, then (but for ``nnx.jit``) make the step and take its first."""
    jax.block_until_ready(jnp.zeros(8))  # the backend is up: its start-up is no part of either side
    mesh, make, tx = one_device_mesh(), maker(*dims), optax.adamw(1e-3)
    t0 = time.perf_counter()
    model = {"eager": make, "nnx.jit": nnx.jit(make),
             "parallelize": lambda: parallelize(make, mesh, {}, default=())}[build]()
    jax.block_until_ready(nnx.state(model))
    row = {"build_s": time.perf_counter() - t0}
    if build != "nnx.jit":
        batch = on_device(batches(dims, 1)[0], mesh, build == "parallelize")
        t0 = time.perf_counter()
        step = TrainStep(model, tx, loss_fn) if build == "parallelize" else one_device_trainer(model, tx, loss_fn)
        float(step(*batch))
        row["first_call_s"] = time.perf_counter() - t0
    return row


def fresh(build: str, size: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", build, size] + ([f"--{args.sizes}"] if args.sizes else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{build} ({size}) failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def interleaved(ours, theirs, rounds: int, reps: int, unit: float) -> dict:
    """Time per call of ``ours(i)`` and ``theirs(i)`` (i = 0..reps-1) in ``unit`` seconds, medians over ``rounds``
    rounds, and the median, least and greatest of the rounds' ratios; a round runs each side ``reps`` times and
    then waits for its last result."""
    times = {"jshard": [], "jax.jit": []}
    for _ in range(rounds):
        for name, call in (("jshard", ours), ("jax.jit", theirs)):
            t0 = time.perf_counter()
            for i in range(reps):
                out = call(i)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / reps / unit)
    ratios = sorted(a / b for a, b in zip(times["jshard"], times["jax.jit"], strict=True))
    return {"jshard": statistics.median(times["jshard"]), "jax.jit": statistics.median(times["jax.jit"]),
            "ratio": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]}


def dispatch(mesh, rounds: int = 40, reps: int = 200) -> dict:
    a, b = np.random.default_rng(0).normal(size=(2, 64, 64)).astype(np.float32)
    ours, theirs = jshard.jit(lambda x, y: x @ y), jax.jit(lambda x, y: x @ y)
    da, db = (jshard.distribute(v, mesh, [Replicate()]) for v in (a, b))
    ja, jb = (jax.device_put(v, mesh.devices.flat[0]) for v in (a, b))
    jax.block_until_ready((ours(da, db), theirs(ja, jb)))  # compiled before the clock starts
    return interleaved(lambda i: ours(da, db), lambda i: theirs(ja, jb), rounds, reps, unit=1e-6)


def steady(dims, steps: int, rounds: int) -> dict:
    """Step times of both sides in this process (both warm), and the losses of their first ``steps`` steps."""
    mesh, make, tx = one_device_mesh(), maker(*dims), optax.adamw(1e-3)
    ours = TrainStep(parallelize(make, mesh, {}, default=()), tx, loss_fn)
    theirs = one_device_trainer(make(), tx, loss_fn)
    data = batches(dims, steps)
    ours_data, theirs_data = ([on_device(b, mesh, side) for b in data] for side in (True, False))
    ours_losses = [float(ours(*b)) for b in ours_data]
    theirs_losses = [theirs(*b) for b in theirs_data]
    t = interleaved(lambda i: float(ours(*ours_data[i])), lambda i: theirs(*theirs_data[i]), rounds, steps,
                    unit=1e-3)
    vocab, dim, _, layers, seq, batch = dims
    ratio = curve_ratio(ours_losses, theirs_losses, n_per_step=summed_terms(vocab, dim, layers, seq, batch))
    darrays = jax.tree.leaves(ours.params, is_leaf=lambda a: isinstance(a, jshard.DArray))
    params = sum(int(np.prod(p.shape)) for p in darrays)
    return dict(params=params, jshard_step_ms=t["jshard"], jax_step_ms=t["jax.jit"],
                ratio=t["ratio"], ratio_min=t["ratio_min"], ratio_max=t["ratio_max"], loss_curve_ratio=ratio,
                losses_agree=bool(ratio <= 1), jshard_losses=ours_losses, jax_losses=theirs_losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", dest="sizes", action="store_const", const="quick", help="sizes for a CPU")
    which.add_argument("--full", dest="sizes", action="store_const", const="full", help="sizes for an accelerator")
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--child", nargs=2, metavar=("BUILD", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        build, size = args.child
        print(json.dumps(child(build, SIZES[size][sizes(args)])))
        return
    # the fresh processes run before this one touches a device: the first process to use a GPU takes most of its
    # memory (XLA preallocates), which would leave too little for another
    first = {(build, size): fresh(build, size, args) for size in SIZES for build in BUILDS}
    which = sizes(args)
    steps, rounds = ROUNDS[which]
    mesh = one_device_mesh()
    over = dispatch(mesh)
    rows = []
    for size in SIZES:
        dims = SIZES[size][which]
        row = dict(size=size, vocab=dims[0], dim=dims[1], heads=dims[2], layers=dims[3], seq=dims[4], batch=dims[5],
                   **steady(dims, steps, rounds))
        for build in BUILDS:
            got = first[build, size]
            row[f"{build}_build_s"] = got["build_s"]
            if "first_call_s" in got:
                row[f"{'jshard' if build == 'parallelize' else 'jax'}_first_call_s"] = got["first_call_s"]
        rows.append(row)
        print(f"{size}: step ratio {row['ratio']:.2f}", file=sys.stderr, flush=True)

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, flax {flax.__version__}; sizes: "
          f"{which}; {steps} steps per round, {rounds} interleaved rounds\n")
    print(f"dispatch, 64x64 matmul: jshard.jit {over['jshard']:.1f} µs, jax.jit {over['jax.jit']:.1f} µs, ratio "
          f"{over['ratio']:.2f} ({over['ratio_min']:.2f}-{over['ratio_max']:.2f})\n")
    print(f"{'size':<6} {'params':>7} {'vocab':>6} {'width':>6} {'layers':>6} {'seq':>4} {'batch':>5} "
          f"{'step ms jshard':>15} {'jax.jit':>8} {'ratio med (min-max)':>20} {'build s eager':>14} {'nnx.jit':>8} "
          f"{'parallelize':>12} {'first s jax.jit':>16} {'jshard':>7} {'losses':>7}")
    for r in rows:
        print(f"{r['size']:<6} {r['params'] / 1e6:>6.1f}M {r['vocab']:>6} {r['dim']:>6} {r['layers']:>6} "
              f"{r['seq']:>4} {r['batch']:>5} {r['jshard_step_ms']:>15.2f} {r['jax_step_ms']:>8.2f} "
              f"{r['ratio']:>8.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) {r['eager_build_s']:>14.2f} "
              f"{r['nnx.jit_build_s']:>8.2f} {r['parallelize_build_s']:>12.2f} {r['jax_first_call_s']:>16.2f} "
              f"{r['jshard_first_call_s']:>7.2f} {'agree' if r['losses_agree'] else 'DIFFER':>7}")
    print("\nbuild: parameters ready on the device; first call: making the step and taking its first step; each in a "
          "fresh process")
    write_json(args.out, device=device.device_kind, platform=device.platform, flax=flax.__version__, sizes=which,
               steps=steps,
               rounds=rounds, dispatch_us=over, rows=rows)


if __name__ == "__main__":
    main()
