"""A Flax GPT training step: ``jshard`` (TrainStep) against plain ``jax.jit`` with the same NamedShardings.

On 8 devices (emulated on CPU when fewer), for TP4, DP2 x TP4 and FSDP2 x TP4 (Megatron's plan, with FullyShard
on dp for the latter), FSDP over 8 and sequence parallelism: the steady-state step time of each (interleaved
rounds, median ratio and its range; target jshard / jax.jit <= 1.00), the process's CPU time per step (all
threads, spinning included: a second view where emulated devices outnumber cores), the collectives, bytes
received and memory of each compiled program (target: jshard's <= GSPMD's), the first call of each (fresh
programs, caches emptied, alternating which side goes first; median of ``--first-calls``; target <= 1.2x), and
the loss curves (they must agree). Prints a table and writes JSON.

    python benchmarks/train_step.py [--layers 2] [--steps N] [--rounds N] [--size toy|compute|large]
                                    [--first-calls 3] [--setups tp4,sp] [--fsdp-unit module|block]
                                    [--out benchmarks/results/train_step.json]

Steps and rounds default by size (``ROUNDS``): a large step takes seconds on CPU devices, so 10 x 10 of them would
run for hours. Each setup reports on stderr as it finishes.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from redistribute import hlo_traffic  # noqa: E402

import jshard  # noqa: E402
from jshard import Replicate, Shard  # noqa: E402
from jshard.gpt import GPT, cross_entropy, plan, summed_terms  # noqa: E402
from jshard.parallel import FullyShard, TrainStep, parallelize  # noqa: E402
from jshard.validate.tolerance import curve_ratio  # noqa: E402
from report import write_json  # noqa: E402

VOCAB, DIM, HEADS, SEQ, BATCH = 256, 128, 4, 64, 16
# --size: (vocab, width, heads, sequence, batch); "compute" is compute-bound on CPU devices (the width 1024,
# 8 layers, sequence 512 takes minutes a step on 2 emulated-device cores: run it with --size large where cores allow)
SIZES = {"toy": (256, 128, 4, 64, 16), "compute": (2048, 512, 8, 256, 8), "large": (8192, 1024, 16, 512, 8)}
# --size: default (steps per round, interleaved rounds)
ROUNDS = {"toy": (10, 10), "compute": (10, 10), "large": (3, 3)}
# name: (mesh shape, axis names, plan style, FSDP on "dp" under the plan's styles)
SETUPS = {"tp4": ((4,), ("tp",), "tp", False), "dp2xtp4": ((2, 4), ("dp", "tp"), "tp", False),
          "fsdp2xtp4": ((2, 4), ("dp", "tp"), "tp", True), "fsdp8": ((8,), ("dp",), "fsdp", False),
          "sp": ((2, 4), ("dp", "tp"), "sp", False)}


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def traffic(compiled) -> dict:
    """Collectives by kind, bytes a device receives and the per-device memory of a compiled step."""
    kinds, received = hlo_traffic(compiled.as_text())
    m = compiled.memory_analysis()
    return {"collectives": dict(kinds), "received_bytes": int(received),
            "temp_plus_args_bytes": int(m.temp_size_in_bytes + m.argument_size_in_bytes)}


def run(name: str, layers: int, steps: int, rounds: int, first_calls: int, unit: str = "module") -> dict:
    shape, names, style, fsdp = SETUPS[name]
    n = int(np.prod(shape))
    devices = jax.devices() if len(jax.devices()) >= n else jax.devices("cpu")
    mesh = jax.make_mesh(shape, names, devices=devices[:n])
    rng = np.random.default_rng(0)
    batches = [tuple(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32) for _ in range(2)) for _ in range(steps)]
    tx = optax.adamw(1e-3)
    make = lambda: GPT(VOCAB, DIM, HEADS, layers, SEQ, rngs=nnx.Rngs(0))
    data = tuple(Shard(0) if a == "dp" else Replicate() for a in names)

    # (a) jshard
    styles, default = plan(style, dp="dp", tp=names[-1])
    default = (FullyShard("dp"),) if fsdp else default
    if unit == "block" and FullyShard("dp") in default:  # torchtitan: fully_shard(block) each, fully_shard(root)
        units = {"": FullyShard("dp"), **{f"blocks/{i}": FullyShard("dp") for i in range(layers)}}
        styles, default = {**styles, **units}, ()
    model = parallelize(make, mesh, styles, default=default)
    dbatches = [[jshard.distribute(a, mesh, data) for a in b] for b in batches]

    # (b) jax.jit with the same placements as NamedShardings (GSPMD / Shardy partitions the program)
    auto = jax.make_mesh(shape, names, devices=devices[:n], axis_types=(AxisType.Auto,) * len(shape))
    graphdef, params, rest = nnx.split(make(), nnx.Param, ...)
    specs = jax.tree.map(lambda d: d.spec.to_partition_spec(), nnx.split(model, nnx.Param, ...)[1],
                         is_leaf=lambda a: isinstance(a, jshard.DArray))
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(auto, s)), params, specs)
    replicated = NamedSharding(auto, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(lambda a: a if len(a.sharding.device_set) > 1 else jax.device_put(a, replicated),
                             jax.jit(tx.init)(params))  # step counts come out on one device
    data_sharding = NamedSharding(auto, jshard.Spec.create(mesh, data, (BATCH, SEQ), np.int32).to_partition_spec())
    jbatches = [[jax.device_put(a, data_sharding) for a in b] for b in batches]

    def plain(params, opt_state, ids, labels):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), ids, labels))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def fresh_jit():
        return jax.jit(plain, out_shardings=(jax.tree.map(lambda a: a.sharding, params),
                                             jax.tree.map(lambda a: a.sharding, opt_state), None),
                       donate_argnums=(0, 1))

    # first calls (trace, plan, compile, run) of fresh programs, each side's caches and JAX's emptied first:
    # `first_calls` rounds on batches 0.., the side that goes first alternating (the process's own warm-up
    # lands on both alike); the steps they take are the loss curves' first steps
    ours, theirs, t_ours_first, t_theirs_first, step = [], [], [], [], None
    for i in range(first_calls):
        for side in (("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")):
            jax.clear_caches()
            jshard.clear_caches()
            if side == "ours":
                carried = step.state if step else None
                step = TrainStep(step.model if step else model, tx, loss_fn)
                if carried:
                    step.state = carried  # the optimizer's moments go on, as jax.jit's opt_state does
                t0 = time.perf_counter()
                ours.append(float(step(*dbatches[i])))
                t_ours_first.append(time.perf_counter() - t0)
            else:
                jstep = fresh_jit()
                t0 = time.perf_counter()
                params, opt_state, loss = jstep(params, opt_state, *jbatches[i])
                theirs.append(float(loss))
                t_theirs_first.append(time.perf_counter() - t0)
    ours_hlo = traffic(step.lower(*dbatches[1]).compile())
    theirs_hlo = traffic(jstep.lower(params, opt_state, *jbatches[0]).compile())
    first_ratios = sorted(a / b for a, b in zip(t_ours_first, t_theirs_first, strict=True))

    for i in range(first_calls, steps):
        ours.append(float(step(*dbatches[i])))
        params, opt_state, loss = jstep(params, opt_state, *jbatches[i])
        theirs.append(float(loss))

    # steady state: interleaved rounds of `steps` steps each, blocking at the end of a round; wall and CPU time
    times = {"jshard": [], "jax.jit": []}
    cpu = {"jshard": [], "jax.jit": []}

    def ours_round():
        for b in dbatches:
            loss = step(*b)
        jax.block_until_ready(loss.block)

    def theirs_round():
        nonlocal params, opt_state
        for b in jbatches:
            params, opt_state, loss = jstep(params, opt_state, *b)
        jax.block_until_ready(loss)

    for _ in range(rounds):
        for side, round_ in (("jshard", ours_round), ("jax.jit", theirs_round)):
            t0, c0 = time.perf_counter(), time.process_time()
            round_()
            times[side].append((time.perf_counter() - t0) / steps * 1e3)
            cpu[side].append((time.process_time() - c0) / steps * 1e3)
    ratios = sorted(a / b for a, b in zip(times["jshard"], times["jax.jit"], strict=True))
    cpu_ratios = sorted(a / b for a, b in zip(cpu["jshard"], cpu["jax.jit"], strict=True))
    return dict(setup=name, layers=layers, jshard_step_ms=round(statistics.median(times["jshard"]), 2),
                jax_step_ms=round(statistics.median(times["jax.jit"]), 2),
                ratio=round(statistics.median(ratios), 3), ratio_min=round(ratios[0], 3),
                jshard_cpu_ms=round(statistics.median(cpu["jshard"]), 2),
                jax_cpu_ms=round(statistics.median(cpu["jax.jit"]), 2),
                cpu_ratio=round(statistics.median(cpu_ratios), 3), cpu_ratio_min=round(cpu_ratios[0], 3),
                cpu_ratio_max=round(cpu_ratios[-1], 3),
                ratio_max=round(ratios[-1], 3), jshard=ours_hlo, jax=theirs_hlo,
                jshard_first_call_s=round(statistics.median(t_ours_first), 2),
                jax_first_call_s=round(statistics.median(t_theirs_first), 2),
                first_call_ratio=round(statistics.median(first_ratios), 3),
                first_call_ratio_min=round(first_ratios[0], 3), first_call_ratio_max=round(first_ratios[-1], 3),
                loss_max_rel_diff=float(max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))),
                losses_agree=curve_ratio(ours, theirs, n_per_step=summed_terms(VOCAB, DIM, layers, SEQ, BATCH)) <= 1,
                first_loss=ours[0], last_loss=ours[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default: by --size)")
    ap.add_argument("--out", default="benchmarks/results/train_step.json")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: by --size)")
    ap.add_argument("--first-calls", type=int, default=3, help="first calls timed per side (fresh programs)")
    ap.add_argument("--size", choices=list(SIZES), default="toy")
    ap.add_argument("--setups", default="", help=f"comma-separated, of {', '.join(SETUPS)} (default: all)")
    ap.add_argument("--fsdp-unit", choices=["module", "block"], default="module",
                    help="what FSDP gathers together: each module holding parameters (default=FullyShard), or each "
                         "transformer block (FullyShard matched on blocks/i, as torchtitan)")
    args = ap.parse_args()
    steps, rounds = ROUNDS[args.size]
    args.steps = steps if args.steps is None else args.steps
    args.rounds = rounds if args.rounds is None else args.rounds
    if not 2 <= args.first_calls <= args.steps:
        ap.error(f"--first-calls must be at least 2 (the side that goes first alternates, so the process's warm-up "
                 f"lands on both) and at most --steps ({args.steps}); got {args.first_calls}")
    global VOCAB, DIM, HEADS, SEQ, BATCH
    VOCAB, DIM, HEADS, SEQ, BATCH = SIZES[args.size]
    names = args.setups.split(",") if args.setups else list(SETUPS)
    rows, start = [], time.perf_counter()
    for name in names:
        rows.append(run(name, args.layers, args.steps, args.rounds, args.first_calls, args.fsdp_unit))
        print(f"{name}: step ratio {rows[-1]['ratio']:.2f}, first call {rows[-1]['first_call_ratio']:.2f} "
              f"({time.perf_counter() - start:.0f} s so far)", file=sys.stderr, flush=True)
    print(f"GPT: vocab {VOCAB}, width {DIM}, {HEADS} heads, sequence {SEQ}, batch {BATCH}, {args.layers} layers; "
          f"{args.steps} steps per round, {args.rounds} interleaved rounds; FSDP unit: {args.fsdp_unit}\n")
    print(f"{'setup':<10} {'step ms jshard':>15} {'jax.jit':>8} {'ratio med (min-max)':>20} {'collectives':>12} "
          f"{'GSPMD':>6} {'recv KB/dev':>12} {'GSPMD':>8} {'temp+args MB':>13} {'GSPMD':>7} {'first s':>8} "
          f"{'jax.jit':>8} {'ratio (min-max)':>16} {'CPU ratio (min-max)':>20} {'losses':>7}")
    for r in rows:
        a, b = r["jshard"], r["jax"]
        print(f"{r['setup']:<10} {r['jshard_step_ms']:>15.1f} {r['jax_step_ms']:>8.1f} "
              f"{r['ratio']:>8.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
              f"{sum(a['collectives'].values()):>12} {sum(b['collectives'].values()):>6} "
              f"{a['received_bytes'] / 1e3:>12.1f} {b['received_bytes'] / 1e3:>8.1f} "
              f"{a['temp_plus_args_bytes'] / 2**20:>13.1f} {b['temp_plus_args_bytes'] / 2**20:>7.1f} "
              f"{r['jshard_first_call_s']:>8.2f} {r['jax_first_call_s']:>8.2f} "
              f"{r['first_call_ratio']:>5.2f} ({r['first_call_ratio_min']:.2f}-{r['first_call_ratio_max']:.2f}) "
              f"{r['cpu_ratio']:>9.2f} ({r['cpu_ratio_min']:.2f}-{r['cpu_ratio_max']:.2f}) "
              f"{'agree' if r['losses_agree'] else 'DIFFER':>7}")
    print("\ntargets: ratio <= 1.00, collectives and received bytes <= GSPMD's, temp+args <= GSPMD's, first call "
          "<= 1.2x")
    write_json(args.out, rows=rows, size=args.size, vocab=VOCAB, dim=DIM, seq=SEQ, batch=BATCH,
               fsdp_unit=args.fsdp_unit)


if __name__ == "__main__":
    main()
