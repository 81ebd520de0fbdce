"""A Flax GPT training step: ``jshard`` (TrainStep) against plain ``jax.jit`` with the same NamedShardings.

On 8 devices (emulated on CPU when fewer) for DP2 x TP4 (Megatron plan) and FSDP over 8: the steady-state
step time of each (interleaved rounds, median ratio; target jshard / jax.jit <= 1.10), the collectives per
step in each compiled program (target: jshard's <= GSPMD's), the first call of each, and the loss curves
(they must agree). Prints a table and writes JSON.

    python benchmarks/train_step.py [--layers 2] [--steps 10] [--out benchmarks/results/train_step.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

import jshard  # noqa: E402
from jshard import Replicate, Shard  # noqa: E402
from jshard.gpt import GPT, cross_entropy, plan, summed_terms  # noqa: E402
from jshard.parallel import TrainStep, parallelize  # noqa: E402
from jshard.validate.tolerance import curve_ratio  # noqa: E402
from report import write_json  # noqa: E402

VOCAB, DIM, HEADS, SEQ, BATCH = 256, 128, 4, 64, 16
SETUPS = {"dp2xtp4": ((2, 4), ("dp", "tp"), "tp"), "fsdp8": ((8,), ("dp",), "fsdp")}


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def hlo_collectives(text: str) -> dict:
    found = re.findall(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", text)
    return dict(collections.Counter(found))


def run(name: str, layers: int, steps: int, rounds: int = 10) -> dict:
    shape, names, style = SETUPS[name]
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    mesh = jax.make_mesh(shape, names, devices=devices[:8])
    rng = np.random.default_rng(0)
    batches = [tuple(rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32) for _ in range(2)) for _ in range(steps)]
    tx = optax.adamw(1e-3)
    make = lambda: GPT(VOCAB, DIM, HEADS, layers, SEQ, rngs=nnx.Rngs(0))
    data = tuple(Shard(0) if a == "dp" else Replicate() for a in names)

    # (a) jshard
    jax.clear_caches()
    styles, default = plan(style, dp="dp", tp=names[-1])
    model = parallelize(make(), mesh, styles, default=default)
    step = TrainStep(model, tx, loss_fn)
    dbatches = [[jshard.distribute(a, mesh, data) for a in b] for b in batches]
    t0 = time.perf_counter()
    ours = [float(step(*dbatches[0]))]
    t_ours_first = time.perf_counter() - t0
    ours_hlo = hlo_collectives(step.lower(*dbatches[1]).compile().as_text())

    # (b) jax.jit with the same placements as NamedShardings (GSPMD / Shardy partitions the program)
    auto = jax.make_mesh(shape, names, devices=devices[:8], axis_types=(AxisType.Auto,) * len(shape))
    graphdef, params, rest = nnx.split(make(), nnx.Param, ...)
    specs = jax.tree.map(lambda d: d.spec.to_partition_spec(), step.params,
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

    jstep = jax.jit(plain, out_shardings=(jax.tree.map(lambda a: a.sharding, params),
                                          jax.tree.map(lambda a: a.sharding, opt_state), None), donate_argnums=(0, 1))
    theirs_hlo = hlo_collectives(jstep.lower(params, opt_state, *jbatches[0]).compile().as_text())
    jax.clear_caches()  # the first call below compiles afresh
    t0 = time.perf_counter()
    params, opt_state, loss = jstep(params, opt_state, *jbatches[0])
    theirs = [float(loss)]
    t_theirs_first = time.perf_counter() - t0

    for i in range(1, steps):
        ours.append(float(step(*dbatches[i])))
        params, opt_state, loss = jstep(params, opt_state, *jbatches[i])
        theirs.append(float(loss))

    # steady state: interleaved rounds of `steps` steps each, blocking at the end of a round
    times = {"jshard": [], "jax.jit": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in dbatches:
            loss = step(*b)
        jax.block_until_ready(loss.block)
        times["jshard"].append((time.perf_counter() - t0) / steps * 1e3)
        t0 = time.perf_counter()
        for b in jbatches:
            params, opt_state, loss = jstep(params, opt_state, *b)
        jax.block_until_ready(loss)
        times["jax.jit"].append((time.perf_counter() - t0) / steps * 1e3)
    ratio = statistics.median(a / b for a, b in zip(times["jshard"], times["jax.jit"]))
    return dict(setup=name, layers=layers, jshard_step_ms=round(statistics.median(times["jshard"]), 2),
                jax_step_ms=round(statistics.median(times["jax.jit"]), 2), ratio=round(ratio, 3),
                jshard_collectives=ours_hlo, jax_collectives=theirs_hlo,
                jshard_first_call_s=round(t_ours_first, 2), jax_first_call_s=round(t_theirs_first, 2),
                loss_max_rel_diff=float(max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))),
                losses_agree=curve_ratio(ours, theirs, n_per_step=summed_terms(VOCAB, DIM, layers, SEQ, BATCH)) <= 1,
                first_loss=ours[0], last_loss=ours[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/train_step.json")
    args = ap.parse_args()
    rows = [run(name, args.layers, args.steps) for name in SETUPS]
    print(f"GPT: vocab {VOCAB}, width {DIM}, {HEADS} heads, sequence {SEQ}, batch {BATCH}, {args.layers} layers; "
          f"{args.steps} steps per round")
    for r in rows:
        total = lambda c: sum(c.values())
        print(f"{r['setup']:>8}: step {r['jshard_step_ms']:.1f} ms (jshard) vs {r['jax_step_ms']:.1f} ms (jax.jit), "
              f"ratio {r['ratio']:.2f} (target <= 1.10); collectives per step {total(r['jshard_collectives'])} "
              f"{r['jshard_collectives']} vs {total(r['jax_collectives'])} {r['jax_collectives']}; first call "
              f"{r['jshard_first_call_s']:.1f} s vs {r['jax_first_call_s']:.1f} s; losses agree: {r['losses_agree']} "
              f"(max rel diff {r['loss_max_rel_diff']:.1e}, {r['first_loss']:.3f} -> {r['last_loss']:.3f})")
    write_json(args.out, rows=rows)


if __name__ == "__main__":
    main()
