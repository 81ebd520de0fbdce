"""A model's identical blocks as pipeline stages: stacked along one mesh axis, run by the schedule in ``TrainStep``.

``parallelize(make, mesh, {"blocks": PipelineParallel("pp", microbatches=8)})`` replaces the list of blocks at
``blocks`` by a ``Pipelined`` module: one block's module whose parameters hold every block's, stacked along a new
dim 0 and split along the pipeline axis (stage ``s`` of ``p`` holds blocks ``s*L/p ... (s+1)*L/p - 1``, ``L/p``
rounded up where ``p`` does not divide ``L``). The
model's own code does not change: iterating ``model.blocks`` gives each block in turn, and ``for block in
self.blocks: x = block(x)`` runs them.

``TrainStep`` sees the ``Pipelined`` module and takes the step by the schedule (``value_and_grad``): the batch is
cut into ``m`` microbatches (microbatch ``i`` the rows ``i, i + m, i + 2m, ...``); what the model computes before
the first block (embeddings) runs on each microbatch; the blocks and what follows them (the head, and
``loss_fn``'s loss) run in the pipeline, the last stage computing each microbatch's loss as soon as its forward
pass is done (``jshard.parallel.pipeline``); the gradient of what came before the blocks is pulled back from the
first stage's input gradients. The loss is the mean of the microbatches'
losses: for a loss that is a mean over the batch, one device's loss on the whole batch.

To find those three parts the model's ``loss_fn`` is traced twice more, at a microbatch's shapes: once stopped at
the first block's call (its input is the pipeline's), once with the blocks standing aside (each returns an input
given to it, the last block the pipeline's output), so what follows is the tail. A model whose blocks are not one
chain (``x = block(x)`` in order, each once, nothing else reading a block's output) is refused with an error.

A module that stacks its layers already (built by ``nnx.vmap``, run by the model's own ``nnx.scan``) stays where
it is, its layer dim split along the pipeline axis (``StackedStages``). Python cannot stop inside a scan's body, so
its three parts are cut from the loss's jaxpr at the one ``scan`` over the stack (``_ScanCut``): what computes its
carry, its body, what reads its result.

This module is pipelining's side of two hooks: ``PipelineParallel.restructure`` answers ``parallelize`` with
``Stages`` or ``StackedStages``, and the module installed carries a ``PipelineStep`` as its ``jshard_step``, from
which ``TrainStep`` takes the step.

>>> import jax, jax.numpy as jnp, numpy as np, optax, jshard
>>> from flax import nnx
>>> from jshard.parallel import PipelineParallel, TrainStep, parallelize
>>> class Block(nnx.Module):
...     def __init__(self, rngs):
...         self.linear = nnx.Linear(8, 8, rngs=rngs)
...     def __call__(self, x):
...         return jnp.tanh(self.linear(x))
>>> class Deep(nnx.Module):
...     def __init__(self, rngs):
...         self.blocks = nnx.List([Block(rngs) for _ in range(4)])
...         self.head = nnx.Linear(8, 1, rngs=rngs)
...     def __call__(self, x):
...         for block in self.blocks:
...             x = block(x)
...         return self.head(x)
>>> mesh = jax.make_mesh((4, 2), ("pp", "dp"))
>>> model = parallelize(lambda: Deep(nnx.Rngs(0)), mesh, {"blocks": PipelineParallel("pp", microbatches=2)})
>>> kernel = model.blocks.layers.linear.kernel.get_value()
>>> kernel.shape, kernel.placements
((4, 8, 8), (S(0), R))
>>> step = TrainStep(model, optax.sgd(0.1), lambda m, x: jnp.mean(m(x) ** 2))
>>> x = jshard.distribute(np.ones((4, 8), np.float32), mesh, [jshard.Replicate(), jshard.Shard(0)])
>>> float(step(x)) > float(step(x))
True
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..darray import DArray
from ..engine.constrain import hidden_axis
from ..engine.program import tracing_mesh
from ..jaxcompat import jc, open_jaxpr, run_equations, scan_params, source_info_util
from ..placements import Replicate, shift_dims
from .pipeline import MERGES, split_placement, value_and_grad_read

__all__ = ["PipelineStep", "Pipelined", "StackedStages", "Stages", "blocks_differ", "carried", "stacked_placements",
           "unmerged"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))


class Pipelined(nnx.Module):
    """``depth`` identical blocks stacked: ``layers`` is one block's module whose parameters hold all of them along
    a new dim 0, split along the pipeline axis of ``style``. Iterating it gives each block; a block called outside
    ``TrainStep``'s pipelined step runs on its slice of the stacked parameters."""

    def __init__(self, layers: nnx.Module, depth: int, style: Any):
        self.layers = layers
        self.depth = depth
        self.style = style
        self.jshard_step = PipelineStep(style, depth, ("layers",))

    def __len__(self) -> int:
        return self.depth

    def __iter__(self) -> Iterator[_Block]:
        return (_Block(self, i) for i in range(self.depth))

    def __getitem__(self, i: int) -> _Block:
        if not isinstance(i, int) or not -self.depth <= i < self.depth:
            raise IndexError(f"Pipelined: block index {i!r} out of range for {self.depth} blocks")
        return _Block(self, i % self.depth)

    def block(self, i: int) -> nnx.Module:
        """Block ``i`` as a module of its own, on its slice of the stacked parameters."""
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


