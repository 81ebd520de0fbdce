"""Training a parallelized NNX model with optax: every step keeps parameters and optimizer state in place.

``init_optimizer(tx, params)`` places each optimizer-state subtree that mirrors the parameters (Adam's
``mu`` and ``nu``, momentum) like the parameters and everything else (step counts) replicated.
``TrainStep(model, tx, loss_fn)`` is one ``jshard.jit`` program per step: forward, gradients, optimizer
update. Gradients are pinned to their parameters' placements (a data-parallel gradient is all-reduced once per
parameter, an FSDP one reduce-scattered), so the update runs where the parameters and optimizer state live;
both keep their placements and their storage is donated. The rest of the model's state (``nnx.Rngs``' keys
and counts: dropout) goes through the step too and comes back updated, so every step draws fresh masks.

Arguments are checked before any work: a model that was never parallelized, an optax factory passed
uncalled (``optax.adamw`` for ``optax.adamw(1e-3)``), a loss that is not a float scalar (checked while the
first step traces, before it runs) are errors that say so.

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
import jax.numpy as jnp
import optax
from flax import nnx

from ..api import constrain, jit, same_as
from ..arguments import is_darray
from ..cost import CostModel
from ..darray import DArray
from ..explanation import Explanation
from ..placements import Replicate
from ..planner import check_cost_model
from .parallelize import holds_darray, kind_of, placements_of

__all__ = ["TrainStep", "init_optimizer"]


def init_optimizer(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` with every subtree shaped like ``params`` placed like it, the rest Replicate.
    ``params``: DArrays, say ``nnx.state(model, nnx.Param)`` of a parallelized model."""
    _check_tx(tx, "init_optimizer")
    if isinstance(params, nnx.Module):
        raise TypeError("init_optimizer: params is a whole nnx.Module; pass its parameters, "
                        "nnx.state(model, nnx.Param)")
    if not holds_darray(params):
        raise ValueError(f"init_optimizer: params ({kind_of(params)}) hold no DArray; pass the parameters of a "
                         "parallelized model, nnx.state(parallelize(model, mesh, plan), nnx.Param)")
    return jit(tx.init, out_placements=_mirror(tx.init, params))(params)


