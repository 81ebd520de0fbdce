"""Long-context training: a GPT with context parallelism (jshard) against ``jax.jit`` (GSPMD) and one device.

A GPT of width 256, 4 heads and 2 layers, batch 1 per data-parallel replica, at sequence 4K to 32K on 8 devices
(emulated on CPU when fewer), in three meshes: ``cp8`` (the sequence over 8 devices), ``dp2xcp4`` (data over 2,
sequence over 4), ``cp4xtp2`` (sequence over 4, Megatron tensor parallelism over 2). jshard runs
``jshard.gpt.plan`` with context parallelism once per attention method (``ring``, ``all_gather``, ``all_to_all``
where the heads a device holds divide over cp); the token ids and labels take the causal load-balanced layout
(``jshard.sharded_attention.balanced``). GSPMD runs ``jax.jit`` of the same training step with the same
``NamedSharding``s (ids and labels sequence-sharded over cp, the parameters as the plan places them; GSPMD decides
the rest), and one device runs it unsharded; both attend with ``jax.nn.dot_product_attention``, differentiated by
JAX, as a model written without jshard does (``--baseline jshard``: with the GPT's ``jshard.attention``, whose
gradient outside ``jshard.jit`` is jshard's own blockwise kernel, which GSPMD then partitions).

Per row, measured in one process per (mesh, sequence), all sides interleaved step by step: the step time (median
of ``--steps`` steps after the first; ratio to GSPMD), the per-device peak memory of the compiled program
(``memory_analysis``: temporaries + arguments + outputs), the collectives and bytes (jshard's ``explain`` totals;
for both sides the collectives the compiled HLO runs, loops counted by their trip counts, and the bytes a device
receives in them), the causal load imbalance (``jshard.sharded_attention.load``: score blocks a device computes, max /
mean; beside it the contiguous ``Shard(1)`` layout's), and whether the loss curves agree (jshard, GSPMD, one
device, from the same initial parameters and batches). And for one attention alone (forward and backward, compiled,
not run): each side's per-device temporaries, against one device's score matrix (targets: ``1/N**2`` of it for the
ring, ``1/N`` for the all-gather). A side whose compiled program would not fit in the memory this machine has free
(per-device peak x devices, estimated before it runs) is not run: the table says so. Each (mesh, sequence) runs in
a fresh process, progress on stderr; the JSON is written after each, so a long sweep stopped midway keeps its rows.

    python benchmarks/long_context.py [--seq 4096,8192,16384,32768] [--configs cp8,dp2xcp4,cp4xtp2]
                                      [--methods ring,all_gather,all_to_all] [--steps 3] [--quick]
                                      [--baseline xla|jshard] [--fit-share 0.5]
                                      [--out benchmarks/results/long_context.json]

``--quick`` (a notebook's run, under 2 minutes): sequence 1024 and 2048, cp8, one timed step. From a
notebook, ``measure(config, seq)`` returns the rows of one mesh and length, measured in the calling process.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402
from redistribute import hlo_traffic  # noqa: E402

import jshard  # noqa: E402
import jshard.gpt as gpt_module  # noqa: E402
from jshard import Replicate, Shard, StridedShard  # noqa: E402
from jshard.gpt import GPT, cross_entropy, plan, summed_terms  # noqa: E402
from jshard.parallel import TrainStep, parallelize  # noqa: E402
from jshard.sharded_attention import balanced, load  # noqa: E402
from jshard.validate.tolerance import curve_ratio  # noqa: E402
from report import write_json  # noqa: E402

DIM, HEADS, LAYERS, VOCAB = 256, 4, 2, 256
# name: (mesh shape, axis names, jshard.gpt.plan style)
CONFIGS = {"cp8": ((8,), ("cp",), "cp"), "dp2xcp4": ((2, 4), ("dp", "cp"), "dp+cp"),
           "cp4xtp2": ((4, 2), ("cp", "tp"), "cp+tp")}
METHODS = ("ring", "all_gather", "all_to_all")
BASELINES = ("xla", "jshard")  # the attention GSPMD and one device run: see measure
SEQS = (4096, 8192, 16384, 32768)
QUICK = {"seqs": (1024, 2048), "configs": ("cp8",), "steps": 1}
# of the memory free when a side is about to run, what its estimated peak may take: the process holds more than
# memory_analysis's figure (the runtime, every side's compiled programs and state, XLA:CPU's allocations); GSPMD's
# dp2xcp4 step at sequence 8192, estimated at 11.5 GB, took the process to 16.5 GB resident
FIT_SHARE = 0.5


def measure(config: str, seq: int, methods: Sequence[str] = METHODS, *, steps: int = 3, vocab: int = VOCAB,
            one_device: bool = True, baseline: str = "xla", log: Callable[[str], None] | None = None) -> list[dict]:
    """Rows of one mesh (``config``, a key of ``CONFIGS``) at sequence ``seq``: one per attention method, each
    with jshard's figures, GSPMD's and one device's (the same for every row), measured in this process, all
    sides interleaved step by step (``steps`` timed steps after a first, compiling one). ``baseline``: the
    attention GSPMD and one device run, ``"xla"`` (``jax.nn.dot_product_attention``, differentiated by JAX: the
    model as plain JAX writes it) or ``"jshard"`` (the GPT's own ``jshard.attention``, whose gradient outside
    ``jshard.jit`` runs jshard's blockwise kernels, partitioned by GSPMD). Needs 8 devices (set
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, as this module does on import).
    ``log`` gets a line per stage (default: stderr).

    >>> rows = measure("cp8", 256, ["ring"], steps=1, log=lambda line: None)
    >>> rows[0]["jshard"]["status"], rows[0]["losses_agree_gspmd"], rows[0]["losses_agree_one_device"]
    ('ran', True, True)
    """
    if config not in CONFIGS:
        raise ValueError(f"measure: config {config!r} is not one of {', '.join(CONFIGS)}")
    if baseline not in BASELINES:
        raise ValueError(f"measure: baseline {baseline!r} is not one of {', '.join(BASELINES)}")
    unknown = [m for m in methods if m not in ("auto", *METHODS)]
    if unknown:
        raise ValueError(f"measure: methods {unknown} are not among auto, {', '.join(METHODS)}")
    shape, names, style = CONFIGS[config]
    n = int(np.prod(shape))
    devices = jax.devices() if len(jax.devices()) >= n else jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(_too_few_devices(config, n, len(devices)))
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    where = f"{config} seq {seq}"
    sizes = dict(zip(names, shape, strict=True))
    batch = sizes.get("dp", 1)
    rng = np.random.default_rng(seq)
    batches = [tuple(rng.integers(0, vocab, (batch, seq)).astype(np.int32) for _ in range(2))
               for _ in range(steps + 1)]
    tx = optax.adamw(1e-3)

    def make():
        return GPT(vocab, DIM, HEADS, LAYERS, seq, rngs=nnx.Rngs(0))

    def loss_fn(model, ids, labels):
        return cross_entropy(model(ids), labels)

    mesh = jax.make_mesh(shape, names, devices=devices[:n])
    layout = balanced(seq, sizes.get("cp", 1))  # the causal load-balanced layout, as ContextParallel places it
    data = tuple(Shard(0) if a == "dp" else layout if a == "cp" else Replicate() for a in names)
    ours: dict[str, _Side] = {}
    reasons: dict[str, str] = {}
    for method in methods:
        reason = _unsupported(method, sizes)
        if reason:
            reasons[method] = reason
            continue
        log(f"{where}: jshard {method}: building and compiling")
        styles, default = plan(style, dp="dp", tp="tp", cp="cp", method=method)
        step = TrainStep(parallelize(make, mesh, styles, default=default), tx, loss_fn)
        dbatches = [[jshard.distribute(a, mesh, data) for a in b] for b in batches]
        ours[method] = _jshard_side(f"jshard {method}", step, dbatches, n)

    log(f"{where}: attention alone: compiling")
    attention_temps = _attention_temps(mesh, devices[:n], sizes, (batch, seq, HEADS, DIM // HEADS), layout, list(ours))
    if ours:
        param_specs = next(iter(ours.values())).params_specs
    else:  # no method applies here: GSPMD's parameters still go where the plan places them
        styles, default = plan(style, dp="dp", tp="tp", cp="cp")
        param_specs = _param_specs(nnx.split(parallelize(make, mesh, styles, default=default), nnx.Param, ...)[1])
    log(f"{where}: GSPMD: compiling")
    with _baseline_attention(baseline):  # the baselines trace (and compile) here, and run what they compiled
        theirs = _gspmd_side(make, tx, loss_fn, shape, names, devices[:n], batches, param_specs)
        alone = None
        if one_device:
            log(f"{where}: one device: compiling")
            alone = _one_device_side(make, tx, loss_fn, devices[0], batches)
    sides = [*ours.values(), theirs] + ([alone] if alone else [])
    _run_interleaved(sides, steps, log, where)

    n_terms = summed_terms(vocab, DIM, LAYERS, seq, batch)
    rows = []
    for method in methods:
        side = ours.get(method)
        row = dict(config=config, mesh=dict(sizes), seq=seq, batch=batch, method=method, vocab=vocab, dim=DIM,
                   heads=HEADS, layers=LAYERS, steps=steps, baseline=baseline,
                   jshard=side.report() if side else {"status": f"not applicable: {reasons[method]}"},
                   gspmd=theirs.report(), one_device=alone.report() if alone else {"status": "not measured"})
        if side is not None:
            row.update(_comparisons(side, theirs, alone, n_terms), attention=attention_temps[method])
        else:
            row.update(attention=attention_temps[None])
        rows.append(row)
    return rows


def _too_few_devices(config: str, n: int, have: int) -> str:
    return (f"measure: config {config} needs {n} devices, JAX has {have}; set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX is imported (a fresh kernel or "
            "process), or run python benchmarks/long_context.py")


@dataclass
class _Side:
    """One way of running the step: its compiled program's figures, and (where it fits) a step function
    ``run(i) -> loss`` over batch ``i`` that returns once the step is done (the loss a scalar array or DArray)."""

    name: str
    devices: int
    memory: dict
    collectives: dict
    run: Callable[[int], object] | None = None
    extra: dict = field(default_factory=dict)
    params_specs: object = None
    times_ms: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    status: str = "ran"
    error: str | None = None

    def report(self) -> dict:
        out = dict(status=self.status, memory=self.memory, collectives=self.collectives, **self.extra,
                   losses=self.losses)
        if self.times_ms:
            out["step_ms"] = round(statistics.median(self.times_ms), 1)
            out["step_ms_all"] = [round(t, 1) for t in self.times_ms]
        if self.error:
            out["error"] = self.error
        return out


def _unsupported(method: str, sizes: dict) -> str | None:
    """Why ``method`` cannot run on this mesh (all-to-all needs a device's heads to divide over cp), or None."""
    heads = HEADS // sizes.get("tp", 1)
    if method == "all_to_all" and heads % sizes.get("cp", 1):
        return f"{heads} heads a device (of {HEADS}, tp={sizes.get('tp', 1)}) do not divide over cp={sizes['cp']}"
    return None


def _jshard_side(name: str, step: TrainStep, dbatches: list, n: int) -> _Side:
    compiled = step.lower(*dbatches[0]).compile()
    explained = step.explain(*dbatches[0])
    totals = {k: {"count": int(c), "bytes": int(b)} for k, (c, b) in sorted(explained.totals.items())}
    side = _Side(name, n, _memory(compiled), _hlo_collectives(compiled.as_text(), n),
                 extra={"explain_totals": totals, "load": _load(explained)},
                 params_specs=_param_specs(step.params))
    if _fits(side):
        side.run = _stepper(step, dbatches)
    return side


def _stepper(step: TrainStep, dbatches: list) -> Callable[[int], Any]:
    """A jshard side's ``run(i)``: step ``i`` on its batch, waited for."""

    def run(i):
        loss = step(*dbatches[i])
        jax.block_until_ready(loss.block)
        return loss

    return run


def _param_specs(params):
    """The ``PartitionSpec`` of each parameter (DArrays) of a parallelized model."""
    return jax.tree.map(lambda d: d.spec.to_partition_spec(), params, is_leaf=lambda a: isinstance(a, jshard.DArray))


def _gspmd_side(make, tx, loss_fn, shape, names, devices, batches, param_specs) -> _Side:
    """``jax.jit`` of the step with the parameters' and data's ``NamedSharding``s; GSPMD partitions the rest."""
    auto = jax.make_mesh(shape, names, devices=devices, axis_types=(AxisType.Auto,) * len(shape))
    graphdef, params, rest = nnx.split(make(), nnx.Param, ...)
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(auto, s)), params, param_specs)
    replicated = NamedSharding(auto, PartitionSpec())
    opt_state = jax.tree.map(lambda a: a if len(a.sharding.device_set) > 1 else jax.device_put(a, replicated),
                             jax.jit(tx.init)(params))  # step counts come out on one device
    # the sequence contiguous over cp: a NamedSharding has no striped layout
    data = NamedSharding(auto, PartitionSpec("dp" if "dp" in names else None, "cp"))
    placed = [[jax.device_put(a, data) for a in b] for b in batches]
    jstep = jax.jit(_plain(graphdef, rest, tx, loss_fn),
                    out_shardings=(jax.tree.map(lambda a: a.sharding, params),
                                   jax.tree.map(lambda a: a.sharding, opt_state), replicated),
                    donate_argnums=(0, 1))
    return _compiled_side("GSPMD", jstep, [params, opt_state], placed, len(devices))


