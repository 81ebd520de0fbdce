"""What a role assignment means for a model: the styles it gives ``parallelize``, where the batch goes, and what it
reads of the model's own structure (its list of identical blocks, its mixtures of experts, which side of a tensor
axis each linear layer takes).

A role is what a mesh axis does: ``"dp"`` (the batch split, parameters replicated), ``"fsdp"`` (the batch split,
parameters sharded and gathered where used), ``"zero"`` (the batch split, parameters and optimizer state sharded,
the parameters gathered once a step as the model is called and their gradients reduce-scattered once: Megatron-LM's
distributed optimizer; ``FullyShard`` matched on the whole model), ``"ep"`` (expert parallelism, offered where the
model has mixtures of experts: the batch split, every mixture's experts split and kept in place,
``ExpertParallel``), ``"tp"`` (Megatron's tensor parallelism), ``"sp"`` (``"tp"`` with the norms and residual
stream sharded on the sequence), ``"cp"`` (context parallelism: the sequence split, attention crossing the axis as
the cost model chooses) or ``"pp"`` (pipeline parallelism: the list of identical blocks split into stages, 1F1B).
Under ``"tp"`` / ``"sp"`` each linear layer's side is read from the model's own dataflow, not from its names: a
layer fed by no other layer's output (q, k, v, up, a head) runs column parallel, one fed by a column-parallel layer
(o, down) row parallel, alternating along a chain; embeddings looked up by the batch's ids are split on the
vocabulary; norms pin their output replicated (``"tp"``) or run sequence parallel (``"sp"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..jaxcompat import inlined_call, jc, open_jaxpr, scan_params
from ..placements import Placement, Replicate, Shard
from .parallelize import blocks_differ, module_key
from .styles import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    FullyShard,
    ParallelStyle,
    PipelineParallel,
    RowwiseParallel,
    SequenceParallel,
    expert_weights,
)

__all__ = ["BATCH_ROLES", "BLOCK_SCOPE", "ROLES", "TENSOR_ROLES", "TRACED_AS", "batch_placements", "compute_dtype",
           "cut_model", "mixtures", "module_at", "param_path", "pipeline_microbatches", "repeated", "styles_of",
           "tensor_sides"]

ROLES = ("dp", "fsdp", "zero", "ep", "tp", "sp", "cp", "pp")
BATCH_ROLES = ("dp", "fsdp", "zero", "ep")  # roles that split the batch
TENSOR_ROLES = ("tp", "sp")
TRACED_AS = {"fsdp": "dp"}  # roles whose steps trace alike (see _Whole)


def accumulating(names: tuple, sizes: tuple, roles: dict) -> tuple[tuple, tuple, dict]:
    """Axis ``names``, ``sizes`` and ``roles`` with gradient accumulation's pipeline of one stage: a ``pp`` axis of
    size 1 after the data axes (``predict(microbatches=)`` without ``pp``, and ``autoplan`` over the budget)."""
    at = next((i for i, a in enumerate(names) if roles[a] not in BATCH_ROLES), len(names))
    return ((*names[:at], "pp", *names[at:]), (*sizes[:at], 1, *sizes[at:]),
            {a: roles.get(a, "pp") for a in (*names[:at], "pp", *names[at:])})


def pipeline_microbatches(stages: int, rows: int, data: int) -> int | None:
    """A pipeline's microbatches: twice its stages where the batch's rows allow (each microbatch split over the data
    axes), else as many as its stages (None: too few rows)."""
    return next((m for m in (2 * stages, stages) if rows % m == 0 and (rows // m) % data == 0), None)


def styles_of(roles: dict[str, str], tensor: dict, blocks: tuple | None = None,
              microbatches: int | None = None, pricing: bool = False, param_dtype=None,
              remat: bool = False) -> tuple[dict, tuple]:
    """``(plan, default)`` for ``parallelize`` from a role assignment (a pipeline runs the blocks at ``blocks`` as
    ``microbatches`` microbatches, recomputing each layer's forward where ``remat``; FSDP gathers parameters in
    ``param_dtype``, the model's compute dtype); to price it (``pricing``), a data-parallel axis gathers its
    parameters, whole already, as an FSDP one does (``_Whole``)."""
    # zero with a pipeline: each module's parameters sharded on the axis, the stages taking theirs whole (gathered
    # once a step as the pipeline starts); without one, the whole model is one unit gathered where it is called
    staged = "pp" in roles.values()
    default = tuple((FullyShard if r in ("fsdp", "zero") else _Whole)(a, param_dtype=param_dtype)
                    for a, r in roles.items() if r == "fsdp" or (pricing and r == "dp") or (staged and r == "zero"))
    plan: dict[str, tuple[ParallelStyle, ...]] = {}
    for axis, role in roles.items():
        if role == "cp":
            plan[""] = (*plan.get("", ()), ContextParallel(axis))
        if role == "zero" and not staged:
            plan[""] = (*plan.get("", ()), FullyShard(axis, param_dtype=param_dtype))
        if role == "pp":
            plan[module_key(blocks, any_index=True)] = (PipelineParallel(
                axis, microbatches=microbatches, remat=remat, whole=tuple(a for a, r in roles.items() if r == "zero")),)
        if role == "ep":
            for pattern in (p for p, side in tensor.items() if side == "experts"):
                plan[pattern] = (*plan.get(pattern, ()), ExpertParallel(axis))
        if role not in TENSOR_ROLES:
            continue
        seq = role == "sp"
        for pattern, side in tensor.items():
            if side == "experts":  # a mixture's experts: whole on the tensor axis
                continue
            if side == "col":
                style = ColwiseParallel(axis)
            elif side in ("row", "embed"):
                style = RowwiseParallel(axis, output=Shard(1) if seq else Replicate())
            else:  # a norm
                style = SequenceParallel(axis) if seq else ParallelStyle(axis, output=Replicate())
            plan[pattern] = (style,)
    return plan, default


@dataclasses.dataclass(frozen=True)
class _Whole(FullyShard):
    """Data parallelism as ``autoplan`` prices it: FSDP's gather of a module's parameters while it runs, of
    parameters already whole on the axis, which the plan drops (the constraint asks for what is there). A
    data-parallel step then traces as its FSDP twin does, and the two share one trace."""

    def param(self, module, name, shape):
        return Replicate()


def batch_placements(mesh: Mesh, roles: dict[str, str], batch: tuple) -> tuple[tuple[Placement, ...], ...]:
    """The batch split over the data axes; its sequence dim (1) laid out as context parallelism takes it."""
    def placement(axis, b):
        if roles[axis] in BATCH_ROLES and b.shape:
            return Shard(0)
        if roles[axis] == "cp" and len(b.shape) >= 2:
            return ContextParallel(axis).sequence(b.shape[1], mesh.shape[axis])
        return Replicate()

    return tuple(tuple(placement(a, b) for a in mesh.axis_names) for b in batch)


def compute_dtype(model: nnx.Module):
    """The dtype the model's layers compute in where it is narrower than their parameters' (Flax layers built with
    ``dtype=jnp.bfloat16``, float32 parameters: mixed precision), else None: FSDP then gathers parameters in it."""
    found = set()
    for _, node in nnx.iter_graph(model):
        dtype, param_dtype = getattr(node, "dtype", None), getattr(node, "param_dtype", None)
        if isinstance(node, nnx.Module) and dtype is not None and param_dtype is not None:
            found.add((np.dtype(dtype), np.dtype(param_dtype)))
    if len(found) == 1:
        (dtype, param_dtype), = found
        if dtype.itemsize < param_dtype.itemsize and jnp.issubdtype(dtype, jnp.floating):
            return dtype
    return None


def mixtures(model: nnx.Module) -> tuple[str, ...]:
    """The plan patterns of the model's mixtures of experts (``ExpertParallel``'s modules): modules whose own
    parameters of rank 3 share one leading dim, the expert count (``[E, D, H]``), written for every block alike."""
    found = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        leading = [shape[0] for _, shape in expert_weights(node)]
        if len(leading) >= 2 and len(set(leading)) == 1 and leading[0] > 1:
            found[module_key(tuple(path), any_index=True)] = None
    return tuple(found)


def repeated(model: nnx.Module) -> tuple | None:
    """The path of the model's list of identical blocks holding the most parameters (None: no such list), identical
    as ``parallelize`` takes them (``blocks_differ``; a pipeline also needs them stateless, see ``_candidates``)."""
    best, most = None, 0
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, (nnx.List, list)) or len(node) < 2:
            continue
        members = list(node)
        if not all(isinstance(m, nnx.Module) for m in members):
            continue
        size = sum(math.prod(np.shape(v)) for v in jax.tree.leaves(nnx.state(node, nnx.Param)))
        if size > most and blocks_differ(members, stateless=False) is None:
            best, most = tuple(path), size
    return best


def tensor_sides(model: nnx.Module, loss_fn: Callable, batch: tuple) -> dict[str, str]:
    """Per module pattern (block indices as ``*``): ``"col"`` / ``"row"`` for linear layers, by the parity of the
    longest chain of layers feeding them in the loss's dataflow; ``"embed"`` for embeddings looked up by the batch;
    ``"norm"`` for norms."""
    small = cut_model(model, repeated(model), 1)
    graphdef, params, rest = nnx.split(small, nnx.Param, ...)
    paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    closed = jax.make_jaxpr(lambda p, *b: loss_fn(nnx.merge(graphdef, p, rest), *b))(params, *batch)
    jaxpr = closed.jaxpr
    n = len(paths)
    source = {v: param_path(paths[i]) for i, v in enumerate(jaxpr.invars[:n])}  # var -> parameter path it is
    from_batch = set(jaxpr.invars[n:])
    depth = {}
    sides: dict[str, str] = {}

    def enter(outer: list, inner: list) -> None:
        """What the outer vars are, said of the vars that stand for them inside a call or loop body (a scanned
        stack's kernel is the body's slice of it), or back out of it."""
        for a, b in zip(outer, inner, strict=True):
            if isinstance(a, jc.Literal) or isinstance(b, jc.Literal):
                continue
            if a in source:
                source[b] = source[a]
            depth[b] = depth.get(a, 0)
            if a in from_batch:
                from_batch.add(b)

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            body = inlined_call(eqn) or (scan_params(eqn).body if eqn.primitive.name == "scan" else None)
            inner = open_jaxpr(body)[0] if body is not None else None
            if inner is not None and len(inner.invars) == len(eqn.invars):
                enter(eqn.invars, inner.invars)
                walk(inner)
                enter(inner.outvars, eqn.outvars)
                continue
            ins = [v for v in eqn.invars if not isinstance(v, jc.Literal)]
            params_in = [source[v] for v in ins if v in source]
            d = max((depth.get(v, 0) for v in ins), default=0)
            if eqn.primitive.name in ("convert_element_type", "reshape", "transpose", "copy", "broadcast_in_dim") \
                    and len(params_in) == 1 and len(ins) == 1:
                source[eqn.outvars[0]] = params_in[0]  # still the parameter, in another form
                continue
            kernels = [p for p in params_in if p[-1] == "kernel"]
            if eqn.primitive.name == "dot_general" and kernels:
                other = [v for v in ins if source.get(v) != kernels[0]]
                d = 1 + max((depth.get(v, 0) for v in other), default=0)
                sides[module_key(kernels[0][:-1], any_index=True)] = "col" if d % 2 else "row"
            elif any(p[-1] == "embedding" for p in params_in) and any(v in from_batch for v in ins):
                sides[module_key(next(p for p in params_in if p[-1] == "embedding")[:-1], any_index=True)] = "embed"
            for o in eqn.outvars:
                depth[o] = d
                if any(v in from_batch for v in ins):
                    from_batch.add(o)

    walk(jaxpr)
    for path, node in nnx.iter_graph(small):
        if isinstance(node, (nnx.LayerNorm, nnx.RMSNorm)) and path:
            sides.setdefault(module_key(tuple(path), any_index=True), "norm")
    return sides


def param_path(keys: tuple) -> tuple:
    """A parameter's path in its state: its module's path and its name (the Variable's ``.value`` dropped)."""
    path = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keys)
    return path[:-1] if path and path[-1] == "value" else path


