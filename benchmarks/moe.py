"""Mixture-of-experts GPTs trained three ways, side by side in one run: jshard (``jshard.experts`` under
``ExpertParallel``, dropless), GSPMD (``jax.jit`` with ``NamedSharding``\\ s, the experts on the same axis, GShard's
one-hot dispatch and combine at capacity factor 1.25, MaxText's dropping path) and one device (plain ``jax.jit``,
dropless).

Per model (8 experts top-2, 64 experts top-8) and mesh (ep8: the batch and the experts over 8 devices; dp2xep4:
the batch over both axes, the experts over ep; ep4xtp2: attention tensor parallel on tp, the experts over ep):
the step time (median of the steady steps), the bytes a device receives in one step (the compiled program's
collectives), its memory (temporaries and arguments), the tokens dropped (GSPMD's copies past capacity) and the
load imbalance (the most tokens an expert took over the mean, in the last step). Prints a table, writes
``benchmarks/results/moe.json``.

    python benchmarks/moe.py [--steps 6] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402
from redistribute import hlo_traffic  # noqa: E402

import jshard  # noqa: E402
from jshard import Replicate, Shard  # noqa: E402
from jshard.gpt import GPT, MoE, cross_entropy, plan  # noqa: E402
from jshard.moe import imbalance, route  # noqa: E402
from jshard.parallel import TrainStep, parallelize  # noqa: E402
from report import write_json  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 256, 128, 4, 2, 64, 16
MODELS = {"8x top-2": (8, 2), "64x top-8": (64, 8)}
MESHES = {"ep8": ((8,), ("ep",), "ep"), "dp2xep4": ((2, 4), ("dp", "ep"), "dp+ep"),
          "ep4xtp2": ((4, 2), ("ep", "tp"), "ep+tp")}
CAPACITY_FACTOR = 1.25


class GShardMoE(MoE):
    """The same mixture (same parameters) dispatched as GShard does: each batch row a group, the copies of its
    tokens in choice order (every token's first choice before any second), each expert taking at most
    ``capacity`` of them; the rest dropped (their output zero). Counts what it dropped in ``dropped``."""

    def __call__(self, x):
        g, s, d = x.shape
        e, k = self.w_up.shape[0], self.top_k
        capacity = math.ceil(CAPACITY_FACTOR * s * k / e)
        idx, weights = route(self.router(x), k)                                  # [g, s, k]
        chosen = jax.nn.one_hot(idx, e, dtype=x.dtype)                           # [g, s, k, e]
        by_choice = jnp.swapaxes(chosen, 1, 2).reshape(g, k * s, e)              # first choices first
        slot = jnp.swapaxes(((jnp.cumsum(by_choice, axis=1) - 1) * by_choice).reshape(g, k, s, e), 1, 2)
        slot = slot.astype(jnp.int32)
        kept = chosen * (slot < capacity)
        place = kept[..., None] * jax.nn.one_hot(slot, capacity, dtype=x.dtype)  # [g, s, k, e, c]
        dispatch = place.sum(2)
        combine = (weights[..., None, None].astype(x.dtype) * place).sum(2)
        xe = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        h = jax.nn.silu(jnp.einsum("egcd,edh->egch", xe, self.w_gate[...])) * jnp.einsum(
            "egcd,edh->egch", xe, self.w_up[...])
        out = jnp.einsum("gsec,egcd->gsd", combine, jnp.einsum("egch,ehd->egcd", h, self.w_down[...]))
        self.dropped[...] = jnp.sum(chosen) - jnp.sum(kept)
        self.load[...] = jnp.sum(kept, axis=(0, 1, 2)).astype(jnp.int32)
        return out


class Count(nnx.Variable):
    """What the GSPMD mixture dropped and how much each expert took in the last step."""


def make(experts, top_k, gshard=False):
    def build():
        model = GPT(VOCAB, DIM, HEADS, LAYERS, SEQ, rngs=nnx.Rngs(0), experts=experts, top_k=top_k,
                    balance=None if gshard else 0.0)  # 0.0: the load counted, the routing left alone
        if gshard:
            for block in model.blocks:
                block.moe.__class__ = GShardMoE
                block.moe.dropped, block.moe.load = Count(jnp.zeros(())), Count(jnp.zeros(experts, jnp.int32))
        return model

    return build


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def plain_step(graphdef, tx):
    """A training step under plain ``jax.jit``: ``(params, opt_state, rest, ids, labels) -> (params, opt_state,
    rest, loss)``, the state the forward pass updates (the mixtures' counts) carried as ``TrainStep`` does."""

    @jax.jit
    def step(params, opt_state, rest, ids, labels):
        def loss_of(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return loss_fn(m, ids, labels), nnx.split(m, nnx.Param, ...)[2]

        (loss, rest), g = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rest, loss

    return step


def traffic(compiled) -> tuple[int, int]:
    _, received = hlo_traffic(compiled.as_text())
    m = compiled.memory_analysis()
    return int(received), int(m.temp_size_in_bytes + m.argument_size_in_bytes)


def timed(fn, steps):
    times = []
    for i in range(steps):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def run(model_name, mesh_name, steps, batches):
    experts, top_k = MODELS[model_name]
    shape, names, style = MESHES[mesh_name]
    n = math.prod(shape)
    devices = jax.devices()[:n] if len(jax.devices()) >= n else jax.devices("cpu")[:n]
    mesh = jax.make_mesh(shape, names, devices=devices)
    tx = optax.adamw(1e-3)
    data = tuple(Shard(0) if a in ("dp", "ep") else Replicate() for a in names)
    rows = []

    # (a) jshard: dropless, the experts kept on ep, the tokens sent to them
    styles, default = plan(style, **({"tp": "tp"} if "tp" in names else {}))
    step = TrainStep(parallelize(make(experts, top_k), mesh, styles, default=default), tx, loss_fn)
    dbatches = [[jshard.distribute(a, mesh, data) for a in b] for b in batches]
    t0 = time.perf_counter()
    losses = [float(step(*dbatches[0]))]
    first = time.perf_counter() - t0
    step_s = timed(lambda i: losses.append(float(step(*dbatches[i % len(dbatches)]))), steps)
    received, memory = traffic(step.lower(*dbatches[0]).compile())
    load = step.model.blocks[0].moe.load.get_value().full()
    w_up = step.model.blocks[0].moe.w_up.get_value()
    rows.append(dict(model=model_name, mesh=mesh_name, side="jshard", step_ms=1e3 * step_s, first_s=first,
                     received_bytes=received, memory_bytes=memory, dropped=0, imbalance=imbalance(load),
                     experts_per_device=w_up.spec.local_block_shape[0], loss=losses[-1]))

    # (b) GSPMD: jax.jit over NamedShardings, the experts on ep, GShard's dispatch at capacity 1.25
    auto = jax.make_mesh(shape, names, devices=devices, axis_types=(AxisType.Auto,) * len(shape))
    graphdef, params, rest = nnx.split(make(experts, top_k, gshard=True)(), nnx.Param, ...)

    def spec_of(path, a):
        keys = [getattr(k, "key", None) for k in path]
        return PartitionSpec("ep") if keys[-1] in ("w_up", "w_gate", "w_down") else PartitionSpec()

    shardings = jax.tree_util.tree_map_with_path(lambda p, a: NamedSharding(auto, spec_of(p, a)), params)
    params = jax.device_put(params, shardings)
    opt_state = jax.jit(tx.init)(params)
    batch_axes = tuple(a for a in names if a in ("dp", "ep"))
    batch_sharding = NamedSharding(auto, PartitionSpec(batch_axes))
    jbatches = [[jax.device_put(a, batch_sharding) for a in b] for b in batches]

    plain = plain_step(graphdef, tx)

    state = [params, opt_state, rest]
    t0 = time.perf_counter()
    *state, loss = plain(*state, *jbatches[0])
    gspmd_losses = [float(loss)]
    first = time.perf_counter() - t0

    def one(i):
        nonlocal state
        *new, loss = plain(*state, *jbatches[i % len(jbatches)])
        state = new
        gspmd_losses.append(float(loss))

    step_s = timed(one, steps)
    received, memory = traffic(plain.lower(*state, *jbatches[0]).compile())
    moe = nnx.merge(graphdef, state[0], state[2]).blocks[0].moe
    rows.append(dict(model=model_name, mesh=mesh_name, side="GSPMD", step_ms=1e3 * step_s, first_s=first,
                     received_bytes=received, memory_bytes=memory,
                     dropped=int(sum(float(b.moe.dropped[...]) for b in nnx.merge(graphdef, state[0],
                                                                                   state[2]).blocks)),
                     imbalance=imbalance(np.asarray(moe.load[...])), experts_per_device=experts // mesh.shape["ep"],
                     loss=gspmd_losses[-1]))
    return rows


def one_device(model_name, steps, batches):
    experts, top_k = MODELS[model_name]
    graphdef, params, rest = nnx.split(make(experts, top_k)(), nnx.Param, ...)
    tx = optax.adamw(1e-3)

    plain = plain_step(graphdef, tx)

    state = [params, tx.init(params), rest]
    losses = []

    def one(i):
        nonlocal state
        *new, loss = plain(*state, *batches[i % len(batches)])
        state = new
        losses.append(float(loss))

    one(0)
    step_s = timed(one, steps)
    _, memory = traffic(plain.lower(*state, *batches[0]).compile())
    load = nnx.merge(graphdef, state[0], state[2]).blocks[0].moe.load[...]
    return dict(model=model_name, mesh="1 device", side="one device", step_ms=1e3 * step_s, first_s=float("nan"),
                received_bytes=0, memory_bytes=memory, dropped=0, imbalance=imbalance(np.asarray(load)),
                experts_per_device=experts, loss=losses[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="the 8-expert model on ep8 only")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.steps):
        ids = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
        batches.append((ids, np.roll(ids, -1, 1)))
    rows = []
    for model_name in (["8x top-2"] if args.quick else MODELS):
        rows.append(one_device(model_name, args.steps, batches))
        for mesh_name in (["ep8"] if args.quick else MESHES):
            rows += run(model_name, mesh_name, args.steps, batches)
    head = (f"{'model':<10} {'mesh':<9} {'side':<11} {'step ms':>8} {'first s':>8} {'received B':>11} "
            f"{'memory B':>11} {'dropped':>8} {'imbalance':>9} {'experts/dev':>11}")
    print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {len(jax.devices())}; GPT vocab {VOCAB}, width {DIM},"
          f" {LAYERS} layers, sequence {SEQ}, batch {BATCH}; GSPMD at capacity factor {CAPACITY_FACTOR}\n")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<10} {r['mesh']:<9} {r['side']:<11} {r['step_ms']:>8.1f} {r['first_s']:>8.1f} "
              f"{r['received_bytes']:>11,} {r['memory_bytes']:>11,} {r['dropped']:>8} {r['imbalance']:>9.2f} "
              f"{r['experts_per_device']:>11}")
    ratios = {}
    for r in rows:
        if r["side"] == "jshard":
            g = next(x for x in rows if x["side"] == "GSPMD" and x["model"] == r["model"] and x["mesh"] == r["mesh"])
            ratios[f"{r['model']} {r['mesh']}"] = dict(step=r["step_ms"] / g["step_ms"],
                                                      bytes=r["received_bytes"] / max(g["received_bytes"], 1))
    print("\njshard / GSPMD (step time, bytes received): " + ", ".join(
        f"{k}: {v['step']:.2f}x, {v['bytes']:.2f}x" for k, v in ratios.items()))
    write_json(os.path.join(os.path.dirname(__file__), "results", "moe.json"), rows=rows, ratios=ratios,
               platform=jax.devices()[0].platform)


if __name__ == "__main__":
    main()
