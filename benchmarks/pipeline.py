"""Pipeline parallelism: a GPT's blocks in stages (GPipe, 1F1B, interleaved 1F1B) against the same model unpipelined.

A GPT of 8 layers (width 128, 4 heads, vocabulary 256, sequence 64; flags change them) on 8 devices (emulated on CPU
when fewer), pipelined on two meshes: ``pp4xdp2`` (4 stages, data parallel over 2: ``jshard.gpt.plan("pp+dp")``) and
``pp2xtp4`` (2 stages, Megatron tensor parallelism over 4: ``plan("pp+tp")``), with 4, 8 and 16 microbatches and
each schedule (``gpipe``, ``1f1b``, ``interleaved`` with 2 virtual stages). The baselines are the same model without
pipelining on the same 8 devices: ``dp2xtp4`` (``plan("dp+tp")``) and ``fsdp8`` (``plan("fsdp")``), and one device
(``jax.jit`` with ``jax.nn.dot_product_attention``: the loss oracle).

The batch: a microbatch holds ``--per-microbatch`` (4) sequences per data-parallel replica of the pipelined mesh,
so the global batch is ``microbatches x 4 x dp`` (128 sequences at 16 microbatches on pp4xdp2) and every side of a
(mesh, microbatches) group, the baselines included, trains on the same batches. A fixed microbatch (rather than a
fixed global batch) is what makes GPipe's memory grow with the microbatch count and 1F1B's not, and what lets the
step time be fitted against it (below).

Per (mesh, microbatches) group, in this process, all sides interleaved step by step (the order rotating): the
step time (median of ``--steps`` steps after the first; ratio to each baseline); the per-device peak memory of the
compiled program (``memory_analysis``: temporaries + arguments + outputs); the FLOPs, collectives and bytes of the
compiled HLO, each loop counted by its trip count and each conditional with every branch (``cost_analysis`` counts
a loop's body once, so it would miss all but one tick: the count here is the work of a program in which bubbles
cost as much as work, an upper bound of what the pipeline's ``lax.cond``\\ s run); the collective-permutes apart
(the stage-to-stage traffic, a permute's bytes averaged over the devices, its pairs' destinations receiving a
block and the others nothing; the kernel's switch between the sets of stage pairs a tick sends along counted as it
runs, each branch on the ticks that select it, read off the kernel's tables since the program text does not print
them) against what the schedule must move, ``microbatches x (p*v - 1)`` activations forward and as many gradients
back, per device ``2 m (p v - 1) A / p`` for an activation block of ``A`` bytes, and the
other collectives whose groups join stages (target: none in the forward pass; the gradients' sums after it); the
blocks' parameter bytes a device holds, against the same placements without the pipeline axis (target ``1/p``);
the schedule's ``wasted()`` and ``theory()``, its ticks, buffer slots and in-flight microbatches; and whether every
side's losses agree with one device's (``jshard.validate.tolerance.curve_ratio``).

Across microbatches, per mesh and schedule: the measured wasted fraction. Each step time is taken relative to
the one-device step of its group (interleaved with it, so under the same load of this shared machine), times
``m``: ``t(m)``, in one device's time per microbatch. A least-squares fit ``t(m) = a * v * m + b`` (``v * m``
units a device runs) splits it into work (``a`` per unit) and a fixed part ``b`` that does not scale with the
work, and ``b / t(m)`` is the share of the step that part takes: on devices of their own, the bubble (``p - 1``
ticks) plus the step's fixed costs (optimizer, gradient reductions, dispatch); its theory is
``(p - 1) / (v m + p - 1)``. Emulated CPU devices share this machine's cores, so an idle stage's core runs the
busy stages' work and wall time follows the total work, not the critical path: there the fit measures the fixed
costs, not the bubble. And the peak memory's growth per microbatch, in activation blocks ``A``: what grows with
the global batch outside the pipeline (the embeddings' output and its gradient, ``2A`` per microbatch) plus the
pipeline's buffers (per buffer slot ``2A``, the two inboxes, and the residuals its layers keep for their backward
units), whose slots grow with ``m`` for GPipe and stop growing for 1F1B at ``2(p - 1) + 1`` (interleaved: per
chunk, at ``2p``); target: 1F1B's in-pipeline part flat.

    python benchmarks/pipeline.py [--configs pp4xdp2,pp2xtp4] [--microbatches 4,8,16]
                                  [--schedules gpipe,1f1b,interleaved] [--steps 3] [--layers 8] [--dim 128]
                                  [--heads 4] [--vocab 256] [--seq 64] [--per-microbatch 4] [--quick]
                                  [--out benchmarks/results/pipeline.json]

``--quick`` (a notebook's run; 3 to 4 minutes on 2 shared CPU cores, most of it compiling): pp4xdp2,
microbatches 4 and 8, 1f1b and gpipe, 2 timed steps. From a notebook, ``measure(config, microbatches)`` returns
the rows of one group, measured in the calling process.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import collections  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from long_context import (  # noqa: E402
    _COMPUTATION,
    _TRIP,
    _WHILE,
    _baseline_attention,
    _memory,
    _one_device_side,
    _run_interleaved,
    _Side,
    _stepper,
)
from redistribute import hlo_traffic  # noqa: E402

import jshard  # noqa: E402
from jshard import Replicate, Shard  # noqa: E402
from jshard.gpt import GPT, cross_entropy, plan, summed_terms  # noqa: E402
from jshard.parallel import TrainStep, parallelize  # noqa: E402
from jshard.parallel.pipeline import _routes  # noqa: E402
from jshard.parallel.schedule import Schedule, make_schedule  # noqa: E402
from jshard.validate.tolerance import curve_ratio  # noqa: E402
from report import write_json  # noqa: E402


@dataclass(frozen=True)
class Model:
    """The GPT's sizes, and how many sequences a microbatch holds per data-parallel replica."""

    layers: int = 8
    dim: int = 128
    heads: int = 4
    vocab: int = 256
    seq: int = 64
    per_microbatch: int = 4


