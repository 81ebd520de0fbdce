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
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from ..darray import DArray
from ..engine import paused_collector
from .hardware import Hardware
from .initialise import building
from .parallelize import blocks_differ, kind_of
from .plan import Plan, role_names
from .pricing import price, step_inputs
from .roles import (
    BATCH_ROLES,
    ROLES,
    TENSOR_ROLES,
    cut_model,
    mixtures,
    module_at,
    pipeline_microbatches,
    repeated,
    tensor_sides,
)
from .training import check_tx, step_function

__all__ = ["ROLES", "autoplan"]


def autoplan(make: Callable[[], nnx.Module], mesh: Mesh, loss_fn: Callable, *batch: Any,
             tx: optax.GradientTransformation | None = None, memory_budget: int | None = None,
             styles: Sequence[str] | None = None, runners_up: int = 3) -> Plan:
    """The fastest plan for training ``make()`` on ``mesh`` with ``loss_fn(model, *batch)`` whose predicted
    memory per device fits ``memory_budget`` bytes (None: any).

    ``make``: the model's constructor, as ``parallelize`` takes it (it is only traced: nothing is built);
    ``batch``: arrays or ``jax.ShapeDtypeStruct``s at global shape; ``tx``: the optimizer (its state counts in
    memory; default ``optax.adamw(1e-3)``); ``styles``: the roles an axis may take (default all of ``ROLES``).
    Raises ``ValueError`` naming the budget and the smallest memory a plan reaches when none fits.

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
        return _autoplan(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up)


def _autoplan(make, mesh, loss_fn, batch, tx, memory_budget, styles, runners_up) -> Plan:
    start = time.perf_counter()
    _check_args(make, mesh, loss_fn, batch, tx, memory_budget, styles)
    if isinstance(runners_up, bool) or not isinstance(runners_up, int) or runners_up < 0:
        raise ValueError(f"autoplan: runners_up is how many next-best plans to keep, an int >= 0, got {runners_up!r}")
    tx = optax.adamw(1e-3) if tx is None else tx
    styles = tuple(styles or ROLES)
    batch = tuple(jax.ShapeDtypeStruct(np.shape(b), b.dtype) for b in batch)
    with building():
        model = nnx.eval_shape(make)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"autoplan: make() must build an nnx.Module, it built {kind_of(model)}; pass the model's "
                        "constructor, lambda: GPT(cfg, rngs=nnx.Rngs(0))")
    blocks = repeated(model)
    tensor = tensor_sides(model, loss_fn, batch) if set(styles) & set(TENSOR_ROLES) else {}
    experts = mixtures(model) if "ep" in styles else ()
    tensor.update((pattern, "experts") for pattern in experts)
    hardware = Hardware.measure(mesh)
    priced, rejected, traces = [], [], {}
    # a pipeline takes blocks whose state is their parameters, as parallelize does: no plan it would refuse
    members = list(module_at(model, blocks)) if blocks is not None else []
    depth = len(members) if members and blocks_differ(members) is None else 0
    for roles in _candidates(mesh, tuple(s for s in styles if s != "ep" or experts), batch, depth):
        name = role_names(roles)
        try:
            priced.append(price(model, blocks, mesh, roles, tensor, loss_fn, batch, tx, hardware, traces))
        except Exception as e:  # a role the model cannot take on this mesh (a dim the axis does not divide, ...)
            rejected.append((name, f"cannot run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    if not priced:
        raise ValueError(f"autoplan: no plan of {styles} runs {type(model).__name__} on mesh "
                         f"{dict(mesh.shape)}: " + "; ".join(f"{n}: {w}" for n, w in rejected))
    fits = [p for p in priced if memory_budget is None or p.memory.total <= memory_budget]
    if not fits:
        least = min(priced, key=lambda p: p.memory.total)
        raise ValueError(f"autoplan: no plan fits memory_budget={memory_budget:,} bytes per device on mesh "
                         f"{dict(mesh.shape)}; the smallest is {least.name} at {least.memory.total:,} bytes "
                         f"predicted; raise the budget, add devices, or shrink the batch")
    rejected += [(p.name, f"over the budget: {p.memory.total:,} bytes predicted") for p in priced if p not in fits]
    fits.sort(key=lambda p: p.step_us)
    if memory_budget is not None:
        fits, over = _checked(fits, memory_budget, model, blocks, mesh, loss_fn, batch, tx)
        rejected += over
        if not fits:
            raise ValueError(f"autoplan: no plan fits memory_budget={memory_budget:,} bytes per device on mesh "
                             f"{dict(mesh.shape)} once compiled: " + "; ".join(f"{n}: {w}" for n, w in over)
                             + "; raise the budget, add devices, or shrink the batch")
    best, rest = fits[0], tuple(fits[1:1 + runners_up])
    return dataclasses.replace(best, runners_up=rest, rejected=tuple(rejected), budget=memory_budget,
                               solve_s=time.perf_counter() - start)


def _check_args(make, mesh, loss_fn, batch, tx, budget, styles) -> None:
    if isinstance(make, nnx.Module) or not callable(make):
        raise TypeError(f"autoplan: make must be the model's constructor, a function of no arguments (lambda: "
                        f"GPT(cfg, rngs=nnx.Rngs(0))), got {kind_of(make)}; it is only traced, never built")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"autoplan: mesh must be a jax.sharding.Mesh (say jax.make_mesh((2, 4), ('dp', 'tp'))), "
                        f"got {kind_of(mesh)}")
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


def _candidates(mesh: Mesh, styles: tuple[str, ...], batch: tuple, depth: int) -> list[dict[str, str]]:
    """Every role assignment, one per class of assignments that differ only by a permutation of interchangeable
    axes (same size); an axis of size 1 does nothing, whatever its role, and is left ``"dp"``. A pipeline needs
    ``depth`` blocks (0: the model has no list of identical blocks) that its stages split, and microbatches."""
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
        if stages and (not depth or depth % stages[0] or pipeline_microbatches(stages[0], rows, data) is None):
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

