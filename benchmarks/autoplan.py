"""Autoplan against hand plans: the plan ``autoplan`` finds, measured beside every hand plan that fits its budget.

The GPT of ``train_step.py`` at its sizes ``toy`` (vocabulary 256, width 128, 4 heads, sequence 64, batch 16) and
``compute`` (2048, 512, 8, 256, 8), ``--layers`` blocks (2), trained with adamw on ``jshard.gpt.cross_entropy``,
on the meshes ``8``, ``2x4`` and ``2x2x2`` (any ``AxB...`` shape is taken; the axes are named ``a``, ``b``, ``c``,
...). Per size and mesh:

- the hand plans: ``jshard.gpt.plan``'s styles ``HANDS`` (dp, fsdp, tp, sp, fsdp+tp, dp+cp, cp+tp, pp+fsdp,
  pp+dp+tp) with the mesh's axes given to their roles (``hand_roles``: pipeline the first axis, tensor the last,
  context the last one left, FSDP the largest one left; every axis no role takes carries the batch, data
  parallel), each one that applies to the mesh, the model and the batch built, compiled and run;
- the replicated plan's memory: the measured memory (the compiled step's ``memory_analysis``, arguments plus
  temporaries) of hand plan ``dp``, every parameter replicated and the batch split over every axis; the budgets
  are ``--budgets`` of it (default: none, 60%, 35%, 20%);
- per budget, ``autoplan`` with that budget (its solve time), the plan it finds built by ``parallelize(make, mesh,
  plan)`` with the batch placed by ``plan.batch``, its predicted memory (``plan.memory.total``) against the
  measured one, whether the measured one is within the budget, and its step time against the best hand plan
  whose measured memory fits the budget;
- every plan's first-step loss against one device's (``jshard.gpt.one_device_trainer``), within the rounding
  bound of ``jshard.validate.tolerance``.

Each plan is built and measured once per size and mesh (a plan found under several budgets, too); the step times
come from ``--rounds`` interleaved rounds of ``--steps`` steps over every plan of the mesh, the order rotating, a
plan's time a step in a round being the round's wall time over its steps: the found plans and the hand plans run
side by side, under the same load of this shared machine. A ratio is the median over the rounds of the found
plan's time over the hand plan's in the same round.

And the solve time alone of a 32-layer, width-4096 GPT (vocabulary 32000, 32 heads, sequence 2048, batch 8) on
``2x4`` and ``2x2x2``: planned abstractly, never built (``--skip-large`` leaves it out).

Targets: step time <= 1.02x the best fitting hand plan on every case; measured memory within the budget on every
case; solve time <= 5 s for the 32-layer model.

    python benchmarks/autoplan.py [--sizes toy,compute] [--meshes 8,2x4,2x2x2] [--budgets none,0.6,0.35,0.2]
                                  [--layers 2] [--rounds N] [--steps N] [--hands dp,fsdp,...] [--skip-large]
                                  [--quick] [--out benchmarks/results/autoplan.json]

``--quick``: toy on ``2x4``, budgets none and 35%, 5 rounds of 3 steps, and the 32-layer solves (about 2 minutes
on 2 CPU cores shared with other work).

Where a found plan gives the axes the same roles as a hand plan, the table prints their ratio too: for FSDP or
data parallelism alone the two place every parameter alike and compile to the same memory, so their ratio is the
measurement's own spread (1.13 for ``compute`` FSDP on 8 with 4 rounds, on 2 CPU cores shared with other work).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from redistribute import hlo_traffic  # noqa: E402
from train_step import SIZES, loss_fn  # noqa: E402

import jshard  # noqa: E402
from jshard import Replicate, Shard  # noqa: E402
from jshard.gpt import GPT, one_device_trainer, plan, summed_terms  # noqa: E402
from jshard.parallel import Plan, TrainStep, autoplan, parallelize  # noqa: E402
from jshard.parallel.plan import role_names  # noqa: E402
from jshard.validate.tolerance import curve_ratio  # noqa: E402
from report import write_json  # noqa: E402

# jshard.gpt.plan styles measured by hand; "dp" (every parameter replicated) is the memory the budgets scale
HANDS = ("dp", "fsdp", "tp", "sp", "fsdp+tp", "dp+cp", "cp+tp", "pp+fsdp", "pp+dp+tp")
MESHES = ("8", "2x4", "2x2x2")
BUDGETS = (None, 0.6, 0.35, 0.2)  # fractions of the replicated plan's measured memory; None: no budget
# --sizes: (steps per round, interleaved rounds)
ROUNDS = {"toy": (5, 10), "compute": (3, 5)}
# the 32-layer model solved, never built: (vocabulary, width, heads, layers, sequence), batch, meshes
LARGE = ((32000, 4096, 32, 32, 2048), 8, ("2x4", "2x2x2"))
QUICK = {"sizes": ("toy",), "meshes": ("2x4",), "budgets": (None, 0.35), "steps": 3, "rounds": 5}
TARGETS = {"step_ratio": 1.02, "large_solve_s": 5.0}


def hand_roles(style: str, sizes: dict[str, int]) -> dict[str, str] | None:
    """Each mesh axis's role under ``jshard.gpt.plan``'s ``style``, or None where the mesh has too few axes for
    it. Roles go to axes of more than one device: ``pp`` the first, the tensor role (``tp`` / ``sp``) the last,
    ``cp`` the last one left, ``fsdp`` the largest one left (the first of equals); every other axis is ``dp`` (it
    carries the batch), and so is an axis of one device whatever the style.

    >>> hand_roles("fsdp+tp", {"a": 2, "b": 4}), hand_roles("pp+dp+tp", {"a": 2, "b": 2, "c": 2})
    ({'a': 'fsdp', 'b': 'tp'}, {'a': 'pp', 'b': 'dp', 'c': 'tp'})
    >>> hand_roles("cp+tp", {"a": 8}) is None, hand_roles("tp", {"a": 1, "b": 8})
    (True, {'a': 'dp', 'b': 'tp'})
    """
    parts = style.split("+")
    free = [a for a, n in sizes.items() if n > 1]
    roles = dict.fromkeys(sizes, "dp")
    for role, where in (("pp", 0), ("tp", -1), ("sp", -1), ("cp", -1), ("fsdp", None)):  # picked in this order
        if role not in parts:
            continue
        if not free:
            return None
        axis = max(free, key=lambda a: sizes[a]) if where is None else free[where]
        free.remove(axis)
        roles[axis] = role
    return roles


def batches(size: str, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``count`` batches (ids, labels) every plan of ``size`` trains on, the first the one whose loss is
    compared with one device's.

    >>> [a.shape for a in batches("toy", 2)[1]]
    [(16, 64), (16, 64)]
    """
    vocab, _, _, seq, batch = SIZES[size]
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(0, vocab, (batch, seq)).astype(np.int32) for _ in range(2)) for _ in range(count)]


