"""Pipeline parallelism: a deep model's identical layers split into stages along one mesh axis, microbatches flowing
stage to stage, forward and backward passes interleaved by a schedule, all inside the step's one program.

``pipeline_value_and_grad(layer, tail, stacked, other, x0, side, axis=..., schedule=...)`` is the mean over
microbatches ``i`` of ``tail(other, layer(stacked[L-1], ... layer(stacked[0], x0[i])), *side[i])`` with its
gradients: with respect to ``stacked`` (every layer's parameters, stacked along a leading dim of length ``L``),
``other`` and ``x0``. It binds one equation, ``jshard_pipeline``, which the engine plans like a loop:

- ``stacked`` lies split along ``axis`` (``Shard(0)``: device ``d`` of the axis holds layers
  ``d*L/p ... (d+1)*L/p - 1``, ``L/p`` rounded up where ``p`` does not divide ``L``, the last stages holding fewer;
  with ``v`` virtual stages ``StridedShard(0, v)``, chunks of ``L/(p*v)`` layers dealt round-robin); everything
  else is replicated along ``axis``, placed freely on the other axes;
- one layer's forward, its backward and the tail's value and gradient are jaxprs of their own, planned on the
  mesh without ``axis`` (``jshard.constrain`` inside them names the other axes alone), so tensor, data or sequence
  parallelism runs inside every stage. The forward unit returns the residuals of the layer's vjp that depend on
  its input, which the stage keeps per microbatch in flight until the backward unit reads them. By default
  (``remat``) the layer runs under ``jax.checkpoint``, so its residual is its input and its forward runs once more
  in the backward unit; without, every residual is kept and each layer's forward runs once per microbatch, as
  ``jax.grad`` runs it. Residuals made from the parameters alone (a weight cast to the compute dtype) are made
  again in the backward unit, never kept per microbatch;
- the local kernel is a loop over the schedule's ticks (``jshard.parallel.schedule``): per tick every device runs
  the forward unit and the backward unit the tables give it (``lax.cond``: an idle device computes nothing), then
  sends its activation one stage on and its input gradient one stage back (two ``ppermute``\\ s, each over only the
  pairs of stages that move something on that tick: a ``lax.switch`` between the few sets of pairs the schedule
  uses, so ramping up and down sends no zeros).

The loss and the tail's gradients come out ``Partial(sum)`` along ``axis`` (the last stage computed them), the
input gradient too (the first stage did); the stacked gradients lie like the parameters.

>>> import jax, jax.numpy as jnp, numpy as np, jshard
>>> mesh = jax.make_mesh((4,), ("pp",))
>>> w = jshard.distribute(np.full((8, 3, 3), 0.5, np.float32), mesh, [jshard.Shard(0)])  # 8 layers, 2 a stage
>>> x0 = jshard.distribute(np.ones((4, 2, 3), np.float32), mesh, [jshard.Replicate()])  # 4 microbatches
>>> def run(w, x0):
...     return pipeline_value_and_grad(lambda lw, x: jnp.tanh(x @ lw), lambda o, x: jnp.mean(x ** 2), w, (), x0,
...                                    (), axis="pp", schedule="1f1b")
>>> loss, (gw, go, gx) = jshard.jit(run)(w, x0)
>>> x = np.ones((2, 3))
>>> for _ in range(8):
...     x = np.tanh(x @ np.full((3, 3), 0.5))
>>> bool(np.isclose(float(loss.full()), np.mean(x ** 2))), gw.placements
(True, (S(0),))
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from ..cost import Communication
from ..engine.constrain import constrain_p, hidden_axis
from ..engine.kernel import local_function
from ..engine.program import tracing_mesh
from ..engine.walk import Body, control, move_cost, plan_jaxpr
from ..jaxcompat import flattened, jc, mlir, open_jaxpr, pruned, run_equations, source_info_util
from ..placements import Partial, Placement, Replicate, Shard, StridedShard, shift_dims
from ..planner import model_in_force
from ..propagate import Choice
from ..rules.elementwise import ELEMENTWISE
from ..rules.registry import Rule
from ..spec import Spec, format_mesh
from .schedule import SCHEDULES, make_schedule

__all__ = ["MERGES", "pipeline_p", "pipeline_value_and_grad", "split_placement", "value_and_grad_read"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))

MERGES = ("sum", "last")  # how a layer's state, left by each microbatch's call, merges over the step


def pipeline_value_and_grad(layer: Callable, tail: Callable, stacked: Any, other: Any, x0: Any, side: Any, *,
                            axis: str, schedule: str = "1f1b", virtual_stages: int = 1, remat: bool = True,
                            whole: tuple[str, ...] = ()) -> tuple[Any, tuple]:
    """``(loss, (d stacked, d other, d x0))``: the mean over microbatches of the pipeline's loss, and its gradients.

    ``layer(layer_params, x) -> y`` is one layer (``layer_params`` shaped like ``stacked`` without its leading
    dim; ``y`` like ``x``); ``tail(other, x, *side_i) -> loss`` takes the last layer's output of microbatch ``i``;
    ``x0`` stacks the microbatches' inputs ``[m, ...]`` and ``side`` (a tuple of arrays ``[m, ...]``) what the
    tail reads of each; ``remat`` (default): each layer keeps its input alone and runs its forward again in its
    backward unit (``jax.checkpoint``), else it keeps every residual its backward reads (no forward run again, a
    stage's memory its layers' activations for every microbatch in flight); ``whole``: mesh axes along which
    ``stacked`` and ``other`` enter the pipeline whole (a sharded parameter gathered once, its gradient reduced once
    after the last microbatch; ``PipelineParallel``'s). Call it inside ``jshard.jit`` (or ``TrainStep``); see the
    module's docstring.
    """
    loss, d_stacked, d_other, dx0, _ = value_and_grad_read(layer, tail, stacked, other, x0, side, axis=axis,
                                                           schedule=schedule, virtual_stages=virtual_stages,
                                                           remat=remat, whole=whole)
    leaves, o_tree = jax.tree.flatten(other)
    d_other = [jnp.zeros_like(a) if d is None else d for a, d in zip(leaves, d_other, strict=True)]
    return loss, (d_stacked, jax.tree.unflatten(o_tree, d_other), dx0)


def value_and_grad_read(layer: Callable, tail: Callable, stacked: Any, other: Any, x0: Any, side: Any, *,
                        axis: str, schedule: str = "1f1b", virtual_stages: int = 1, remat: bool = True,
                        whole: tuple[str, ...] = (), state: Sequence = (),
                        merges: Sequence[str] = ()) -> tuple[Any, Any, list, Any, list]:
    """``pipeline_value_and_grad``'s ``(loss, d stacked, d other, d x0)``, ``d other`` a list of the gradients of
    ``other``'s leaves, None for each leaf the tail never reads (no zeros made), and the layers' state after the
    step (a list, empty without ``state``).

    ``state``: the layers' state besides their parameters (arrays stacked like ``stacked``, a mixture's routing bias
    and load), never differentiated. With it ``layer(layer_params, layer_state, x) -> (y, new_state)``, both states
    lists of arrays: every microbatch runs with the state as the step found it, and what each call leaves is merged
    over the microbatches by ``merges`` (per array: ``"sum"`` adds them, a count; ``"last"`` keeps the last
    microbatch's, a value every microbatch leaves alike), as one call on the whole batch would leave it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline: schedule={schedule!r} is not one of {', '.join(map(repr, SCHEDULES))}")
    leaves, tree = jax.tree.flatten(stacked)
    o_leaves, o_tree = jax.tree.flatten(other)
    side = tuple(side)
    if not leaves:
        raise ValueError("pipeline: stacked holds no arrays; pass the layers' parameters stacked along dim 0")
    depth = leaves[0].shape[0] if leaves[0].ndim else 0
    if any(not a.ndim or a.shape[0] != depth for a in leaves):
        raise ValueError(f"pipeline: every stacked parameter needs the same leading dim (the layer count); got "
                         f"shapes {[tuple(a.shape) for a in leaves]}")
    m = x0.shape[0] if np.ndim(x0) else 0
    if m < 1 or any(np.ndim(s) < 1 or s.shape[0] != m for s in side):
        raise ValueError(f"pipeline: x0 and every side input stack the microbatches along dim 0; got x0 "
                         f"{tuple(np.shape(x0))} and side {[tuple(np.shape(s)) for s in side]}")
    state, merges = list(state), tuple(merges)
    if len(merges) != len(state) or not set(merges) <= set(MERGES) or any(
            np.ndim(a) < 1 or a.shape[0] != depth for a in state):
        raise ValueError(f"pipeline: state takes one array a layer stacked along dim 0 ({depth} layers) and merges "
                         f"one of {MERGES} for each; got state shapes {[tuple(np.shape(a)) for a in state]} and "
                         f"merges {merges}")
    x_aval = jax.ShapeDtypeStruct(x0.shape[1:], x0.dtype)
    s_avals = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in state]
    side_avals = [jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in side]
    o_avals = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in o_leaves]

    def called(lp, ls, x):
        y, new = layer(jax.tree.unflatten(tree, lp), list(ls), x) if state else (layer(jax.tree.unflatten(tree, lp),
                                                                                       x), [])
        if getattr(y, "shape", None) != x.shape or y.dtype != x.dtype:
            raise TypeError(f"pipeline: a layer maps {x.dtype}{list(x.shape)} to "
                            f"{getattr(y, 'dtype', type(y).__name__)}{list(getattr(y, 'shape', ()))}; a pipelined "
                            "layer must return an array shaped like its input (the next layer's input)")
        new = list(new)
        if [(np.shape(a), np.dtype(a.dtype)) for a in new] != [(a.shape, np.dtype(a.dtype)) for a in s_avals]:
            raise TypeError(f"pipeline: a layer leaves its state as {[f'{a.dtype}{list(np.shape(a))}' for a in new]}"
                            f" where it takes {[f'{a.dtype}{list(a.shape)}' for a in s_avals]}; a pipelined layer "
                            "leaves its state shaped as it found it")
        return y, new

    def forward(lp, ls, x):
        return called(lp, ls, x)[0]

    def saving(lp, ls, x):  # the layer's output and what its backward reads: the vjp's residuals
        unit = jax.checkpoint(forward) if remat else forward
        y, pull = jax.vjp(lambda lp, x: unit(lp, ls, x), lp, x)
        res, saved["tree"] = jax.tree.flatten(pull)
        return (y, *res)

    def last(o, x, *s):
        def mean_part(o, x):
            loss = tail(jax.tree.unflatten(o_tree, o), x, *s)
            if getattr(loss, "shape", None) != () or not jnp.issubdtype(loss.dtype, jnp.floating):
                raise TypeError(f"pipeline: the tail returned {getattr(loss, 'dtype', type(loss).__name__)}"
                                f"{list(getattr(loss, 'shape', ()))}; it must return a float scalar loss")
            return loss / m

        loss, (do, dx) = jax.value_and_grad(mean_part, argnums=(0, 1))(o, x)
        return (loss, *do, dx)

    mesh = tracing_mesh()
    if mesh is None or axis not in mesh.axis_names:
        where = f"the mesh {format_mesh(mesh)}" if mesh is not None else "no mesh (it was called outside jshard.jit)"
        raise ValueError(f"pipeline: axis={axis!r} is not an axis of {where}; call it inside jshard.jit (or "
                         "TrainStep) on a mesh with that axis")
    p = mesh.shape[axis]
    saved = {}
    with hidden_axis(axis, mesh.axis_names):
        # a parameter the layer reads only cast to the compute dtype enters cast (gathered, held whole and read in
        # that dtype), its gradients summed over the microbatches in its own dtype
        narrow = _narrowed(jax.make_jaxpr(forward)([jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in leaves],
                                                   s_avals, x_aval), len(leaves))
        sums = tuple(a.dtype for a in leaves)
        leaves = [a if dt is None else a.astype(dt) for a, dt in zip(leaves, narrow, strict=True)]
        layer_avals = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in leaves]
        fwd, bwd = _forward_and_backward(jax.make_jaxpr(saving)(layer_avals, s_avals, x_aval), saved["tree"],
                                         len(leaves) + len(state))
        update = jax.make_jaxpr(lambda lp, ls, x: called(lp, ls, x)[1])(layer_avals, s_avals, x_aval) \
            if state else None  # what a call leaves of the state: the layer pruned to it (a router, not experts)
        # a leaf of other the tail's loss never reads (the embedding, read before the layers) takes no part in it:
        # its gradient there, zeros of its whole shape, would be made and accumulated for every microbatch
        tl = jax.make_jaxpr(last)(o_avals, x_aval, *side_avals)
        k = len(o_avals)
        reads = pruned(tl, [True] * len(tl.jaxpr.invars))[1][:k]  # an unread leaf's gradient reads nothing
        outs = tl.jaxpr.outvars
        tl = tl.replace(jaxpr=tl.jaxpr.replace(outvars=[outs[0], *(v for v, r in zip(outs[1:1 + k], reads,
                                                                                     strict=True) if r), outs[-1]]))
        tl = pruned(tl, [*reads, *[True] * (len(tl.jaxpr.invars) - k)])[0]
    make_schedule(schedule, p, m, virtual_stages)  # the schedule's own errors, before the program is planned
    if not set(whole) <= set(mesh.axis_names) - {axis}:
        raise ValueError(f"pipeline: whole={tuple(whole)!r} names axes that are not the other axes of the mesh "
                         f"{format_mesh(mesh)}; name those along which the parameters enter whole")
    if (depth % (p * virtual_stages) if virtual_stages > 1 else depth < p):  # one chunk a device may be uneven
        raise ValueError(f"pipeline: {depth} layers do not split into {p} stages x {virtual_stages} virtual stages "
                         f"on mesh axis {axis!r}; use a layer count that is a multiple of {p * virtual_stages}"
                         + ("" if virtual_stages > 1 else f", or at least {p}"))
    read = [a for a, r in zip(o_leaves, reads, strict=True) if r]
    out = pipeline_p.bind(*leaves, *read, x0, *side, *state, fwd=fwd, bwd=bwd, tail=tl, axis=axis, kind=schedule,
                          virtual=virtual_stages, counts=(len(leaves), len(read), len(side)), whole=tuple(whole),
                          sums=sums, update=update, merges=merges)
    n, k = len(leaves), len(read)
    loss, d_stacked, d_read, dx0 = out[0], out[1:1 + n], iter(out[1 + n:1 + n + k]), out[1 + n + k]
    return (loss, jax.tree.unflatten(tree, d_stacked), [next(d_read) if r else None for r in reads], dx0,
            list(out[2 + n + k:]))


