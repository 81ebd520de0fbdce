"""Training a parallelized NNX model with optax: every step keeps parameters and optimizer state in place.

``init_optimizer(tx, params)`` places each optimizer-state subtree that mirrors the parameters (Adam's
``mu`` and ``nu``, momentum) like the parameters and everything else (step counts) replicated.
``TrainStep(model, tx, loss_fn)`` is one ``jshard.jit`` program per step: forward, gradients, optimizer
update. Gradients are pinned to their parameters' placements (a data-parallel gradient is all-reduced once per
parameter, an FSDP one reduce-scattered), so the update runs where the parameters and optimizer state live;
both keep their placements and their storage is donated.

>>> import jax, jax.numpy as jnp, numpy as np, optax, jshard
>>> from flax import nnx
>>> from jshard.parallel import ColwiseParallel, TrainStep, parallelize
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> model = parallelize(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), mesh, {"": ColwiseParallel("tp")})
>>> step = TrainStep(model, optax.sgd(0.1), lambda m, x: jnp.mean(m(x) ** 2))
>>> x = jshard.distribute(np.ones((8, 4), np.float32), mesh, [jshard.Shard(0), jshard.Replicate()])
>>> float(step(x)) > float(step(x))
True
>>> step.model.kernel.get_value().placements
(R, S(1))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from ..api import Explanation, constrain, jit, same_as
from ..darray import DArray
from ..placements import Replicate
from .parallelize import placements_of

__all__ = ["TrainStep", "init_optimizer"]


def init_optimizer(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` with every subtree shaped like ``params`` placed like it, the rest Replicate."""
    return jit(tx.init, out_placements=_mirror(tx.init, params))(params)


class TrainStep:
    """One training step of ``model`` (parallelized) with ``tx``: ``loss_fn(model, *batch) -> scalar``.

    Call it with a batch (DArrays, arrays) to take a step; it returns the loss (a replicated DArray).
    ``.model`` is the model with the current parameters, ``.explain(*batch)`` the plan of a step.
    """

    def __init__(self, model: Any, tx: optax.GradientTransformation, loss_fn: Callable, *, donate: bool = True):
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.opt_state = init_optimizer(tx, self.params)
        graphdef = self.graphdef
        # gradients land on their parameters' placements at once (one all-reduce per replicated parameter, one
        # reduce-scatter per sharded one), so the optimizer's elementwise update needs no communication
        grad_placements = jax.tree.leaves(placements_of(self.params), is_leaf=lambda p: isinstance(p, tuple))

        def step(params, opt_state, rest, *batch):
            def loss_of(p):
                m = nnx.merge(graphdef, p, rest)
                loss = loss_fn(m, *batch)
                return loss, nnx.split(m, nnx.Param, ...)[2]  # state the forward pass updated (RNG counts)

            (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            leaves, tree = jax.tree.flatten(grads)
            grads = jax.tree.unflatten(tree, [constrain(g, p) for g, p in zip(leaves, grad_placements)])
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, rest, loss

        mesh_rank = next(a for a in jax.tree.leaves(self.params, is_leaf=_is_darray) if _is_darray(a)).mesh.devices.ndim
        self._step = jit(step, out_placements=(same_as(0), same_as(1), None, (Replicate(),) * mesh_rank),
                         donate_argnums=(0, 1) if donate else ())

    def __call__(self, *batch) -> DArray:
        self.params, self.opt_state, self.rest, loss = self._step(self.params, self.opt_state, self.rest, *batch)
        return loss

    @property
    def model(self) -> Any:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def explain(self, *batch) -> Explanation:
        return self._step.explain(self.params, self.opt_state, self.rest, *batch)

    def lower(self, *batch) -> Any:
        return self._step.lower(self.params, self.opt_state, self.rest, *batch)


def _is_darray(a) -> bool:
    return isinstance(a, DArray)


def _mirror(init: Callable, params: Any) -> Any:
    """Output pins for ``init(params)``: subtrees with the structure of ``params`` take their placements."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params, is_leaf=_is_darray)
    shapes = jax.eval_shape(init, avals)
    structure = jax.tree.structure(avals)
    placements = jax.tree.leaves(placements_of(params), is_leaf=lambda p: isinstance(p, tuple))
    rank = len(placements[0]) if placements else 0

    def pin(node):
        if jax.tree.structure(node) == structure:
            return jax.tree.unflatten(structure, placements)
        return (Replicate(),) * rank

    return jax.tree.map(pin, shapes, is_leaf=lambda n: jax.tree.structure(n) == structure)