class _Block:
    """Block ``i`` of a ``Pipelined`` module, as iterating it gives it: calling it runs the block, or, while
    ``value_and_grad`` traces the model, records the call."""

    def __init__(self, owner: Pipelined, i: int):
        self.owner, self.i = owner, i

    def __call__(self, x, *args, **kwargs):
        tape = _TAPE.get()
        if tape is None:
            return self.owner.block(self.i)(x, *args, **kwargs)
        return tape.call(self.i, x, args, kwargs)


# -- parallelize's side: PipelineParallel.restructure -------------------------------------------------------------

class Stages:
    """A list of identical blocks (``nnx.List``) as pipeline stages: each parameter's blocks drawn as one stack, a
    new dim 0 split along the pipeline axis, and the list replaced by a ``Pipelined`` module holding the first
    block's module on the stacks. Checked when made, before anything changes."""

    def __init__(self, style: Any, module: nnx.List, where: str, mesh: Mesh):
        self.style, self.where, self.mesh = style, where, mesh
        blocks = list(module)
        if not blocks or not where or where.rsplit("/", 1)[-1].isdigit():
            raise ValueError(f"parallelize: {style.label} is matched on {where or 'the root module'} (a list of "
                             f"{len(blocks)} inside a list); match it on a list of identical blocks held by a module "
                             "attribute (nnx.List, say 'blocks')")
        why = blocks_differ(blocks)
        if why is not None:
            raise ValueError(f"parallelize: {style.label} stacks the blocks of {where}, and {why}")
        _check_depth(style, len(blocks), f"the {len(blocks)} blocks of {where}", "block", mesh)

    def placements(self, path: tuple, placements: tuple) -> tuple:
        """A block parameter's placements, as its block has them (the stack's are ``stacks``')."""
        return placements

    def stacks(self, paths: list[tuple], placements: list[tuple]) -> list[tuple[list[int], tuple]]:
        """Per parameter of a block (by its path inside the block): the members ``i`` of ``paths`` (below the list,
        block index first) that are that parameter in each block, in block order, and the placements of their
        stack (``stacked_placements``)."""
        by_name: dict[tuple, list[int]] = {}
        for i, path in enumerate(paths):
            by_name.setdefault(path[1:], []).append(i)
        return [(members, stacked_placements(placements[members[0]], self.mesh, self.style, self.where))
                for members in by_name.values()]

    def install(self, module: nnx.List) -> nnx.Module:
        """The ``Pipelined`` module that takes the list's place (its first block holds the stacks by now, and takes
        the blocks' state stacked the same way)."""
        blocks = list(module)
        held = [dict(carried(b)) for b in blocks]
        for path, v in held[0].items():
            values = [h[path].get_value() for h in held]
            first = values[0]  # an abstract model's (autoplan's) are shapes
            v.set_value(jax.ShapeDtypeStruct((len(values), *first.shape), first.dtype)
                        if isinstance(first, jax.ShapeDtypeStruct) else jnp.stack(values))
        return Pipelined(blocks[0], len(blocks), self.style)


