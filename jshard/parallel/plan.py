"""``Plan``: a parallel plan found by ``autoplan``, with what it is predicted to cost.

``parallelize(make, mesh, plan)`` takes one as it takes a dict of styles (its ``.styles`` and ``.default``);
the batch goes in with ``.batch``'s placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..placements import Placement, format_placements
from .styles import ParallelStyle

__all__ = ["Memory", "Plan", "format_bytes", "plan_name", "role_names"]


class Memory(NamedTuple):
    """Predicted bytes per device of a training step: the parameters, their gradients, the optimizer state, the
    batch, and the activations and other temporaries at their peak. ``total`` is what the compiled step's
    ``memory_analysis`` reports as arguments plus temporaries."""

    params: int
    grads: int
    optimizer: int
    batch: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.batch + self.activations


@dataclass(frozen=True)
class Plan:
    """A plan for ``parallelize`` and the batch, found by ``autoplan``.

    ``styles`` / ``default``: what ``parallelize(make, mesh, styles, default=default)`` takes (or pass the Plan
    itself); ``batch``: the placements of each batch input (``jshard.distribute(ids, mesh, plan.batch[0])``);
    ``roles``: what each mesh axis does (``{"dp": "fsdp", "tp": "tp"}``); ``step_us``: the predicted step time
    (communication by the cost model, computation by the measured rate of the devices); ``bytes_moved``: bytes
    a device sends in collectives per step; ``memory``: predicted bytes per device; ``runners_up``: the next best
    plans that fit, best first; ``rejected``: the plans that did not fit or could not run, with why;
    ``solve_s``: seconds the search took; ``compiled_bytes``: under a budget, the compiled step's bytes per
    device (``memory_analysis``'s arguments and temporaries, at the depth the plan was priced at, the further
    blocks' predicted share added), checked against the budget; None without one (runners-up are not compiled).
    ``mesh_shape`` / ``axis_names``: the mesh the plan runs on (``jax.make_mesh(plan.mesh_shape, plan.axis_names)``:
    what to build when ``autoplan`` was given a chip count); ``mfu`` and ``tokens_per_s_per_chip``: the predicted
    model FLOPs utilisation and throughput, where ``autoplan`` planned a chip count (see ``predict``).
    """

    roles: dict[str, str]
    styles: dict[str, tuple[ParallelStyle, ...]]
    default: tuple[ParallelStyle, ...]
    batch: tuple[tuple[Placement, ...], ...]
    step_us: float
    bytes_moved: int
    memory: Memory
    runners_up: tuple[Plan, ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()
    budget: int | None = None
    solve_s: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict, compare=False)
    compiled_bytes: int | None = None
    mesh_shape: tuple[int, ...] = ()
    axis_names: tuple[str, ...] = ()
    mfu: float | None = None
    tokens_per_s_per_chip: float | None = None

    @property
    def step_s(self) -> float:
        """The predicted step in seconds."""
        return self.step_us / 1e6

    @property
    def name(self) -> str:
        """The roles as one word per axis, ``"fsdp(dp)+tp(tp)"`` (on an abstract mesh whose axes are named by their
        roles, with their sizes: ``"fsdp64xpp2xsp8"``), a pipeline's microbatches and recomputed blocks after it."""
        sizes = dict(zip(self.axis_names, self.mesh_shape, strict=True)) if self.detail.get("abstract") else None
        return plan_name(self.roles, sizes, self.detail.get("microbatches"), self.detail.get("remat"))

    def explain(self) -> str:
        """The chosen style of every module, the predicted figures, and the runners-up with theirs: why the plan
        beats them (its step split into compute, each link level's collectives, a pipeline's schedule; its
        memory)."""
        b = format_bytes
        budget = "no memory budget" if self.budget is None else f"memory budget {b(self.budget)} per device"
        mesh = f" on mesh {dict(zip(self.axis_names, self.mesh_shape, strict=True))}" if self.axis_names else ""
        lines = [f"autoplan: {self.name}{mesh}  ({budget}; searched in {self.solve_s:.2f} s)",
                 f"  predicted step {self.step_us / 1e3:.2f} ms: {_split(self)}; {b(self.bytes_moved)} moved per "
                 "device",
                 *([f"  predicted MFU {self.mfu:.1%}, {self.tokens_per_s_per_chip:,.0f} tokens/s per chip"]
                   if self.mfu is not None else []),
                 f"  predicted memory {b(self.memory.total)} per device: parameters {b(self.memory.params)}, "
                 f"gradients {b(self.memory.grads)}, optimizer {b(self.memory.optimizer)}, batch "
                 f"{b(self.memory.batch)}, activations and temporaries {b(self.memory.activations)}",
                 *([f"  compiled {b(self.compiled_bytes)} per device, within the budget"]
                   if self.compiled_bytes is not None else []),
                 "  batch: " + ", ".join(format_placements(p) for p in self.batch),
                 "  default: " + (", ".join(map(_style, self.default)) or "none")]
        for pattern, styles in self.styles.items():
            lines.append(f"  {pattern or '(the model)'}: {', '.join(map(_style, styles))}")
        if self.runners_up:
            lines.append("  runners-up:")
            for p in self.runners_up:
                mfu = f"  MFU {p.mfu:.1%}" if p.mfu is not None else ""
                lines.append(f"    {p.name:<28} step {p.step_us / 1e3:8.2f} ms ({_split(p)})  moved "
                             f"{b(p.bytes_moved):>9}  memory {b(p.memory.total):>9}{mfu}")
        if self.rejected:
            lines.append("  left out:")
            lines.extend(f"    {name:<28} {why}" for name, why in self.rejected)
        return "\n".join(lines)


def _split(p: Plan) -> str:
    """A plan's step in parts: compute (a pipeline's schedule within it), collectives by link level, the part
    hidden behind compute."""
    d = p.detail
    parts = [f"compute {d.get('compute_us', 0) / 1e3:.2f} ms"]
    if d.get("pipeline_us"):
        parts.append(f"pipeline schedule {d['pipeline_us'] / 1e3:.2f} ms of it")
    levels = [(level, d[f"{level}_us"]) for level in ("intra", "inter") if d.get(f"{level}_us")]
    parts += [f"{level} {us / 1e3:.2f} ms" for level, us in levels] or \
        [f"collectives {d.get('comm_us', 0) / 1e3:.2f} ms"]
    if d.get("hidden_us"):
        parts.append(f"{d['hidden_us'] / 1e3:.2f} ms hidden")
    return ", ".join(parts)


def plan_name(roles: dict[str, str], sizes: dict[str, int] | None = None, microbatches: int | None = None,
              remat: bool = False) -> str:
    """A plan's name: its roles (``role_names``; sized, ``"fsdp64xsp8"``, where ``sizes`` are given and every axis
    is named by its role), a pipeline's microbatches and recomputed blocks after them.

    >>> plan_name({"fsdp": "fsdp", "pp": "pp"}, {"fsdp": 64, "pp": 2}, microbatches=8)
    'fsdp64xpp2 m=8'
    """
    named = sizes is not None and all(a == r for a, r in roles.items())
    name = "x".join(f"{r}{sizes[a]}" for a, r in roles.items()) if named else role_names(roles)
    return " ".join([name, *([f"m={microbatches}"] if microbatches else []), *(["remat"] if remat else [])])


def role_names(roles: dict[str, str]) -> str:
    """A role assignment as one word per axis.

    >>> role_names({"dp": "fsdp", "tp": "tp"})
    'fsdp(dp)+tp(tp)'
    """
    return "+".join(f"{role}({axis})" for axis, role in roles.items())


def _style(s: ParallelStyle) -> str:
    return f"{type(s).__name__}({s.axis!r})"


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB, MiB, KiB or B, two decimals.

    >>> format_bytes(3 * 2**29)
    '1.50 GiB'
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