@dataclass
class Side:
    """One plan of a mesh: built, compiled and run (``status`` says why not), and its step times per round."""

    name: str
    origin: str  # the hand style, or "autoplan"
    roles: dict
    status: str = "ran"
    step: TrainStep | None = None
    batches: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    first_loss: float | None = None
    round_ms: list = field(default_factory=list)

    def report(self, reference: float, n_terms: int) -> dict:
        """The side's JSON: its figures, its first loss against one device's ``reference`` (the loss's longest
        chain summing ``n_terms`` terms) and its median step time."""
        out = dict(name=self.name, origin=self.origin, roles=self.roles, status=self.status, **self.figures)
        if self.first_loss is not None:
            out.update(first_loss=self.first_loss, loss_rel_diff=abs(self.first_loss - reference) / abs(reference),
                       loss_agrees=curve_ratio([self.first_loss], [reference], n_per_step=n_terms) <= 1)
        if self.round_ms:
            out.update(step_ms=round(statistics.median(self.round_ms), 3),
                       step_ms_rounds=[round(t, 3) for t in self.round_ms])
        return out


def measure(size: str, mesh_shape: Sequence[int], *, layers: int = 2, budgets: Sequence[float | None] = BUDGETS,
            hands: Sequence[str] = HANDS, steps: int = 5, rounds: int = 10,
            log: Callable[[str], None] | None = None) -> dict:
    """One size (a key of ``train_step.SIZES``) on one mesh (``mesh_shape``, axes named ``a``, ``b``, ...): the
    hand plans ``hands`` (``"dp"`` always among them: the budgets are fractions of its memory), the plan found
    under each of ``budgets``, their figures, first-step losses and interleaved step times (see the module's
    docstring). ``log`` gets a line per stage (default: stderr).

    >>> case = measure("toy", (1,), layers=1, budgets=[None], hands=["dp"], steps=1, rounds=1,
    ...                log=lambda line: None)
    >>> row = case["budgets"][0]
    >>> row["found"], row["best_hand"], row["within_budget"], case["hands"]["dp(a)"]["loss_agrees"]
    ('dp(a)', 'dp(a)', True, True)
    """
    if size not in SIZES:
        raise ValueError(f"measure: size {size!r} is not one of {', '.join(SIZES)}; say measure('toy', (2, 4))")
    unknown = [h for h in hands if h not in HANDS]
    if unknown:
        raise ValueError(f"measure: hand plans {unknown} are not among {', '.join(HANDS)}")
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    vocab, dim, heads, seq, batch = SIZES[size]
    mesh = _mesh(mesh_shape, "measure")
    names, sizes = mesh.axis_names, dict(mesh.shape)
    where = f"{size} {'x'.join(map(str, mesh_shape))}"
    tx = optax.adamw(1e-3)

    def make():
        return GPT(vocab, dim, heads, layers, seq, rngs=nnx.Rngs(0))

    data = batches(size, steps + 1)
    reference = one_device_trainer(make(), tx, loss_fn)(*data[0])

    sides: dict[str, Side] = {}
    for style in dict.fromkeys(("dp", *hands)):
        roles = hand_roles(style, sizes)
        if roles is None or role_names(roles) in sides:
            continue  # the mesh has too few axes for the style, or another style gave the axes these roles
        why = _not_applicable(roles, sizes, layers, batch)
        if why:
            log(f"{where}: hand plan {style} ({role_names(roles)}) does not apply: {why}")
            continue
        log(f"{where}: hand plan {style} ({role_names(roles)}): building and compiling")
        styles, default, placements = _hand_plan(style, roles, sizes, seq, batch)
        sides[role_names(roles)] = _side(role_names(roles), style, roles, make, mesh, styles, default, placements,
                                        tx, data, log, where)
    replicated = sides[role_names(dict.fromkeys(names, "dp"))]
    if replicated.status != "ran":
        raise RuntimeError(f"measure: the replicated plan does not run on {where}: {replicated.status}")
    base = replicated.figures["memory"]["total"]

    specs = [jax.ShapeDtypeStruct((batch, seq), jnp.int32)] * 2
    found: dict[str, Side] = {}
    rows = []
    for fraction in budgets:
        budget = None if fraction is None else int(fraction * base)
        row: dict = dict(fraction=fraction, budget=budget)
        try:
            p = autoplan(make, mesh, loss_fn, *specs, tx=tx, memory_budget=budget)
        except ValueError as e:
            row.update(found=None, error=str(e))
            log(f"{where}: budget {fraction}: {e}")
            rows.append(row)
            continue
        row.update(found=p.name, solve_s=round(p.solve_s, 3), predicted=_predicted(p),
                   runners_up=[q.name for q in p.runners_up], rejected=[list(r) for r in p.rejected])
        log(f"{where}: budget {fraction}: autoplan chose {p.name} in {p.solve_s:.2f} s")
        if p.name not in found:
            found[p.name] = _side(p.name, "autoplan", dict(p.roles), make, mesh, p, (), p.batch, tx, data, log,
                                  where)
        rows.append(row)

    _run_interleaved([*sides.values(), *found.values()], steps, rounds, log, where)
    for row in rows:
        row.update(_compared(row, found.get(row["found"]), sides))
    n_terms = summed_terms(vocab, dim, layers, seq, batch)
    return dict(size=size, mesh=sizes, layers=layers, model=dict(vocab=vocab, dim=dim, heads=heads, seq=seq,
                                                                  batch=batch),
                steps=steps, rounds=rounds, replicated_bytes=base, one_device_loss=reference,
                hands={k: s.report(reference, n_terms) for k, s in sides.items()},
                found={k: s.report(reference, n_terms) for k, s in found.items()}, budgets=rows)


