"""Memory of a GPT bigger than toy size: sharded initialisation, and the training step next to GSPMD.

A GPT of width 1024, vocabulary 32k and 8 layers (about 170M float32 parameters, 0.67 GB) on 8 devices (emulated
on CPU when fewer), FSDP over 8 and DP2 x TP4. Each setup runs in a fresh process per way of building the model:

- ``constructor``: ``parallelize(lambda: GPT(...), mesh, plan)``, the sharded initialisation;
- ``built``: ``parallelize(GPT(...), mesh, plan)``, built eagerly on one device and then distributed.

Measured: the host's peak resident memory (VmHWM) over the process's baseline after imports; the bytes the
devices hold afterwards; the initialisation program's per-device peak (``memory_analysis``: outputs plus
temporaries) over the device's share of the parameters. On CPU the devices' memory is host memory too, so
"host beyond devices" is the host peak less the devices' peak (all devices' init peaks, or what they hold).
And the compiled training step's per-device arguments and temporaries, jshard's ``TrainStep`` next to ``jax.jit``
with the same ``NamedSharding``s (lowered from shapes, never run). Targets: init peak per device <= 1.1x the
share; host beyond devices < 2x the parameters; the step's temp + argument bytes <= GSPMD's. Prints a table and
writes JSON.

    python benchmarks/memory.py [--layers 8] [--dim 1024] [--vocab 32768] [--out benchmarks/results/memory.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

SETUPS = {"fsdp8": ((8,), ("dp",), "fsdp"), "dp2xtp4": ((2, 4), ("dp", "tp"), "tp")}
HEADS, SEQ, BATCH = 16, 128, 8


def rss(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak so far (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident memory (Linux >= 4.0), so the next peak is an operation's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}


def child(setup: str, how: str, layers: int, dim: int, vocab: int) -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import jshard
    from jshard import DArray, Replicate, Shard
    from jshard.gpt import GPT, cross_entropy, plan
    from jshard.parallel import TrainStep, parallelize

    shape, names, style = SETUPS[setup]
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    mesh = jax.make_mesh(shape, names, devices=devices[:8])
    styles, default = plan(style, dp="dp", tp=names[-1])

    def make():
        return GPT(vocab, dim, HEADS, layers, SEQ, rngs=nnx.Rngs(0))

    jax.block_until_ready(jax.numpy.zeros(8))  # backends up: the baseline includes the runtime
    base = rss()
    t0 = time.perf_counter()
    model = parallelize(make if how == "constructor" else make(), mesh, styles, default=default)
    params = [a for a in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda a: isinstance(a, DArray))]
    jax.block_until_ready([p.block for p in params])
    init_s = time.perf_counter() - t0
    peak = rss("VmHWM") - base
    total = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in params)
    per_device = {}
    for p in params:
        for s in p.block.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    share = max(per_device.values())
    held = sum(per_device.values())
    on_cpu = devices[0].platform == "cpu"
    row = dict(setup=setup, how=how, params=sum(int(np.prod(p.shape)) for p in params), params_bytes=total,
               share_bytes=share, init_s=round(init_s, 2), host_peak_bytes=peak, devices_hold_bytes=held,
               host_beyond_devices_bytes=peak - held if on_cpu else peak)
    if how == "constructor":  # the initialiser's own program, as parallelize runs it
        pins = [p.placements for p in params]
        init = jshard.jit(lambda: jax.tree.leaves(nnx.state(make(), nnx.Param)), out_placements=pins, mesh=mesh)
        m = analysis(init.lower().compile())
        # the same initialiser under jax.jit with the parameters' NamedShardings as out_shardings (GSPMD)
        auto = jax.make_mesh(shape, names, devices=devices[:8], axis_types=(AxisType.Auto,) * len(shape))
        outs = [NamedSharding(auto, p.spec.to_partition_spec()) for p in params]
        g = analysis(jax.jit(lambda: jax.tree.leaves(nnx.state(make(), nnx.Param)), out_shardings=outs)
                     .lower().compile())
        row.update(init_program=m, init_peak_per_device_bytes=m["output"] + m["temp"],
                   init_peak_over_share=round((m["output"] + m["temp"]) / share, 3),
                   init_gspmd=g, init_gspmd_peak_over_share=round((g["output"] + g["temp"]) / share, 3))
        if on_cpu:  # the devices' temporaries were host memory while the initialiser ran
            row["host_beyond_devices_bytes"] = peak - held - m["temp"] * len(per_device)
    if how != "constructor":
        return row

    # the training step: jshard's TrainStep, and jax.jit over the same NamedShardings (lowered from shapes)
    tx = optax.adamw(1e-3)

    def loss_fn(model, ids, labels):
        return cross_entropy(model(ids), labels)

    data = tuple(Shard(0) if a == "dp" else Replicate() for a in names)
    ids = jshard.distribute(np.zeros((BATCH, SEQ), np.int32), mesh, data)
    step = TrainStep(model, tx, loss_fn)
    ours = analysis(step.lower(ids, ids).compile())

    auto = jax.make_mesh(shape, names, devices=devices[:8], axis_types=(AxisType.Auto,) * len(shape))
    graphdef, abstract, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    specs = jax.tree.map(lambda d: NamedSharding(auto, d.spec.to_partition_spec()), step.params,
                         is_leaf=lambda a: isinstance(a, DArray))
    p_structs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, specs)
    replicated = NamedSharding(auto, PartitionSpec())
    o_shapes = jax.eval_shape(tx.init, p_structs)
    flat_specs = jax.tree.leaves(specs)
    o_structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), o_shapes)
    o_structs = _mirror_shardings(o_structs, p_structs, flat_specs)
    d_struct = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32, sharding=NamedSharding(
        auto, jshard.Spec.create(mesh, data, (BATCH, SEQ), np.int32).to_partition_spec()))

    def plain(params, opt_state, ids, labels):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), ids, labels))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    shardings = lambda t: jax.tree.map(lambda a: a.sharding, t)  # noqa: E731
    jstep = jax.jit(plain, out_shardings=(shardings(p_structs), shardings(o_structs), replicated),
                    donate_argnums=(0, 1))
    theirs = analysis(jstep.lower(p_structs, o_structs, d_struct, d_struct).compile())
    row.update(step_jshard=ours, step_gspmd=theirs,
               step_temp_plus_args_ratio=round((ours["temp"] + ours["argument"])
                                               / (theirs["temp"] + theirs["argument"]), 3))
    return row


def _mirror_shardings(o_structs, p_structs, flat_specs):
    """Optimizer-state subtrees shaped like the parameters take their shardings (Adam's mu and nu)."""
    import jax

    structure = jax.tree.structure(p_structs)

    def place(node):
        if jax.tree.structure(node) == structure:
            return jax.tree.unflatten(structure, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                                  for a, s in zip(jax.tree.leaves(node), flat_specs, strict=True)])
        return node

    return jax.tree.map(place, o_structs, is_leaf=lambda n: jax.tree.structure(n) == structure)


