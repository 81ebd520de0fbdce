"""``autoplan``: the parallel plan of a whole training step, searched under a memory budget.

A plan gives each mesh axis a role (``jshard.parallel.roles``: ``dp``, ``fsdp``, ``ep``, ``tp``, ``sp``, ``cp``,
``pp``). Roles on several axes compose (FSDP on one data axis and data parallelism on another is HSDP; one tensor,
one context, one pipeline and one expert axis at most). Each candidate is priced by jshard itself
(``jshard.parallel.pricing``: the step traced on specs alone and planned by the engine, as ``TrainStep`` would run
it) on the hardware the mesh's devices are measured to be (``Hardware.measure``). Under a budget the compiler has
the last word: the fastest plan predicted to fit is lowered and compiled on specs alone and taken only if its
compiled step fits as well (``Plan.compiled_bytes``), else the next.

The candidates are few once axes of the same size and cost are taken as interchangeable (a role assignment and
its permutations are one candidate), so the search prices every one and is exact over its space: no solver's
relaxation, no heuristic pruning, and the runners-up come for free. Candidates with the same roles on the axes in
another order, or ``dp`` where the other has ``fsdp`` (priced with FSDP's gathers of parameters already whole),
trace one step between them (``jshard.engine.shared_trace``): each pins the gradients in it to its own parameters'
placements and is planned on its own mesh (axes are named by their place in the order of roles).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from ..darray import DArray
from ..engine import paused_collector
from .hardware import Hardware
from .initialise import building
from .parallelize import blocks_differ, kind_of
from .plan import Plan, plan_name
from .predict import step_flops
from .pricing import price, step_inputs
from .roles import (
    BATCH_ROLES,
    ROLES,
    TENSOR_ROLES,
    accumulating,
    compute_dtype,
    cut_model,
    mixtures,
    module_at,
    pipeline_microbatches,
    repeated,
    tensor_sides,
)
from .styles import expert_weights
from .training import check_tx, step_function

__all__ = ["ROLES", "autoplan"]


def autoplan(make: Callable[[], nnx.Module], mesh: Mesh | AbstractMesh | int, loss_fn: Callable, *batch: Any,
             tx: optax.GradientTransformation | None = None, memory_budget: int | None = None,
             styles: Sequence[str] | None = None, runners_up: int = 3, hardware: Hardware | None = None) -> Plan:
    """The fastest plan for training ``make()`` with ``loss_fn(model, *batch)`` whose predicted memory per device
    fits ``memory_budget`` bytes.

    ``mesh``: a ``jax.sharding.Mesh`` (its devices measured: ``Hardware.measure``, unless ``hardware`` is given;
    memory_budget None: any), an ``AbstractMesh`` of axes to give roles, or a chip count: the search then also
    chooses how the chips factor into roles (``Plan.mesh_shape`` / ``Plan.axis_names`` say the mesh to build),
    which sit inside a node, a pipeline's microbatches and whether blocks recompute their activations, on
    ``hardware`` (default ``Hardware.h100()``) under its HBM (memory_budget None: the chip's HBM).
    ``make``: the model's constructor, as ``parallelize`` takes it (it is only traced: nothing is built);
    ``batch``: arrays or ``jax.ShapeDtypeStruct``\\ s at global shape (token ids first); ``tx``: the optimizer (its
    state counts in memory; default ``optax.adamw(1e-3)``); ``styles``: the roles an axis may take (default all of
    ``ROLES`` but ``"zero"``, which ``predict`` prices and a search tries where it is named). Raises
    ``ValueError`` naming the budget and the smallest memory a plan reaches when none fits.

    >>> import jax, jax.numpy as jnp, jshard
    >>> from flax import nnx
    >>> from jshard.parallel import autoplan
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> make, x = lambda: nnx.Linear(64, 64, rngs=nnx.Rngs(0)), jax.ShapeDtypeStruct((16, 64), jnp.float32)
    >>> free = autoplan(make, mesh, lambda m, x: jnp.mean(m(x) ** 2), x, styles=("dp", "fsdp"))
    >>> sorted(p.name for p in (free, *free.runners_up))  # both priced, the faster first
    ['dp(x)', 'fsdp(x)']
    >>> budget = min(p.memory.total for p in (free, *free.runners_up))  # room for the smaller one only
    >>> tight = autoplan(make, mesh, lambda m, x: jnp.mean(m(x) ** 2), x, styles=("dp", "fsdp"), memory_budget=budget)
    >>> tight.roles, tight.batch, tight.memory.total <= budget
    ({'x': 'fsdp'}, ((S(0),),), True)
    """
    with paused_collector():  # the search makes millions of short-lived objects over a large live heap
        if isinstance(mesh, (int, np.integer)) and not isinstance(mesh, bool):
            return _autoplan_chips(make, int(mesh), loss_fn, batch, tx, memory_budget, styles, runners_up,
                                   hardware or Hardware.h100())
        return _autoplan(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up, hardware)


def _autoplan(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up, hardware) -> Plan:
    start = time.perf_counter()
    _check_args(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up, hardware)
    if isinstance(mesh, AbstractMesh) and hardware is None:
        raise TypeError(f"autoplan: an abstract mesh {dict(mesh.shape)} has no devices to measure; give hardware= "
                        "(Hardware.h100(), ...)")
    model, batch, tx, styles = _model(make, batch, tx, styles)
    blocks = repeated(model)
    tensor = tensor_sides(model, loss_fn, batch) if set(styles) & set(TENSOR_ROLES) else {}
    experts = mixtures(model) if "ep" in styles else ()
    tensor.update((pattern, "experts") for pattern in experts)
    hardware = hardware or Hardware.measure(mesh, compute_dtype(model) or jnp.float32)  # in the model's dtype
    depth = _depth(model, blocks)
    bound = _bound(step_flops(model, blocks, loss_fn, batch)[1], mesh.size, hardware, batch)
    candidates = sorted(((mesh, roles, {}) for roles in
                         _candidates(mesh, tuple(s for s in styles if s != "ep" or experts), batch, depth)), key=bound)
    # a budget on devices is checked compiled after: a plan left unpriced might have been the one to fall back on
    checked = memory_budget is not None and isinstance(mesh, Mesh)
    priced, rejected = _priced(model, blocks, tensor, loss_fn, batch, tx, hardware, candidates,
                               None if checked else bound, memory_budget)
    if not priced:
        raise ValueError(f"autoplan: no plan of {styles} runs {type(model).__name__} on mesh "
                         f"{dict(mesh.shape)}: " + "; ".join(f"{n}: {w}" for n, w in rejected))
    fits, rejected = _fitting(priced, rejected, memory_budget, f"on mesh {dict(mesh.shape)}")
    if memory_budget is not None and isinstance(mesh, Mesh):
        fits, over = _checked(fits, memory_budget, model, blocks, mesh, loss_fn, batch, tx)
        rejected += over
        if not fits:
            raise ValueError(f"autoplan: no plan fits memory_budget={memory_budget:,} bytes per device on mesh "
                             f"{dict(mesh.shape)} once compiled: " + "; ".join(f"{n}: {w}" for n, w in over)
                             + "; raise the budget, add devices, or shrink the batch")
    best, rest = fits[0], tuple(fits[1:1 + runners_up])
    return dataclasses.replace(best, runners_up=rest, rejected=tuple(rejected), budget=memory_budget,
                               solve_s=time.perf_counter() - start)


def _check_args(make, mesh, loss_fn, batch, tx, budget, styles, runners_up, hardware) -> None:
    if isinstance(make, nnx.Module) or not callable(make):
        raise TypeError(f"autoplan: make must be the model's constructor, a function of no arguments (lambda: "
                        f"GPT(cfg, rngs=nnx.Rngs(0))), got {kind_of(make)}; it is only traced, never built")
    if not isinstance(mesh, (Mesh, AbstractMesh, int)) or isinstance(mesh, bool) or (isinstance(mesh, int)
                                                                                      and mesh < 1):
        raise TypeError(f"autoplan: mesh must be a jax.sharding.Mesh (say jax.make_mesh((2, 4), ('dp', 'tp'))), an "
                        f"AbstractMesh or a chip count (say 1024), got {kind_of(mesh)}")
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(f"autoplan: hardware must be a jshard.parallel.Hardware (Hardware.h100(), "
                        f"Hardware.measure(mesh)), got {kind_of(hardware)}")
    if isinstance(runners_up, bool) or not isinstance(runners_up, int) or runners_up < 0:
        raise ValueError(f"autoplan: runners_up is how many next-best plans to keep, an int >= 0, got {runners_up!r}")
    if not callable(loss_fn):
        raise TypeError(f"autoplan: loss_fn must be a function loss_fn(model, *batch) -> scalar loss, got "
                        f"{kind_of(loss_fn)}")
    if not batch:
        raise ValueError("autoplan: pass the batch loss_fn takes (arrays or jax.ShapeDtypeStructs at global shape), "
                         "autoplan(make, mesh, loss_fn, ids, labels)")
    for i, b in enumerate(batch):
        if not (hasattr(b, "shape") and hasattr(b, "dtype")) or isinstance(b, DArray):
            raise TypeError(f"autoplan: batch input {i} must be an array or a jax.ShapeDtypeStruct at global shape, "
                            f"got {kind_of(b)}")
    if tx is not None:
        check_tx(tx, "autoplan")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, np.integer))
                               or budget <= 0):
        raise ValueError(f"autoplan: memory_budget is bytes per device, a positive int (say 2 * 2**30), got "
                         f"{budget!r}")
    if styles is not None:
        bad = [s for s in styles if s not in ROLES]
        if bad or not styles:
            raise ValueError(f"autoplan: styles are the roles a mesh axis may take, some of {ROLES}; got "
                             f"{tuple(styles)!r}")


def _model(make, batch, tx, styles):
    """The abstract model, the batch as shapes, the optimizer and the roles to try."""
    with building():
        model = nnx.eval_shape(make)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"autoplan: make() must build an nnx.Module, it built {kind_of(model)}; pass the model's "
                        "constructor, lambda: GPT(cfg, rngs=nnx.Rngs(0))")
    batch = tuple(jax.ShapeDtypeStruct(np.shape(b), b.dtype) for b in batch)
    return model, batch, optax.adamw(1e-3) if tx is None else tx, tuple(styles or (r for r in ROLES if r != "zero"))


def _depth(model, blocks) -> int:
    """How many blocks a pipeline may split (0: none): blocks whose state is their parameters, as ``parallelize``
    takes them, so that no plan is one it would refuse."""
    members = list(module_at(model, blocks)) if blocks is not None else []
    return len(members) if members and blocks_differ(members) is None else 0


def _priced(model, blocks, tensor, loss_fn, batch, tx, hardware, candidates, bound: Callable | None = None,
            budget: int | None = None, again: Callable | None = None) -> tuple[list[Plan], list]:
    """Each candidate ``(mesh, roles, options)`` priced (``options``: a pipeline's microbatches, remat), or rejected
    with the refusal of the style or rule that cannot take it (a dim its axis does not divide, ...): only a
    ``ValueError`` is a refusal, any other error jshard's own and raised. ``bound``: µs no step of a candidate takes
    less than (taken in order, least first), so that one whose bound is no less than the fastest plan within
    ``budget`` priced so far is left unpriced: it cannot be the plan chosen, nor, recomputing more, its remat.
    ``again``: the candidates to price at once in place of a plan over ``budget`` (its remat)."""
    priced, rejected, traces = [], [], {}
    best, skipped = None, 0
    queue = [(c, True) for c in reversed(candidates)]
    while queue:
        candidate, first = queue.pop()
        mesh, roles, options = candidate
        if bound is not None and best is not None and bound(candidate) >= best.step_us:
            skipped += 1
            continue
        try:
            plan = price(model, blocks, mesh, roles, tensor, loss_fn, batch, tx, hardware, traces, **options)
        except ValueError as e:
            rejected.append((_label(roles, mesh, options), f"cannot run: {type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}"))
            continue
        priced.append(plan)
        fits = budget is None or plan.memory.total <= budget
        if fits and (best is None or plan.step_us < best.step_us):
            best = plan
        if not fits and first and again is not None:
            queue += [(c, False) for c in reversed(again(plan))]
    if skipped:
        rejected.append((f"{skipped} more layouts", f"not priced: their blocks' FLOPs a chip through their "
                         f"pipelines' bubbles alone take longer than {best.name}'s step"))
    return priced, rejected


def _label(roles: dict, mesh, options: dict) -> str:
    sizes = dict(mesh.shape) if isinstance(mesh, AbstractMesh) else None  # as Plan.name says it
    return plan_name(roles, sizes, options.get("microbatches"), options.get("remat", False))


def _fitting(priced: list[Plan], rejected: list, budget: int | None, where: str) -> tuple[list[Plan], list]:
    """The priced plans within ``budget``, fastest first (a ValueError naming the smallest when none is), and the
    rejected with those over it."""
    fits = [p for p in priced if budget is None or p.memory.total <= budget]
    if not fits:
        least = min(priced, key=lambda p: p.memory.total)
        raise ValueError(f"autoplan: no plan fits memory_budget={budget:,} bytes per device {where}; the smallest is "
                         f"{least.name} at {least.memory.total:,} bytes predicted; raise the budget, add devices, "
                         "or shrink the batch")
    rejected = rejected + [(p.name, f"over the budget: {p.memory.total:,} bytes predicted")
                           for p in priced if p not in fits]
    return sorted(fits, key=lambda p: p.step_us), rejected


def _autoplan_chips(make, chips, loss_fn, batch, tx, budget, styles, runners_up, hardware) -> Plan:
    """``autoplan`` on ``chips`` chips of ``hardware``: every factoring of the chips into roles (``_factorings``)
    priced on its abstract mesh, each over the budget again with its blocks recomputing their activations or
    accumulating its gradients; each plan carries its prediction's figures (MFU, tokens per second per chip). The
    factorings are priced least bubble first, and one whose blocks' FLOPs alone, through its pipeline's bubble, take
    longer than the fastest plan within the budget so far is left unpriced (it cannot be chosen)."""
    start = time.perf_counter()
    _check_args(make, chips, loss_fn, batch, tx, budget, styles, runners_up, hardware)
    model, batch, tx, styles = _model(make, batch, tx, styles)
    budget = hardware.hbm_bytes if budget is None else budget
    blocks = repeated(model)
    experts = mixtures(model) if "ep" in styles else ()
    tensor = tensor_sides(model, loss_fn, batch) if set(styles) & set(TENSOR_ROLES) else {}
    tensor.update((pattern, "experts") for pattern in experts)
    flops, in_blocks = step_flops(model, blocks, loss_fn, batch)
    bound = _bound(in_blocks, chips, hardware, batch)
    candidates = sorted(_factorings(model, chips, styles, batch, _depth(model, blocks), hardware,
                                    _expert_count(model) if experts else 0), key=bound)

    def again(p: Plan) -> list:  # over the budget: its blocks recomputing, or accumulating its gradients
        remat = (AbstractMesh(p.mesh_shape, p.axis_names), p.roles,
                 {"remat": True, "microbatches": p.detail["microbatches"]})
        return [remat] + [a for a in [_accumulating(batch, p)] if a is not None]

    priced, rejected = _priced(model, blocks, tensor, loss_fn, batch, tx, hardware, candidates, bound, budget,
                               again if blocks is not None else None)
    if not priced:
        raise ValueError(f"autoplan: no factoring of {chips} chips into {styles} runs {type(model).__name__}: "
                         + "; ".join(f"{n}: {w}" for n, w in rejected))
    tokens = math.prod(batch[0].shape)
    priced = [dataclasses.replace(p, mfu=flops / (p.step_us / 1e6 * chips * hardware.flops),
                                  tokens_per_s_per_chip=tokens / (p.step_us / 1e6) / chips) for p in priced]
    fits, rejected = _fitting(priced, rejected, budget, f"on {chips} x {hardware.name}")
    best, rest = fits[0], tuple(fits[1:1 + runners_up])
    return dataclasses.replace(best, runners_up=rest, rejected=tuple(rejected), budget=budget,
                               solve_s=time.perf_counter() - start)


def _bound(in_blocks: float, chips: int, hardware: Hardware, batch: tuple) -> Callable:
    """A candidate's least step in µs: its blocks' FLOPs (``in_blocks``, the whole model's) a chip at the hardware's
    rate, through its pipeline's bubble ``(m + p - 1) / m`` (its microbatches ``m`` as given, or as the pipeline
    would take them)."""
    rows = min((b.shape[0] for b in batch if b.shape), default=1)

    def bound(candidate) -> float:
        mesh, roles, options = candidate
        sizes = dict(mesh.shape)
        stages = [sizes[a] for a, r in roles.items() if r == "pp"]
        p = stages[0] if stages else 1
        data = math.prod(sizes[a] for a, r in roles.items() if r in BATCH_ROLES)
        m = options.get("microbatches") or (pipeline_microbatches(p, rows, data) if p > 1 else 1) or 1
        return in_blocks / chips * (m + p - 1) / m / hardware.flops_per_us

    return bound


def _accumulating(batch: tuple, plan: Plan) -> tuple[AbstractMesh, dict, dict] | None:
    """``plan`` (without a pipeline) accumulating its gradients over one sequence a data-parallel replica at a time:
    its blocks a pipeline of one stage, on a ``pp`` axis of size 1 after the data axes (Megatron-LM's micro-batches);
    None where it has a pipeline or a replica holds one sequence already."""
    if "pp" in plan.roles.values():
        return None
    rows = min((b.shape[0] for b in batch if b.shape), default=1)
    data = math.prod(n for a, n in zip(plan.axis_names, plan.mesh_shape, strict=True)
                     if plan.roles[a] in BATCH_ROLES)
    if rows // data < 2:
        return None
    names, shape, roles = accumulating(plan.axis_names, plan.mesh_shape, plan.roles)
    return AbstractMesh(shape, names), roles, {"microbatches": rows // data}


def _factorings(model, chips: int, styles: tuple, batch: tuple, depth: int, hardware: Hardware,
                experts: int) -> list[tuple[AbstractMesh, dict, dict]]:
    """The ways to lay ``chips`` out, outermost first: the data axis (``fsdp``; ``dp`` too where the model's
    parameters, gradients and Adam's state fit a chip replicated over it; HSDP, ``_data_splits``), ``ep`` inside it
    for mixtures of ``experts`` experts (over a divisor of their count), a pipeline (``pp``, its stages holding the
    blocks evenly or not: ``_stages``), context parallelism (``cp``, for sequences of 16K tokens and more), and
    tensor parallelism innermost (``sp``, else ``tp``) over a divisor of a node's chips. A pipeline runs
    one sequence per data-parallel replica a microbatch (Megatron's micro-batch of one: the smallest bubble, and
    1F1B's memory does not grow with the count), where that gives it at least as many microbatches as stages.
    Axes are named by their roles."""
    rows = min((b.shape[0] for b in batch if b.shape), default=1)
    seq = batch[0].shape[1] if len(batch[0].shape) > 1 else 1
    tensor_role = "sp" if "sp" in styles else "tp" if "tp" in styles else None
    node = hardware.chips_per_node
    state = 16 * sum(math.prod(np.shape(v)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    out, seen = [], set()
    for t in [t for t in _divisors(math.gcd(node, chips)) if t == 1 or tensor_role]:
        for p in [p for p in _divisors(chips // t) if p == 1 or ("pp" in styles and _stages(depth, p))]:
            for c in [c for c in _divisors(chips // (t * p))
                      if c == 1 or ("cp" in styles and seq >= 16384 and c <= 16 and seq % (2 * c) == 0)]:
                data = chips // (t * p * c)
                if rows % data:
                    continue
                for split in _data_splits(data, styles, state / (t * p), hardware.hbm_bytes):
                    for e in ([1] + [e for e in _divisors(math.gcd(split[-1][1], experts)) if e > 1]
                              if experts and "ep" in styles else [1]):
                        inner = (split[-1][0], split[-1][1] // e)
                        sizes = [*split[:-1], inner, ("ep", e), ("pp", p), ("cp", c), (tensor_role, t)]
                        sizes = [(r, n) for r, n in sizes if n > 1] or [("dp", 1)]
                        if tuple(sizes) in seen:  # a split whose data role is left size 1 is another's
                            continue
                        seen.add(tuple(sizes))
                        mesh = AbstractMesh(tuple(n for _, n in sizes), tuple(r for r, _ in sizes))
                        roles = {r: r for r, _ in sizes}
                        if p == 1:
                            out.append((mesh, roles, {}))
                            continue
                        if rows // data >= p:  # one sequence a replica a microbatch: the least bubble
                            out.append((mesh, roles, {"microbatches": rows // data}))
    return out


def _expert_count(model) -> int:
    """The experts the model's mixtures share (the greatest common divisor of their counts): what an ``ep`` axis
    must divide."""
    counts = [shape[0] for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)
              for _, shape in expert_weights(node)]
    return math.gcd(*counts) if counts else 0


def _data_splits(data: int, styles: tuple, state: float, hbm: int) -> list[list[tuple[str, int]]]:
    """How the data axis's ``data`` chips split, outermost first: all ``fsdp``; all ``zero`` where named; all ``dp``
    where the model's state (``state`` bytes a chip before it) fits a chip replicated; and HSDP, ``dp`` across
    groups of ``fsdp`` (the
    smallest group whose share of the state takes at most half a chip, and twice and four times it), which keeps
    FSDP's gathers within a group on thousands of chips."""
    if data == 1:
        return [[("dp", 1)]]
    out = [[("fsdp", data)]] if "fsdp" in styles else []
    if "zero" in styles:  # Megatron-LM's distributed optimizer: the state sharded, the parameters gathered once
        out.append([("zero", data)])
    if "dp" in styles and state <= hbm:
        out.append([("dp", data)])
    if {"dp", "fsdp"} <= set(styles):
        groups = [f for f in _divisors(data) if 1 < f < data and state / f <= hbm / 2]
        out += [[("dp", data // f), ("fsdp", f)] for f in groups[:3]]
    return out


def _stages(depth: int, p: int) -> bool:
    """Whether ``p`` pipeline stages take ``depth`` blocks: each stage holds ``ceil(depth / p)`` (uneven where ``p``
    does not divide them, the last stages holding fewer: Llama 3 405B's 126 layers over 16), and none is left
    without a block."""
    return depth >= p and -(-depth // p) * (p - 1) < depth


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(mesh: Mesh, styles: tuple[str, ...], batch: tuple, depth: int) -> list[dict[str, str]]:
    """Every role assignment, one per class of assignments that differ only by a permutation of interchangeable
    axes (same size); an axis of size 1 does nothing, whatever its role, and is left ``"dp"``. A pipeline needs
    ``depth`` blocks (0: the model has no list of identical blocks) that its stages take (``_stages``), and
    microbatches."""
    names, sizes = list(mesh.axis_names), dict(mesh.shape)
    options = [("dp",) if sizes[a] == 1 else styles for a in names]
    rows = min((b.shape[0] for b in batch if b.shape), default=1)
    seen, out = set(), []
    for combo in itertools.product(*options):
        if sum(r in TENSOR_ROLES for r in combo) > 1 or any(combo.count(r) > 1 for r in ("cp", "pp", "ep")):
            continue
        data = math.prod(sizes[a] for a, r in zip(names, combo, strict=True) if r in BATCH_ROLES)
        if rows % data:
            continue
        stages = [sizes[a] for a, r in zip(names, combo, strict=True) if r == "pp"]
        if stages and (not _stages(depth, stages[0]) or pipeline_microbatches(stages[0], rows, data) is None):
            continue
        key = tuple(sorted((sizes[a], r) for a, r in zip(names, combo, strict=True)))
        if key in seen:
            continue
        seen.add(key)
        out.append(dict(zip(names, combo, strict=True)))
    return out


def _checked(fits: list[Plan], budget: int, model, blocks, mesh, loss_fn, batch, tx) -> tuple[list[Plan], list]:
    """``fits`` (fastest first) from the first whose compiled step fits ``budget``, that one carrying its compiled
    bytes, and the ones before it, rejected with theirs. The prediction cannot see how XLA schedules and lays out
    the step's buffers (a collective's result kept, a gather's index arrays), so the compiler has the last word.

    A plan is compiled at the depth it was priced at (two blocks; a pipeline whole), on parameters that hold only
    their specs: arguments plus temporaries per device, as ``memory_analysis`` gives them, and the share the
    prediction adds for the further blocks."""
    over = []
    for i, p in enumerate(fits):
        cut = p.detail["cut"]
        small = cut_model(model, blocks if cut < p.detail["depth"] else None, cut)
        args = step_inputs(small, mesh, p.styles, p.default, p.batch, batch, tx)
        memory = step_function(small, tx, loss_fn).lower(*args[:3], *args[3]).compile().memory_analysis()
        if memory is None:  # a backend that does not say: the prediction stands
            return fits[i:], over
        compiled = int(memory.argument_size_in_bytes + memory.temp_size_in_bytes
                       + p.memory.total - p.detail["cut_bytes"])
        if compiled <= budget:
            return [dataclasses.replace(p, compiled_bytes=compiled), *fits[i + 1:]], over
        over.append((p.name, f"over the budget compiled: {compiled:,} bytes (predicted {p.memory.total:,})"))
    return [], over

