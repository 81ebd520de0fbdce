"""Building a GPT sharded: ``parallelize(make, mesh, plan)`` next to eager ``make()`` and ``nnx.jit(make)``, as the
model gets deeper.

``make = lambda: GPT(vocab, width, 4, layers, 64, rngs=nnx.Rngs(0))`` at 2, 4, 8 and 16 layers (vocabulary 256,
width 64 by default), on 8 devices (emulated on CPU when fewer): eager construction and ``nnx.jit(make)`` (one
device, whatever the mesh), and ``parallelize`` under FSDP over 8 (``default=FullyShard("dp")`` on mesh (8,)) and
under the tp plan on DP2 x TP4, and that again in a process that built the same model once already (its compiled
initialisers reused). Every measurement runs in a fresh process with JAX's persistent compilation cache
off, so no compiled program is shared; it times the call until every parameter is ready (median of ``--repeats``
processes): wall-clock seconds, and the process's CPU seconds (all threads: a second view where other work shares
the cores). ``--before DIR`` measures the ``parallelize`` rows once more with the jshard checked out in ``DIR``
(say ``git worktree add /tmp/before HEAD``), interleaved with these, so that both see the same machine. Targets:
``parallelize``'s time at 16 layers at most 2x its time at 2 layers, and no more than ``nnx.jit(make)``'s at 16
layers. Prints a table and writes JSON.

    python benchmarks/init.py [--layers 2,4,8,16] [--dim 64] [--vocab 256] [--repeats 3] [--before DIR]
                              [--out benchmarks/results/init.json]
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

HEADS, SEQ = 4, 64
# how: (mesh shape, axis names, plan style), None for the builds that place nothing
WAYS = {"eager": None, "nnx.jit": None, "fsdp8": ((8,), ("dp",), "fsdp"), "dp2xtp4": ((2, 4), ("dp", "tp"), "tp"),
        "dp2xtp4 again": ((2, 4), ("dp", "tp"), "tp")}  # the second parallelize of the same model in one process


def child(how: str, layers: int, dim: int, vocab: int) -> tuple[float, float]:
    """Wall-clock and CPU seconds to build the GPT ``how``, from the call to every parameter ready (JAX started
    beforehand)."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from flax import nnx

    from jshard import DArray
    from jshard.gpt import GPT, plan
    from jshard.parallel import parallelize

    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")

    def make():
        return GPT(vocab, dim, HEADS, layers, SEQ, rngs=nnx.Rngs(0))

    if WAYS[how] is not None:
        shape, names, style = WAYS[how]
        mesh = jax.make_mesh(shape, names, devices=devices[:8])
        styles, default = plan(style, dp="dp", tp=names[-1])
    if how.endswith(" again"):  # built once before: its compiled initialisers are there to reuse
        parallelize(make, mesh, styles, default=default)
    t0, c0 = time.perf_counter(), time.process_time()
    if how == "eager":
        model = make()
    elif how == "nnx.jit":
        model = nnx.jit(make)()
    else:
        model = parallelize(make, mesh, styles, default=default)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda a: isinstance(a, DArray))
    jax.block_until_ready([a.block if isinstance(a, DArray) else a for a in leaves])
    return time.perf_counter() - t0, time.process_time() - c0


def measure(how: str, layers: int, args, jshard_dir: str | None = None) -> tuple[float, float]:
    """The medians over ``--repeats`` fresh processes of ``child``'s wall-clock and CPU seconds, with the jshard
    in ``jshard_dir`` (None: the one this script imports)."""
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    if jshard_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([jshard_dir] + [p for p in [env.get("PYTHONPATH")] if p])
    times = []
    for _ in range(args.repeats):
        run = subprocess.run([sys.executable, __file__, "--child", how, str(layers), "--dim", str(args.dim),
                              "--vocab", str(args.vocab)], capture_output=True, text=True, env=env)
        if run.returncode:
            raise SystemExit(f"{how} at {layers} layers failed:\n{run.stderr[-3000:]}")
        times.append(json.loads(run.stdout.strip().splitlines()[-1]))
    return statistics.median(t for t, _ in times), statistics.median(c for _, c in times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,4,8,16")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", metavar="DIR", help="a checkout of jshard to measure parallelize with as well")
    ap.add_argument("--out", default="benchmarks/results/init.json")
    ap.add_argument("--child", nargs=2, metavar=("HOW", "LAYERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.dim, args.vocab)))
        return
    depths = [int(n) for n in args.layers.split(",")]
    rows = [(how, how, None) for how in WAYS]
    if args.before:
        rows += [(f"{how} before", how, args.before) for how in WAYS if WAYS[how] is not None]
    wall, cpu = {name: {} for name, _, _ in rows}, {name: {} for name, _, _ in rows}
    for layers in depths:
        for name, how, jshard_dir in rows:
            wall[name][layers], cpu[name][layers] = measure(how, layers, args, jshard_dir)
            print(f"  {layers:>2} layers  {name:<15} {wall[name][layers]:.2f} s, CPU {cpu[name][layers]:.2f} s",
                  flush=True)
    first, last = depths[0], depths[-1]
    print(f"\nGPT vocab {args.vocab}, width {args.dim}, {HEADS} heads, sequence {SEQ}: seconds to build, each a fresh "
          f"process (median of {args.repeats}); parallelize under fsdp8 (mesh (8,)) and dp2xtp4 (the tp plan)")
    summary = {}
    for title, seconds in (("wall-clock", wall), ("CPU, all threads", cpu)):
        print(f"\n{title:<16}" + "".join(f"{f'{n} layers':>11}" for n in depths)
              + f"{f'{last}/{first} layers':>15}{f'/nnx.jit at {last}':>16}")
        for name, _, _ in rows:
            growth = seconds[name][last] / seconds[name][first]
            versus = seconds[name][last] / seconds["nnx.jit"][last]
            summary.setdefault(name, {})[title] = {"growth": round(growth, 3), "vs_nnx_jit": round(versus, 3)}
            print(f"{name:<16}" + "".join(f"{seconds[name][n]:>11.2f}" for n in depths)
                  + f"{growth:>15.2f}{versus:>16.2f}")
    again = {n: wall["dp2xtp4 again"][n] / wall["dp2xtp4"][n] for n in depths}
    print(f"\ntargets (fsdp8, dp2xtp4): {last}/{first} layers <= 2, /nnx.jit at {last} <= 1; a second parallelize "
          f"<= 0.3x the first: " + ", ".join(f"{again[n]:.2f}x at {n} layers" for n in depths))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import write_json

    write_json(args.out, wall={name: {str(n): s for n, s in t.items()} for name, t in wall.items()},
               cpu={name: {str(n): s for n, s in t.items()} for name, t in cpu.items()}, summary=summary,
               layers=depths, dim=args.dim, vocab=args.vocab, heads=HEADS, seq=SEQ, before=args.before,
               again={str(n): round(r, 3) for n, r in again.items()})


if __name__ == "__main__":
    main()