class StackedStages:
    """A module that already stacks identical layers (built by ``nnx.vmap``, run by ``nnx.scan``: every parameter
    ``(layers, ...)``) as pipeline stages: its stack dim split along the pipeline axis, the module kept where it is,
    marked for ``TrainStep`` (``PipelineStep``). Checked when made, before anything changes."""

    def __init__(self, style: Any, module: nnx.Module, where: str, mesh: Mesh):
        from .styles import stack_depth  # styles builds on this module

        self.style, self.where, self.mesh = style, where, mesh
        found = [(path, owner, v) for path, owner, v in _params_with_owners(module)]
        told = [stack_depth(owner, str(path[-1]), np.shape(v.get_value())) for path, owner, v in found]
        depths = {np.shape(v.get_value())[0] if np.ndim(v.get_value()) else 0 for _, _, v in found}
        if not found or not any(told) or len(depths) != 1:
            raise ValueError(f"parallelize: {style.label} is matched on {where} ({type(module).__name__}); match it on "
                             "a list of identical blocks held by a module attribute (nnx.List, say 'blocks') or on a "
                             "module stacking its layers (built by nnx.vmap, run by nnx.scan: every parameter with "
                             "one leading layer dim)")
        state = carried(module)
        if state:
            raise ValueError(f"parallelize: {style.label} splits the layers of {where} into stages, and they hold "
                             f"state besides parameters ({type(state[0][1]).__name__}: RNG streams, batch "
                             "statistics, a mixture's balancing), which a stack run by nnx.scan does not carry "
                             "through a pipeline; keep the state out of the layers, or build them as a list of "
                             "blocks (nnx.List), whose state a pipeline carries where its Variable says merge=")
        (self.depth,) = depths
        _check_depth(style, self.depth, f"the {self.depth} stacked layers of {where}", "layer", mesh)

    def placements(self, path: tuple, placements: tuple) -> tuple:
        """A stacked parameter's placements: its stack dim split along the pipeline axis (the other styles placed
        it as one layer, past the stack)."""
        axis = list(self.mesh.axis_names).index(self.style.axis)
        if placements[axis] != Replicate():
            raise ValueError(f"parallelize: parameter {'/'.join(map(str, path))} of {self.where} is placed "
                             f"{placements[axis]!r} on mesh axis {self.style.axis!r}, which {self.style.label} uses "
                             "for the stages; place the layers' parameters on the other axes")
        out = list(placements)
        out[axis] = split_placement(self.style.virtual_stages)
        return tuple(out)

    def stacks(self, paths: list[tuple], placements: list[tuple]) -> list[tuple[list[int], tuple]]:
        """Nothing to stack: the module's parameters are stacks already."""
        return []

    def install(self, module: nnx.Module) -> nnx.Module:
        """The module itself, marked: ``TrainStep`` takes its step by the pipeline (``PipelineStep``)."""
        module.jshard_step = PipelineStep(self.style, self.depth, ())
        return module


def _params_with_owners(module: nnx.Module) -> list[tuple[tuple, nnx.Module, nnx.Variable]]:
    """Each parameter inside ``module``: its path, the module holding it, its Variable."""
    nodes = dict(nnx.iter_graph(module))
    return [(path, nodes[path[:-1]], v) for path, v in nodes.items() if isinstance(v, nnx.Param)]


def _check_depth(style: Any, depth: int, what: str, unit: str, mesh: Mesh) -> None:
    size = mesh.shape[style.axis] * style.virtual_stages
    if style.virtual_stages == 1 and depth >= size:  # uneven stages: the last ones hold fewer
        return
    if depth % size:
        raise ValueError(f"parallelize: {style.label} splits {what} into {mesh.shape[style.axis]} stages x "
                         f"{style.virtual_stages} virtual stages; use a {unit} count that is a multiple of {size} "
                         "(or another axis size; with one virtual stage, at least as many as the stages)")


def blocks_differ(blocks: Sequence[nnx.Module], *, stateless: bool = True) -> str | None:
    """Why ``blocks`` are not identical blocks, which one block's graph runs (a pipeline's stages, blocks
    ``autoplan`` prices as one), whose state is their parameters where ``stateless`` (as a pipeline's must be);
    None where they are.

    >>> from flax import nnx
    >>> blocks_differ([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)]) is None
    True
    >>> blocks_differ([nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 8, rngs=nnx.Rngs(0))])[:29]
    'block 1 (Linear) differs from'
    """
    first = _signature(blocks[0])
    for i, b in enumerate(blocks[1:], 1):
        if _signature(b) != first:
            return (f"block {i} ({type(b).__name__}) differs from block 0 ({type(blocks[0]).__name__}) in its "
                    "structure, settings (attributes such as a head count), parameter shapes or dtypes; the blocks "
                    "must be identical")
    bad = unmerged(carried(blocks[0])) if stateless else None
    if bad is not None:
        return (f"the blocks hold state besides parameters ({type(bad).__name__}: RNG streams, batch "
                "statistics) that does not say how a step's microbatches merge it; pipelined blocks hold "
                f"parameters, and state whose Variable says merge= one of {MERGES} (a mixture's load and routing "
                "bias: jshard.gpt.Balance)")
    return None