# name: (mesh shape, axis names, jshard.gpt.plan style)
CONFIGS = {"pp4xdp2": ((4, 2), ("pp", "dp"), "pp+dp"), "pp2xtp4": ((2, 4), ("pp", "tp"), "pp+tp")}
BASELINES = {"dp2xtp4": ((2, 4), ("dp", "tp"), "dp+tp"), "fsdp8": ((8,), ("dp",), "fsdp")}
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # schedule: virtual stages
MICROBATCHES = (4, 8, 16)
QUICK = {"configs": ("pp4xdp2",), "microbatches": (4, 8), "schedules": ("1f1b", "gpipe"), "steps": 2}


def measure(config: str, microbatches: int, schedules: Sequence[str] = tuple(SCHEDULES), *, steps: int = 3,
            model: Model = Model(), log: Callable[[str], None] | None = None) -> list[dict]:
    """Rows of one pipelined mesh (``config``, a key of ``CONFIGS``) at ``microbatches``: one per schedule, each
    with the pipeline's figures, both baselines' and one device's (the same for every row), all measured in this
    process, the sides interleaved step by step (``steps`` timed steps after a first, compiling one). Needs 8
    devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts, as this module sets on
    import). ``log`` gets a line per stage (default: stderr).

    >>> rows = measure("pp2xtp4", 2, ["1f1b"], steps=1, model=Model(layers=2, dim=32, vocab=64, seq=16),
    ...                log=lambda line: None)
    >>> rows[0]["pipeline"]["status"], rows[0]["losses_agree"], rows[0]["blocks_memory"]["share"]
    ('ran', {'pipeline': True, 'dp2xtp4': True, 'fsdp8': True}, 0.5)
    """
    if config not in CONFIGS:
        raise ValueError(f"measure: config {config!r} is not one of {', '.join(CONFIGS)}")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"measure: schedules {unknown} are not among {', '.join(SCHEDULES)}")
    shape, names, style = CONFIGS[config]
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    if len(devices) < 8:
        raise RuntimeError(_too_few_devices(len(devices)))
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    sizes = dict(zip(names, shape, strict=True))
    p, dp = sizes["pp"], sizes.get("dp", 1)
    batch = microbatches * model.per_microbatch * dp
    for s in schedules:
        make_schedule(s, p, microbatches, SCHEDULES[s])  # the schedule's own errors, before anything compiles
    where = f"{config} m={microbatches}"
    rng = np.random.default_rng(microbatches)
    batches = [tuple(rng.integers(0, model.vocab, (batch, model.seq)).astype(np.int32) for _ in range(2))
               for _ in range(steps + 1)]
    tx = optax.adamw(1e-3)

    def make():
        return GPT(model.vocab, model.dim, model.heads, model.layers, model.seq, rngs=nnx.Rngs(0))

    def loss_fn(m, ids, labels):
        return cross_entropy(m(ids), labels)

    ours: dict[str, _Side] = {}
    for s in schedules:
        log(f"{where}: {s}: building and compiling")
        styles, default = plan(style, microbatches=microbatches, schedule=s, virtual_stages=SCHEDULES[s])
        ours[s] = _jshard_side(s, make, tx, loss_fn, devices, shape, names, styles, default, batches,
                               make_schedule(s, p, microbatches, SCHEDULES[s]))
    theirs: dict[str, _Side] = {}
    for name, (b_shape, b_names, b_style) in BASELINES.items():
        log(f"{where}: {name}: building and compiling")
        styles, default = plan(b_style)
        theirs[name] = _jshard_side(name, make, tx, loss_fn, devices, b_shape, b_names, styles, default, batches)
    log(f"{where}: one device: compiling")
    with _baseline_attention("xla"):  # the oracle attends by jax.nn.dot_product_attention, as plain JAX does
        alone = _one_device_side(make, tx, loss_fn, devices[0], batches)
    _run_interleaved([*ours.values(), *theirs.values(), alone], steps, log, where)

    n_terms = summed_terms(model.vocab, model.dim, model.layers, model.seq, batch)
    activation = model.per_microbatch * model.seq * model.dim * 4  # one microbatch's block input, as a device holds it
    rows = []
    for s, side in ours.items():
        sched = make_schedule(s, p, microbatches, SCHEDULES[s])
        v = sched.virtual_stages
        needed = 2 * microbatches * (p * v - 1) * activation / p
        permute = side.extra["permute"]
        row = dict(config=config, mesh=sizes, microbatches=microbatches, schedule=s, virtual_stages=v,
                   global_batch=batch, microbatch_sequences=model.per_microbatch * dp, steps=steps,
                   model=vars(model), pipeline=side.report(),
                   baselines={k: t.report() for k, t in theirs.items()}, one_device=alone.report(),
                   schedule_wasted=round(sched.wasted(), 4), schedule_theory=round(sched.theory(), 4),
                   ticks=sched.ticks, slots=sched.slots, in_flight=sched.in_flight().tolist(),
                   activation_bytes=activation, stage_traffic=dict(
                       permute, needed_bytes=int(needed),
                       over_needed=round(permute["received_bytes"] / needed, 3) if needed else None),
                   blocks_memory=side.extra["blocks"])
        row.update(_comparisons(side, theirs, alone, n_terms), flops_ratio_tick_model=_tick_model(row))
        rows.append(row)
    return rows


