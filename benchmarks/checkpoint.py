"""Checkpoint save and restore of a GPT's parameters: ``jshard.checkpoint`` next to Orbax's own ``StandardCheckpointer``
saving the equivalent ``NamedSharding`` arrays (``DArray.to_jax()``).

A GPT of width 1024, vocabulary 32k and 8 layers (about 170M float32 parameters, 0.67 GB) built sharded on 8
devices (emulated on CPU when fewer) under DP2 x TP4 (the tp plan) and FSDP8. Every measurement runs in a fresh
process, so the peak is its own: the host's peak resident memory (VmHWM) over the process's resident memory just
before the operation (``VmHWM`` reset there; a restore starts with only the target layouts in hand). Per setup and
way (jshard / Orbax):

- ``save``: the parameters to a new directory (median of ``--repeats`` saves, each to its own directory);
- ``restore same``: into the layouts they were saved under;
- ``restore other``: into the other setup's layouts (DP2 x TP4 <-> FSDP8: every device reads other rows).

Targets: jshard's time within 1.2x of Orbax's, and no more peak memory. Every GPT parameter's layout is one a
``NamedSharding`` expresses (even shards at these sizes), so jshard hands it to Orbax's own array handler: the
ratios measure what jshard adds around it (flattening the tree, wrapping restored arrays as DArrays). Uneven
layouts, which no ``NamedSharding`` expresses, go through jshard's own handler and are not measured here (Orbax
has nothing to compare them with). Prints a table and writes JSON.

    python benchmarks/checkpoint.py [--layers 8] [--dim 1024] [--vocab 32768] [--repeats 3]
                                    [--out benchmarks/results/checkpoint.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import mb, reset_peak, rss  # noqa: E402

SETUPS = {"dp2xtp4": ((2, 4), ("dp", "tp"), "tp"), "fsdp8": ((8,), ("dp",), "fsdp")}
OTHER = {"dp2xtp4": "fsdp8", "fsdp8": "dp2xtp4"}
HEADS, SEQ = 16, 128


def mesh_of(setup: str):
    import jax

    shape, names, _ = SETUPS[setup]
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    return jax.make_mesh(shape, names, devices=devices[:8])


def build(setup: str, layers: int, dim: int, vocab: int) -> dict:
    """The GPT's parameters under ``setup``, built sharded, as a flat dict of DArrays keyed by path."""
    import jax
    from flax import nnx

    from jshard import DArray
    from jshard.gpt import GPT, plan
    from jshard.parallel import parallelize

    mesh = mesh_of(setup)
    styles, default = plan(SETUPS[setup][2], dp="dp", tp=mesh.axis_names[-1])
    model = parallelize(lambda: GPT(vocab, dim, HEADS, layers, SEQ, rngs=nnx.Rngs(0)), mesh, styles, default=default)
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=lambda a: isinstance(a, DArray))[0]
    params = {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): x for path, x in flat}
    jax.block_until_ready([x.block for x in params.values()])
    return params