def split_placement(virtual_stages: int) -> Placement:
    """How the stacked blocks lie along the pipeline axis: contiguous stages, or ``virtual_stages`` chunks per device
    dealt round-robin (device ``d`` holds virtual stages ``d, p + d, 2p + d, ...``)."""
    return Shard(0) if virtual_stages == 1 else StridedShard(0, virtual_stages)


# -- the primitive ------------------------------------------------------------------------------------------------

def _abstract(*args, fwd, bwd, tail, axis, kind, virtual, counts, whole, sums, update, merges):
    n, k, s = counts
    return [jax.core.ShapedArray((), tail.out_avals[0].dtype),
            *(jax.core.ShapedArray(a.shape, dt) for a, dt in zip(args[:n], sums, strict=True)), *args[n:n + k + 1],
            *args[n + k + 1 + s:]]


def _impl(*args, fwd, bwd, tail, axis, kind, virtual, counts, whole, sums, update, merges):
    """One device: the microbatches one after another through every layer, then back."""
    n, k, s = counts
    stacked, other, x0 = args[:n], args[n:n + k], args[n + k]
    side, state = args[n + k + 1:n + k + 1 + s], args[n + k + 1 + s:]
    merged = [jnp.zeros_like(a) if how == "sum" else a for a, how in zip(state, merges, strict=True)]
    depth = stacked[0].shape[0]
    loss = jnp.zeros((), tail.out_avals[0].dtype)
    d_stacked = [jnp.zeros(a.shape, dt) for a, dt in zip(stacked, sums, strict=True)]
    d_other = [jnp.zeros_like(a) for a in other]
    dx0 = []
    for i in range(x0.shape[0]):
        x, kept = x0[i], []
        for j in range(depth):
            lj = [*(a[j] for a in stacked), *(a[j] for a in state)]
            if state:
                left = jax.core.eval_jaxpr(update.jaxpr, update.consts, *lj, x)
                merged = [_merge(a, j, b, how) for a, b, how in zip(merged, left, merges, strict=True)]
            x, *res = jax.core.eval_jaxpr(fwd.jaxpr, fwd.consts, *lj, x)
            kept.append(res)
        li, *do, dy = jax.core.eval_jaxpr(tail.jaxpr, tail.consts, *other, x, *[a[i] for a in side])
        loss = loss + li
        d_other = [a + b for a, b in zip(d_other, do, strict=True)]
        for j in reversed(range(depth)):
            *dl, dy = jax.core.eval_jaxpr(bwd.jaxpr, bwd.consts, *[a[j] for a in stacked], *[a[j] for a in state],
                                          *kept[j], dy)
            d_stacked = [a.at[j].add(b.astype(a.dtype)) for a, b in zip(d_stacked, dl, strict=True)]
        dx0.append(dy)
    return [loss, *d_stacked, *d_other, jnp.stack(dx0), *merged]