def mb(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--out", default="benchmarks/results/memory.json")
    ap.add_argument("--child", nargs=2, metavar=("SETUP", "HOW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.layers, args.dim, args.vocab)))
        return
    rows = []
    for setup in SETUPS:
        for how in ("constructor", "built"):  # a fresh process each: peaks are per process
            cmd = [sys.executable, __file__, "--child", setup, how, "--layers", str(args.layers), "--dim",
                   str(args.dim), "--vocab", str(args.vocab)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"{setup}/{how} failed:\n{run.stderr[-3000:]}")
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
    p = rows[0]
    print(f"GPT: vocab {args.vocab}, width {args.dim}, {HEADS} heads, {args.layers} layers, sequence {SEQ}, batch "
          f"{BATCH}: {p['params'] / 1e6:.0f}M parameters, {mb(p['params_bytes'])} MB (float32); MB below\n")
    print(f"{'setup':<8} {'build':<12} {'init s':>7} {'host peak':>10} {'devices hold':>13} {'host beyond':>12} "
          f"{'/ params':>9} {'share/dev':>10} {'init peak/dev':>14} {'/ share':>8} {'GSPMD init / share':>19}")
    for r in rows:
        init = r.get("init_peak_per_device_bytes")
        print(f"{r['setup']:<8} {r['how']:<12} {r['init_s']:>7.1f} {mb(r['host_peak_bytes']):>10} "
              f"{mb(r['devices_hold_bytes']):>13} {mb(r['host_beyond_devices_bytes']):>12} "
              f"{r['host_beyond_devices_bytes'] / r['params_bytes']:>9.2f} {mb(r['share_bytes']):>10} "
              f"{mb(init) if init else '-':>14} {r['init_peak_over_share'] if init else '-':>8} "
              f"{r['init_gspmd_peak_over_share'] if init else '-':>19}")
    print(f"\n{'setup':<8} {'step: jshard args':>18} {'temp':>8} {'| GSPMD args':>12} {'temp':>8} "
          f"{'(temp+args) ratio':>18}  (target <= 1)")
    for r in rows:
        if "step_jshard" in r:
            a, b = r["step_jshard"], r["step_gspmd"]
            print(f"{r['setup']:<8} {mb(a['argument']):>18} {mb(a['temp']):>8} {mb(b['argument']):>12} "
                  f"{mb(b['temp']):>8} {r['step_temp_plus_args_ratio']:>18}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import write_json

    write_json(args.out, rows=rows, layers=args.layers, dim=args.dim, vocab=args.vocab)


if __name__ == "__main__":
    main()