def carried(module: nnx.Module) -> list[tuple[tuple, nnx.Variable]]:
    """The variables inside ``module`` besides its parameters (a mixture's routing bias and load, RNG streams),
    with their paths, in ``nnx.iter_graph`` order."""
    return [(tuple(path), v) for path, v in nnx.iter_graph(module)
            if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)]


def unmerged(variables: list[tuple[tuple, nnx.Variable]]) -> nnx.Variable | None:
    """The first of ``variables`` (``carried``'s) that does not say how a pipelined step's microbatches merge what
    each call leaves of it (``merge=`` one of ``pipeline.MERGES`` in its metadata), None where all do."""
    return next((v for _, v in variables if v.get_metadata().get("merge") not in MERGES), None)


def _signature(module: nnx.Module) -> tuple:
    """What identical blocks share: the graph (classes, structure, settings such as a head count) and each
    parameter's shape and dtype."""
    graphdef, state = nnx.split(module)
    shapes = [(tuple(np.shape(v)), str(getattr(v, "dtype", type(v).__name__))) for v in jax.tree.leaves(state)]
    return graphdef, tuple(shapes)


def stacked_placements(placements: tuple, mesh: Mesh, style: Any, where: str = "") -> tuple:
    """The placements of a block parameter's stack (a new dim 0) from one block's: split along the pipeline axis,
    as they were on the others."""
    axis = list(mesh.axis_names).index(style.axis)
    shifted = shift_dims(placements, 1)
    if shifted[axis] != Replicate():
        raise ValueError(f"parallelize: a parameter of {where or 'a pipelined block'} is placed {placements[axis]!r} "
                         f"on mesh axis {style.axis!r}, which {style.label} uses for the stages; place the blocks' "
                         "parameters on the other axes")
    shifted[axis] = split_placement(style.virtual_stages)
    return tuple(shifted)


# -- TrainStep's side: the step by the schedule -------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineStep:
    """What a pipelined module carries for ``TrainStep`` (its ``jshard_step``): the style, the layer count, and where
    the stacked parameters are below the module (``("layers",)`` for a ``Pipelined`` list, ``()`` for a module that
    stacks its layers itself). ``TrainStep`` takes the step's loss and gradients from ``value_and_grad``."""

    style: Any
    depth: int
    stack: tuple

    @property
    def label(self) -> str:
        return self.style.label

    def value_and_grad(self, graphdef: Any, loss_fn: Callable, params: Any, rest: Any, batch: tuple, *, path: tuple,
                       module: nnx.Module) -> tuple[tuple[Any, Any], Any]:
        """``((loss, rest), grads)`` of ``loss_fn(model, *batch)`` as ``jax.value_and_grad(..., has_aux=True)``
        gives them in ``TrainStep``, taken by the schedule (see the module's docstring); ``module`` is the pipelined
        module, at ``path`` in the model."""
        style = self.style
        m = style.microbatches
        leaves, batch_tree = jax.tree.flatten(batch)
        for a in leaves:
            if np.ndim(a) < 1 or a.shape[0] % m:
                raise ValueError(f"TrainStep: {style.label} cuts the batch into {m} microbatches along dim 0, and a "
                                 f"batch input has shape {tuple(np.shape(a))}; use a batch size that is a multiple "
                                 f"of {m}")
        # microbatch i takes rows i, i + m, i + 2m, ...: a batch sharded over data-parallel devices stays sharded in
        # every microbatch (contiguous rows would put whole microbatches on one device)
        micro = [jnp.swapaxes(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 0, 1) for a in leaves]
        flat, tree = jax.tree_util.tree_flatten_with_path(params)
        inside = [_starts(p, path + self.stack) for p, _ in flat]
        stacked = [v for (_, v), i in zip(flat, inside, strict=True) if i]
        other = [v for (_, v), i in zip(flat, inside, strict=True) if not i]

        def model_of(s, o):
            return nnx.merge(graphdef, jax.tree.unflatten(tree, _interleave(inside, s, o)), rest, copy=True)

        def loss_of(s, o, *mb):
            return loss_fn(model_of(s, o), *jax.tree.unflatten(batch_tree, mb))

        where = "/".join(map(str, path))
        # the blocks' state (stacked like their parameters): each microbatch runs with it as the step found it
        holder = nnx.merge(graphdef, params, rest, copy=True)
        prefix = tuple(path) + self.stack
        held = [(p[len(prefix):], v) for p, v in carried(holder) if p[:len(prefix)] == prefix]
        if self.stack:
            before, layer, tail = _taped(self, module, lambda o, *mb: loss_of(stacked, o, *mb), where,
                                         [p for p, _ in held])
        else:
            before, layer, tail = _scanned(self, loss_of, stacked, other, micro, where)
        x0, pull = jax.vjp(lambda o: jax.vmap(lambda *mb: before(o, *mb))(*micro), other)
        if self.stack:
            _check_standins(tail, other, micro, x0, self.depth)
        loss, d_stacked, d_other, dx0, left = value_and_grad_read(
            layer, tail, stacked, other, x0, tuple(micro), axis=style.axis, schedule=style.schedule,
            virtual_stages=style.virtual_stages, remat=style.remat, whole=style.whole,
            state=[v.get_value() for _, v in held], merges=[v.get_metadata()["merge"] for _, v in held])
        (d_before,) = pull(dx0)
        d_other = [b if a is None else a + b for a, b in zip(d_other, d_before, strict=True)]
        for (_, v), a in zip(held, left, strict=True):
            v.set_value(a)
        rest = nnx.split(holder, nnx.Param, ...)[2] if held else rest
        return (loss, rest), jax.tree.unflatten(tree, _interleave(inside, d_stacked, d_other))