def module_at(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def cut_model(model: nnx.Module, path: tuple | None, depth: int, remat: bool = False) -> nnx.Module:
    """A copy of the abstract ``model`` whose block list at ``path`` keeps its first ``depth`` blocks, the last
    called inside ``jax.named_scope(BLOCK_SCOPE)`` (so the equations of its forward and backward passes say so);
    ``remat``: every block's activations recomputed in the backward pass (``jax.checkpoint`` around each call: what
    the step keeps of a block is its input)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state, copy=True)
    if path is not None:
        parent = module_at(copy, path[:-1])
        kept = list(getattr(parent, path[-1]))[:depth]
        for i, block in enumerate(kept):
            block.__class__ = _scoped(type(block), scope=i == len(kept) - 1, remat=remat)
        setattr(parent, path[-1], nnx.List(kept))
    return copy


def recompute_blocks(model: nnx.Module) -> nnx.Module:
    """``model`` (changed in place) with every block of its list of identical blocks (``repeated``) recomputing
    its activations in the backward pass (``nnx.remat`` around each call: the step keeps a block's input), as a
    ``Plan`` with ``remat`` and no pipeline was priced; a model without such a list is returned as it is."""
    path = repeated(model)
    if path is not None:
        for block in module_at(model, path):
            block.__class__ = _scoped(type(block), scope=False, remat=True)
    return model


BLOCK_SCOPE = "jshard_autoplan_block"


@functools.cache
def _scoped(cls: type, scope: bool = True, remat: bool = False) -> type:
    if not (scope or remat):
        return cls

    def run(self, *args, **kwargs):
        if not remat:
            return super(scoped, self).__call__(*args, **kwargs)
        return nnx.remat(lambda module, *a: super(scoped, module).__call__(*a, **kwargs))(self, *args)

    def __call__(self, *args, **kwargs):
        if not scope:
            return run(self, *args, **kwargs)
        with jax.named_scope(BLOCK_SCOPE):
            return run(self, *args, **kwargs)

    scoped = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})
    return scoped