def solve_large(mesh_shape: Sequence[int], log: Callable[[str], None] | None = None) -> dict:
    """``autoplan``'s solve of the 32-layer, width-4096 GPT (``LARGE``) on ``mesh_shape``, never built: its time,
    the plan it chose and what that plan is predicted to cost.

    >>> solve_large((1,), log=lambda line: None)["plan"]
    'dp(a)'
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    (vocab, dim, heads, layers, seq), batch, _ = LARGE
    mesh = _mesh(mesh_shape, "solve_large")
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    t0 = time.perf_counter()
    p = autoplan(lambda: GPT(vocab, dim, heads, layers, seq, rngs=nnx.Rngs(0)), mesh, loss_fn, ids, ids)
    wall = time.perf_counter() - t0
    log(f"32-layer GPT on {'x'.join(map(str, mesh_shape))}: {p.name} in {p.solve_s:.2f} s")
    return dict(mesh=dict(mesh.shape), model=dict(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq,
                                                  batch=batch),
                solve_s=round(p.solve_s, 3), wall_s=round(wall, 3), plan=p.name, predicted=_predicted(p),
                runners_up=[q.name for q in p.runners_up], rejected=[list(r) for r in p.rejected])


# ---------------------------------------------------------------------------------------------------
# internals


def _mesh(shape: Sequence[int], where: str):
    """The mesh of ``shape`` on the first devices (emulated CPU ones where the accelerators are fewer), its axes
    named ``a``, ``b``, ..."""
    n = math.prod(shape)
    devices = jax.devices() if len(jax.devices()) >= n else jax.devices("cpu")
    if len(devices) < n:
        raise RuntimeError(f"{where}: mesh {tuple(shape)} needs {n} devices, JAX has {len(devices)}; set "
                           f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX is imported, or run "
                           "python benchmarks/autoplan.py")
    return jax.make_mesh(tuple(shape), tuple("abcdefgh"[:len(shape)]), devices=devices[:n])


def _not_applicable(roles: dict, sizes: dict, layers: int, batch: int) -> str | None:
    """Why a hand plan's roles cannot run this model and batch (None: they can)."""
    data = math.prod(sizes[a] for a, r in roles.items() if r in ("dp", "fsdp"))
    if batch % data:
        return f"the batch of {batch} does not split over the {data} devices of the data axes"
    pp = [sizes[a] for a, r in roles.items() if r == "pp"]
    if pp and layers % pp[0]:
        return f"{layers} layers do not split into {pp[0]} stages"
    if pp and batch % (pp[0] * data):
        return f"the batch of {batch} does not split into {pp[0]} microbatches over {data} data devices"
    return None


