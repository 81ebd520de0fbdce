"""The main job: train a small GPT (Flax NNX) on 8 devices and check it against one device.

Run ``python -m jshard.demo`` (``make demo``). It builds a mesh (DP2 x TP4 by default; 8 CPU devices are
emulated when the machine has fewer accelerators), makes the model tensor-, sequence-, fully-sharded-, data- or
context-parallel (or a ``+``-joined combination, ``dp+cp``, ``cp+tp``, ``fsdp+cp+tp``) with ``jshard.parallel``,
prints the placements of one block's parameters and what a training step communicates (collectives and bytes by
kind, from ``explain``), then trains with optax AdamW on a deterministic synthetic corpus, next to the same
model trained on one device. It exits non-zero if the two loss curves differ by more than the rounding of a
reordered computation explains (``jshard.validate.tolerance``, with the loss's summation chain from
``jshard.gpt.summed_terms``).

It takes the path that scales: the model is built sharded (``parallelize`` of a constructor: no device ever
holds a sharded parameter whole) and each process reads only its own rows of every batch
(``jshard.process_rows`` and ``jshard.from_process_local``, what a per-host data loader does).
``--processes 2`` runs it as JAX's multi-controller mode runs on two hosts: it launches two processes of 4 CPU
devices each (``jshard.launch``), joined by ``jax.distributed``, with the data axis crossing them.
``--checkpoint DIR`` saves the training state every ``--save-every`` steps (Orbax's ``CheckpointManager``,
asynchronous, the last two kept; every process writes its own blocks) and, when DIR already holds a checkpoint,
resumes from its last step, whatever the mesh and style it was saved under.

With context parallelism (``--style cp``) the sequence is sharded over the mesh axis named ``cp`` (the default
mesh puts it on all 8 devices; ``--mesh dp=2,cp=4 --style dp+cp`` shares them with the batch), striped so that
causal attention gives every device the same work (in contiguous blocks with ``--processes``, where each process
loads one range of every row), and every attention crosses it by ``--method``.

With pipeline parallelism (``--style pp``, ``pp+dp+tp``, ``pp+fsdp``, ...) the blocks are split into stages over the
mesh axis named ``pp`` (the default mesh gives it 2 devices, or 8 alone) and each step runs ``--microbatches``
microbatches through them by ``--schedule`` (``gpipe``, ``1f1b``, or ``interleaved`` with ``--virtual-stages``
chunks a device). The GPT then has ``pp x virtual stages`` layers unless ``--layers`` says otherwise (a multiple of
it); the microbatches cut the batch of 8 rows. With ``--processes`` the first mesh axis crosses the processes: with
``pp`` first (``--mesh pp=2,dp=4``) each process holds its own stages. A pipelined run's checkpoint resumes under any
other pipeline (mesh, schedule, styles beside it) with the same ``--layers``.

With expert parallelism (``--style ep``, ``dp+ep``, ``fsdp+ep``, ``ep+tp``, ``pp+ep``) every block's MLP is a mixture
of 8 experts (2 a token, ``jshard.experts``) spread over the mesh axis named ``ep`` (the default mesh gives it 4
devices beside 2 of the other axis, or 8 alone), the tokens sharded over it too and sent to their experts by
all-to-all; the load imbalance (the most tokens an expert took over the mean) is printed as it trains, the routing
bias balancing it (DeepSeek-V3's rule; not inside a pipeline yet).

With ``--style auto`` the plan is ``jshard.parallel.autoplan``'s: every assignment of its roles (data, fully sharded
data, tensor, sequence, context, pipeline parallelism, and expert parallelism for a model with mixtures:
``jshard.parallel.search.ROLES``) to the mesh axes is priced
on the demo's own training step, and the fastest whose predicted memory per device fits ``--memory-budget`` (when given)
is trained, its table (``Plan.explain``) printed first; the batch is placed as the plan says. The default mesh is
``a=2,b=4`` (any ``--mesh`` works: the plan gives the axes their roles, whatever their names). When no plan fits the
budget, the demo exits with autoplan's message. The checkpoints hold values, not plans: a run resumes under
``--style auto`` from any other's, and the other way round.

    python -m jshard.demo [--mesh dp=2,tp=4] [--style tp|sp|fsdp|dp|cp|dp+cp|cp+tp|pp+dp+tp|auto|...]
                          [--method auto|ring|...] [--microbatches 4] [--schedule gpipe|1f1b|interleaved]
                          [--virtual-stages 1] [--memory-budget 2GB] [--steps 20] [--layers 2] [--processes 2]
                          [--checkpoint DIR] [--save-every 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import tempfile
import time

from jshard.parallel.schedule import SCHEDULES

# rows a step trains on, whatever the mesh and style: a run resumed from a checkpoint under another one goes on with
# the same batches (and the one-device run catches up on them)
BATCH = 8
# --memory-budget's units: SI (powers of 1000) and binary (powers of 1024), the byte itself for a plain number
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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


def default_mesh(style: str) -> str:
    """The demo's mesh of 8 devices for ``style``: DP2 x TP4 without context or pipeline parallelism; with context
    parallelism, the sequence on the devices the data (2) and tensor (4, or 2 beside data) axes leave; with pipeline
    parallelism, 2 stages (8 alone) and 2 devices for each other axis, the last one taking what is left.

    >>> default_mesh("tp"), default_mesh("cp"), default_mesh("dp+cp"), default_mesh("fsdp+cp+tp")
    ('dp=2,tp=4', 'cp=8', 'dp=2,cp=4', 'dp=2,cp=2,tp=2')
    >>> default_mesh("pp+dp+tp"), default_mesh("pp+tp"), default_mesh("pp+fsdp"), default_mesh("pp")
    ('pp=2,dp=2,tp=2', 'pp=2,tp=4', 'pp=2,dp=4', 'pp=8')
    >>> default_mesh("auto")  # the plan gives the axes their roles: their names say none
    'a=2,b=4'
    >>> default_mesh("ep"), default_mesh("dp+ep"), default_mesh("pp+ep"), default_mesh("ep+tp")
    ('ep=8', 'dp=2,ep=4', 'pp=2,ep=4', 'tp=2,ep=4')
    """
    if style == "auto":
        return "a=2,b=4"
    parts = set(style.split("+"))
    if "ep" in parts and "cp" not in parts:  # the experts over 4 devices (8 alone), beside 2 of the other axis
        other = next((name for name, kinds in (("pp", {"pp"}), ("dp", {"dp", "fsdp"}), ("tp", {"tp", "sp"}))
                      if parts & kinds), None)
        return "ep=8" if other is None else f"{other}=2,ep=4"
    if "pp" in parts:
        others = [name for name, kinds in (("dp", {"dp", "fsdp"}), ("cp", {"cp"}), ("tp", {"tp", "sp"}))
                  if parts & kinds]
        if not others:
            return "pp=8"
        axes = {"pp": 2, **{name: 2 for name in others}}
        axes[others[-1]] = 8 // (2 ** len(others))
        return ",".join(f"{name}={size}" for name, size in axes.items())
    if "cp" not in parts:
        return "dp=2,tp=4"
    dp = 2 if parts & {"dp", "fsdp"} else 1
    tp = (2 if dp > 1 else 4) if parts & {"tp", "sp"} else 1
    axes = {"dp": dp, "cp": 8 // (dp * tp), "tp": tp}
    return ",".join(f"{name}={size}" for name, size in axes.items() if size > 1)


def roles(style: str, names: tuple[str, ...]) -> dict[str, str | None]:
    """Which mesh axis is the data (``dp``), tensor (``tp``), context (``cp``) and pipeline (``pp``) axis of
    ``style``: ``cp`` and ``pp`` by name, the tensor axis the last of the others (where the style has one), the data
    axis the first of those left.

    >>> roles("tp", ("dp", "tp")), roles("cp+tp", ("cp", "tp"))
    ({'dp': 'dp', 'tp': 'tp', 'cp': None, 'pp': None}, {'dp': None, 'tp': 'tp', 'cp': 'cp', 'pp': None})
    >>> roles("pp+dp+tp", ("pp", "dp", "tp"))
    {'dp': 'dp', 'tp': 'tp', 'cp': None, 'pp': 'pp'}
    >>> roles("auto", ("dp", "tp"))  # autoplan assigns them
    {'dp': None, 'tp': None, 'cp': None, 'pp': None}
    >>> roles("dp+ep", ("dp", "ep"))
    {'dp': 'dp', 'tp': None, 'cp': None, 'pp': None, 'ep': 'ep'}
    """
    if style == "auto":
        return {"dp": None, "tp": None, "cp": None, "pp": None}
    parts = set(style.split("+"))
    named = {}
    for role, example in (("cp", "dp=2,cp=4"), ("pp", "pp=2,dp=2,tp=2"), ("ep", "dp=2,ep=4")):
        named[role] = role if role in parts else None
        if named[role] is not None and role not in names:
            what = {"cp": "the sequence", "pp": "the blocks into stages", "ep": "the experts"}[role]
            raise SystemExit(f"--style {style!r} splits {what} over the mesh axis named {role!r}, and --mesh has "
                             f"{', '.join(names)}; add one, like --mesh {example}")
    others = [n for n in names if n not in named.values()]
    tp = others.pop() if parts & {"tp", "sp"} and others else None
    if parts & {"tp", "sp"} and tp is None:
        beside = " and ".join(repr(n) for n in named.values() if n)
        raise SystemExit(f"--style {style!r} needs a tensor axis beside {beside}; add one, like --mesh "
                         f"{'cp=2,tp=4' if named['cp'] else 'pp=2,tp=4'}")
    if named["ep"] is None:
        del named["ep"]
    return {"dp": others[0] if others else None, "tp": tp, **named}


def parse_size(text: str) -> int:
    """Bytes from ``--memory-budget``: a number with an optional unit, SI (``kB``, ``MB``, ``GB``, ``TB``: powers of
    1000) or binary (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024), in any case; a plain number is bytes.

    >>> parse_size("2GB"), parse_size("1.5GiB"), parse_size("512 MiB"), parse_size("1000000")
    (2000000000, 1610612736, 536870912, 1000000)
    """
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = found and found.group(2).lower()
    if found is None or unit not in UNITS:
        raise SystemExit(f"--memory-budget {text!r}: give bytes per device as a number with an optional unit, SI "
                         "(kB, MB, GB, TB: powers of 1000) or binary (KiB, MiB, GiB, TiB: powers of 1024), like 2GB, "
                         "512MiB or 1.5GiB")
    size = int(float(found.group(1)) * UNITS[unit])
    if size < 1:
        raise SystemExit(f"--memory-budget {text!r} is under one byte: give a positive size, like 2GB")
    return size


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    pairs = [p.split("=") for p in text.split(",")]
    try:
        return tuple(n.strip() for n, _ in pairs), tuple(int(s) for _, s in pairs)
    except ValueError:
        raise SystemExit(f"--mesh {text!r}: write axis=size pairs, like dp=2,tp=4") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None,
                    help="axis=size pairs; 'cp' is the context axis, the last other one the tensor axis, the first the "
                         "data axis (default: dp=2,tp=4, or for a style with cp its sequence over 8 devices; with "
                         "--style auto the plan gives each axis its role, default a=2,b=4)")
    ap.add_argument("--style", default="tp",
                    help="tp, sp, fsdp, dp, cp, pp, ep, or a '+'-joined combination: dp+cp, cp+tp, fsdp+cp+tp, "
                         "dp+ep, ...; auto: "
                         "the plan autoplan finds (default mesh a=2,b=4)")
    ap.add_argument("--method", default="auto",
                    help="how attention crosses the context axis: ring, all_gather, all_to_all or auto (the cost model "
                         "chooses)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="with pp: the microbatches a step runs through the stages (default 4)")
    ap.add_argument("--schedule", default=None, choices=SCHEDULES,
                    help="with pp: the order of the microbatches' forward and backward units (default 1f1b)")
    ap.add_argument("--virtual-stages", type=int, default=None,
                    help="with pp and --schedule interleaved: the chunks of blocks each device holds (default 1)")
    ap.add_argument("--memory-budget", default=None, metavar="SIZE",
                    help="with --style auto: bytes per device the plan may take, SI (2GB = 2e9 bytes) or binary "
                         "(1.5GiB = 1.5 x 2^30 bytes) units, or plain bytes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=None,
                    help="the GPT's blocks (default 2; with pp, the stages times the virtual stages)")
    ap.add_argument("--processes", type=int, default=1, help="run as this many JAX processes (localhost)")
    ap.add_argument("--checkpoint", default=None, metavar="DIR",
                    help="save the training state here every --save-every steps; resume from it when it holds one")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names, sizes = parse_mesh(args.mesh or default_mesh(args.style))
    budget = _auto(args)
    axes = roles(args.style, names)
    layers, pipeline = _pipeline(args, dict(zip(names, sizes, strict=True)), axes["pp"])
    if args.processes > 1 and args.process_id is None:
        return _launch(args, argv if argv is not None else sys.argv[1:], math.prod(sizes))
    if args.process_id is not None:
        from jshard.launch import join

        # gloo's connection chatter goes to file descriptor 1: keep it there, and the demo's own lines apart
        shown = os.dup(1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.stdout = os.fdopen(shown, "w", buffering=1)
        join(args.process_id, args.port, args.processes)
    _ensure_devices(max(8, math.prod(sizes)))

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jshard
    from jshard import Replicate, Shard
    from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
    from jshard.parallel import TrainStep, autoplan, parallelize
    from jshard.validate.tolerance import curve_ratio

    n = int(np.prod(sizes))
    devices = jax.devices()
    if len(devices) < n:
        devices = jax.devices("cpu")
    # process by process: the first mesh axis (data) crosses processes, the others stay inside one
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))[:n]
    mesh = jax.make_mesh(sizes, names, devices=devices)
    vocab, dim, heads, seq, batch = 64, 64, 4, 32, BATCH
    if jax.process_index() != 0:  # every process runs the same program; one of them reports
        sys.stdout = open(os.devnull, "w")
    where = f"{jax.process_count()} processes, " if jax.process_count() > 1 else ""

    # with expert parallelism, every block's MLP a mixture of 8 experts (2 a token), balanced by its routing bias
    moe = dict(experts=8, top_k=2, balance=1e-2) if axes.get("ep") else {}

    def make():
        return GPT(vocab, dim, heads, layers, seq, rngs=nnx.Rngs(0), **moe)

    def loss_fn(model, ids, labels):
        return cross_entropy(model(ids), labels)

    tx = optax.adamw(3e-3, eps=1e-6)
    if args.style == "auto":
        shape = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        try:
            # every process finds the same plan: autoplan ranks by process 0's measurements
            found = autoplan(make, mesh, loss_fn, shape, shape, tx=tx, memory_budget=budget)
        except ValueError as e:
            raise SystemExit(f"--style auto{f' --memory-budget {args.memory_budget}' if budget else ''} on "
                             f"--mesh {','.join(f'{n}={s}' for n, s in zip(names, sizes, strict=True))}: {e}") from None
        if jax.process_count() > 1:
            found = _contiguous(found, mesh, seq)
        styles, default = found.styles, found.default
    else:
        try:
            styles, default = plan(args.style, method=args.method, **pipeline,
                                   **{k: v for k, v in axes.items() if v is not None})
        except ValueError as e:
            raise SystemExit(f"--style {args.style!r} --method {args.method!r}: {e}") from None
    if axes["cp"] and jax.process_count() > 1:
        # each process loads one contiguous range of every row (process_rows); striped tokens are not one
        styles[""] = dataclasses.replace(styles[""], balance=False)
    how = f", attention across {axes['cp']!r} by {args.method!r}" if axes["cp"] else ""
    if axes["pp"]:
        how += (f", {pipeline['microbatches']} microbatches through {mesh.shape[axes['pp']]} stages by "
                f"{pipeline['schedule']!r}")
        how += f" ({pipeline['virtual_stages']} chunks a device)" if pipeline["virtual_stages"] > 1 else ""
    print(f"jshard demo: a {layers}-layer GPT (vocab {vocab}, width {dim}, {heads} heads, sequence {seq}) "
          f"on {jshard.spec.format_mesh(mesh)} of {where}{devices[0].platform} devices, style {args.style!r}{how}\n")
    if args.style == "auto":
        print(found.explain(), end="\n\n")

    model = parallelize(make, mesh, styles, default=default)  # built sharded: each device draws its blocks
    if axes["pp"]:  # the blocks stacked along a new dim 0, split into stages over pp
        blocks, which = model.blocks.layers, f"the {layers} blocks, stacked"
    else:
        blocks, which = model.blocks[0], "block 0"
    print(f"placements of {which} (one entry per mesh axis):")
    for path, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Param):
            d = var.get_value()
            where, shape = "/".join(map(str, path)), str(d.shape)
            print(f"  {where:<14} {shape:<13} {jshard.placements.format_placements(d.placements)}")
    print()

    tokens = corpus(vocab, args.steps * batch * (seq + 1) + 1)
    windows = tokens[: args.steps * batch * (seq + 1)].reshape(args.steps, batch, seq + 1)
    # the batch over the data axis; with context parallelism the sequence over cp, in the model's own layout; under
    # autoplan, as its plan says (ids and labels alike)
    layout = {axes["dp"]: Shard(0)} if axes["dp"] else {}
    if axes.get("ep"):  # the tokens over the experts' axis too: each device sends its own to their experts
        layout[axes["ep"]] = Shard(0)
    if axes["cp"]:
        layout[axes["cp"]] = styles[""].sequence(seq, mesh.shape[axes["cp"]])
    data_axes = tuple(layout.get(a, Replicate()) for a in names)
    placed = found.batch if args.style == "auto" else (data_axes, data_axes)
    parts = [jshard.process_rows(mesh, p, (batch, seq)) for p in placed]  # this process's part of every batch

    def shard(step):
        whole = windows[step, :, :-1], windows[step, :, 1:]
        return [jshard.from_process_local(a[rows][:, cols], mesh, p, shape=(batch, seq))  # what a loader reads
                for a, p, (rows, cols) in zip(whole, placed, parts, strict=True)]

    train = TrainStep(model, tx, loss_fn)
    totals = train.explain(*shard(0)).per_call  # a pipeline's layers once per microbatch and layer
    print("one training step communicates: " + (", ".join(
        f"{kind} x{count} ({nbytes:,} B per device)" for kind, (count, nbytes) in sorted(totals.items()))
        or "nothing"))

    reference = one_device_trainer(make(), tx, loss_fn)
    manager, start = _checkpoints(args, train), 0
    if manager is not None and manager.latest_step() is not None:
        start = manager.latest_step()
        try:
            train.state = manager.restore(start, args=jshard.checkpoint.Restore(train.state))  # into this run's plan
        except ValueError as e:
            manager.close()
            raise SystemExit(f"--checkpoint {args.checkpoint}: step {start} does not restore into a {layers}-layer "
                             f"GPT under --style {args.style!r}: {e}\nResume with the --layers it was saved with, or "
                             "start in another directory") from None
        for step in range(start):  # the one-device run catches up, to be compared from here on
            reference(jnp.asarray(windows[step, :, :-1]), jnp.asarray(windows[step, :, 1:]))
        print(f"resumed from {args.checkpoint} after step {start}")

    ours, theirs = [], []
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        ours.append(float(train(*shard(step))))
        theirs.append(reference(jnp.asarray(windows[step, :, :-1]), jnp.asarray(windows[step, :, 1:])))
        if manager is not None:  # every --save-every steps and the last; the blocks are copied before it returns
            manager.save(step + 1, args=jshard.checkpoint.Save(train.state), force=step + 1 == args.steps)
        done = (step + 1) / args.steps
        bar = "#" * int(30 * done) + "." * (30 - int(30 * done))
        balance = f"  imbalance {_imbalance(train.model):.2f}" if moe.get("balance") else ""
        print(f"\r[{bar}] step {step + 1:>3}/{args.steps}  loss {ours[-1]:.4f}  one device {theirs[-1]:.4f}"
              f"{balance}  ({time.perf_counter() - t0:.1f} s)", end="", flush=True)
    print("\n")
    if manager is not None:
        manager.wait_until_finished()
        print(f"checkpoints in {args.checkpoint}: steps {manager.all_steps()}")
        manager.close()
    if not ours:
        print(f"nothing to train: the checkpoint is at step {start} of --steps {args.steps}")
        return 0
    ratio = curve_ratio(ours, theirs, n_per_step=summed_terms(vocab, dim, layers, seq, batch))
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    print(f"loss {ours[0]:.4f} -> {ours[-1]:.4f} (log vocab = {np.log(vocab):.4f}); largest relative difference "
          f"from one device: {worst:.1e}, {ratio:.2f} of the rounding bound -> {'OK' if ratio <= 1 else 'MISMATCH'}")
    return 0 if ratio <= 1 else 1


def _imbalance(model) -> float:
    """The mixtures' load imbalance in the last step: the most tokens an expert took over the mean, the worst
    block's."""
    import numpy as np

    from jshard.moe import imbalance

    stacked = getattr(model.blocks, "layers", None)  # a pipeline holds the blocks stacked: row i is block i's
    loads = np.asarray(stacked.moe.load.get_value().full()) if stacked is not None else [
        np.asarray(block.moe.load.get_value().full()) for block in model.blocks]
    return max(imbalance(load) for load in loads)