def _too_few_devices(have: int) -> str:
    return (f"measure: the benchmark needs 8 devices, JAX has {have}; set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX is imported (a fresh kernel or process), "
            "or run python benchmarks/pipeline.py")


def _jshard_side(name: str, make, tx, loss_fn, devices, shape, names, styles, default, batches,
                 schedule: Schedule | None = None) -> _Side:
    """A jshard ``TrainStep`` on a mesh ``shape`` x ``names`` (pipelined by ``schedule`` where given): its compiled
    program's figures, and its steps."""
    mesh = jax.make_mesh(shape, names, devices=devices[:math.prod(shape)])
    model = parallelize(make, mesh, styles, default=default)
    step = TrainStep(model, tx, loss_fn)
    data = tuple(Shard(0) if a == "dp" else Replicate() for a in names)
    dbatches = [[jshard.distribute(a, mesh, data) for a in b] for b in batches]
    compiled = step.lower(*dbatches[0]).compile()
    axis = list(names).index("pp") if "pp" in names else None
    # the pipeline's sends as its kernel switches between them (a direction of one set sends without a switch)
    switches = [r for r in _routes(schedule).values() if len(r[0]) > 1] if schedule else []
    figures = _hlo_figures(compiled.as_text(), len(mesh.devices.flat), None if axis is None else (shape, axis),
                           switches)
    side = _Side(name, len(mesh.devices.flat), _memory(compiled), figures.pop("collectives"),
                 extra=dict(figures, blocks=_blocks_memory(model, mesh)))
    side.run = _stepper(step, dbatches)
    return side