def _one_device_side(make, tx, loss_fn, device, batches) -> _Side:
    graphdef, params, rest = nnx.split(make(), nnx.Param, ...)
    params = jax.device_put(params, device)
    opt_state = jax.device_put(jax.jit(tx.init)(params), device)
    placed = [[jax.device_put(a, device) for a in b] for b in batches]
    jstep = jax.jit(_plain(graphdef, rest, tx, loss_fn), donate_argnums=(0, 1))
    return _compiled_side("one device", jstep, [params, opt_state], placed, 1)


def _plain(graphdef, rest, tx, loss_fn):
    def step(params, opt_state, ids, labels):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), ids, labels))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _compiled_side(name: str, jstep, state: list, placed: list, devices: int) -> _Side:
    """A ``jax.jit`` step compiled once (the figures, and the program the steps run), its state carried in
    ``state`` (donated)."""
    compiled = jstep.lower(*state, *placed[0]).compile()
    side = _Side(name, devices, _memory(compiled), _hlo_collectives(compiled.as_text(), devices))
    if not _fits(side):
        return side

    def run(i):
        state[0], state[1], loss = compiled(*state, *placed[i])
        jax.block_until_ready(loss)
        return loss

    side.run = run
    return side


def _attention_temps(mesh, devices, sizes: dict, shape: tuple, layout, methods: list[str]) -> dict:
    """Per-device temporaries of one causal attention's forward and backward pass alone, q/k/v laid out as the
    model's activations: jshard by each method on cp, GSPMD and one device; and one device's score matrix (one
    ``[heads, q, k]`` float32 per batch row), which the ring's blocks should take ``1/N**2`` of and the
    all-gather's ``1/N``. Compiled, never run. Keyed by method, and None for the figures without jshard's."""
    import jax.numpy as jnp

    def temp(jit, fn, *args) -> int:
        grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
        return int(jit(grads).lower(*args).compile().memory_analysis().temp_size_in_bytes)

    names = tuple(sizes)
    auto = jax.make_mesh(tuple(sizes.values()), names, devices=devices, axis_types=(AxisType.Auto,) * len(names))
    spec = PartitionSpec("dp" if "dp" in names else None, "cp", "tp" if "tp" in names else None)
    sharded = jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(auto, spec))
    whole = jax.ShapeDtypeStruct(shape, np.float32, sharding=jax.sharding.SingleDeviceSharding(devices[0]))
    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    shared = {"gspmd": temp(jax.jit, plain, *[sharded] * 3), "one_device": temp(jax.jit, plain, *[whole] * 3)}
    scores = shape[0] * shape[2] * shape[1] ** 2 * 4
    out = {None: dict(temp=shared, one_device_scores_bytes=scores)}
    placements = tuple(Shard(0) if a == "dp" else layout if a == "cp" else Shard(2) for a in names)
    qkv = [jshard.distribute(np.zeros(shape, np.float32), mesh, placements) for _ in range(3)]
    for method in methods:
        ours = temp(jshard.jit, lambda q, k, v, m=method: jshard.attention(q, k, v, is_causal=True, method={"cp": m}),
                    *qkv)
        out[method] = dict(temp={"jshard": ours, **shared}, one_device_scores_bytes=scores,
                           jshard_over_scores=round(ours / scores, 4),
                           jshard_over_gspmd=round(ours / shared["gspmd"], 3) if shared["gspmd"] else None)
    return out