class TrainStep:
    """One training step of ``model`` (parallelized) with ``tx``: ``loss_fn(model, *batch) -> scalar``.

    Call it with a batch (DArrays, arrays) to take a step; it returns the loss (a replicated DArray).
    ``.model`` is the model with the current parameters, ``.explain(*batch)`` the plan of a step.
    ``cost_model`` prices the step's plan, as in ``jshard.jit``.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable, *,
                 donate: bool = True, cost_model: CostModel | None = None):
        if not isinstance(model, nnx.Module):
            raise TypeError("TrainStep: model must be a Flax nnx.Module made parallel by jshard.parallel.parallelize, "
                            f"got {kind_of(model)}")
        _check_tx(tx, "TrainStep")
        if not callable(loss_fn):
            raise TypeError(f"TrainStep: loss_fn must be a function loss_fn(model, *batch) -> scalar loss, got "
                            f"{type(loss_fn).__name__} {loss_fn!r}")
        if not isinstance(donate, bool):
            raise TypeError(f"TrainStep: donate must be True or False, got {donate!r}")
        if cost_model is not None:
            check_cost_model(cost_model, "TrainStep")
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        if not holds_darray(self.params):
            raise ValueError(f"TrainStep: the parameters of {type(model).__name__} are not DArrays: the model was not "
                             "parallelized; call jshard.parallel.parallelize(model, mesh, plan) first")
        self.opt_state = init_optimizer(tx, self.params)
        graphdef = self.graphdef
        # gradients land on their parameters' placements at once (one all-reduce per replicated parameter, one
        # reduce-scatter per sharded one), so the optimizer's elementwise update needs no communication
        grad_placements = jax.tree.leaves(placements_of(self.params), is_leaf=lambda p: isinstance(p, tuple))

        def step(params, opt_state, rest, *batch):
            def loss_of(p):
                # fresh Variables at this trace level: the forward pass may update them (RNG counts), and Flax
                # refuses updates to Variables made outside the gradient's trace
                m = nnx.merge(graphdef, p, rest, copy=True)
                loss = loss_fn(m, *batch)
                _check_loss(loss, loss_fn)
                return loss, nnx.split(m, nnx.Param, ...)[2]  # state the forward pass updated (RNG counts)

            (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
            leaves, tree = jax.tree.flatten(grads)
            grads = jax.tree.unflatten(tree, [constrain(g, p) for g, p in zip(leaves, grad_placements)])
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, rest, loss

        mesh_rank = next(filter(is_darray, jax.tree.leaves(self.params, is_leaf=is_darray))).mesh.devices.ndim
        self._step = jit(step, out_placements=(same_as(0), same_as(1), None, (Replicate(),) * mesh_rank),
                         donate_argnums=(0, 1) if donate else (), cost_model=cost_model)

    def __call__(self, *batch) -> DArray:
        self.params, self.opt_state, self.rest, loss = self._step(self.params, self.opt_state, self.rest, *batch)
        return loss

    @property
    def state(self) -> dict[str, Any]:
        """Everything a step carries from one call to the next: ``{"params", "opt_state", "rest"}``. Save it with
        ``jshard.checkpoint.save(directory, step.state)``; resume with
        ``step.state = jshard.checkpoint.restore(directory, like=step.state)``, under this step's placements
        whatever the saved ones were."""
        return {"params": self.params, "opt_state": self.opt_state, "rest": self.rest}

    @state.setter
    def state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"params", "opt_state", "rest"}:
            raise TypeError("TrainStep.state: expected a dict with keys params, opt_state and rest (what .state "
                            f"returns), got {kind_of(state)}")
        for name, new in state.items():
            old = getattr(self, name)
            got, want = jax.tree.structure(new, is_leaf=is_darray), jax.tree.structure(old, is_leaf=is_darray)
            if got != want:
                raise ValueError(f"TrainStep.state: {name} has another structure than this step's ({got} vs {want}); "
                                 "restore with like=step.state")
            for a, b in zip(jax.tree.leaves(new, is_leaf=is_darray), jax.tree.leaves(old, is_leaf=is_darray)):
                if is_darray(b) and (not is_darray(a) or a.spec != b.spec):
                    raise ValueError(f"TrainStep.state: a leaf of {name} is {a!r} where this step holds {b!r}; "
                                     "restore with like=step.state, which gives this step's placements")
        self.params, self.opt_state, self.rest = state["params"], state["opt_state"], state["rest"]

    @property
    def model(self) -> Any:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def explain(self, *batch) -> Explanation:
        return self._step.explain(self.params, self.opt_state, self.rest, *batch)

    def lower(self, *batch) -> Any:
        return self._step.lower(self.params, self.opt_state, self.rest, *batch)


def _check_tx(tx: Any, where: str) -> None:
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return
    # optax.adamw rather than optax.adamw(1e-3): the factory, not the transformation
    fix = f"; call it: {tx.__name__}(learning_rate)" if callable(tx) and hasattr(tx, "__name__") else ""
    raise TypeError(f"{where}: tx must be an optax.GradientTransformation (say optax.adamw(1e-3)), got "
                    f"{kind_of(tx)}{fix}")


def _check_loss(loss: Any, loss_fn: Callable) -> None:
    """The loss must be a float scalar: a gradient needs one number (and TrainStep takes no aux outputs)."""
    if getattr(loss, "shape", None) == () and jnp.issubdtype(loss.dtype, jnp.floating):
        return
    got = f"{loss.dtype}{list(loss.shape)}" if hasattr(loss, "shape") else type(loss).__name__
    raise TypeError(f"TrainStep: loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!s} returned {got}; it must "
                    "return the loss alone, a float scalar (reduce it, say with jnp.mean)")


def _mirror(init: Callable, params: Any) -> Any:
    """Output pins for ``init(params)``: subtrees with the structure of ``params`` take their placements."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params, is_leaf=is_darray)
    shapes = jax.eval_shape(init, avals)
    structure = jax.tree.structure(avals)
    placements = jax.tree.leaves(placements_of(params), is_leaf=lambda p: isinstance(p, tuple))
    rank = len(placements[0]) if placements else 0

    def pin(node):
        if jax.tree.structure(node) == structure:
            return jax.tree.unflatten(structure, placements)
        return (Replicate(),) * rank

    return jax.tree.map(pin, shapes, is_leaf=lambda n: jax.tree.structure(n) == structure)
