"""A model's identical blocks as pipeline stages: stacked along one mesh axis, run by the schedule in ``TrainStep``.

``parallelize(make, mesh, {"blocks": PipelineParallel("pp", microbatches=8)})`` replaces the list of blocks at
``blocks`` by a ``Pipelined`` module: one block's module whose parameters hold every block's, stacked along a new
dim 0 and split along the pipeline axis (stage ``s`` of ``p`` holds blocks ``s*L/p ... (s+1)*L/p - 1``). The
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
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..darray import DArray
from ..jaxcompat import jc, open_jaxpr, source_info_util
from ..placements import Replicate, shift_dims
from .pipeline import pipeline_value_and_grad, split_placement

__all__ = ["Pipelined", "find_pipelined", "stacked_placements", "value_and_grad"]

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
        return tape.call(self.owner, self.i, x, args, kwargs)


def find_pipelined(model: nnx.Module) -> list[tuple[tuple, Pipelined]]:
    """The ``Pipelined`` modules inside ``model``, with their paths."""
    return [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, Pipelined)]


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


# -- the step -----------------------------------------------------------------------------------------------------

def value_and_grad(graphdef: Any, loss_fn: Callable, params: Any, rest: Any, batch: tuple, *, path: tuple,
                   pipelined: Pipelined) -> tuple[tuple[Any, Any], Any]:
    """``((loss, rest), grads)`` of ``loss_fn(model, *batch)`` as ``jax.value_and_grad(..., has_aux=True)`` gives
    them in ``TrainStep``, taken by ``pipelined``'s schedule (see the module's docstring)."""
    style = pipelined.style
    m = style.microbatches
    leaves, batch_tree = jax.tree.flatten(batch)
    for a in leaves:
        if np.ndim(a) < 1 or a.shape[0] % m:
            raise ValueError(f"TrainStep: {style.label} cuts the batch into {m} microbatches along dim 0, and a batch "
                             f"input has shape {tuple(np.shape(a))}; use a batch size that is a multiple of {m}")
    # microbatch i takes rows i, i + m, i + 2m, ...: a batch sharded over data-parallel devices stays sharded in
    # every microbatch (contiguous rows would put whole microbatches on one device)
    micro = [jnp.swapaxes(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 0, 1) for a in leaves]
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    inside = [_starts(p, path + ("layers",)) for p, _ in flat]
    stacked = [v for (_, v), i in zip(flat, inside, strict=True) if i]
    other = [v for (_, v), i in zip(flat, inside, strict=True) if not i]
    block_graphdef = nnx.graphdef(pipelined.layers)
    block_tree = jax.tree.structure(nnx.state(pipelined.layers, nnx.Param), is_leaf=lambda a: isinstance(a, DArray))

    def model_with(o):
        return nnx.merge(graphdef, jax.tree.unflatten(tree, _interleave(inside, stacked, o)), rest, copy=True)

    def before(o, *mb):
        tape = _Tape("before", pipelined)
        with _taping(tape):
            try:
                loss_fn(model_with(o), *jax.tree.unflatten(batch_tree, mb))
            except _Reached as r:
                return r.x
        raise ValueError(f"TrainStep: loss_fn never called the pipelined blocks at {'/'.join(map(str, path))}; "
                         "the model must run them, for block in self.blocks: x = block(x)")

    def layer(lp, x):
        return nnx.merge(block_graphdef, jax.tree.unflatten(block_tree, lp))(x)

    def tail(o, x, *mb, standins=None):
        tape = _Tape("after", pipelined, x, standins or [jnp.zeros_like(x)] * (pipelined.depth - 1))
        with _taping(tape):
            loss = loss_fn(model_with(o), *jax.tree.unflatten(batch_tree, mb))
        tape.check_chain()
        return loss

    x0, pull = jax.vjp(lambda o: jax.vmap(lambda *mb: before(o, *mb))(*micro), other)
    _check_standins(tail, other, micro, x0, pipelined.depth)
    loss, (d_stacked, d_other, dx0) = pipeline_value_and_grad(
        layer, tail, stacked, other, x0, tuple(micro), axis=style.axis, schedule=style.schedule,
        virtual_stages=style.virtual_stages)
    (d_before,) = pull(dx0)
    d_other = [a + b for a, b in zip(d_other, d_before, strict=True)]
    return (loss, rest), jax.tree.unflatten(tree, _interleave(inside, d_stacked, d_other))


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

    def __init__(self, mode: str, pipelined: Pipelined, out: Any = None, standins: list | None = None):
        self.mode, self.pipelined, self.out, self.standins = mode, pipelined, out, standins
        self.calls, self.last = 0, None

    def call(self, owner: Pipelined, i: int, x, args, kwargs):
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
        self.last = self.out if i == owner.depth - 1 else self.standins[i]
        return self.last

    def check_chain(self) -> None:
        if self.calls != self.pipelined.depth:
            raise ValueError(f"TrainStep: the model called {self.calls} of its {self.pipelined.depth} pipelined "
                             "blocks; a pipelined model runs every block once, in order")


_TAPE: contextvars.ContextVar[_Tape | None] = contextvars.ContextVar("jshard_pipeline_tape", default=None)


@contextlib.contextmanager
def _taping(tape: _Tape):
    token = _TAPE.set(tape)
    try:
        yield
    finally:
        _TAPE.reset(token)