def _blocks_memory(model, mesh) -> dict:
    """The bytes of the blocks' parameters one device holds (the largest block of each), all of them whole, and the
    device's bytes had the pipeline axis been left out of the placements: ``share`` is the first over the last
    (``1/p`` for a pipeline of ``p`` stages; 1 without one)."""
    state = nnx.state(model.blocks, nnx.Param)
    arrays = jax.tree.leaves(state, is_leaf=lambda a: isinstance(a, jshard.DArray))
    names = list(mesh.axis_names)
    local = sum(a.spec.local_bytes for a in arrays)
    whole = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays)
    if "pp" in names:
        ax = names.index("pp")
        unpiped = sum(a.spec.with_placements([Replicate() if i == ax else q for i, q in
                                              enumerate(a.placements)]).local_bytes for a in arrays)
    else:
        unpiped = local
    return {"local_bytes": int(local), "whole_bytes": int(whole), "without_pp_bytes": int(unpiped),
            "share": round(local / unpiped, 4)}


def _hlo_figures(hlo: str, devices: int, stages: tuple[tuple[int, ...], int] | None = None,
                 switches: Sequence[tuple[tuple, np.ndarray]] = ()) -> dict:
    """A compiled per-device program's FLOPs (dots: 2 x output x contracted size), collectives by kind with the
    bytes a device receives in them (``hlo_traffic``; a collective-permute's on average over the ``devices``: its
    block times the share of devices its pairs deliver one to), the collective-permutes apart, and (given
    ``stages``: the mesh's shape and the pipeline axis) the other collectives whose groups join devices of different
    stages; each computation counted as often as it runs (``_executions``: a while loop's body its known trip count
    times, each branch of a conditional as often as the conditional, so a masked-out tick counts as work, but for
    the branches of the pipeline's ``switches``, each counted as often as a tick selects it)."""
    flops, kinds, received = 0.0, collections.Counter(), 0.0
    permute = {"count": 0, "received_bytes": 0.0}
    cross = {"kinds": collections.Counter(), "received_bytes": 0.0}
    types = dict(_DEFINITION.findall(hlo))
    for lines, times in _executions(hlo, stages, switches):
        text = "\n".join(lines)
        permutes = [x for x in lines if _PERMUTE.search(x)]
        k, r = hlo_traffic("\n".join(x for x in lines if not _PERMUTE.search(x)), devices)
        k.update({"collective-permute": len(permutes)} if permutes else {})
        pr = sum(_permute_received(x, devices) for x in permutes)
        kinds.update({kind: c * times for kind, c in k.items()})
        received += (r + pr) * times
        permute["count"] += len(permutes) * times
        permute["received_bytes"] += pr * times
        flops += sum(_dot_flops(m, types) for m in _DOT.finditer(text)) * times
        for line in lines if stages else ():
            group = _GROUPS.search(line)
            if group and _crosses(group, *stages):
                kc, rc = hlo_traffic(line, devices)
                cross["kinds"].update({kind: c * times for kind, c in kc.items()})
                cross["received_bytes"] += rc * times
    out = {"flops": int(flops), "permute": dict(permute, received_bytes=int(permute["received_bytes"])),
           "collectives": {"kinds": dict(sorted(kinds.items())), "count": sum(kinds.values()),
                           "received_bytes": int(received)}}
    if stages:
        out["across_stages"] = {"kinds": dict(sorted(cross["kinds"].items())),
                                "received_bytes": int(cross["received_bytes"])}
    return out


def _crosses(group: re.Match, shape: tuple[int, ...], axis: int) -> bool:
    """Whether a collective's replica groups join devices at different coordinates of mesh axis ``axis`` (devices
    numbered in the mesh's order). Groups are listed (``{{0,1},{2,3}}``), an iota (``[2,4]<=[4,2]T(1,0)``), or,
    from jax 0.12 on, mesh axes (``mesh['pp'=2,'dp'=2] {'pp'}``)."""
    if group.group(5) is not None:
        name = re.findall(r"'(\w+)'=", group.group(5))[axis]
        return shape[axis] > 1 and f"'{name}'" in group.group(6)
    if group.group(1) is not None:
        groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", group.group(1))]
    else:
        dims = [int(d) for d in group.group(3).split(",")]
        perm = [int(d) for d in group.group(4).split(",")] if group.group(4) else list(range(len(dims)))
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm)
        groups = ids.reshape([int(d) for d in group.group(2).split(",")]).tolist()
    return any(len({int(np.unravel_index(d, shape)[axis]) for d in g}) > 1 for g in groups)