def _merge(merged: jax.Array, at: Any, left: jax.Array, how: str) -> jax.Array:
    """The state merged over the microbatches so far (``merged[at]``: a layer's) with what one more call left."""
    return merged.at[at].add(left) if how == "sum" else merged.at[at].set(left)


def _primitive() -> jc.Primitive:
    p = jc.Primitive("jshard_pipeline")
    p.multiple_results = True
    p.def_impl(_impl)
    p.def_abstract_eval(_abstract)
    mlir.register_lowering(p, mlir.lower_fun(_impl, multiple_results=True))
    return p


pipeline_p = _primitive()


# -- the plan: stages on the pipeline axis, each stage's code planned on the others --------------------------------

@control("jshard_pipeline")
def plan_pipeline(eqn: jc.JaxprEqn, specs: list[Spec], mesh: Mesh) -> tuple[Choice, Callable, tuple]:
    prm = eqn.params
    n, k, s = prm["counts"]
    axis, v = prm["axis"], prm["virtual"]
    if axis not in mesh.axis_names:
        raise ValueError(f"pipeline: mesh axis {axis!r} is not in the mesh (axes {mesh.axis_names}); name one of them")
    ax = mesh.axis_names.index(axis)
    p = mesh.shape[axis]
    stacked, other, x0 = specs[:n], specs[n:n + k], specs[n + k]
    side, state = specs[n + k + 1:n + k + 1 + s], specs[n + k + 1 + s:]
    depth, m = stacked[0].shape[0], x0.shape[0]
    sched = make_schedule(prm["kind"], p, m, v)
    split = split_placement(v)
    names = tuple(a for a in mesh.axis_names if a != axis)
    sub = AbstractMesh(tuple(n for a, n in mesh.shape.items() if a != axis), names) \
        if isinstance(mesh, AbstractMesh) else Mesh(np.take(mesh.devices, 0, axis=ax), names)  # priced: no devices

    # what the program takes: the layers split along the axis (dim 0 whole on the others), everything else
    # replicated along it; microbatch stacks whole along dim 0 (a tick reads one microbatch)
    ins_stacked = [_along(sp, ax, split, keep_dim0=False, whole=prm["whole"]) for sp in stacked]
    ins_other = [_along(sp, ax, Replicate(), keep_dim0=True, whole=prm["whole"]) for sp in other]
    ins_x0, *ins_side = [_along(sp, ax, Replicate(), keep_dim0=False) for sp in (x0, *side)]
    ins_state = [_along(sp, ax, split, keep_dim0=False, whole=names) for sp in state]  # small: whole in a stage
    layer = [_inner(sp, sub, ax, drop_dim0=True) for sp in ins_stacked]
    kept_state = [_inner(sp, sub, ax, drop_dim0=True) for sp in ins_state]
    tail_in = [_inner(sp, sub, ax, drop_dim0=False) for sp in ins_other]
    x = _inner(ins_x0, sub, ax, drop_dim0=True)
    side_in = [_inner(sp, sub, ax, drop_dim0=True) for sp in ins_side]

    x, fwd = _steady(prm["fwd"], layer + kept_state, x, sub)
    fwd_jaxpr, bwd_jaxpr = prm["fwd"], prm["bwd"]
    lighter = _lightened(fwd_jaxpr, fwd, layer + kept_state + [x], bwd_jaxpr, n + len(state))
    if lighter is not None:  # each residual kept as the first plan laid it out
        fwd_jaxpr, bwd_jaxpr, kept = lighter
        free = (None,) * len(sub.axis_names)
        fwd = plan_jaxpr(_pinned(fwd_jaxpr, (free, *(free if q is None else q for q in kept))),
                         layer + kept_state + [x], sub)
    ins_x0 = _outer(x, mesh, ax, Replicate(), stack=m)
    res = list(fwd.out_specs[1:])  # the residuals a stage stashes, as the forward unit makes them
    bwd = plan_jaxpr(_pinned(bwd_jaxpr, _gradient_pins(layer)), layer + kept_state + res + [x], sub)
    tail = plan_jaxpr(prm["tail"], tail_in + [x] + side_in, sub)
    whole = (Replicate(),) * len(sub.axis_names)
    fwd_pins = [x] + [None] * len(res)
    bwd_pins = [None] * n + [x]  # pinned inside the unit (_gradient_pins); a Partial is reduced once, after
    tail_pins = [tail.out_specs[0].with_placements(whole)] + [None] * k + [x]
    d_layer, d_other = bwd.out_specs[:n], tail.out_specs[1:1 + k]
    summed = [Spec.create(sp.mesh, sp.placements, sp.shape, dt, where="pipeline")
              for sp, dt in zip(d_layer, prm["sums"], strict=True)]

    outs = [_outer(tail_pins[0], mesh, ax, Partial("sum"), stack=None),
            *[_outer(sp, mesh, ax, split, stack=depth) for sp in summed],
            *[_outer(sp, mesh, ax, Partial("sum"), stack=None) for sp in d_other],
            _outer(x, mesh, ax, Partial("sum"), stack=m),
            *[_outer(sp, mesh, ax, split, stack=depth) for sp in kept_state]]
    update = plan_jaxpr(prm["update"], layer + kept_state + [x], sub) if state else None
    kernel = _kernel(sched, axis, depth, local_function(fwd, fwd_pins), local_function(bwd, bwd_pins),
                     local_function(tail, tail_pins), counts=prm["counts"], loss_dtype=tail_pins[0].dtype,
                     update=update and (local_function(update, kept_state), prm["merges"]),
                     accumulators=([(sp.local_block_shape, sp.dtype) for sp in d_layer],
                                   [(sp.local_block_shape, sp.dtype) for sp in d_other]), sums=prm["sums"],
                     residuals=[(sp.local_block_shape, sp.dtype) for sp in res])
    rule = Rule("jshard_pipeline", strategies=None, communicates=lambda *_: _sends(sched, axis, x),
                describe=lambda *_: f"{sched!r}\n{sched.table()}")
    runs = m * -(-depth // p)  # each layer's forward and backward once per microbatch (the fullest stage's)
    bodies = (Body("layer forward", fwd, fwd_pins, runs=runs), Body("layer backward", bwd, bwd_pins, runs=runs),
              Body("tail", tail, tail_pins, runs=m),
              *([Body("layer state", update, kept_state, runs=runs)] if state else []))
    model = model_in_force()
    cost = (move_cost(specs, ins_stacked + ins_other + [ins_x0] + ins_side + ins_state)
            + sum(b.runs * (b.plan.cost + move_cost(b.plan.out_specs, b.pins)) for b in bodies)
            + sum(c.cost(model, dict(mesh.shape)) for c in _sends(sched, axis, x)))
    return Choice(tuple(ins_stacked + ins_other + [ins_x0] + ins_side + ins_state), tuple(outs), cost, rule), kernel, \
        bodies


def _gradient_pins(layer: list[Spec]) -> tuple:
    """Per layer parameter, the placements its gradient accumulates in: split where the parameter is split, as the
    plan makes it elsewhere (``None``: a pending sum over a data axis is reduced once, after the last microbatch).
    Left free, a sequence-parallel layer's weight gradient came out a pending sum of the whole matrix, ``n`` times
    the parameter's block, accumulated and kept so for every layer of the stage."""
    return tuple(tuple(q if q.is_shard else None for q in sp.placements) for sp in layer)


@functools.lru_cache(maxsize=64)
def _pinned(closed: jc.ClosedJaxpr, pins: tuple) -> jc.ClosedJaxpr:
    """A unit with its outputs constrained to ``pins`` (per output, placements with None for an axis left as the
    plan makes it; the first ``len(pins)`` outputs), so that the unit's plan weighs their moves as it chooses how to
    make them: the backward unit's gradients, the lightened forward unit's residuals."""
    def pinned(*args):
        outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
        return [constrain_p.bind(o, placements=pin, pin_gradient=False) if any(q is not None for q in pin) else o
                for o, pin in zip(outs, pins, strict=False)] + outs[len(pins):]
    return jax.make_jaxpr(pinned)(*closed.in_avals)


def _along(spec: Spec, ax: int, placement: Placement, keep_dim0: bool, whole: tuple[str, ...] = ()) -> Spec:
    """``spec`` with ``placement`` on mesh axis ``ax`` and, unless ``keep_dim0``, dim 0 whole on the others; whole
    on the axes named ``whole``."""
    ps = [Replicate() if (not keep_dim0 and q.is_shard and q.dim == 0) or name in whole else q
          for q, name in zip(spec.placements, spec.mesh.axis_names, strict=True)]
    ps = [Replicate() if q.is_partial else q for q in ps]  # a program input is whole (a Partial is reduced first)
    ps[ax] = placement
    return spec.with_placements(ps, where="pipeline")


def _inner(spec: Spec, sub: Mesh, ax: int, drop_dim0: bool) -> Spec:
    """The spec of one slice (``drop_dim0``) or of the whole of ``spec``'s value, on the mesh without axis ``ax``."""
    ps = [q for i, q in enumerate(spec.placements) if i != ax]
    if drop_dim0:
        ps = shift_dims(ps, -1)
    return Spec.create(sub, ps, spec.shape[1:] if drop_dim0 else spec.shape, spec.dtype, where="pipeline")


def _outer(spec: Spec, mesh: Mesh, ax: int, placement: Placement, stack: int | None) -> Spec:
    """``_inner`` undone: an inner spec on the whole mesh, with ``placement`` on axis ``ax`` (stacked ``stack`` deep
    along a new dim 0 where given)."""
    ps = list(spec.placements)
    shape = spec.shape
    if stack is not None:
        ps = shift_dims(ps, 1)
        shape = (stack, *shape)
    ps.insert(ax, placement)
    return Spec.create(mesh, ps, shape, spec.dtype, where="pipeline")


def _steady(closed: jc.ClosedJaxpr, layer: list[Spec], x: Spec, sub: Mesh):
    """The layer's input spec and its forward unit's plan: the input as it arrives, or as a value of the layer's
    shape lies inside the layer's plan (a sequence-parallel block's residual stream), whichever plans cheapest with
    the output moved to it. A layer's output is the next layer's input: where the arrival's layout is not the one
    the layer keeps (a batch split on the tensor axis), every layer would move its input in and its output back."""
    def priced(spec):
        plan = plan_jaxpr(closed, layer + [spec], sub)
        return plan.cost + move_cost(plan.out_specs[:1], [spec]), spec, plan

    best = priced(x)
    seen = {x.placements}
    for eq in best[2].equations:
        for spec in eq.choice.outs:
            if (spec.shape == x.shape and spec.dtype == x.dtype and spec.placements not in seen
                    and not any(q.is_partial for q in spec.placements)):
                seen.add(spec.placements)
                best = min(best, priced(x.with_placements(spec.placements, where="pipeline")), key=lambda b: b[0])
    return best[1], best[2]


def _forward_and_backward(closed: jc.ClosedJaxpr, tree: Any, n: int) -> tuple[jc.ClosedJaxpr, jc.ClosedJaxpr]:
    """A layer's forward unit and backward unit, from the jaxpr of its output and its vjp's residuals (``tree``
    rebuilds the vjp from them; ``n`` parameters, then the input). The forward unit ``(*params, x) -> (y,
    *stashed)`` returns the residuals that depend on the layer's input: a stage keeps them per microbatch and layer
    until the backward unit ``(*params, *stashed, dy) -> (*d params, dx)`` reads them; that unit makes the other
    residuals again from the parameters (a weight cast to the compute dtype is never kept per microbatch)."""
    jaxpr, consts = open_jaxpr(flattened(closed))  # a call's values its own: each kept or made again alone
    jaxpr = _merged(jaxpr)
    varying = _depending(jaxpr, n)
    res = jaxpr.outvars[1:]
    stashed, seen = [], set()
    for i, v in enumerate(res):  # one value the vjp reads in several places is kept once
        if not isinstance(v, jc.Literal) and v in varying and v not in seen:
            seen.add(v)
            stashed.append(i)
    remade = [v for v in res if not isinstance(v, jc.Literal) and v not in varying]
    again = _needed([e for e in jaxpr.eqns if not varying.intersection(e.outvars)], remade)

    def forward(*args):
        env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
        return run_equations(jaxpr.eqns, env, [jaxpr.outvars[0], *(res[i] for i in stashed)])

    def backward(*args):
        env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars[:n], args[:n], strict=True))
        env |= {res[i]: a for i, a in zip(stashed, args[n:-1], strict=True)}
        dlp, dx = jax.tree.unflatten(tree, run_equations(again, env, res))(args[-1])
        return (*dlp, dx)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    kept = [jax.ShapeDtypeStruct(res[i].aval.shape, res[i].aval.dtype) for i in stashed]
    return jax.make_jaxpr(forward)(*avals), jax.make_jaxpr(backward)(*avals[:n], *kept, avals[n])