def _hand_plan(style: str, roles: dict, sizes: dict, seq: int, batch: int) -> tuple[dict, tuple, tuple]:
    """``jshard.gpt.plan(style)`` on the axes ``roles`` name, and the batch's placements: split on dim 0 over the
    data axes, on the sequence over the context axis (as ``ContextParallel`` lays it out), whole elsewhere. A
    pipeline takes twice as many microbatches as stages where the batch splits so, else one per stage."""
    axis = {r: a for a, r in roles.items()}  # every role but dp (the axes that only carry the batch) has one axis
    named = {k: axis[r] for k, r in (("dp", "fsdp"), ("tp", "tp"), ("tp", "sp"), ("cp", "cp"), ("pp", "pp"))
             if r in axis}
    extra = {}
    if "pp" in axis:
        p = sizes[axis["pp"]]
        data = math.prod(sizes[a] for a, r in roles.items() if r in ("dp", "fsdp"))
        extra["microbatches"] = 2 * p if batch % (2 * p * data) == 0 else p
    styles, default = plan(style, **named, **extra)
    layout = {a: (Shard(0) if r in ("dp", "fsdp") else styles[""].sequence(seq, sizes[a]) if r == "cp"
                  else Replicate()) for a, r in roles.items()}
    placements = tuple(layout.values())
    return styles, default, (placements, placements)