def _taped(step: PipelineStep, pipelined: Pipelined, loss_of: Callable, where: str,
           held: list[tuple]) -> tuple[Callable, ...]:
    """``(before, layer, tail)`` of a ``Pipelined`` list, found by running the model with its blocks recording their
    calls (``_Tape``); ``held``: the paths inside a block of its state besides parameters, which ``layer`` then
    takes and leaves (``layer(params, state, x) -> (y, state)``)."""
    block_graphdef = nnx.graphdef(pipelined.layers)
    block_tree = jax.tree.structure(nnx.state(pipelined.layers, nnx.Param), is_leaf=lambda a: isinstance(a, DArray))
    block_rest = nnx.state(pipelined.layers, nnx.Not(nnx.Param))

    def before(o, *mb):
        with _taping(_Tape("before", step.depth)):
            try:
                loss_of(o, *mb)
            except _Reached as r:
                return r.x
        raise ValueError(f"TrainStep: loss_fn never called the pipelined blocks at {where}; the model must run them, "
                         "for block in self.blocks: x = block(x)")

    def layer(lp, *args):
        block = nnx.merge(block_graphdef, jax.tree.unflatten(block_tree, lp), block_rest, copy=True)
        if not held:
            return block(*args)
        ls, x = args
        variables = dict(carried(block))
        for path, a in zip(held, ls, strict=True):
            variables[path].set_value(a)
        return block(x), [variables[path].get_value() for path in held]

    def tail(o, x, *mb, standins=None):
        tape = _Tape("after", step.depth, x, standins or [jnp.zeros_like(x)] * (step.depth - 1))
        with _taping(tape):
            loss = loss_of(o, *mb)
        tape.check_chain()
        return loss

    return before, layer, tail


def _scanned(step: PipelineStep, loss_of: Callable, stacked: list, other: list, micro: list,
             where: str) -> tuple[Callable, ...]:
    """``(before, layer, tail)`` of a module that stacks its layers, cut from the model's jaxpr at the one scan over
    the stack (``_ScanCut``): what computes the scan's carry, the scan's body, and what reads the scan's result. The
    layer and the tail are cut from a trace with the pipeline axis hidden, as a pipeline stage is planned."""
    args = ([_aval(a) for a in stacked], [_aval(a) for a in other], *[_aval(a, 1) for a in micro])
    whole = _ScanCut(jax.make_jaxpr(loss_of)(*args), step, len(stacked), len(other), where)
    with hidden_axis(step.style.axis, tracing_mesh().axis_names):
        hidden = _ScanCut(jax.make_jaxpr(loss_of)(*args), step, len(stacked), len(other), where)
    return whole.before, hidden.layer, hidden.tail