def child(setup: str, how: str, op: str, directory: str, layers: int, dim: int, vocab: int, repeats: int) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import jshard.checkpoint

    target = setup if op != "restore_other" else OTHER[setup]
    layouts = os.path.join(directory, f"layouts-{target}.pkl")
    if op == "save":
        params = build(setup, layers, dim, vocab)
        with open(layouts, "wb") as f:  # what a restore into this setup asks for, without building the model
            pickle.dump({k: (x.placements, x.shape, x.dtype) for k, x in params.items()}, f)
        tree = params if how == "jshard" else {k: x.to_jax() for k, x in params.items()}
        del params
    else:  # a restore starts with nothing but the target layouts
        with open(layouts, "rb") as f:
            mesh = mesh_of(target)
            specs = {k: jshard.Spec.create(mesh, p, shape, dtype) for k, (p, shape, dtype) in pickle.load(f).items()}
    gc.collect()
    times = []
    reset_peak()
    base = rss()
    if op == "save":
        for r in range(repeats):
            path = os.path.join(directory, f"{setup}-{how}-{r}")
            t0 = time.perf_counter()
            if how == "jshard":
                jshard.checkpoint.save(path, tree)
            else:
                with ocp.StandardCheckpointer() as c:
                    c.save(path, tree)
            times.append(time.perf_counter() - t0)
    else:
        path = os.path.join(directory, f"{setup}-{how}-0")
        for _ in range(repeats):
            t0 = time.perf_counter()
            if how == "jshard":
                back = jshard.checkpoint.restore(path, like=specs)
                jax.block_until_ready([x.block for x in back.values()])
            else:
                like = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.to_named_sharding())
                        for k, x in specs.items()}
                with ocp.StandardCheckpointer() as c:
                    back = c.restore(path, like)
                jax.block_until_ready(back)
            times.append(time.perf_counter() - t0)
            del back
    total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in (specs if op != "save" else tree).values())
    return {"setup": setup, "how": how, "op": op, "target": target, "params_bytes": total, "seconds": times,
            "median_s": statistics.median(times), "peak_bytes": rss("VmHWM") - base}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/checkpoint.json")
    ap.add_argument("--child", nargs=4, metavar=("SETUP", "HOW", "OP", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = ["--layers", str(args.layers), "--dim", str(args.dim), "--vocab", str(args.vocab),
             "--repeats", str(args.repeats)]
    if args.child:
        print(json.dumps(child(*args.child, args.layers, args.dim, args.vocab, args.repeats)))
        return
    rows = []
    directory = tempfile.mkdtemp(prefix="jshard-bench-checkpoint-")
    try:
        for op in ("save", "restore_same", "restore_other"):  # saves first: restores read them
            for setup in SETUPS:
                for how in ("jshard", "orbax"):  # side by side, a fresh process each
                    run = subprocess.run([sys.executable, __file__, "--child", setup, how, op, directory, *sizes],
                                         capture_output=True, text=True)
                    if run.returncode:
                        raise SystemExit(f"{setup}/{how}/{op} failed:\n{run.stderr[-3000:]}")
                    rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
                    print(f"  {setup:<8} {op:<14} {how:<7} {rows[-1]['median_s']:.2f} s", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\nGPT parameters: vocab {args.vocab}, width {args.dim}, {args.layers} layers: "
          f"{mb(rows[0]['params_bytes'])} MB float32; median of {args.repeats}; peak = host VmHWM over the "
          "resident memory before the operation (peak reset there)\n")
    print(f"{'saved under':<12} {'operation':<22} {'jshard s':>9} {'Orbax s':>8} {'time ratio':>11} "
          f"{'jshard peak MB':>15} {'Orbax peak MB':>14} {'peak ratio':>11}")
    by = {(r["setup"], r["op"], r["how"]): r for r in rows}
    summary = []
    for setup in SETUPS:
        for op in ("save", "restore_same", "restore_other"):
            a, b = by[(setup, op, "jshard")], by[(setup, op, "orbax")]
            shown = {"save": "save", "restore_same": "restore, same layout",
                     "restore_other": f"restore into {OTHER[setup]}"}[op]
            t, p = a["median_s"] / b["median_s"], a["peak_bytes"] / max(b["peak_bytes"], 1)
            summary.append({"setup": setup, "op": op, "time_ratio": round(t, 3), "peak_ratio": round(p, 3)})
            print(f"{setup:<12} {shown:<22} {a['median_s']:>9.2f} {b['median_s']:>8.2f} {t:>11.2f} "
                  f"{mb(a['peak_bytes']):>15} {mb(b['peak_bytes']):>14} {p:>11.2f}")
    print("\ntargets: time ratio <= 1.2, peak ratio <= 1.0")
    from report import write_json

    write_json(args.out, rows=rows, summary=summary, layers=args.layers, dim=args.dim, vocab=args.vocab)


if __name__ == "__main__":
    main()