def _side(name: str, origin: str, roles: dict, make, mesh, styles, default, placements, tx, data, log,
          where: str) -> Side:
    """A plan built, compiled (its figures) and run once on the first batch (its loss); a plan that fails says so
    in its status."""
    side = Side(name, origin, roles)
    try:
        model = parallelize(make, mesh, styles, default=default)  # a found Plan carries its own default
        side.step = TrainStep(model, tx, loss_fn)
        side.batches = [[jshard.distribute(a, mesh, list(p)) for a, p in zip(b, placements, strict=True)]
                        for b in data]
        side.figures = _figures(side.step.lower(*side.batches[0]).compile(), mesh.devices.size)
        side.first_loss = float(side.step(*side.batches[0]))
    except Exception as e:  # a plan the model cannot take (a dim its axis does not divide, ...) is reported
        side.status = f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        side.step, side.batches = None, []
        log(f"{where}: {name}: {side.status}")
    return side


def _figures(compiled, devices: int) -> dict:
    """The compiled step's memory per device (``memory_analysis``; ``total``: arguments + temporaries, what
    ``Plan.memory.total`` predicts) and its collectives."""
    m = compiled.memory_analysis()
    kinds, received = hlo_traffic(compiled.as_text(), devices)
    memory = {"arguments": int(m.argument_size_in_bytes), "temp": int(m.temp_size_in_bytes),
              "output": int(m.output_size_in_bytes)}
    memory["total"] = memory["arguments"] + memory["temp"]
    return {"memory": memory, "collectives": dict(kinds), "received_bytes": int(received)}


def _predicted(p: Plan) -> dict:
    return dict(step_us=round(p.step_us, 1), bytes_moved=p.bytes_moved, memory=p.memory._asdict(),
                memory_total=p.memory.total, compiled_bytes=p.compiled_bytes)


def _run_interleaved(sides: list[Side], steps: int, rounds: int, log, where: str) -> None:
    """``rounds`` rounds in which every side that runs takes ``steps`` steps (batches 1..``steps``), the order
    rotating; each round's wall time over its steps is the side's time a step in that round."""
    running = [s for s in sides if s.step is not None]
    for r in range(rounds):
        for side in running[r % len(running):] + running[:r % len(running)]:
            if side.step is None:
                continue
            t0 = time.perf_counter()
            try:
                for i in range(1, steps + 1):
                    loss = side.step(*side.batches[i])
                jax.block_until_ready(loss.block)
            except Exception as e:  # one plan's failure is its row's; the others still run
                side.status = f"failed while timed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                side.step, side.round_ms = None, []
                log(f"{where}: {side.name}: {side.status}")
                continue
            side.round_ms.append((time.perf_counter() - t0) / steps * 1e3)
        log(f"{where}: round {r + 1}/{rounds}: " + ", ".join(
            f"{s.name} {s.round_ms[-1]:.1f} ms" for s in running if s.round_ms))


def _compared(row: dict, found: Side | None, hands: dict[str, Side]) -> dict:
    """A budget's found plan (None: autoplan found none) against the hand plans whose measured memory fits the
    budget: its measured memory against the prediction and the budget, and its step time over each fitting hand
    plan's (median over the rounds of the ratio within a round) and over the best one's."""
    fitting = {k: h for k, h in hands.items() if h.round_ms and h.figures
               and (row["budget"] is None or h.figures["memory"]["total"] <= row["budget"])}
    out: dict = {"fitting_hands": sorted(fitting)}
    if fitting:
        best = min(fitting, key=lambda k: statistics.median(fitting[k].round_ms))
        out.update(best_hand=best, best_hand_step_ms=round(statistics.median(fitting[best].round_ms), 3))
    if found is None:
        return out
    out["found_status"] = found.status
    if found.figures:
        measured = found.figures["memory"]["total"]
        out.update(measured_bytes=measured, memory_ratio=round(row["predicted"]["memory_total"] / measured, 4),
                   within_budget=row["budget"] is None or measured <= row["budget"])
    if found.round_ms and fitting:
        ratios = {k: round(statistics.median(a / b for a, b in zip(found.round_ms, h.round_ms, strict=True)), 4)
                  for k, h in fitting.items()}
        out.update(step_ratios=ratios, step_ratio=ratios[out["best_hand"]],
                   found_step_ms=round(statistics.median(found.round_ms), 3))
    return out