def _auto(args) -> int | None:
    """``--memory-budget`` in bytes (None without it), after refusing what ``--style auto`` does not search and a
    budget given to a fixed style."""
    if args.style != "auto":
        if args.memory_budget is not None:
            raise SystemExit(f"--memory-budget {args.memory_budget}: the memory autoplan's plan may take, and "
                             f"--style {args.style!r} is a fixed plan; add --style auto to search one under the "
                             "budget, or leave --memory-budget out")
        return None
    if args.method != "auto":
        raise SystemExit(f"--method {args.method}: under --style auto the cost model picks how attention crosses a "
                         "context-parallel axis (--method auto); name the style to pin it, like --style dp+cp "
                         f"--method {args.method}, or leave --method out")
    given = [flag for flag, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                                      ("--virtual-stages", args.virtual_stages)) if value is not None]
    if given:
        raise SystemExit(f"{', '.join(given)}: settings of a pipeline, which --style auto sets itself where it "
                         "pipelines (1F1B, twice the stages in microbatches); name the style to choose them, like "
                         "--style pp+dp+tp, or leave them out")
    return None if args.memory_budget is None else parse_size(args.memory_budget)


def _contiguous(found, mesh, seq: int):
    """``found`` with the sequence in contiguous blocks on its context-parallel axes, where it has any: in
    multi-controller mode each process loads one range of every row (``process_rows``), which striped tokens are not
    (as ``--style cp`` does with ``--processes``)."""
    from jshard.parallel import ContextParallel

    cp = {s.axis: dataclasses.replace(s, balance=False)
          for styles in found.styles.values() for s in styles if isinstance(s, ContextParallel)}
    if not cp:
        return found
    styles = {pattern: tuple(cp[s.axis] if isinstance(s, ContextParallel) else s for s in these)
              for pattern, these in found.styles.items()}
    batch = tuple(tuple(cp[a].sequence(seq, mesh.shape[a]) if a in cp else p
                        for a, p in zip(mesh.axis_names, placements, strict=True)) for placements in found.batch)
    return dataclasses.replace(found, styles=styles, batch=batch)


