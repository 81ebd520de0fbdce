"""Deep models, scanned: the first call (``parallelize`` + the first ``TrainStep``) of a GPT whose blocks are stacked
by ``nnx.vmap`` and run by ``nnx.scan`` (``GPT(..., scan=True)``), as the model gets deeper, beside the same GPT
with a Python list of blocks.

Each measurement runs in a fresh process with JAX's persistent compilation cache off, on 8 devices (emulated on
CPU when fewer), plan ``fsdp+tp`` on DP2 x TP4 (FullyShard inside each layer, Megatron's tensor parallelism), a
batch of 8 x 64 tokens, width 64, vocabulary 256: wall-clock seconds from the call to ``parallelize`` until the
first loss is on the host (median of ``--repeats`` processes), and the steady step's time (median of 10 steps).
Target: the scanned model's first call at 32 layers at most 1.5x its first call at 4 layers. Prints a table and
writes JSON.

    python benchmarks/scan_layers.py [--layers 4,32] [--repeats 3] [--out benchmarks/results/scan_layers.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

VOCAB, DIM, HEADS, SEQ, BATCH = 256, 64, 4, 64, 8


def child(layers: int, scan: bool) -> dict:
    """Seconds to the first loss (parallelize + first step) and per steady step, in this fresh process."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    import numpy as np
    import optax
    from flax import nnx

    import jshard
    from jshard import Replicate, Shard
    from jshard.gpt import GPT, cross_entropy, plan
    from jshard.parallel import TrainStep, parallelize

    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices[:8])
    styles, default = plan("fsdp+tp", scan=scan)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    batch = [jshard.distribute(a, mesh, [Shard(0), Replicate()]) for a in (ids, np.roll(ids, -1, 1))]
    t0 = time.perf_counter()
    model = parallelize(lambda: GPT(VOCAB, DIM, HEADS, layers, SEQ, rngs=nnx.Rngs(0), scan=scan), mesh, styles,
                        default=default)
    step = TrainStep(model, optax.adamw(1e-3), lambda m, ids, labels: cross_entropy(m(ids), labels))
    first_loss = float(step(*batch))
    first = time.perf_counter() - t0
    times = []
    for _ in range(10):
        t = time.perf_counter()
        float(step(*batch))
        times.append(time.perf_counter() - t)
    return {"first_s": first, "step_s": statistics.median(times), "loss": first_loss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("LAYERS", "SCAN"), help="(internal) one measurement, as JSON")
    ap.add_argument("--out", default="benchmarks/results/scan_layers.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1] == "scan")))
        return
    layers = [int(n) for n in args.layers.split(",")]
    runs: dict = {}
    for _ in range(args.repeats):  # interleaved, so that both kinds see the same machine
        for n in layers:
            for kind in ("scan", "list"):
                out = subprocess.run([sys.executable, __file__, "--child", str(n), kind], capture_output=True,
                                     text=True, check=True)
                runs.setdefault((kind, n), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for (kind, n), got in sorted(runs.items()):
        rows.append({"blocks": kind, "layers": n, "first_s": statistics.median(r["first_s"] for r in got),
                     "step_s": statistics.median(r["step_s"] for r in got), "loss": got[0]["loss"]})
    print(f"{'blocks':<8} {'layers':>6} {'first call s':>13} {'x its first':>12} {'step ms':>9}")
    base = {r["blocks"]: r["first_s"] for r in rows if r["layers"] == min(layers)}
    for r in rows:
        r["vs_fewest"] = r["first_s"] / base[r["blocks"]]
        print(f"{r['blocks']:<8} {r['layers']:>6} {r['first_s']:>13.2f} {r['vs_fewest']:>12.2f} "
              f"{1e3 * r['step_s']:>9.1f}")
    deepest = next(r for r in rows if r["blocks"] == "scan" and r["layers"] == max(layers))
    print(f"target: scanned first call at {max(layers)} layers <= 1.5x at {min(layers)}: "
          f"{deepest['vs_fewest']:.2f}x ({'met' if deepest['vs_fewest'] <= 1.5 else 'missed'})")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "repeats": args.repeats, "devices": 8}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