def _least(error: str) -> str:
    """What autoplan's error says came nearest the budget, in MB: the smallest predicted plan, or the plans predicted
    to fit that the compiler refused, with their compiled memory (its message, where it names neither).

    >>> _least("autoplan: no plan fits ...; the smallest is fsdp(a) at 6,551,432 bytes predicted; raise ...")
    'predicted fsdp(a) 6.25 MB'
    >>> _least("... once compiled: pp(a)+sp(b): over the budget compiled: 3,632,244 bytes (predicted 3,501,832); ...")
    'compiled pp(a)+sp(b) 3.46 MB'
    """
    found = re.search(r"the smallest is (\S+) at ([\d,]+) bytes", error)
    if found:
        return f"predicted {found.group(1)} {_mb(int(found.group(2).replace(',', '')))} MB"
    compiled = re.findall(r"(\S+): over the budget compiled: ([\d,]+) bytes", error)
    if compiled:
        return "compiled " + ", ".join(f"{name} {_mb(int(n.replace(',', '')))} MB" for name, n in compiled)
    return error


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _print_table(cases: list[dict], large: list[dict]) -> None:
    for c in cases:
        m = c["model"]
        print(f"\n{c['size']} GPT (vocabulary {m['vocab']}, width {m['dim']}, {m['heads']} heads, sequence "
              f"{m['seq']}, batch {m['batch']}, {c['layers']} layers) on mesh {c['mesh']}: {c['rounds']} rounds of "
              f"{c['steps']} steps; replicated plan {_mb(c['replicated_bytes'])} MB; one-device first loss "
              f"{c['one_device_loss']:.6f}")
        print(f"  {'plan':<26} {'from':<9} {'MB (args+temp)':>14} {'ms/step':>8} {'collectives':>11} "
              f"{'first loss':>11} {'status'}")
        for s in [*c["hands"].values(), *c["found"].values()]:
            loss = "-" if "first_loss" not in s else f"{s['first_loss']:.6f}{'' if s['loss_agrees'] else ' !'}"
            print(f"  {s['name']:<26} {s['origin']:<9} {_mb(s['memory']['total']) if 'memory' in s else '-':>14} "
                  f"{s.get('step_ms', '-'):>8} {sum(s.get('collectives', {}).values()):>11} {loss:>11} "
                  f"{s['status']}")
        print(f"  {'budget':<16} {'found':<26} {'solve s':>7} {'pred MB':>8} {'compiled':>8} {'meas MB':>8} "
              f"{'pred/meas':>9} {'in budget':>9} {'best fitting hand':<26} {'ms':>7} {'hand ms':>8} {'ratio':>6}")
        for r in c["budgets"]:
            budget = "none" if r["budget"] is None else f"{r['fraction']:.0%} {_mb(r['budget'])} MB"
            if r["found"] is None:
                hand = (f"; hand plans that fit: {', '.join(r['fitting_hands'])} (best {r['best_hand']}, "
                        f"{r['best_hand_step_ms']} ms)" if r["fitting_hands"] else "; no hand plan fits either")
                print(f"  {budget:<16} autoplan found none: smallest {_least(r['error'])}{hand}")
                continue
            print(f"  {budget:<16} {r['found']:<26} {r['solve_s']:>7.2f} {_mb(r['predicted']['memory_total']):>8} "
                  f"{_mb(r['predicted'].get('compiled_bytes')):>8} {_mb(r.get('measured_bytes')):>8} "
                  f"{r.get('memory_ratio', '-'):>9} "
                  f"{str(r.get('within_budget', '-')):>9} {r.get('best_hand', 'none fits'):<26} "
                  f"{r.get('found_step_ms', '-'):>7} {r.get('best_hand_step_ms', '-'):>8} "
                  f"{r.get('step_ratio', '-'):>6}")
            if r["found"] in r.get("step_ratios", {}):  # alike placements timed twice: the measurement's spread
                print(f"  {'':<16} (the hand plan with its roles: ratio {r['step_ratios'][r['found']]})")
    if large:
        print("\n32-layer GPT (vocabulary 32000, width 4096, 32 heads, sequence 2048, batch 8), planned abstractly:")
        for r in large:
            print(f"  mesh {r['mesh']}: {r['plan']} in {r['solve_s']:.2f} s, predicted "
                  f"{r['predicted']['memory_total'] / 2**30:.2f} GiB a device, step "
                  f"{r['predicted']['step_us'] / 1e3:,.1f} ms")
    print(f"\ntargets: step ratio <= {TARGETS['step_ratio']} against the best fitting hand plan; measured memory "
          f"within the budget; 32-layer solve <= {TARGETS['large_solve_s']:g} s")


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: write sizes joined by x, like 2x4") from None
    if not shape or min(shape) < 1 or math.prod(shape) > 8:
        raise argparse.ArgumentTypeError(f"mesh {text!r}: sizes >= 1 on at most 8 devices, like 2x4 or 1x8")
    return shape


