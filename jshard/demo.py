"""The main job: train a small GPT (Flax NNX) on 8 devices and check it against one device.

Run ``python -m jshard.demo`` (``make demo``). It builds a mesh (DP2 x TP4 by default; 8 CPU devices are
emulated when the machine has fewer accelerators), makes the model tensor-, sequence-, fully-sharded- or
data-parallel with ``jshard.parallel``, prints the placements of one block's parameters and what a training
step communicates (collectives and bytes by kind, from ``explain``), then trains with optax AdamW on a
deterministic synthetic corpus, next to the same model trained on one device. It exits non-zero if the
two loss curves differ by more than the rounding of a reordered computation explains
(``jshard.validate.tolerance``, with the loss's summation chain from ``jshard.gpt.summed_terms``).

    python -m jshard.demo [--mesh dp=2,tp=4] [--style tp|sp|fsdp|dp] [--steps 20] [--layers 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def _ensure_devices(n: int = 8) -> None:
    # must run before JAX initialises its backends; accelerators are left alone
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def corpus(vocab: int, length: int, seed: int = 0):
    """Token ids from a fixed random Markov chain: every token has four likely successors, so there is
    something to learn and the loss falls well below log(vocab)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, (vocab, 4))
    ids = np.empty(length, np.int32)
    ids[0] = 0
    for i in range(1, length):
        ids[i] = successors[ids[i - 1], rng.integers(0, 4)] if rng.random() < 0.9 else rng.integers(0, vocab)
    return ids


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    pairs = [p.split("=") for p in text.split(",")]
    try:
        return tuple(n.strip() for n, _ in pairs), tuple(int(s) for _, s in pairs)
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: write axis=size pairs, like dp=2,tp=4") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="dp=2,tp=4",
                    help="axis=size pairs; the first is the data axis, the last the tensor axis")
    ap.add_argument("--style", default="tp", choices=["tp", "sp", "fsdp", "dp"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    names, sizes = parse_mesh(args.mesh)
    _ensure_devices(max(8, math.prod(sizes)))

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jshard
    from jshard import Replicate, Shard
    from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
    from jshard.parallel import TrainStep, parallelize
    from jshard.validate.tolerance import curve_ratio

    n = int(np.prod(sizes))
    devices = jax.devices()
    if len(devices) < n:
        devices = jax.devices("cpu")
    mesh = jax.make_mesh(sizes, names, devices=devices[:n])
    vocab, dim, heads, seq, batch = 64, 64, 4, 32, 8
    print(f"jshard demo: a {args.layers}-layer GPT (vocab {vocab}, width {dim}, {heads} heads, sequence {seq}) "
          f"on {jshard.spec.format_mesh(mesh)} of {devices[0].platform} devices, style {args.style!r}\n")

    def make():
        return GPT(vocab, dim, heads, args.layers, seq, rngs=nnx.Rngs(0))

    def loss_fn(model, ids, labels):
        return cross_entropy(model(ids), labels)

    styles, default = plan(args.style, dp=names[0], tp=names[-1])
    model = parallelize(make(), mesh, styles, default=default)
    print("placements of block 0 (one entry per mesh axis):")
    for path, var in nnx.iter_graph(model.blocks[0]):
        if isinstance(var, nnx.Param):
            d = var.get_value()
            where, shape = "/".join(map(str, path)), str(d.shape)
            print(f"  {where:<14} {shape:<10} {jshard.placements.format_placements(d.placements)}")
    print()

    tokens = corpus(vocab, args.steps * batch * (seq + 1) + 1)
    windows = tokens[: args.steps * batch * (seq + 1)].reshape(args.steps, batch, seq + 1)
    data_axes = tuple(Shard(0) if a == names[0] else Replicate() for a in names)  # the batch over the data axis

    def shard(step):
        ids, labels = windows[step, :, :-1], windows[step, :, 1:]
        return [jshard.distribute(a, mesh, data_axes) for a in (ids, labels)]

    tx = optax.adamw(3e-3, eps=1e-6)
    train = TrainStep(model, tx, loss_fn)
    totals = train.explain(*shard(0)).totals
    print("one training step communicates: " + (", ".join(
        f"{kind} x{count} ({nbytes:,} B per device)" for kind, (count, nbytes) in sorted(totals.items()))
        or "nothing"))

    reference = one_device_trainer(make(), tx, loss_fn)

    ours, theirs = [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        ours.append(float(train(*shard(step))))
        theirs.append(reference(jnp.asarray(windows[step, :, :-1]), jnp.asarray(windows[step, :, 1:])))
        done = (step + 1) / args.steps
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        print(f"\r[{bar}] step {step + 1:>3}/{args.steps}  loss {ours[-1]:.4f}  one device {theirs[-1]:.4f}  "
              f"({time.perf_counter() - t0:.1f} s)", end="", flush=True)
    print("\n")
    ratio = curve_ratio(ours, theirs, n_per_step=summed_terms(vocab, dim, args.layers, seq, batch))
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    print(f"loss {ours[0]:.4f} -> {ours[-1]:.4f} (log vocab = {np.log(vocab):.4f}); largest relative difference "
          f"from one device: {worst:.1e}, {ratio:.2f} of the rounding bound -> {'OK' if ratio <= 1 else 'MISMATCH'}")
    return 0 if ratio <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