@contextlib.contextmanager
def _baseline_attention(baseline: str) -> Iterator[None]:
    """Within the block, with ``baseline="xla"``, the GPT attends with ``jax.nn.dot_product_attention`` (JAX
    differentiates it, as it would a model written without jshard); ``"jshard"`` leaves its ``jshard.attention``."""
    if baseline == "jshard":
        yield
        return
    calls = []

    def plain(q, k, v, *, is_causal):
        calls.append(1)
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)

    own, gpt_module.attention = gpt_module.attention, plain
    try:
        yield
    finally:
        gpt_module.attention = own
    if not calls:
        raise RuntimeError("long_context: the GPT no longer attends through jshard.gpt.attention, so the baselines "
                           "ran jshard.attention; swap the attention where jshard.gpt now calls it "
                           "(_baseline_attention), or run with --baseline jshard")


def _memory(compiled) -> dict:
    """Per-device bytes of a compiled program (``memory_analysis``), and its peak: temp + arguments + outputs."""
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    out["peak"] = out["temp"] + out["argument"] + out["output"]
    return out


def _available() -> int:
    """Bytes of memory this machine has free now (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _fits(side: _Side) -> bool:
    """Whether a side's devices' peaks fit in the memory free now; if not, the side says so and will not run."""
    need, free = side.memory["peak"] * side.devices, _available()
    side.memory["estimate_all_devices"] = need
    if need <= FIT_SHARE * free:
        return True
    side.status = (f"does not fit: needs {need / 2**30:.1f} GiB ({side.devices} x {side.memory['peak'] / 2**30:.2f} "
                   f"GiB by memory_analysis), over {FIT_SHARE:g} of the {free / 2**30:.1f} GiB free (--fit-share)")
    return False


def _run_interleaved(sides: list[_Side], steps: int, log, where: str) -> None:
    """Step 0 (the first call: jshard's compile) on every side, then ``steps`` timed steps, the sides taking
    turns (the order rotating, so no side always follows the same one); losses and step times per side."""
    running = [s for s in sides if s.run is not None]
    for i in range(steps + 1):
        turn = running[i % len(running):] + running[:i % len(running)] if running else []
        for side in turn:
            if side.error:
                continue
            t0 = time.perf_counter()
            try:
                loss = side.run(i)
            except Exception as e:  # one side's failure is reported in its row; the others still run
                side.status, side.error = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log(f"{where}: {side.name} failed:\n{traceback.format_exc()}")
                continue
            dt = (time.perf_counter() - t0) * 1e3
            side.losses.append(float(loss))
            if i:
                side.times_ms.append(dt)
            log(f"{where}: {side.name} step {i}: {dt:,.0f} ms, loss {side.losses[-1]:.5f}")


def _comparisons(ours: _Side, theirs: _Side, alone: _Side | None, n_terms: int) -> dict:
    """Ratios to GSPMD, and whether the loss curves agree (None where a side did not run)."""
    def ratio(a, b):
        return round(a / b, 3) if b else None

    out = {"memory_ratio": ratio(ours.memory["peak"], theirs.memory["peak"]),
           "received_ratio": ratio(ours.collectives["received_bytes"], theirs.collectives["received_bytes"])}
    if ours.times_ms and theirs.times_ms:
        out["step_ratio"] = ratio(statistics.median(ours.times_ms), statistics.median(theirs.times_ms))
    for name, other in (("gspmd", theirs), ("one_device", alone)):
        if other is not None and ours.losses and len(other.losses) == len(ours.losses):
            out[f"losses_agree_{name}"] = curve_ratio(ours.losses, other.losses, n_per_step=n_terms) <= 1
            out[f"loss_max_rel_diff_{name}"] = max(abs(a - b) / abs(b) for a, b in zip(ours.losses, other.losses,
                                                                                         strict=True))
    return out


def _hlo_collectives(hlo: str, devices: int) -> dict:
    """The collectives a compiled program runs, by kind, and the bytes a device receives in them: each
    computation's collectives (``hlo_traffic``) times how often it runs, a while loop's body its known trip count
    times (the ring's ``fori_loop``); loops without one are counted once and named in ``unknown_trip_counts``."""
    computations, order, times = {}, [], collections.Counter()
    name = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(2)
            computations[name] = []
            order.append(name)
            times[name] = 1 if head.group(1) else 0
        elif name is not None:
            computations[name].append(line)
    unknown = 0
    # callers come after their callees in HLO text: walk from the entry backwards
    for comp in reversed(order):
        for line in computations[comp]:
            loop = _WHILE.search(line)
            if loop:
                trip = _TRIP.search(line)
                unknown += trip is None
                times[loop.group(1)] += times[comp]  # the condition: no collectives
                times[loop.group(2)] += times[comp] * (int(trip.group(1)) if trip else 1)
                continue
            for one, branches in _CALLEE.findall(line):
                for callee in [one] if one else re.split(r",\s*", branches):
                    times[callee.strip().lstrip("%")] += times[comp]
    kinds, received = collections.Counter(), 0.0
    for comp in order:
        if times[comp]:
            k, r = hlo_traffic("\n".join(computations[comp]), devices)
            kinds.update({kind: c * times[comp] for kind, c in k.items()})
            received += r * times[comp]
    return {"kinds": dict(sorted(kinds.items())), "count": sum(kinds.values()), "received_bytes": int(received),
            "unknown_trip_counts": unknown}


_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*?condition=%([\w.\-]+), body=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLEE = re.compile(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def _load(explained) -> dict | None:
    """Score blocks per device of the step's attention (``jshard.sharded_attention.load``, forward), its imbalance
    (max / mean), and the imbalance the contiguous layout (``Shard(1)`` for the striped one) would have."""
    row = next((r for r in explained.rows if r["primitive"].split(" | ")[-1].removeprefix("jshard.") in _ATTENTION),
               None)
    if row is None:
        return None
    q, k = row["ins"][:2]
    blocks = np.asarray(load(q, k, True))
    contiguous = np.asarray(load(_contiguous(q), _contiguous(k), True))
    return {"blocks": blocks.ravel().tolist(), "imbalance": round(float(blocks.max() / blocks.mean()), 3),
            "contiguous_imbalance": round(float(contiguous.max() / contiguous.mean()), 3),
            "q_placements": str(q.placements), "k_placements": str(k.placements)}


_ATTENTION = ("attention", "attention_fwd", "attention_masked")  # the forward equations' primitives


def _contiguous(spec):
    placements = [Shard(p.dim) if isinstance(p, StridedShard) else p for p in spec.placements]
    return jshard.Spec.create(spec.mesh, placements, spec.shape, spec.dtype)


def _child(config: str, seq: int, methods: list[str], steps: int, vocab: int, baseline: str) -> None:
    print(json.dumps(measure(config, seq, methods, steps=steps, vocab=vocab, baseline=baseline)))


def _failed_rows(config: str, seq: int, methods: list[str], why: str) -> list[dict]:
    return [dict(config=config, seq=seq, method=m, jshard={"status": why}, gspmd={"status": why},
                 one_device={"status": why}) for m in methods]


def _mb(side: dict, key: str = "peak") -> str:
    return f"{side['memory'][key] / 2**20:,.0f}" if "memory" in side else "-"


def _ms(side: dict) -> str:
    return f"{side['step_ms']:,.0f}" if "step_ms" in side else "-"


def _print_table(rows: list[dict]) -> None:
    print(f"\nGPT: width {DIM}, {HEADS} heads, {LAYERS} layers, batch 1 per dp replica; step ms (median), peak = "
          "temp + args + outputs per device (MB), collectives run and MB a device receives (compiled HLO), load "
          "imbalance max/mean (balanced / contiguous); attention alone: forward + backward temporaries per device "
          "(MB), and jshard's over one device's score matrix\n")
    print(f"{'config':<8} {'seq':>6} {'method':<10} {'ms jshard':>10} {'GSPMD':>8} {'ratio':>6} {'1 dev':>8} "
          f"{'peak jshard':>12} {'GSPMD':>7} {'1 dev':>7} {'coll jshard':>12} {'GSPMD':>6} {'recv jshard':>12} "
          f"{'GSPMD':>7} {'imbalance':>11} {'losses':>7} {'attn jshard':>12} {'GSPMD':>7} {'1 dev':>7} "
          f"{'/ scores':>9}")
    notes = []
    for r in rows:
        a, b, c = r["jshard"], r["gspmd"], r["one_device"]
        if "memory" not in a:
            print(f"{r['config']:<8} {r['seq']:>6} {r['method']:<10} {a['status']}")
            continue
        load = a.get("load") or {}
        attn = r["attention"]["temp"]
        agree = [r.get(f"losses_agree_{k}") for k in ("gspmd", "one_device")]
        losses = "-" if all(x is None for x in agree) else "agree" if all(x in (True, None) for x in agree) \
            else "DIFFER"
        print(f"{r['config']:<8} {r['seq']:>6} {r['method']:<10} {_ms(a):>10} {_ms(b):>8} "
              f"{r.get('step_ratio') or '-':>6} {_ms(c):>8} {_mb(a):>12} {_mb(b):>7} {_mb(c):>7} "
              f"{a['collectives']['count']:>12} {b['collectives']['count'] if 'collectives' in b else '-':>6} "
              f"{a['collectives']['received_bytes'] / 2**20:>12.1f} "
              f"{b['collectives']['received_bytes'] / 2**20 if 'collectives' in b else 0:>7.1f} "
              f"{load.get('imbalance', '-'):>5} / {load.get('contiguous_imbalance', '-'):<5} {losses:>7} "
              f"{attn['jshard'] / 2**20:>12.1f} {attn['gspmd'] / 2**20:>7.1f} {attn['one_device'] / 2**20:>7.1f} "
              f"{r['attention']['jshard_over_scores']:>9.4f}")
        for who, side in (("jshard", a), ("GSPMD", b), ("one device", c)):
            if side["status"] not in ("ran", "not measured"):
                notes.append(f"  {r['config']} seq {r['seq']} {r['method']}: {who} {side['status']}"
                             + (f" ({side['error']})" if side.get("error") else ""))
    if notes:
        print("\nnot run:\n" + "\n".join(dict.fromkeys(notes)))
    print("\ntargets: jshard's peak and received bytes <= GSPMD's, step ratio <= 1.00, load imbalance <= 1.05, "
          "losses agree")


def main():
    global FIT_SHARE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", default=",".join(map(str, SEQS)), help="comma-separated sequence lengths")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated attention methods, of auto, {', '.join(METHODS)}")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side, after the first (compiling) one")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--baseline", choices=BASELINES, default="xla",
                    help="the attention GSPMD and one device run: jax.nn.dot_product_attention (xla, default), or "
                         "the GPT's jshard.attention, whose gradient outside jshard.jit is jshard's blockwise kernel")
    ap.add_argument("--fit-share", type=float, default=FIT_SHARE,
                    help="run a side only where its estimated peak (per device x devices) is at most this share of "
                         "the memory free then")
    ap.add_argument("--quick", action="store_true",
                    help=f"sequences {QUICK['seqs']}, configs {QUICK['configs']}, {QUICK['steps']} timed step")
    ap.add_argument("--out", default=None, help="JSON (default: benchmarks/results/long_context[_quick].json)")
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    FIT_SHARE = args.fit_share
    methods = args.methods.split(",")
    if args.child:
        _child(args.child[0], int(args.child[1]), methods, args.steps, args.vocab, args.baseline)
        return
    seqs = [int(s) for s in args.seq.split(",")]
    configs = args.configs.split(",")
    if args.quick:
        seqs, configs, args.steps = list(QUICK["seqs"]), list(QUICK["configs"]), QUICK["steps"]
    bad = [c for c in configs if c not in CONFIGS] + [m for m in methods if m not in ("auto", *METHODS)]
    if bad:
        ap.error(f"{bad} not among the configs {', '.join(CONFIGS)} or the methods auto, {', '.join(METHODS)}")
    out = args.out or f"benchmarks/results/long_context{'_quick' if args.quick else ''}.json"
    rows, start = [], time.perf_counter()
    for seq in seqs:
        for config in configs:  # a fresh process each: no warm-up, cache or peak carried from the last
            print(f"[{time.perf_counter() - start:,.0f} s] {config} at sequence {seq}", file=sys.stderr, flush=True)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", config, str(seq), "--methods",
                   ",".join(methods), "--steps", str(args.steps), "--vocab", str(args.vocab), "--baseline",
                   args.baseline, "--fit-share", str(args.fit_share)]
            run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # progress goes on to stderr
            if run.returncode:
                why = f"process failed (exit {run.returncode})"
                if run.returncode < 0:
                    signal_name = signal.Signals(-run.returncode).name
                    why = f"process killed ({signal_name}{': out of memory?' if signal_name == 'SIGKILL' else ''})"
                print(f"{config} seq {seq}: {why}", file=sys.stderr, flush=True)
                rows += _failed_rows(config, seq, methods, why)
            else:
                rows += json.loads(run.stdout.strip().splitlines()[-1])
            # after every process, so that a long sweep stopped midway keeps what it measured
            write_json(out, rows=rows, complete=False, dim=DIM, heads=HEADS, layers=LAYERS, vocab=args.vocab,
                       steps=args.steps, baseline=args.baseline, fit_share=FIT_SHARE, cpus=os.cpu_count(),
                       seconds=round(time.perf_counter() - start))
    _print_table(rows)
    write_json(out, rows=rows, complete=True, dim=DIM, heads=HEADS, layers=LAYERS, vocab=args.vocab, steps=args.steps,
               baseline=args.baseline, fit_share=FIT_SHARE, cpus=os.cpu_count(),
               seconds=round(time.perf_counter() - start))


if __name__ == "__main__":
    main()