def _aval(a: Any, drop: int = 0) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a)[drop:], a.dtype)


class _ScanCut:
    """The jaxpr of ``loss(stacked, other, *microbatch)`` cut at its one ``scan`` over the stacked parameters, which
    must carry one activation, scan the stacked parameters and nothing else, in order, over every layer, read nothing
    computed from the other inputs, and leave its per-layer outputs unread; the stacked parameters are read nowhere
    else."""

    def __init__(self, closed: Any, step: PipelineStep, ns: int, no: int, where: str):
        self.jaxpr, consts = open_jaxpr(closed)
        invars = self.jaxpr.invars
        self.env = dict(zip(self.jaxpr.constvars, consts, strict=True))
        self.s_vars, self.o_vars, self.mb_vars = invars[:ns], invars[ns:ns + no], invars[ns + no:]
        eqns = self.jaxpr.eqns
        index = {v: i for i, v in enumerate(self.s_vars)}
        readers = [k for k, e in enumerate(eqns) if any(_var(v) and v in index for v in e.invars)]
        how = (f"TrainStep: {step.label} pipelines the layers stacked at {where}, which the model must run with one "
               "nnx.scan (or jax.lax.scan) over the stack, carrying the activation from layer to layer")
        if len(readers) != 1 or eqns[readers[0]].primitive.name != "scan" or any(
                _var(v) and v in index for v in self.jaxpr.outvars):
            found = sorted({eqns[k].primitive.name for k in readers}) or ["nothing"]
            raise ValueError(f"{how}; their parameters are read by {', '.join(found)}, and by nothing but that scan "
                             "may they be read")
        self.k = readers[0]
        scan = eqns[self.k]
        sp = scan_params(scan)
        self.consts_in = scan.invars[:sp.consts]
        self.carry_in = scan.invars[sp.consts:sp.consts + sp.carry]
        xs = scan.invars[sp.consts + sp.carry:]
        if sp.carry != 1 or sp.reverse or sp.length != step.depth:
            raise ValueError(f"{how}; the scan carries {sp.carry} values over {sp.length} steps"
                             f"{' in reverse' if sp.reverse else ''}, where a pipeline carries one activation over "
                             f"the {step.depth} layers in order")
        if any(not _var(v) or v not in index for v in xs) or sorted(index[v] for v in xs) != list(range(ns)):
            raise ValueError(f"{how}; the scan also steps over other arrays (per-layer inputs, RNG keys), or not over "
                             "every stacked parameter; a pipelined layer takes its parameters and the activation only")
        self.order = [index[v] for v in xs]
        reaching = _reaching(eqns, set(invars))
        if any(_var(v) and v in reaching for v in self.consts_in):
            raise ValueError(f"{how}; the layers read a value computed from the batch or from parameters outside the "
                             "stack (a mask, positions); a pipelined layer takes only the activation it carries")
        ys = set(scan.outvars[1:])
        read = {v for e in eqns for v in e.invars if _var(v)} | {v for v in self.jaxpr.outvars if _var(v)}
        if ys & read:
            raise ValueError(f"{how}; the model reads the scan's per-layer outputs, where a pipeline gives the last "
                             "layer's activation only")
        self.body, self.body_consts = open_jaxpr(sp.body)
        self.carry_out = scan.outvars[0]

    def before(self, o: list, *mb) -> Any:
        env = dict(self.env) | dict(zip(self.o_vars, o, strict=True)) | dict(zip(self.mb_vars, mb, strict=True))
        return _run(self.jaxpr.eqns, env, self.carry_in)[0]

    def layer(self, lp: list, x: Any) -> Any:
        consts = _run(self.jaxpr.eqns, dict(self.env), self.consts_in)
        return jax.core.eval_jaxpr(self.body, self.body_consts, *consts, x, *[lp[i] for i in self.order])[0]

    def tail(self, o: list, x: Any, *mb) -> Any:
        env = dict(self.env) | dict(zip(self.o_vars, o, strict=True)) | dict(zip(self.mb_vars, mb, strict=True))
        env[self.carry_out] = x
        eqns = self.jaxpr.eqns[:self.k] + self.jaxpr.eqns[self.k + 1:]
        return _run(eqns, env, self.jaxpr.outvars)[0]


def _var(v: Any) -> bool:
    return not isinstance(v, jc.Literal)


