"""``predict``: the step time, throughput, MFU and memory of one parallel configuration on hardware you may not have.

The configuration is a role per mesh axis with its size, outermost first (``{"dp": 64, "pp": 16, "tp": 8}``: tensor
parallelism innermost, inside a node). Its step is priced as ``autoplan`` prices candidates
(``jshard.parallel.pricing``) on an abstract mesh of that many chips (``jax.sharding.AbstractMesh``): no device is
needed and nothing is built, so 16,384 H100s cost what 8 do. The figures are the model's own step as the engine
plans it: the collectives it runs, priced by the hardware's links per level, its matmuls and memory traffic, a
pipeline's schedule tick by tick, and its peak memory per chip.

MFU follows the Llama 3 paper's and torchtitan's convention (Megatron-LM's too): the model's FLOPs are three times
its forward matmuls at global shape (the forward, and the backward's two), attention's scores and values included
at full length (the causal half not taken off), embedding lookups not counted; the step's recomputation (``remat``,
a pipeline's) is not model FLOPs. They are counted from the model's own forward pass, traced at global shape:
``dot_general`` and ``ragged_dot`` equations, into every call and loop body (a scan's ``length`` times), a
``jshard.rules.function`` unit's body included (attention, mixtures of experts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh

from ..darray import DArray
from ..jaxcompat import jc
from .hardware import LEVELS, Hardware
from .initialise import building
from .parallelize import kind_of
from .plan import Memory, Plan, format_bytes
from .pricing import price
from .roles import (
    BATCH_ROLES,
    ROLES,
    TENSOR_ROLES,
    accumulating,
    cut_model,
    mixtures,
    module_at,
    pipeline_microbatches,
    repeated,
    tensor_sides,
)
from .training import check_tx

__all__ = ["Prediction", "predict"]

REMAT = (None, "block")


def predict(make: Callable[[], nnx.Module], loss_fn: Callable, *batch: Any, hardware: Hardware,
            roles: dict[str, int], tx: optax.GradientTransformation | None = None, microbatches: int | None = None,
            remat: str | None = None) -> Prediction:
    """The predicted training step of ``make()`` with ``loss_fn(model, *batch)`` on ``hardware``, the chips laid
    out as ``roles`` (role -> size, outermost first; their product is the chip count).

    ``batch``: arrays or ``jax.ShapeDtypeStruct``\\ s at global shape, the first one the token ids ``[batch, seq]``
    (its size is the step's tokens); ``tx``: the optimizer (default ``optax.adamw(1e-3)``); ``microbatches``: a
    pipeline's (default: twice its stages where the batch allows); without ``pp``, the step accumulates gradients
    over that many microbatches: its blocks run as a pipeline of one stage (``PipelineParallel`` on a ``pp`` axis of
    size 1, which the prediction's roles and plan then name), the gradients reduced once; ``remat="block"``: each
    block's activations recomputed in its backward pass (what a block keeps is its input). ``make`` is only traced.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from jshard.gpt import GPT, cross_entropy
    >>> ids = jax.ShapeDtypeStruct((256, 1024), jnp.int32)
    >>> make = lambda: GPT(vocab=32000, dim=1024, heads=16, layers=8, seq=1024, rngs=nnx.Rngs(0))
    >>> p = predict(make, lambda m, x, y: cross_entropy(m(x), y), ids, ids, hardware=Hardware.h100(),
    ...             roles={"dp": 16, "tp": 8})
    >>> p.chips, 0 < p.mfu < 1, p.memory.total < Hardware.h100().hbm_bytes
    (128, True, True)
    """
    model, mesh, roles, batch, tx = _checked(make, loss_fn, batch, hardware, roles, tx, microbatches, remat)
    axis_roles = {r: r for r in roles}
    blocks = repeated(model)
    styles = set(axis_roles.values())
    tensor = tensor_sides(model, loss_fn, batch) if styles & set(TENSOR_ROLES) else {}
    if "ep" in styles:
        found = mixtures(model)
        if not found:
            raise ValueError(f"predict: roles {roles} give an axis to expert parallelism ('ep'), but "
                             f"{type(model).__name__} has no mixture of experts (modules whose weights share a "
                             "leading expert dim); drop 'ep' from roles")
        tensor.update((pattern, "experts") for pattern in found)
    if "pp" in styles and (blocks is None or len(list(module_at(model, blocks))) < roles["pp"]):
        depth = 0 if blocks is None else len(list(module_at(model, blocks)))
        raise ValueError(f"predict: roles {roles} pipeline the model over pp={roles['pp']} stages, which needs a list "
                         f"of identical blocks, at least one a stage (uneven stages: the last hold fewer); "
                         f"{type(model).__name__} has {'none' if blocks is None else f'{depth} blocks'}")
    rows, data = batch[0].shape[0] if batch[0].shape else 1, math.prod(n for r, n in roles.items() if r in BATCH_ROLES)
    if "pp" in styles and microbatches is None and pipeline_microbatches(roles["pp"], rows, data) is None:
        raise ValueError(f"predict: roles {roles} pipeline the batch's {rows} rows over pp={roles['pp']} stages, and "
                         f"neither {2 * roles['pp']} nor {roles['pp']} microbatches of rows split over the data axes "
                         f"({data} ways); pass microbatches= (a count dividing the rows into multiples of {data})")
    plan = price(model, blocks, mesh, axis_roles, tensor, loss_fn, batch, tx, hardware, {},
                 microbatches=microbatches, remat=remat == "block")
    flops = model_flops(model, blocks, loss_fn, batch)
    return Prediction.of(plan, hardware, dict(roles), flops, math.prod(batch[0].shape))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One configuration's predicted step, per chip: ``step_s``; ``tokens_per_s_per_chip``; ``mfu`` (model FLOPs
    over the chips' peak, see the module's docstring); ``memory`` (as ``autoplan``'s ``Memory``); ``compute_s`` (the
    matmuls and memory traffic, a pipeline's schedule included), ``comm_s`` (collectives, by link level:
    ``{"intra": ..., "inter": ...}``), ``hidden_s`` (the collectives hidden behind compute by ``Hardware.overlap``
    and ``tensor_overlap``, taken off the step); ``bytes_moved`` (sent in collectives); ``plan`` (the priced
    ``Plan``: what ``parallelize`` takes, the batch's placements)."""

    roles: dict[str, int]
    hardware: Hardware
    step_s: float
    tokens_per_s_per_chip: float
    mfu: float
    memory: Memory
    compute_s: float
    comm_s: dict[str, float]
    hidden_s: float
    bytes_moved: int
    model_flops: float
    plan: Plan = dataclasses.field(repr=False, compare=False)

    @classmethod
    def of(cls, plan: Plan, hardware: Hardware, roles: dict[str, int], flops: float, tokens: int) -> Prediction:
        chips = math.prod(roles.values())
        step = plan.step_us / 1e6
        return cls(roles=roles, hardware=hardware, step_s=step, tokens_per_s_per_chip=tokens / step / chips,
                   mfu=flops / (step * chips * hardware.flops), memory=plan.memory,
                   compute_s=plan.detail["compute_us"] / 1e6,
                   comm_s={level: plan.detail[f"{level}_us"] / 1e6 for level in LEVELS},
                   hidden_s=plan.detail["hidden_us"] / 1e6, bytes_moved=plan.bytes_moved, model_flops=flops,
                   plan=plan)

    @property
    def chips(self) -> int:
        return math.prod(self.roles.values())

    @property
    def fits(self) -> bool:
        """Whether the predicted memory per chip is within the chip's HBM."""
        return self.memory.total <= self.hardware.hbm_bytes

    def explain(self) -> str:
        """The prediction in words: the configuration, the step split into compute and each link level, the
        pipeline's schedule, the memory per chip against the chip's HBM.

        >>> print(Prediction.example().explain().splitlines()[0])
        dp=2 x tp=4 on 8 x H100 SXM: step 1.000 s, 1,000 tokens/s per chip, MFU 40.0%
        """
        b = format_bytes
        d = self.plan.detail
        name = " x ".join(f"{r}={n}" for r, n in self.roles.items())
        lines = [f"{name} on {self.chips:,} x {self.hardware.name}: step {self.step_s:.3f} s, "
                 f"{self.tokens_per_s_per_chip:,.0f} tokens/s per chip, MFU {self.mfu:.1%}",
                 f"  compute {self.compute_s:.3f} s ({d.get('flops', 0) / 1e12:,.1f} TFLOP a chip at "
                 f"{self.hardware.efficiency:.0%} of {self.hardware.flops / 1e12:,.0f} TFLOP/s)"
                 + (f", of which a pipeline's schedule {d['pipeline_us'] / 1e6:.3f} s over "
                    f"{d['microbatches']} microbatches" if d.get("pipeline_us") else ""),
                 "  collectives " + ", ".join(f"{level} {self.comm_s[level]:.3f} s" for level in LEVELS)
                 + f" ({b(self.bytes_moved)} sent a chip), {self.hidden_s:.3f} s of them hidden behind compute",
                 f"  memory {b(self.memory.total)} a chip of {b(self.hardware.hbm_bytes)}"
                 f" ({'fits' if self.fits else 'does NOT fit'}): parameters {b(self.memory.params)}, gradients "
                 f"{b(self.memory.grads)}, optimizer {b(self.memory.optimizer)}, activations and "
                 f"temporaries {b(self.memory.activations)}"]
        return "\n".join(lines)

    @classmethod
    def example(cls) -> Prediction:
        """A made-up prediction, for the docstrings."""
        plan = Plan(roles={}, styles={}, default=(), batch=(), step_us=1e6, bytes_moved=2**30,
                    memory=Memory(2**30, 2**30, 2**31, 2**20, 2**32),
                    detail={"compute_us": 8e5, "intra_us": 1e5, "inter_us": 2e5, "hidden_us": 1e5, "flops": 1e14})
        return cls.of(plan, Hardware.h100(), {"dp": 2, "tp": 4}, 0.4 * 8 * Hardware.h100().flops, 8000)


def model_flops(model: nnx.Module, blocks: tuple | None, loss_fn: Callable, batch: tuple) -> float:
    """The model's FLOPs in one training step by the MFU convention (see the module's docstring), from its forward
    pass traced at global shape on the model cut to one block and to two: the first and every further block's."""
    return step_flops(model, blocks, loss_fn, batch)[0]


def step_flops(model: nnx.Module, blocks: tuple | None, loss_fn: Callable, batch: tuple) -> tuple[float, float]:
    """``model_flops`` and the share of them its blocks run (0 without a list of blocks, or with one block), the
    blocks' counted as every block but the first runs."""
    def forward(depth: int) -> float:
        small = cut_model(model, blocks, depth)
        graphdef, params, rest = nnx.split(small, nnx.Param, ...)
        closed = jax.make_jaxpr(lambda p, r, *b: loss_fn(nnx.merge(graphdef, p, r), *b))(params, rest, *batch)
        return _matmul_flops(closed.jaxpr)

    depth = len(list(module_at(model, blocks))) if blocks is not None else 1
    one = forward(1)
    if depth == 1:
        return 3 * one, 0.0
    each = forward(2) - one
    return 3 * (one + (depth - 1) * each), 3 * depth * each


def _matmul_flops(jaxpr: jc.Jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lc)
        elif name == "ragged_dot" or name == "ragged_dot_general":  # rows [M, K] by their group's [K, N]
            m, k = eqn.invars[0].aval.shape[-2:]
            total += 2.0 * m * k * eqn.outvars[0].aval.shape[-1]
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        subs = [v for v in eqn.params.values() if isinstance(v, (jc.Jaxpr, jc.ClosedJaxpr))]
        subs += [b for v in eqn.params.values() if isinstance(v, tuple) for b in v
                 if isinstance(b, (jc.Jaxpr, jc.ClosedJaxpr))]
        if name == "cond":  # the costliest branch
            total += max((_matmul_flops(_open(b)) for b in subs), default=0.0)
            continue
        total += trips * sum(_matmul_flops(_open(b)) for b in subs)
    return total


def _open(j) -> jc.Jaxpr:
    return j.jaxpr if isinstance(j, jc.ClosedJaxpr) else j


def _checked(make, loss_fn, batch, hardware, roles, tx, microbatches, remat):
    """The arguments, checked, as pricing takes them: the abstract model, the abstract mesh (axes named by their
    roles), the roles (a ``pp`` of one stage added for gradient accumulation), the batch as shapes, the optimizer."""
    if isinstance(make, nnx.Module) or not callable(make):
        raise TypeError(f"predict: make must be the model's constructor, a function of no arguments (lambda: "
                        f"GPT(...)), got {kind_of(make)}; it is only traced, never built")
    if not callable(loss_fn):
        raise TypeError(f"predict: loss_fn must be a function loss_fn(model, *batch) -> scalar loss, got "
                        f"{kind_of(loss_fn)}")
    if not isinstance(hardware, Hardware):
        raise TypeError(f"predict: hardware must be a jshard.parallel.Hardware (Hardware.h100(), "
                        f"Hardware.measure(mesh), ...), got {kind_of(hardware)}")
    if not isinstance(roles, dict) or not roles or any(r not in ROLES for r in roles) or any(
            isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in roles.values()):
        raise ValueError(f"predict: roles maps each role (some of {ROLES}) to its size, outermost first, "
                         f"{{'dp': 64, 'pp': 16, 'tp': 8}}; got {roles!r}")
    if sum(r in TENSOR_ROLES for r in roles) > 1:
        raise ValueError(f"predict: roles {roles} give the model two tensor axes; take one of 'tp' / 'sp'")
    if not batch or any(not (hasattr(b, "shape") and hasattr(b, "dtype")) or isinstance(b, DArray) for b in batch):
        raise TypeError("predict: pass the batch loss_fn takes as arrays or jax.ShapeDtypeStructs at global shape, "
                        "the token ids first: predict(make, loss_fn, ids, labels, hardware=..., roles=...)")
    if remat not in REMAT:
        raise ValueError(f"predict: remat is one of {REMAT} (None: activations kept; 'block': each block's "
                         f"recomputed in its backward pass), got {remat!r}")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise ValueError(f"predict: microbatches={microbatches!r} is a count of microbatches a step's batch runs as, "
                         f"an int >= 1; roles are {roles}")
    if microbatches is not None and "pp" not in roles:  # gradient accumulation: a pipeline of one stage
        names, sizes, _ = accumulating(tuple(roles), tuple(roles.values()), {r: r for r in roles})
        roles = dict(zip(names, sizes, strict=True))
    batch = tuple(jax.ShapeDtypeStruct(np.shape(b), b.dtype) for b in batch)
    data = math.prod(n for r, n in roles.items() if r in BATCH_ROLES)
    rows = batch[0].shape[0] if batch[0].shape else 1
    per = rows // (microbatches or 1)
    if rows % (microbatches or 1) or per % data:
        raise ValueError(f"predict: the batch's {rows} rows do not split over the data axes ({data} ways"
                         + (f", in each of {microbatches} microbatches" if microbatches else "")
                         + f") of roles {roles}; make the batch a multiple of {data * (microbatches or 1)}")
    if tx is not None:
        check_tx(tx, "predict")
    tx = optax.adamw(1e-3) if tx is None else tx
    with building():
        model = nnx.eval_shape(make)
    if not isinstance(model, nnx.Module):
        raise TypeError(f"predict: make() must build an nnx.Module, it built {kind_of(model)}")
    mesh = AbstractMesh(tuple(int(n) for n in roles.values()), tuple(roles))
    return model, mesh, roles, batch, tx