def _lightened(fwd: jc.ClosedJaxpr, plan: Any, ins: list[Spec], bwd: jc.ClosedJaxpr,
               n: int) -> tuple[jc.ClosedJaxpr, jc.ClosedJaxpr, tuple] | None:
    """The forward and backward units with each residual the stage would keep replaced by what makes it again
    cheaply, where that is smaller as the forward unit's ``plan`` lays it out, and the placements the plan gave
    the residuals now kept (None for one it does not show); None where none is replaced.

    A residual made by equations the backward unit may run again (``_REMADE``: elementwise, casts, layout, a
    constraint's move), none of them reading an operand larger than what it makes, is made again there from their
    roots: a sequence-parallel layer's gathered input from its sequence-split value (gathered again in the backward
    pass, as Megatron-LM does), a norm's and a GELU's intermediates from their input. Residual by residual, largest
    first, a residual's roots replace it where those not kept already take fewer bytes (``_REMADE`` work is
    memory-bound, a gather's bytes those Megatron-LM moves)."""
    jaxpr = fwd.jaxpr
    placed = dict(zip(jaxpr.invars, ins, strict=True))
    for eq in plan.equations:
        placed.update((v, sp) for v, sp in zip(eq.eqn.outvars, eq.choice.outs, strict=True))
    size = {v: sp.local_bytes for v, sp in placed.items()}
    placed = {v: sp.placements for v, sp in placed.items()}
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    params = set(jaxpr.invars[:n])
    fixed = set(made) - _depending(jaxpr, n)  # made from the parameters alone: made again in the backward unit

    def roots(v, seen) -> set:
        if v in params or v in fixed or v in seen:
            return set()
        seen.add(v)
        e = made.get(v)
        ins = [u for u in (e.invars if e is not None else ()) if not isinstance(u, jc.Literal)
               and u not in params and u not in fixed]
        if (e is None or e.primitive.name not in _REMADE or v not in size
                or any(size.get(u, float("inf")) > size[v] for u in ins)):
            return {v}
        return set().union(*(roots(u, seen) for u in ins)) if ins else set()

    kept = [v for v in dict.fromkeys(jaxpr.outvars[1:]) if not isinstance(v, jc.Literal)]
    made_of = {r: roots(r, set()) for r in kept}
    made_of = {r: found for r, found in made_of.items() if found != {r} and all(v in size for v in found)}
    stash = set(kept)
    while True:  # the move that saves most: a residual's roots kept, every residual they make again dropped
        best, gain = None, 0
        for found in map(frozenset, made_of.values()):
            added = found - stash
            dropped = {r for r, f in made_of.items() if r in stash and r not in added and f <= (stash | added) - {r}}
            saved = sum(size[r] for r in dropped) - sum(size[v] for v in added)
            if saved > gain:
                best, gain = (added, dropped), saved
        if best is None:
            break
        stash = (stash | best[0]) - best[1]
    if stash == set(kept):
        return None
    new = tuple(v for v in [*kept, *sorted(stash - set(kept), key=str)] if v in stash)
    return (*_rebuilt(fwd, bwd, n, new), tuple(placed.get(v) for v in new))