def _reaching(eqns: list, sources: set) -> set:
    """The variables of ``eqns`` computed from ``sources``."""
    reached = set(sources)
    for e in eqns:
        if any(_var(v) and v in reached for v in e.invars):
            reached.update(e.outvars)
    return reached


def _run(eqns: list, env: dict, outvars: list) -> list:
    """``outvars`` computed by the equations of ``eqns`` they need, from the values ``env`` gives."""
    needed = {v for v in outvars if _var(v)}
    todo = []
    for e in reversed(eqns):
        if any(v in needed for v in e.outvars):
            todo.append(e)
            needed.update(v for v in e.invars if _var(v))
    return run_equations(todo[::-1], env, outvars)


def _interleave(inside: list[bool], stacked: list, other: list) -> list:
    """The parameters' leaves in their tree's order, from the stacked blocks' (where ``inside``) and the others'."""
    s, o = iter(stacked), iter(other)
    return [next(s) if i else next(o) for i in inside]


def _check_standins(tail: Callable, other: list, micro: list, x0: Any, depth: int) -> None:
    """Refuse a model that reads a block's output anywhere but in the next block (the stand-ins would feed it
    zeros): the tail is traced with each block's stand-in an input of its own, and none of them may be read."""
    if depth < 2:
        return
    x = jax.ShapeDtypeStruct(x0.shape[1:], x0.dtype)
    o = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in other]
    mb = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in micro]
    closed = jax.make_jaxpr(lambda s, o, x, *mb: tail(o, x, *mb, standins=list(s)))([x] * (depth - 1), o, x, *mb)
    jaxpr, _ = open_jaxpr(closed)
    read = {v for e in jaxpr.eqns for v in e.invars if not isinstance(v, jc.Literal)}
    read.update(v for v in jaxpr.outvars if not isinstance(v, jc.Literal))
    bad = [i for i, v in enumerate(jaxpr.invars[:depth - 1]) if v in read]
    if bad:
        raise ValueError(f"TrainStep: the model reads the output of pipelined block {bad[0]} outside the chain of "
                         "blocks (a residual across blocks, a block's output returned); a pipelined model passes "
                         "each block's output to the next block only, and reads the last one's")


def _starts(keypath: tuple, prefix: tuple) -> bool:
    names = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in keypath)
    return names[:len(prefix)] == prefix


class _Reached(Exception):
    """Raised at the first block's call while the part before the blocks is traced: its input is that part's
    result."""

    def __init__(self, x):
        super().__init__("the first pipelined block was reached")
        self.x = x


class _Tape:
    """What the blocks do while ``value_and_grad`` traces the model: stop at the first (``"before"``), or stand
    aside (``"after"``: block ``L-1`` returns the pipeline's output ``out``, the others stand-ins that nothing may
    read), checking that the blocks are called in order, once each, each on the previous one's output."""

    def __init__(self, mode: str, depth: int, out: Any = None, standins: list | None = None):
        self.mode, self.depth, self.out, self.standins = mode, depth, out, standins
        self.calls, self.last = 0, None

    def call(self, i: int, x, args, kwargs):
        if args or kwargs:
            raise TypeError(f"TrainStep: pipelined block {i} is called with more than its input; a pipelined block "
                            "takes one array (the previous block's output) and returns one like it")
        if self.mode == "before":
            if i != 0:
                raise ValueError(f"TrainStep: the model calls pipelined block {i} first; blocks run in order from 0")
            raise _Reached(x)
        if i != self.calls or (i > 0 and x is not self.last):
            how = "out of order" if i != self.calls else f"on a value other than block {i - 1}'s output"
            raise ValueError(f"TrainStep: the pipelined blocks must form one chain, x = block(x) for each block in "
                             f"order, once each, nothing computed between them; block {i} was called {how}")
        self.calls += 1
        self.last = self.out if i == self.depth - 1 else self.standins[i]
        return self.last

    def check_chain(self) -> None:
        if self.calls != self.depth:
            raise ValueError(f"TrainStep: the model called {self.calls} of its {self.depth} pipelined "
                             "blocks; a pipelined model runs every block once, in order")


_TAPE: contextvars.ContextVar[_Tape | None] = contextvars.ContextVar("jshard_pipeline_tape", default=None)


@contextlib.contextmanager
def _taping(tape: _Tape):
    token = _TAPE.set(tape)
    try:
        yield
    finally:
        _TAPE.reset(token)