def _permute_received(line: str, devices: int) -> float:
    """The bytes a device receives in the collective-permute of HLO ``line``, on average over ``devices``: its block
    (``hlo_traffic``) times the share of devices that get one from another device."""
    _, block = hlo_traffic(line, devices)
    pairs = re.findall(r"\{(\d+),(\d+)\}", _PERMUTE.search(line).group(1))
    return block * len({b for a, b in pairs if a != b}) / devices


def _executions(hlo: str, stages: tuple[tuple[int, ...], int] | None = None,
                switches: Sequence[tuple[tuple, np.ndarray]] = ()) -> list[tuple[list[str], int]]:
    """Each computation's lines and how many times one run of the program runs it (0: never, a loop's condition
    apart: it holds no work). Callers follow their callees in HLO text, so the walk goes from the entry back.

    A conditional's branches run as often as the conditional, but for a pipeline's switch between sends: the text
    does not say which branch a tick takes (its index is a table too large to print), the kernel's tables do. Each
    of ``switches`` is a direction's ``(routes, index)`` as the kernel builds its switch from them
    (``jshard.parallel.pipeline._routes``): the stage pairs each branch sends along and, per tick, the branch
    taken. The conditional whose branches' collective-permutes send along exactly those pairs (``stages``: the
    mesh's shape and the pipeline axis, to read a device's stage), in order, runs branch ``j`` on the ticks whose
    index is ``j`` (it runs once a tick). Every switch must match a conditional of its own."""
    bodies: dict[str, list[str]] = {}
    times: collections.Counter = collections.Counter()
    name = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            name = head.group(2)
            bodies[name] = []
            times[name] = 1 if head.group(1) else 0
        elif name is not None:
            bodies[name].append(line)
    unmatched = list(switches)
    for comp in reversed(bodies):
        for line in bodies[comp]:
            loop = _WHILE.search(line)
            if loop:
                trip = _TRIP.search(line)
                if trip is None:
                    raise ValueError(f"pipeline benchmark: a while loop without a known trip count in {comp}; its "
                                     "FLOPs and collectives cannot be counted")
                times[loop.group(2)] += times[comp] * int(trip.group(1))
                continue
            branches = _branches(line)
            ticks = _switch_ticks(branches, bodies, stages, unmatched) if branches else None
            if ticks is not None:
                each, rest = divmod(times[comp], sum(ticks))
                if rest:
                    raise ValueError(f"pipeline benchmark: a switch between sends of {sum(ticks)} ticks runs "
                                     f"{times[comp]} times in {comp}, not once a tick; its sends cannot be counted")
                for callee, n in zip(branches, ticks, strict=True):
                    times[callee] += each * n
                continue
            for callee in branches or _CALLS.findall(line):
                times[callee] += times[comp]
    if unmatched:
        raise ValueError(f"pipeline benchmark: no conditional of the program switches between the sends "
                         f"{[routes for routes, _ in unmatched]} (stage pairs per branch) its kernel's tables name; "
                         "the ticks' sends cannot be counted (has the kernel's switch changed?)")
    return [(lines, times[comp]) for comp, lines in bodies.items() if times[comp]]


def _branches(line: str) -> list[str]:
    """The branch computations of a conditional in HLO ``line``, in index order (a predicate's: false, then true);
    none for another instruction."""
    if " conditional(" not in line:
        return []
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    if listed:
        return [b.strip().lstrip("%") for b in listed.group(1).split(",")]
    return [re.search(rf"{which}_computation=%([\w.\-]+)", line).group(1) for which in ("false", "true")]


def _switch_ticks(branches: list[str], bodies: dict[str, list[str]], stages, unmatched: list) -> list[int] | None:
    """Per branch, the ticks that take it, where the branches send along the pairs of one of the ``unmatched``
    switches (which it then takes off the list); None where they do not."""
    if stages is None or not unmatched:
        return None
    shape, axis = stages
    sends = []
    for branch in branches:
        pairs = set()
        for line in bodies[branch]:
            found = _PERMUTE.search(line)
            for a, b in re.findall(r"\{(\d+),(\d+)\}", found.group(1) if found else ""):
                pairs.add(tuple(int(np.unravel_index(int(d), shape)[axis]) for d in (a, b)))
        sends.append(pairs)
    for i, (routes, index) in enumerate(unmatched):
        if [set(r) for r in routes] == sends:
            del unmatched[i]
            return np.bincount(index, minlength=len(routes)).tolist()
    return None