def _pipeline(args, sizes: dict[str, int], pp: str | None) -> tuple[int, dict]:
    """The GPT's layer count and the plan's pipeline arguments (none without a pipeline axis), checked against the
    mesh: ``--layers``, else 2, or with a pipeline the least multiple of its stages x virtual stages from 2."""
    given = {flag: value for flag, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                                             ("--virtual-stages", args.virtual_stages)) if value is not None}
    if pp is None:
        if given:
            raise SystemExit(f"{', '.join(given)}: settings of a pipeline, and --style {args.style!r} has none; "
                             f"add 'pp' to the style (--style pp+{args.style} with a 'pp' axis in --mesh) or leave "
                             "them out")
        return 2 if args.layers is None else args.layers, {}
    m = 4 if args.microbatches is None else args.microbatches
    v = 1 if args.virtual_stages is None else args.virtual_stages
    schedule = args.schedule or ("interleaved" if v > 1 else "1f1b")
    for flag, value in (("--microbatches", m), ("--virtual-stages", v), ("--layers", args.layers or 1)):
        if value < 1:
            raise SystemExit(f"{flag} {value}: give at least 1")
    if v > 1 and schedule != "interleaved":
        raise SystemExit(f"--virtual-stages {v} gives each device {v} chunks of blocks, which only the interleaved "
                         f"schedule runs; use --schedule interleaved, or --virtual-stages 1 with --schedule {schedule}")
    stages = sizes[pp]
    chunks = stages * v
    if args.layers is not None and args.layers % chunks:
        raise SystemExit(f"--layers {args.layers}: the pipeline cuts the blocks into {stages} stages (--mesh "
                         f"{pp}={stages}) x {v} virtual stages, so the GPT needs a multiple of {chunks} layers; use "
                         f"--layers {chunks * -(-args.layers // chunks)}")
    if BATCH % m:
        raise SystemExit(f"--microbatches {m}: the demo's batch of {BATCH} rows cuts into "
                         f"{', '.join(str(k) for k in range(1, BATCH + 1) if BATCH % k == 0)} microbatches; use one "
                         "of those")
    if schedule == "interleaved" and m % stages:
        raise SystemExit(f"--schedule interleaved runs microbatches in groups of the {stages} stages, and "
                         f"--microbatches is {m}; use --microbatches {stages * -(-m // stages)}")
    layers = chunks * -(-2 // chunks) if args.layers is None else args.layers
    return layers, {"microbatches": m, "schedule": schedule, "virtual_stages": v}


def _checkpoints(args, train):
    """Orbax's CheckpointManager over ``--checkpoint`` (None without it): asynchronous saves, the last two kept."""
    if args.checkpoint is None:
        return None
    import orbax.checkpoint as ocp

    import jshard.checkpoint  # noqa: F401 - registers jshard's handler with Orbax

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.save_every,
                                           enable_async_checkpointing=True)
    return ocp.CheckpointManager(os.path.abspath(args.checkpoint), options=options)


def _launch(args, argv: list[str], n_devices: int) -> int:
    """Run the demo as ``args.processes`` local JAX processes (``jshard.launch``); process 0 prints."""
    from jshard.launch import launch, log_tail

    if n_devices % args.processes:
        raise SystemExit(f"--processes {args.processes} must divide the mesh's {n_devices} devices")
    print(f"launching {args.processes} JAX processes of {n_devices // args.processes} CPU devices each "
          "(jax.distributed on localhost, gloo collectives)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        errs = [os.path.join(tmp, f"process{i}.err") for i in range(args.processes)]
        codes = launch(lambda i, port: [sys.executable, "-m", "jshard.demo", *argv, "--process-id", str(i),
                                        "--port", str(port)],
                       processes=args.processes, devices=n_devices // args.processes, timeout=900,
                       logs=[(None, e) for e in errs])
        if all(c == 0 for c in codes):
            return 0
        print(f"\nprocess exit codes {codes} (None: killed after a peer failed or at the 900 s timeout)")
        for i, (c, e) in enumerate(zip(codes, errs, strict=True)):
            if c != 0:
                print(f"process {i} stderr:\n{log_tail(e)}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