def _budget(text: str) -> float | None:
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value:
        raise argparse.ArgumentTypeError(f"budget {text!r}: a fraction of the replicated plan's memory (0.35) or "
                                         "none")
    return value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="toy,compute", help=f"comma-separated, of {', '.join(ROUNDS)}")
    ap.add_argument("--meshes", default=",".join(MESHES), help="comma-separated mesh shapes, like 8,2x4,2x2x2")
    ap.add_argument("--budgets", default=",".join("none" if b is None else str(b) for b in BUDGETS),
                    help="comma-separated fractions of the replicated plan's memory, or none (no budget)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="steps per round (default: by size)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: by size)")
    ap.add_argument("--hands", default=",".join(HANDS),
                    help=f"comma-separated hand plans, of {', '.join(HANDS)} (dp always runs: the budgets' base)")
    ap.add_argument("--skip-large", action="store_true", help="leave out the 32-layer solve times")
    ap.add_argument("--quick", action="store_true",
                    help=f"sizes {QUICK['sizes']}, meshes {QUICK['meshes']}, budgets {QUICK['budgets']}, "
                         f"{QUICK['rounds']} rounds of {QUICK['steps']} steps")
    ap.add_argument("--out", default=None, help="JSON (default: benchmarks/results/autoplan[_quick].json)")
    args = ap.parse_args()
    try:
        meshes = [_shape(m) for m in args.meshes.split(",")]
        budgets = [_budget(b) for b in args.budgets.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    sizes, hands = args.sizes.split(","), args.hands.split(",")
    if args.quick:
        sizes, meshes, budgets = list(QUICK["sizes"]), [_shape(m) for m in QUICK["meshes"]], list(QUICK["budgets"])
        args.steps, args.rounds = QUICK["steps"], QUICK["rounds"]
    bad = [s for s in sizes if s not in ROUNDS] + [h for h in hands if h not in HANDS]
    if bad:
        ap.error(f"{bad} not among the sizes {', '.join(ROUNDS)} or the hand plans {', '.join(HANDS)}")
    if args.layers < 1 or (args.steps is not None and args.steps < 1) or (args.rounds is not None and args.rounds < 1):
        ap.error("--layers, --steps and --rounds must be at least 1")
    out = args.out or f"benchmarks/results/autoplan{'_quick' if args.quick else ''}.json"
    cases, large, start = [], [], time.perf_counter()

    def save(complete: bool) -> None:
        write_json(out, cases=cases, large=large, targets=TARGETS, complete=complete, cpus=os.cpu_count(),
                   seconds=round(time.perf_counter() - start))

    for size in sizes:
        steps, rounds = ROUNDS[size]
        for shape in meshes:
            print(f"[{time.perf_counter() - start:,.0f} s] {size} on {'x'.join(map(str, shape))}", file=sys.stderr,
                  flush=True)
            cases.append(measure(size, shape, layers=args.layers, budgets=budgets, hands=hands,
                                 steps=args.steps or steps, rounds=args.rounds or rounds))
            save(False)  # after every case, so that a long sweep stopped midway keeps what it measured
    if not args.skip_large:
        for mesh in LARGE[2]:
            large.append(solve_large(_shape(mesh)))
    _print_table(cases, large)
    save(True)


if __name__ == "__main__":
    main()
