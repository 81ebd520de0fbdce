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

import functools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ..api import constrain, jit, same_as
from ..arguments import is_darray
from ..caches import Cache, memo
from ..cost import CostModel
from ..darray import DArray, distribute
from ..engine import Program
from ..explanation import Explanation
from ..placements import Replicate
from ..planner import check_cost_model
from ..spec import Spec
from .parallelize import holds_darray, kind_of, placements_of
from .pipeline import MERGES
from .stages import carried, unmerged

__all__ = ["TrainStep", "check_tx", "init_optimizer", "mirror_placements", "step_function"]

GRADIENT_PINS = "jshard_gradient_pins"  # the named scope of a step's constraints of its gradients, one per parameter


def init_optimizer(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` with every subtree shaped like ``params`` placed like it, the rest Replicate.
    ``params``: DArrays, say ``nnx.state(model, nnx.Param)`` of a parallelized model."""
    check_tx(tx, "init_optimizer")
    if isinstance(params, nnx.Module):
        raise TypeError("init_optimizer: params is a whole nnx.Module; pass its parameters, "
                        "nnx.state(model, nnx.Param)")
    if not holds_darray(params):
        raise ValueError(f"init_optimizer: params ({kind_of(params)}) hold no DArray; pass the parameters of a "
                         "parallelized model, nnx.state(parallelize(model, mesh, plan), nnx.Param)")
    return jit(tx.init, out_placements=mirror_placements(tx.init, params))(params)


class TrainStep:
    """One training step of ``model`` (parallelized) with ``tx``: ``loss_fn(model, *batch) -> scalar``.

    Call it with a batch (DArrays, arrays) to take a step; it returns the loss (a replicated DArray).
    ``.model`` is the model with the current parameters, ``.explain(*batch)`` the plan of a step.
    ``cost_model`` prices the step's plan, as in ``jshard.jit``.

    From one step to the next the state stays as the program left it, its output blocks, which the next step
    takes as they are: a step costs one dispatch, with no Python per parameter. ``.params``, ``.opt_state``,
    ``.rest``, ``.state`` and ``.model`` build their trees when read; a step after a read takes the trees again,
    so a change made to them in place counts.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable, *,
                 donate: bool = True, cost_model: CostModel | None = None):
        if not isinstance(model, nnx.Module):
            raise TypeError("TrainStep: model must be a Flax nnx.Module made parallel by jshard.parallel.parallelize, "
                            f"got {kind_of(model)}")
        check_tx(tx, "TrainStep")
        if not callable(loss_fn):
            raise TypeError(f"TrainStep: loss_fn must be a function loss_fn(model, *batch) -> scalar loss, got "
                            f"{type(loss_fn).__name__} {loss_fn!r}")
        if not isinstance(donate, bool):
            raise TypeError(f"TrainStep: donate must be True or False, got {donate!r}")
        if cost_model is not None:
            check_cost_model(cost_model, "TrainStep")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        self.graphdef = graphdef
        if not holds_darray(params):
            raise ValueError(f"TrainStep: the parameters of {type(model).__name__} are not DArrays: the model was not "
                             "parallelized; call jshard.parallel.parallelize(model, mesh, plan) first")
        # the carried state: (params, opt_state, rest) as trees, and (tree, blocks) as the last step left it while
        # no one has read the trees since (one of them may be None); see __call__
        self._state: tuple | None = (params, init_optimizer(tx, params), _replicated(rest, params))
        self._flat: tuple | None = None
        # under key 0, the _Hot of the last step: forgotten by jshard.clear_caches(), as the step's programs are
        self._hot = Cache(1)
        hooks = step_hooks(model)
        if hooks:
            # a pipeline's microbatches would draw the same dropout masks, step after step: refused, not wrong;
            # its blocks' state that says how microbatches merge it (a mixture's balancing) is carried
            (path, hook, _), = hooks
            prefix = path + getattr(hook, "stack", ())
            variables = carried(model)
            outside = [(p, v) for p, v in variables if p[:len(prefix)] != prefix]
            bad = next((v for _, v in outside), None) if outside else unmerged(variables)
            if bad is not None:
                raise ValueError(f"TrainStep: {type(model).__name__} takes its step by {hook.label} and holds state "
                                 f"besides its parameters ({type(bad).__name__}: RNG streams for dropout, batch "
                                 "statistics), which such a step does not carry; keep that state out of the model "
                                 f"(pass rngs to the layers that draw) or train it without {hook.label}. A pipelined "
                                 f"block's own state is carried where its Variable says merge= one of {MERGES}")
        self._step = step_function(model, tx, loss_fn, donate=donate, cost_model=cost_model)

    def __call__(self, *batch) -> DArray:
        # the steady state: the last step's output blocks go straight back in, as flat as the program takes them;
        # nothing flattens the model's state or wraps it in DArrays and Variables again until someone reads it
        hot, flat = self._hot.get(0), self._flat
        if hot is not None and flat is not None:
            leaves, tree = jax.tree.flatten(batch)
            if tree == hot.batch_tree and tuple(map(_SPEC, leaves)) == hot.batch_specs:
                out = hot.program.run(flat[2] + list(map(_BLOCK, leaves)))
                self._state, self._flat = None, (flat[0], flat[1], out[:-1])
                return DArray(out[-1], hot.loss_spec)
        args = (*self._exposed(), *batch)
        *state, loss = self._step(*args)
        self._state = tuple(state)
        # the path above is this same call where the step's state comes out as it went in (placements, tree): the
        # same program, by the same key
        program = self._step.steady(*args)
        leaves, tree = jax.tree.flatten(self._state)
        specs = tuple(getattr(a, "spec", None) for a in leaves)
        if program is not None and (tree, specs) == _tree_and_specs(args[:3]):
            batch_leaves, batch_tree = jax.tree.flatten(batch)
            self._hot.put(0, _Hot(program, batch_tree, tuple(map(_SPEC, batch_leaves)), program.out_specs[-1]))
            self._flat = (tree, specs, list(map(_BLOCK, leaves)))
        return loss

    def _exposed(self) -> tuple:
        """The carried state as trees, built from the blocks if need be. Whoever gets them may change them in place
        (a Variable's value), so the next step reads them again rather than the blocks."""
        if self._state is None:
            tree, specs, blocks = self._flat
            self._state = jax.tree.unflatten(tree, [DArray(b, s) for b, s in zip(blocks, specs, strict=True)])
        self._flat = None
        return self._state

    @property
    def params(self) -> Any:
        return self._exposed()[0]

    @params.setter
    def params(self, params: Any) -> None:
        self._state = (params, *self._exposed()[1:])

    @property
    def opt_state(self) -> Any:
        return self._exposed()[1]

    @opt_state.setter
    def opt_state(self, opt_state: Any) -> None:
        params, _, rest = self._exposed()
        self._state = (params, opt_state, rest)

    @property
    def rest(self) -> Any:
        return self._exposed()[2]

    @rest.setter
    def rest(self, rest: Any) -> None:
        self._state = (*self._exposed()[:2], rest)

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
            for a, b in zip(jax.tree.leaves(new, is_leaf=is_darray), jax.tree.leaves(old, is_leaf=is_darray),
                            strict=True):
                if is_darray(b) and (not is_darray(a) or a.spec != b.spec):
                    raise ValueError(f"TrainStep.state: a leaf of {name} is {a!r} where this step holds {b!r}; "
                                     "restore with like=step.state, which gives this step's placements")
        self._state = (state["params"], state["opt_state"], state["rest"])

    @property
    def model(self) -> Any:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def explain(self, *batch) -> Explanation:
        return self._step.explain(self.params, self.opt_state, self.rest, *batch)

    def lower(self, *batch) -> Any:
        return self._step.lower(self.params, self.opt_state, self.rest, *batch)


class _Hot(NamedTuple):
    """A step whose state comes out as it went in: its program, the batch's tree and its DArrays' specs, and the
    loss's spec."""

    program: Program
    batch_tree: Any
    batch_specs: tuple[Spec, ...]
    loss_spec: Spec


_SPEC, _BLOCK = operator.attrgetter("spec"), operator.attrgetter("block")


def _replicated(rest: Any, params: Any) -> Any:
    """The model's other state with its plain numeric arrays (a mixture's balancing bias) replicated DArrays on the
    parameters' mesh, as the step gives them back: the second step then runs the first one's program."""
    mesh = next(filter(is_darray, jax.tree.leaves(params, is_leaf=is_darray))).mesh

    def placed(a):
        if isinstance(a, (jax.Array, np.ndarray)) and not _is_key(a):
            return distribute(a, mesh, [Replicate()] * len(mesh.axis_names))
        return a

    return jax.tree.map(placed, rest)


def _is_key(a: Any) -> bool:
    return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)


def step_hooks(model: nnx.Module) -> list[tuple[tuple, Any, nnx.Module]]:
    """The module inside ``model`` that takes the step's loss and gradients itself, as ``(path, hook, module)``:
    one whose ``jshard_step`` a restructuring style installed (``PipelineParallel``'s ``stages.PipelineStep``,
    whose ``value_and_grad`` runs the schedule). A model has one at most."""
    found = [(tuple(path), node.jshard_step, node) for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Module) and getattr(node, "jshard_step", None) is not None]
    if len(found) > 1:
        raise ValueError(f"TrainStep: the model takes its step by {len(found)} modules ("
                         f"{', '.join(h.label + ' at ' + '/'.join(map(str, p)) for p, h, _ in found)}); a model has "
                         "one pipeline")
    return found


def _tree_and_specs(tree: Any) -> tuple[Any, tuple]:
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple(getattr(a, "spec", None) for a in leaves)


def step_function(model: nnx.Module, tx: optax.GradientTransformation, loss_fn: Callable, *, donate: bool = True,
                  cost_model: CostModel | None = None) -> Any:
    """The ``jshard.jit`` function of one training step of a parallelized ``model``:
    ``(params, opt_state, rest, *batch) -> (params, opt_state, rest, loss)``. ``TrainStep`` runs it;
    ``autoplan`` traces it on parameters that hold only specs, to price a plan without building it."""
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    # gradients land on their parameters' placements at once (one all-reduce per replicated parameter, one
    # reduce-scatter per sharded one), so the optimizer's elementwise update needs no communication; pinned by
    # axis name, so the step's jaxpr is the same whatever the order of the mesh's axes (autoplan shares it)
    names = next(filter(is_darray, jax.tree.leaves(params, is_leaf=is_darray))).mesh.axis_names
    grad_placements = [dict(zip(names, p, strict=True))
                       for p in jax.tree.leaves(placements_of(params), is_leaf=lambda p: isinstance(p, tuple))]
    hooks = step_hooks(model)

    def step(params, opt_state, rest, *batch):
        def loss_of(p):
            # fresh Variables at this trace level: the forward pass may update them (RNG counts), and Flax
            # refuses updates to Variables made outside the gradient's trace
            m = nnx.merge(graphdef, p, rest, copy=True)
            loss = loss_fn(m, *batch)
            _check_loss(loss, loss_fn)
            return loss, nnx.split(m, nnx.Param, ...)[2]  # state the forward pass updated (RNG counts)

        if hooks:
            (path, hook, module), = hooks
            (loss, rest), grads = hook.value_and_grad(graphdef, loss_fn, params, rest, batch, path=path, module=module)
        else:
            (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        leaves, tree = jax.tree.flatten(grads)
        with jax.named_scope(GRADIENT_PINS):  # autoplan finds them by it (it pins them per candidate)
            grads = jax.tree.unflatten(tree, [constrain(g, p) for g, p in zip(leaves, grad_placements, strict=True)])
        params, opt_state = update(grads, opt_state, params)
        # the other state back replicated, as it came in (a mixture's load is a pending sum): the next step runs
        # this step's program
        rest = jax.tree.map(lambda a: a if _is_key(a) else constrain(a, (Replicate(),) * len(names)), rest)
        return params, opt_state, rest, loss

    update = _update(tx)

    return jit(step, out_placements=(same_as(0), same_as(1), None, (Replicate(),) * len(names)),
               donate_argnums=(0, 1) if donate else (), cost_model=cost_model)


def _update(tx: optax.GradientTransformation) -> Callable:
    """``tx``'s update applied: ``(grads, opt_state, params) -> (params, opt_state)``. A ``jax.jit`` function, one per
    ``tx``, whenever ``tx`` hashes: its equations are the same under every plan (they see global shapes; the
    gradients are pinned before), so JAX traces them once and every step traced with ``tx`` (``autoplan`` prices
    dozens) reuses them; the engine plans its equations inline, as if there were no ``jit``."""
    try:
        return _jitted_update(tx)
    except TypeError:  # an unhashable transformation: traced with each step
        return functools.partial(_apply, tx)


@memo(64)
def _jitted_update(tx: optax.GradientTransformation) -> Callable:
    return jax.jit(functools.partial(_apply, tx))


def _apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def check_tx(tx: Any, where: str) -> None:
    """Refuse, naming ``where``, a ``tx`` that is no optax transformation (the factory ``optax.adamw`` passed for
    ``optax.adamw(1e-3)`` says so)."""
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


def mirror_placements(init: Callable, params: Any) -> Any:
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