def _dot_flops(match: re.Match, types: dict[str, str]) -> float:
    out, lhs, contracting = match.group(1), match.group(2), match.group(3)
    lhs_dims = _dims(types.get(lhs, ""))
    size = math.prod(lhs_dims[int(d)] for d in contracting.split(",") if d) if lhs_dims else 0
    return 2.0 * math.prod(_dims(out)) * size


def _dims(type_text: str) -> list[int]:
    m = re.search(r"\[([\d,]*)\]", type_text)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+\[[\d,]*\])", re.M)
# an all-gather, all-reduce, reduce-scatter or all-to-all's replica groups: listed, an iota, or mesh axes
_GROUPS = re.compile(r"(?:all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(.*replica_groups="
                     r"(?:\{(\{[\d,{}]*\})\}|\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
                     r"|mesh\[([^\]]*)\] \{([^}]*)\})")
_DOT = re.compile(r"= (\w+\[[\d,]*\])\S* dot\(%([\w.\-]+), %[\w.\-]+\).*?lhs_contracting_dims=\{([\d,]*)\}")
_PERMUTE = re.compile(r"collective-permute(?:-start)?\(.*source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_CALLS = re.compile(r"(?:calls|to_apply)=%([\w.\-]+)")  # a conditional's branches: _branches


def _comparisons(side: _Side, theirs: dict[str, _Side], alone: _Side, n_terms: int) -> dict:
    """Ratios of the pipeline's step time, peak memory and FLOPs to each baseline's; whether every side's losses
    agree with one device's."""
    out: dict = {"step_ratio": {}, "memory_ratio": {}, "flops_ratio": {}}
    for name, other in theirs.items():
        if side.times_ms and other.times_ms:
            out["step_ratio"][name] = round(statistics.median(side.times_ms) / statistics.median(other.times_ms), 3)
        out["memory_ratio"][name] = round(side.memory["peak"] / other.memory["peak"], 3)
        out["flops_ratio"][name] = round(side.extra["flops"] / other.extra["flops"], 3)
    agree, diff = {}, {}
    for name, s in (("pipeline", side), *theirs.items()):
        if s.losses and len(s.losses) == len(alone.losses):
            agree[name] = curve_ratio(s.losses, alone.losses, n_per_step=n_terms) <= 1
            diff[name] = max(abs(a - b) / abs(b) for a, b in zip(s.losses, alone.losses, strict=True))
    out.update(losses_agree=agree, loss_max_rel_diff=diff)
    return out


def _tick_model(row: dict) -> float:
    """The FLOPs count's model, over the unpipelined step's: every tick runs a forward unit and a backward unit (the
    conditionals' every branch counts), a unit being one chunk's layers on one microbatch, against the 3 forwards'
    work (forward, and the gradient's 2) of the ``v * m`` units a device has. A backward unit costs 3 forwards:
    the gradient's 2 and, under ``PipelineParallel``'s default ``remat``, its layers' forward run again from the
    inputs its forward unit kept."""
    v, m = row["virtual_stages"], row["microbatches"]
    return round(row["ticks"] * (1 + 3) / (3 * v * m), 3)


def across_microbatches(rows: list[dict]) -> list[dict]:
    """Per mesh and schedule, over the microbatch counts measured: the fit ``t(m) = a * v * m + b`` of the step
    times, the measured wasted share ``b / t(m)`` beside the theory, and the peak memory's growth per microbatch in
    activation blocks (see the module's docstring). Needs two microbatch counts or more.

    The step times are taken relative to the one-device step of the same group (run interleaved with it, under the
    same load of a shared machine): ``t(m) = pipeline(m) / one_device(m) * m``, in units of one device's time per
    microbatch. One device's step is the work of its ``m`` microbatches, bubble-free and nearly without fixed
    costs (an optimizer update is a small part of it), so the unit is the same in every group.

    >>> rows = [dict(config="c", schedule="1f1b", microbatches=m, virtual_stages=1, schedule_theory=3 / (m + 3),
    ...              activation_bytes=10, pipeline=dict(step_ms=5.0 * (m + 3) * (1 + m % 3),
    ...              memory=dict(peak=100 + 20 * m)), one_device=dict(step_ms=2.0 * m * (1 + m % 3)))
    ...         for m in (4, 8)]
    >>> s = across_microbatches(rows)[0]
    >>> s["measured_wasted"], s["theory"], s["peak_growth_per_microbatch"]
    ([0.4286, 0.2727], [0.4286, 0.2727], 2.0)
    """
    groups = collections.defaultdict(list)
    for r in rows:
        if "step_ms" in r["pipeline"] and "step_ms" in r["one_device"]:
            groups[r["config"], r["schedule"]].append(r)
    out = []
    for (config, schedule), rs in groups.items():
        rs.sort(key=lambda r: r["microbatches"])
        if len(rs) < 2:
            continue
        m = np.array([r["microbatches"] for r in rs], float)
        units = np.array([r["virtual_stages"] for r in rs]) * m
        t = np.array([r["pipeline"]["step_ms"] / r["one_device"]["step_ms"] for r in rs]) * m
        a, b = np.polyfit(units, t, 1)
        peaks = np.array([r["pipeline"]["memory"]["peak"] for r in rs], float)
        growth = np.polyfit(m, peaks, 1)[0] / rs[0]["activation_bytes"]
        out.append(dict(config=config, schedule=schedule, microbatches=m.astype(int).tolist(),
                        relative_step=[round(float(x), 3) for x in t], per_unit=round(float(a), 3),
                        fixed=round(float(b), 3), measured_wasted=[round(float(b / x), 4) for x in t],
                        theory=[round(r["schedule_theory"], 4) for r in rs],
                        peaks=[int(x) for x in peaks], peak_growth_per_microbatch=round(float(growth), 2)))
    return out


def _print_table(rows: list[dict], summary: list[dict], model: Model) -> None:
    print(f"\nGPT: {model.layers} layers, width {model.dim}, {model.heads} heads, vocabulary {model.vocab}, sequence "
          f"{model.seq}; a microbatch holds {model.per_microbatch} sequences per dp replica.\n"
          "ms: step time (median), and its ratio to dp2xtp4's and fsdp8's; peak MB: temp + args + outputs per "
          "device;\nGFLOP per device (loops by trip count, every branch of a conditional), its ratio to "
          "dp2xtp4's and the tick model's\n(every tick a forward and a backward unit, a backward 3 forwards' "
          "work: the layers' forward again, under remat);\ncoll, recv MB: collectives run and MB a device "
          "receives; ppermute MB: the stage-to-stage part, and over what the\nschedule must move; x-pp: the "
          "other collectives joining stages (loops by trip count); blocks: the blocks' parameter\nbytes a "
          "device holds over the same without pp (target 1/p);\n"
          "wasted, theory: the schedule's wasted() and theory(); slots: buffers per chunk\n")
    print(f"{'config':<8} {'m':>3} {'schedule':<12} {'ms':>7} {'/dp2xtp4':>9} {'/fsdp8':>7} {'peak MB':>8} "
          f"{'dp2xtp4':>8} {'fsdp8':>6} {'GFLOP':>7} {'/dp2xtp4':>9} {'model':>7} {'coll':>5} {'recv MB':>8} "
          f"{'ppermute MB':>12} {'/needed':>8} {'x-pp':>5} {'blocks':>7} {'wasted':>7} {'theory':>7} {'slots':>5} "
          f"{'losses':>7}")
    for r in rows:
        a = r["pipeline"]
        if "memory" not in a:
            print(f"{r['config']:<8} {r['microbatches']:>3} {r['schedule']:<12} {a['status']}")
            continue
        b = r["baselines"]
        agree = r.get("losses_agree", {})
        losses = "-" if not agree else "agree" if all(agree.values()) else "DIFFER " + ",".join(
            k for k, ok in agree.items() if not ok)
        print(f"{r['config']:<8} {r['microbatches']:>3} {r['schedule']:<12} {_ms(a):>7} "
              f"{r['step_ratio'].get('dp2xtp4', '-'):>9} {r['step_ratio'].get('fsdp8', '-'):>7} "
              f"{a['memory']['peak'] / 2**20:>8.1f} {b['dp2xtp4']['memory']['peak'] / 2**20:>8.1f} "
              f"{b['fsdp8']['memory']['peak'] / 2**20:>6.1f} {a['flops'] / 1e9:>7.2f} "
              f"{r['flops_ratio']['dp2xtp4']:>9} {_tick_model(r):>7} {a['collectives']['count']:>5} "
              f"{a['collectives']['received_bytes'] / 2**20:>8.2f} "
              f"{r['stage_traffic']['received_bytes'] / 2**20:>12.2f} {r['stage_traffic']['over_needed']:>8} "
              f"{sum(a['across_stages']['kinds'].values()) if 'across_stages' in a else '-':>5} "
              f"{r['blocks_memory']['share']:>7} {r['schedule_wasted']:>7} {r['schedule_theory']:>7} "
              f"{r['slots']:>5} {losses:>7}")
    if rows:
        base = rows[0]["baselines"]
        print("\nbaselines (first group): " + ", ".join(
            f"{k} {_ms(v)} ms, {v['collectives']['count']} collectives, "
            f"{v['collectives']['received_bytes'] / 2**20:.2f} MB received, {v['flops'] / 1e9:.2f} GFLOP"
            for k, v in base.items() if "memory" in v))
    if summary:
        print("\nacross microbatches: t(m) = step / one device's step x m (in one device's time per microbatch) "
              "fitted to a * v * m + b;\nmeasured wasted = b / t(m) (on emulated CPU devices the fixed costs, not "
              "the bubble: see the docstring);\npeak growth per "
              "microbatch in activation blocks (1F1B target: the 2 of the embeddings and their gradient; GPipe adds "
              "its buffers': the inboxes' 2 and each layer's input)")
        print(f"{'config':<8} {'schedule':<12} {'m':>10} {'t(m)':>20} {'a':>7} {'b':>7} {'measured wasted':>24} "
              f"{'theory':>24} {'peak MB':>24} {'growth/m':>9}")
        for s in summary:
            print(f"{s['config']:<8} {s['schedule']:<12} {_join(s['microbatches'], 'd'):>10} "
                  f"{_join(s['relative_step'], '.2f'):>20} {s['per_unit']:>7} {s['fixed']:>7} "
                  f"{_join(s['measured_wasted'], '.3f'):>24} {_join(s['theory'], '.3f'):>24} "
                  f"{_join([x / 2**20 for x in s['peaks']], '.1f'):>24} {s['peak_growth_per_microbatch']:>9}")
    print("\ntargets: measured wasted within 0.02 of the theory; 1F1B's peak flat in m (but for what grows with the "
          "global batch); blocks 1/p; ppermute bytes / needed = 1.00; losses agree")


def _join(values, fmt: str) -> str:
    return " ".join(format(x, fmt) for x in values)


def _ms(side: dict) -> str:
    return f"{side['step_ms']:,.0f}" if "step_ms" in side else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)), help="comma-separated counts")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(SCHEDULES)}")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side, after the first (compiling) one")
    defaults = Model()
    for name in vars(defaults):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    ap.add_argument("--quick", action="store_true",
                    help=f"configs {QUICK['configs']}, microbatches {QUICK['microbatches']}, schedules "
                         f"{QUICK['schedules']}, {QUICK['steps']} timed steps")
    ap.add_argument("--out", default=None, help="JSON (default: benchmarks/results/pipeline[_quick].json)")
    args = ap.parse_args()
    configs, schedules = args.configs.split(","), args.schedules.split(",")
    counts = [int(m) for m in args.microbatches.split(",")]
    if args.quick:
        configs, counts, schedules = list(QUICK["configs"]), list(QUICK["microbatches"]), list(QUICK["schedules"])
        args.steps = QUICK["steps"]
    bad = [c for c in configs if c not in CONFIGS] + [s for s in schedules if s not in SCHEDULES]
    if bad:
        ap.error(f"{bad} not among the configs {', '.join(CONFIGS)} or the schedules {', '.join(SCHEDULES)}")
    model = Model(**{name: getattr(args, name) for name in vars(defaults)})
    out = args.out or f"benchmarks/results/pipeline{'_quick' if args.quick else ''}.json"
    rows, start = [], time.perf_counter()
    for config in configs:
        for m in counts:
            print(f"[{time.perf_counter() - start:,.0f} s] {config} with {m} microbatches", file=sys.stderr,
                  flush=True)
            rows += measure(config, m, schedules, steps=args.steps, model=model)
            # after every group, so that a long sweep stopped midway keeps what it measured
            write_json(out, rows=rows, summary=across_microbatches(rows), complete=False, model=vars(model),
                       steps=args.steps, cpus=os.cpu_count(), seconds=round(time.perf_counter() - start))
    summary = across_microbatches(rows)
    _print_table(rows, summary, model)
    write_json(out, rows=rows, summary=summary, complete=True, model=vars(model), steps=args.steps,
               cpus=os.cpu_count(), seconds=round(time.perf_counter() - start))


if __name__ == "__main__":
    main()