@functools.lru_cache(maxsize=64)
def _rebuilt(fwd: jc.ClosedJaxpr, bwd: jc.ClosedJaxpr, n: int, new: tuple) -> tuple[jc.ClosedJaxpr, jc.ClosedJaxpr]:
    """The forward unit keeping ``new`` (values of its jaxpr) and the backward unit making its old residuals again
    from them (``_lightened``), once for every candidate plan that keeps the same (a search prices dozens)."""
    jaxpr = fwd.jaxpr
    lean = pruned(fwd.replace(jaxpr=jaxpr.replace(outvars=[jaxpr.outvars[0], *new])), [True] * len(jaxpr.invars))[0]
    again = _needed(jaxpr.eqns, list(jaxpr.outvars[1:]), have=set(new) | set(jaxpr.invars[:n]))
    consts = dict(zip(jaxpr.constvars, fwd.consts, strict=True))

    def backward(*args):
        env = consts | dict(zip(jaxpr.invars[:n], args[:n], strict=True))
        env |= dict(zip(new, args[n:n + len(new)], strict=True))
        res = run_equations(again, env, list(jaxpr.outvars[1:]))
        return jax.core.eval_jaxpr(bwd.jaxpr, bwd.consts, *args[:n], *res, args[-1])

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in [*jaxpr.invars[:n], *new]]
    dy = jax.ShapeDtypeStruct(jaxpr.outvars[0].aval.shape, jaxpr.outvars[0].aval.dtype)
    return lean, jax.make_jaxpr(backward)(*avals, dy)


def _narrowed(closed: jc.ClosedJaxpr, n: int) -> list:
    """Per parameter of a layer (its first ``n`` inputs), the narrower float dtype every use of it casts it to (a
    weight cast to the compute dtype: bf16 of a float32 parameter), None where it is read otherwise."""
    jaxpr = flattened(closed).jaxpr
    outs = {v for v in jaxpr.outvars if not isinstance(v, jc.Literal)}
    casts = {v: set() for v in jaxpr.invars[:n]}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jc.Literal) and v in casts:
                new = e.params.get("new_dtype") if e.primitive.name == "convert_element_type" else None
                casts[v].add(None if new is None else np.dtype(new))
    out = []
    for v in jaxpr.invars[:n]:
        (dt,) = casts[v] if len(casts[v]) == 1 else (None,)
        narrower = (dt is not None and v not in outs and jnp.issubdtype(dt, jnp.floating)
                    and jnp.issubdtype(v.aval.dtype, jnp.floating) and dt.itemsize < np.dtype(v.aval.dtype).itemsize)
        out.append(dt if narrower else None)
    return out


def _merged(jaxpr: jc.Jaxpr) -> jc.Jaxpr:
    """``jaxpr`` with each equation that repeats an earlier one (the same primitive and params on the same inputs,
    no effects) dropped and its outputs read from the earlier one's. Each ``nnx.Linear`` casts its input to the
    compute dtype itself: q, k and v of one input made three copies, each kept per microbatch in a stage's stash."""
    same, first, eqns = {}, {}, []
    for e in jaxpr.eqns:
        e = e.replace(invars=[v if isinstance(v, jc.Literal) else same.get(v, v) for v in e.invars])
        try:
            ins = tuple(("literal", v.aval, v.val.item() if hasattr(v.val, "item") else v.val)
                        if isinstance(v, jc.Literal) else v for v in e.invars)
            key = None if e.effects else (e.primitive, tuple(sorted(e.params.items())), ins)
            hash(key)
        except TypeError:  # a param or literal that cannot be compared cheaply: kept as it is
            key = None
        if key is not None and key in first:
            same.update(zip(e.outvars, first[key].outvars, strict=True))
            continue
        if key is not None:
            first[key] = e
        eqns.append(e)
    outvars = [v if isinstance(v, jc.Literal) else same.get(v, v) for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def _depending(jaxpr: jc.Jaxpr, n: int) -> set:
    """The values of a layer's ``jaxpr`` (``n`` parameters, then its input) made from its input: what differs from
    one microbatch to the next."""
    varying = set(jaxpr.invars[n:])
    for e in jaxpr.eqns:
        if any(not isinstance(v, jc.Literal) and v in varying for v in e.invars):
            varying.update(e.outvars)
    return varying


def _needed(eqns: list, outs: list, have: set = frozenset()) -> list:
    """The equations of ``eqns`` that ``outs`` need, in order, given the values ``have``."""
    need, kept = set(outs) - have, []
    for e in reversed(eqns):
        if need.intersection(e.outvars):
            kept.append(e)
            need.update(v for v in e.invars if not isinstance(v, jc.Literal) and v not in have)
    return kept[::-1]


def _sends(sched, axis: str, x: Spec) -> list[Communication]:
    """What the kernel sends: per tick and direction one ``ppermute`` over exactly the pairs of stages the schedule
    moves an activation (forward) or a gradient (back) between, none where no pair does. A permute of ``k`` pairs on
    ``p`` devices moves ``k`` blocks, ``k / p`` of one per device: permutes are grouped by ``k``, each group priced at
    that average, so the bytes add up to the ``2 m (p v - 1) / p`` blocks per device the schedule must move (a
    permute's launch counted once whatever its pairs)."""
    if sched.stages == 1:  # a chunk's output stays on its device (a permute onto itself)
        return []
    counts = collections.Counter()
    for routes, index in _routes(sched).values():
        for i, n in zip(*np.unique(index, return_counts=True), strict=True):
            counts[len(routes[i])] += int(n)
    return [Communication("permute", (axis,), x.local_bytes * k / sched.stages, count=n)
            for k, n in sorted(counts.items()) if k]


def _kernel(sched, axis: str, depth: int, fwd: Callable, bwd: Callable, tail: Callable, counts, loss_dtype,
            update, accumulators, sums, residuals) -> Callable:
    """The per-device loop over the schedule's ticks (see the module's docstring). ``update``: None, or a layer's
    state unit (what a call leaves of its state) and how each state array merges over the microbatches;
    ``accumulators``: the local (shape, dtype) of one layer's gradients and of the tail's, as their plans make them;
    ``sums``: the dtypes a layer's gradients are summed in; ``residuals``: of what a layer's forward unit keeps for
    its backward unit. The loss is summed in float32 and returned as ``loss_dtype``."""
    n, k, s = counts
    p, v, slots = sched.stages, sched.virtual_stages, sched.slots
    per = -(-depth // (p * v))  # uneven stages (one chunk a device): the last hold fewer, their rows past depth idle
    tables = _tables(sched)
    routes = _routes(sched)

    def send(t, direction, x):
        # only the pairs that move something at tick t: the branch is the tick's, the same on every device, so every
        # device takes it; a device outside its pairs receives zeros, which nothing reads
        sets, index = routes[direction]
        branches = [functools.partial(jax.lax.ppermute, axis_name=axis, perm=pairs) if pairs else jnp.zeros_like
                    for pairs in sets]
        return jax.lax.switch(jnp.asarray(index)[t], branches, x) if len(branches) > 1 else branches[0](x)

    uneven = depth % (p * v) != 0
    merges = update[1] if update else ()

    def layers_forward(chunk, real, x):  # the chunk's output, and each layer's residuals and state left [per, ...]
        def step(x, lr):
            def run():
                left = update[0](*lr[0], x) if update else []
                return [*fwd(*lr[0], x), *left]

            # an idle layer leaves its state as it found it: merged, that adds nothing or keeps the last real value
            idle = lambda: [x, *(jnp.zeros(shape, dtype) for shape, dtype in residuals),  # noqa: E731
                            *(jnp.zeros_like(a) if how == "sum" else a for a, how in zip(lr[0][n:], merges,
                                                                                         strict=True))]
            out = jax.lax.cond(lr[1], run, idle) if uneven else run()
            return out[0], (out[1:len(out) - len(merges)], out[len(out) - len(merges):])

        return jax.lax.scan(step, x, (chunk, real))

    def layers_backward(chunk, real, kept, dy):
        def step(dy, lk):
            idle = lambda: [*(jnp.zeros(shape, dtype) for shape, dtype in accumulators[0]), dy]  # noqa: E731
            *dl, dx = jax.lax.cond(lk[2], lambda: bwd(*lk[0], *lk[1], dy), idle) if uneven else bwd(*lk[0], *lk[1], dy)
            return dx, dl

        dx, dl = jax.lax.scan(step, dy, (chunk, kept, real), reverse=True)
        return list(dl), dx

    def run(*blocks):
        stacked, other, x0 = blocks[:n], blocks[n:n + k], blocks[n + k]
        side, state = blocks[n + k + 1:n + k + 1 + s], blocks[n + k + 1 + s:]
        chunks = [a.reshape((v, per) + a.shape[1:]) for a in (*stacked, *state)]
        d = jax.lax.axis_index(axis)
        real = d * per + jnp.arange(per) < depth  # v == 1 where stages are uneven; else every layer is real
        tab = {name: jnp.asarray(t) for name, t in tables.items()}
        buf = jnp.zeros((v, slots) + x0.shape[1:], x0.dtype)
        stash = [jnp.zeros((v, slots, per) + shape, dtype) for shape, dtype in residuals]
        carry = dict(stash=stash, fin=buf, bin=buf, loss=jnp.zeros((), jnp.float32),
                     grads=[jnp.zeros((v, per) + shape, dtype)
                            for (shape, _), dtype in zip(accumulators[0], sums, strict=True)],
                     other=[jnp.zeros(shape, dtype) for shape, dtype in accumulators[1]], dx0=jnp.zeros_like(x0),
                     state=[jnp.zeros_like(a) if how == "sum" else a
                            for a, how in zip(chunks[n:], merges, strict=True)])

        def at(name, t):
            return tab[name][t, d]

        def tick(t, c):
            fm, fc, bm, bc = at("fm", t), at("fc", t), at("bm", t), at("bc", t)

            def forward(c):
                slot = fm % slots
                xin = jnp.where(at("first_f", t), x0[fm], c["fin"][fc, slot])
                y, (kept, left) = layers_forward([a[fc] for a in chunks], real, xin)
                c = dict(c, stash=[a.at[fc, slot].set(r) for a, r in zip(c["stash"], kept, strict=True)],
                         state=[_merge(a, fc, b, how) for a, b, how in zip(c["state"], left, merges, strict=True)])

                def loss_of(c):
                    li, *do, dy = tail(*other, y, *[a[fm] for a in side])
                    acc = [a + b for a, b in zip(c["other"], do, strict=True)]
                    return dict(c, loss=c["loss"] + li.astype(jnp.float32), other=acc,
                                bin=c["bin"].at[fc, slot].set(dy))

                return jax.lax.cond(at("last_f", t), loss_of, lambda c: c, c), y

            c, y = jax.lax.cond(fm >= 0, forward, lambda c: (c, jnp.zeros_like(x0[0])), c)

            def backward(c):
                slot = bm % slots
                dl, dx = layers_backward([a[bc] for a in chunks], real, [a[bc, slot] for a in c["stash"]],
                                         c["bin"][bc, slot])
                grads = [g.at[bc].add(e.astype(g.dtype)) for g, e in zip(c["grads"], dl, strict=True)]
                dx0 = jnp.where(at("first_b", t), c["dx0"].at[bm].set(dx), c["dx0"])
                return dict(c, grads=grads, dx0=dx0), dx

            c, dx = jax.lax.cond(bm >= 0, backward, lambda c: (c, jnp.zeros_like(x0[0])), c)
            y, dx = send(t, "f", y), send(t, "b", dx)
            fin = jnp.where(at("rf", t) >= 0, c["fin"].at[at("rfc", t), at("rf", t) % slots].set(y), c["fin"])
            bin_ = jnp.where(at("rb", t) >= 0, c["bin"].at[at("rbc", t), at("rb", t) % slots].set(dx), c["bin"])
            return dict(c, fin=fin, bin=bin_)

        c = jax.lax.fori_loop(0, sched.ticks, tick, carry)
        grads, state = ([a.reshape((v * per,) + a.shape[2:]) for a in c[name]] for name in ("grads", "state"))
        return [c["loss"].astype(loss_dtype), *grads, *c["other"], c["dx0"], *state]

    return run


def _tables(sched) -> dict[str, np.ndarray]:
    """The schedule's tables as the kernel reads them, ``[ticks, p]`` each: the forward and backward unit's
    microbatch (-1: none) and chunk; whether the forward unit is the first or last virtual stage, the backward the
    first; and what arrives after the tick: the microbatch (-1: nothing) and chunk of the activation from the
    previous device (``rf``, ``rfc``) and of the gradient from the next (``rb``, ``rbc``)."""
    p, v = sched.stages, sched.virtual_stages
    last = p * v - 1
    d = np.arange(p)[None, :]
    fm, fc = np.asarray(sched.forward), np.asarray(sched.forward_chunk)
    bm, bc = np.asarray(sched.backward), np.asarray(sched.backward_chunk)
    fvs, bvs = fc * p + d, bc * p + d
    src_f, src_b = (np.arange(p) - 1) % p, (np.arange(p) + 1) % p
    sent_f = (fm[:, src_f] >= 0) & (fvs[:, src_f] < last)
    sent_b = (bm[:, src_b] >= 0) & (bvs[:, src_b] > 0)
    return {
        "fm": fm, "fc": fc, "bm": bm, "bc": bc,
        "first_f": (fm >= 0) & (fvs == 0), "last_f": (fm >= 0) & (fvs == last), "first_b": (bm >= 0) & (bvs == 0),
        "rf": np.where(sent_f, fm[:, src_f], -1), "rfc": np.where(sent_f, (fvs[:, src_f] + 1) // p, 0),
        "rb": np.where(sent_b, bm[:, src_b], -1), "rbc": np.where(sent_b, (bvs[:, src_b] - 1) // p, 0),
    }


def _routes(sched) -> dict[str, tuple[tuple, np.ndarray]]:
    """Per direction (``"f"``: activations to the next device, ``"b"``: gradients to the previous), the distinct
    sets of ``(source, destination)`` pairs that send on some tick of ``sched`` (the empty set first, where some tick
    sends nothing that way) and each tick's index into them: the kernel's switch between sends, a branch a set.
    Sets are few, at most ``2p`` a direction: as a wavefront ramps up one more device sends each tick, then all
    do, then one fewer each tick.

    >>> routes, index = _routes(make_schedule("gpipe", 2, 2))["f"]
    >>> routes, index.tolist()
    (((), ((0, 1),)), [1, 1, 0, 0, 0])
    """
    tables = _tables(sched)
    p = sched.stages
    out = {}
    for direction, received, step in (("f", tables["rf"] >= 0, 1), ("b", tables["rb"] >= 0, -1)):
        sets, index = np.unique(received, axis=0, return_inverse=True)
        routes = tuple(tuple(((int(d) - step) % p, int(d)) for d in np.flatnonzero(row)) for row in sets)
        out[direction] = routes, index.reshape(-1).astype(np.int32)
    return out


# what a backward unit may run again to make a residual it was not given: elementwise work, layout changes,
# reductions, a constraint's move (``_lightened``)
_REMADE = ELEMENTWISE | {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "reduce_sum",
                         "reduce_max", "reduce_min", "jshard_constrain"}
