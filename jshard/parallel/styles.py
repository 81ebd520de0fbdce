"""Parallel styles: how one module's parameters and activations live on one mesh axis.

A style names a mesh axis and carries everything ``parallelize`` does with a module it is matched on, behind
one small interface:

- ``param(module, name, shape)``: the placement of each parameter on the axis;
- ``inputs(args, kwargs)`` / ``outputs(out)``: the placements the module's arguments and output are
  constrained to there while it runs (None: whatever the engine finds cheapest), and ``pin_input_gradient``,
  whether the input's gradient is constrained like the input;
- ``compute``: where the module's parameters are while it runs (FSDP: gathered), None for as stored; a style
  with one also takes the parameters of the modules inside the module it is matched on (FSDP's unit);
- ``pin(module, name, shape)`` / ``keeps``: a placement the module's own parameter is held at while it runs
  (ExpertParallel: the experts where they are), None to leave it to the engine;
- ``context()``: a context manager the module's call runs in (ContextParallel: the attention method of its axis);
- ``on(mesh)``: the style as it runs on a mesh (``parallelize`` asks once the plan is checked; ContextParallel
  learns its axis size there, for the balanced layout);
- ``constrains``: whether it changes the module's calls (a module never called cannot take such a style);
- ``restructure(module, where, mesh)``: how the style rebuilds the module it is matched on (None for most):
  ``PipelineParallel`` stacks a list of blocks into stages (``jshard.parallel.stages``). The answer gives each
  parameter inside the module its placements, says which parameters are drawn as one stacked parameter, and
  installs the module that takes the old one's place, which may carry a ``jshard_step`` that ``TrainStep`` takes
  its gradients from.

A new style is one subclass overriding what it changes; ``parallelize`` needs no edit. Styles on different
axes compose: ``[FullyShard("dp"), ColwiseParallel("tp")]`` shards a kernel's rows over ``dp`` and its columns
over ``tp``. Everything else follows from the engine's rules: a row-parallel matmul's output is
``Partial(sum)`` and is reduced where the output constraint (or the next consumer) asks for it.

Column and row parallel place Flax's own layers by what their dims mean (``layout``): the output features
of a ``Linear``, ``LinearGeneral``, ``Einsum``, ``Conv`` kernel (a ``MultiHeadAttention``'s query, key and
value over heads) for column parallel, its input features for row parallel (the attention's ``out`` over
heads: Megatron's plan). Flax stores a ``Linear`` kernel as ``(in, out)`` (PyTorch: ``(out, in)``), so
column parallel shards dim 1 here where DTensor shards dim 0.

A style is checked when it is made: the axis must be a name, ``input`` / ``output`` placements (or None),
``dim`` an int where a style has one: a mistake shows up where the plan is written, not inside a training step.

>>> from flax import nnx
>>> lin = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
>>> ColwiseParallel("tp").param(lin, "kernel", (8, 16)), RowwiseParallel("tp").param(lin, "bias", (16,))
(S(1), R)
>>> query = nnx.LinearGeneral(8, (4, 2), rngs=nnx.Rngs(0))  # (in, heads, head_dim)
>>> ColwiseParallel("tp").param(query, "kernel", (8, 4, 2)), ColwiseParallel("tp").param(query, "bias", (4, 2))
(S(1), S(0))
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..darray import DArray
from ..placements import Placement, Replicate, Shard
from ..sharded_attention import METHODS, attention_method, balanced
from .schedule import SCHEDULES
from .stages import StackedStages, Stages

__all__ = ["ColwiseParallel", "ContextParallel", "DataParallel", "ExpertParallel", "ExpertTensorParallel",
           "FullyShard", "Layout", "ParallelStyle", "PipelineParallel", "RowwiseParallel", "SequenceParallel",
           "UnplacedParameter", "expert_weights", "is_array", "layout", "stack_depth", "style_classes"]

R = Replicate()


@dataclass(frozen=True)
class ParallelStyle:
    """Base of the styles: ``axis`` is the mesh axis name; ``input`` / ``output`` constrain the module's
    positional array arguments and its output on that axis (None leaves them to the engine). Gradients are
    constrained like the values, except the input gradient where ``pin_input_gradient`` is False. ``compute``
    is where the module's own parameters are while it runs (FSDP: gathered). Used as it is, it places every
    parameter Replicate and only constrains activations.

    >>> ParallelStyle("tp", output=Replicate()).outputs(None), ParallelStyle("tp").constrains
    (R, False)
    """

    axis: str = "tp"
    input: Placement | None = None
    output: Placement | None = None
    pin_input_gradient: ClassVar[bool] = True
    compute: ClassVar[Placement | None] = None  # the module's parameters while it runs (None: as stored)
    keeps: ClassVar[bool] = False  # whether the parameters it splits stay so while the module runs (see ``pin``)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"{name}: axis must be a mesh axis name (a str such as 'tp'), got {self.axis!r} "
                            f"({type(self.axis).__name__})")
        for which in ("input", "output"):
            value = getattr(self, which)
            if value is not None and not isinstance(value, Placement):
                raise TypeError(f"{self.label}: {which} must be a placement (Replicate(), Shard(d), ...) or None, "
                                f"got {value!r} ({type(value).__name__})")

    def param(self, module: nnx.Module, name: str, shape: tuple[int, ...]) -> Placement:
        """The placement on ``self.axis`` of parameter ``name`` (of ``shape``) of ``module``; raise
        ``self.refuse(...)`` for one it cannot place."""
        return R

    def pin(self, module: nnx.Module, name: str, shape: tuple[int, ...]) -> Placement | None:
        """The placement on ``self.axis`` that parameter ``name`` of ``module`` is pinned to while the module runs,
        None to leave it to the engine (the cost model may move a weight rather than the activations). A style
        whose ``keeps`` is True pins each parameter it splits where ``param`` put it (``ExpertParallel``: the
        experts stay, the tokens travel to them)."""
        if not self.keeps:
            return None
        placed = self.param(module, name, shape)
        return None if placed == R else placed

    def inputs(self, args: tuple, kwargs: dict) -> tuple[tuple[Placement | None, ...], dict[str, Placement | None]]:
        """The placements on ``self.axis`` of a call's arguments: one per positional argument and one per keyword
        (left out: None), each applied to every array inside that argument. By default ``input`` for each
        positional array argument (a ``MultiHeadAttention``'s query, key and value inputs alike), keywords (masks,
        flags) left alone."""
        return tuple(self.input if is_array(a) else None for a in args), {}

    def outputs(self, out: Any) -> Placement | None:
        """The placement on ``self.axis`` of every array the module returns (None: left to the engine)."""
        return self.output

    def context(self) -> contextlib.AbstractContextManager:
        """A context manager the module's call runs in (its inputs already constrained): settings that reach the
        operations inside, such as the attention method of ``ContextParallel``. By default none."""
        return contextlib.nullcontext()

    def restructure(self, module: nnx.Module, where: str, mesh: Mesh) -> Any:
        """How the style rebuilds ``module`` (at path ``where``), checked before anything changes: an object with
        ``placements(path, placements)`` (a parameter's below the module, from the other styles'), ``stacks(paths,
        placements)`` (``(members, placements)`` of parameters drawn as one stack) and ``install(module)`` (the module
        that takes its place). None, by default: the style places parameters and constrains calls only."""
        return None

    def on(self, mesh: Mesh) -> ParallelStyle:
        """This style as it runs on ``mesh``, whose axes ``parallelize`` has checked: a style whose behaviour
        depends on the mesh returns a copy that knows what it needs (``ContextParallel``: its axis size). By
        default the style itself."""
        return self

    @property
    def constrains(self) -> bool:
        """Whether the style changes the module's calls: constrains its inputs or outputs (by ``input`` /
        ``output``, or by its own ``inputs`` / ``outputs``) or runs them in a ``context`` (a style that overrides
        those methods is taken to use them)."""
        own = any(getattr(type(self), m) is not getattr(ParallelStyle, m) for m in ("inputs", "outputs", "context"))
        return own or self.input is not None or self.output is not None

    @property
    def label(self) -> str:
        """How errors name the style: ``ColwiseParallel('tp')``."""
        return f"{type(self).__name__}({self.axis!r})"

    def refuse(self, module: nnx.Module, name: str, shape: tuple[int, ...], why: str = "") -> UnplacedParameter:
        """The error for a parameter this style cannot place (``why``: what it looked for, by default which
        layers it knows); raise it from ``param``. ``parallelize`` adds the module's path."""
        layers = ", ".join(c.__name__ for c in _LAYOUTS)
        return UnplacedParameter(self, module, name, shape, why or (
            f"it places Flax's {layers} by what their dims mean, and another module's 'kernel' (in, ..., out), "
            "rank-1 'bias' and 'embedding' (vocab, features)"))


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Column parallel: a kernel sharded on its (first) output-feature dim, its bias likewise; an embedding
    table on ``features``; a norm's scale and bias replicated. The input is replicated on the axis (a
    sequence-sharded input is gathered first, as DTensor does), the output comes out sharded on its features.

    >>> ColwiseParallel("tp").input
    R
    """

    input: Placement | None = R
    # the input gradient is Partial(sum): q, k and v's are summed first and reduced once, further back
    pin_input_gradient: ClassVar[bool] = False

    def param(self, module, name, shape):
        dims = layout(module, name, shape)
        if dims is not None and dims.kind == "norm":
            return R
        if dims is None or not dims.outputs:
            raise self.refuse(module, name, shape, _why(module, dims, "output"))
        return Shard(dims.outputs[0])


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Row parallel: a kernel sharded on its (first) input-feature dim with its bias replicated (added once,
    after the reduction); an embedding table sharded on ``vocab`` (the vocabulary-parallel embedding: each
    device looks up the ids it owns, the rest add zeros); a norm's scale and bias replicated. The output is
    reduced to ``output``: Replicate (an all-reduce) or, for sequence parallelism, ``Shard(1)`` (a
    reduce-scatter).

    >>> RowwiseParallel("tp", output=Shard(1)).output
    S(1)
    """

    output: Placement | None = R

    def param(self, module, name, shape):
        dims = layout(module, name, shape)
        if dims is not None and dims.kind in ("norm", "bias"):
            return R
        if dims is None or not dims.inputs:
            raise self.refuse(module, name, shape, _why(module, dims, "input"))
        return Shard(dims.inputs[0])


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Sequence parallel for norms, dropout and residual adds: parameters replicated, input and output sharded
    on the sequence dim (``dim``, default 1 for ``(batch, seq, features)``).

    >>> SequenceParallel("tp").output
    S(1)
    """

    # set from dim, so not arguments: SequenceParallel("tp", input=...) is a TypeError, never silently replaced
    input: Placement | None = field(default=None, init=False)
    output: Placement | None = field(default=None, init=False)
    dim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_dim(self)
        object.__setattr__(self, "input", Shard(self.dim))
        object.__setattr__(self, "output", Shard(self.dim))


@dataclass(frozen=True)
class DataParallel(ParallelStyle):
    """Data parallel on one axis: parameters replicated, the inputs' batch dim (``dim``) sharded. Gradients
    come out ``Partial(sum)`` over the axis and are all-reduced once each where the step pins them.

    >>> DataParallel("dp").input
    S(0)
    """

    axis: str = "dp"
    input: Placement | None = field(default=None, init=False)  # set from dim
    dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_dim(self)
        object.__setattr__(self, "input", Shard(self.dim))


@dataclass(frozen=True)
class FullyShard(ParallelStyle):
    """FSDP / ZeRO-3 on one axis (usually the data axis): every parameter of rank >= 1 sharded on its dim
    ``dim`` (default 0; negative counts from the last dim); the engine gathers it where a computation needs it
    whole and the gradient, a ``Partial(sum)`` over the data axis, is reduce-scattered back to the shard.
    Parameters without that dim (scalars) stay replicated. ``param_dtype`` (say ``jnp.bfloat16``): each parameter
    cast to it on its shard before it is gathered, so the gather moves half the bytes and the gradient comes back in
    it (torch FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``); the parameter and its optimizer state stay in their
    own dtype. It gives the same values as the model's own cast after a gather where the model computes in that
    dtype (a ``dtype=jnp.bfloat16`` Flax layer casts its float32 kernel before using it).

    The module it is matched on is the unit gathered together while it runs: as a ``default=`` style, each
    module holding parameters; matched on a module above them (a transformer block, as torch's
    ``fully_shard(block)``), every parameter inside it that no nearer ``FullyShard`` takes, gathered in one
    collective where they are small enough to share one and the latency saved clearly pays for packing them (by
    the cost model; a module's two small parameters are gathered one by one, see ``jshard.lowering.MIN_SAVING``).

    >>> from flax import nnx
    >>> FullyShard("dp").param(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), "kernel", (8, 16))
    S(0)
    """

    axis: str = "dp"
    dim: int = 0
    param_dtype: Any = None
    compute: ClassVar[Placement | None] = R  # gathered while the module runs, one module at a time

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_dim(self)
        if self.param_dtype is not None:
            try:
                dtype = jnp.dtype(self.param_dtype)
            except TypeError:
                dtype = None
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"{type(self).__name__}: param_dtype is the floating dtype parameters are gathered "
                                 f"in (say jnp.bfloat16), or None; got {self.param_dtype!r}")
            object.__setattr__(self, "param_dtype", dtype)

    def param(self, module, name, shape):
        stack = stack_depth(module, name, shape)  # a stack of layers is cut inside each layer: one gather a layer
        own = len(shape) - stack
        return Shard(stack + self.dim % own) if -own <= self.dim < own else R


@dataclass(frozen=True)
class ContextParallel(ParallelStyle):
    """Context parallelism: the sequence dim (1) of the module's activations sharded over ``axis``, its
    attention (``jshard.attention``) crossing the axis by ``method``. Matched on a model's root (or a stack of
    blocks), it places parameters Replicate on the axis, constrains every positional array argument and every
    array returned to the sequence layout there, and runs the call inside ``jshard.attention_method({axis:
    method})``, so each attention inside runs by ``method`` on that axis: ``"ring"`` (keys and values passed
    around it), ``"all_gather"``, ``"all_to_all"`` (Ulysses: sequence -> heads and back) or ``"auto"`` (the cost
    model chooses). Other styles on other axes compose with it (``DataParallel("dp")`` on the batch,
    ``ColwiseParallel("tp")`` inside the blocks).

    ``balance=True`` lays the sequence out striped (``jshard.sharded_attention.balanced``: token ``t`` on device
    ``t % size``), so that causal attention gives every device the same work; ``False`` cuts it in contiguous
    blocks (``Shard(1)``). ``sequence(length, size)`` is that layout: give the data loader's ids and labels it.

    >>> ContextParallel("cp").sequence(16, 4), ContextParallel("cp", balance=False).sequence(16, 4)
    (SS(1,4), S(1))
    """

    axis: str = "cp"
    method: str = "auto"
    balance: bool = True
    # set from the style's own fields: ContextParallel("cp", input=...) is a TypeError, never silently replaced
    input: Placement | None = field(default=None, init=False)
    output: Placement | None = field(default=None, init=False)
    size: int | None = field(default=None, init=False, repr=False)  # the axis size, once on(mesh) has told it

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ValueError(f"{self.label}: method {self.method!r} is not one of {', '.join(map(repr, METHODS))}; "
                             "'ring' passes keys and values around the axis, 'all_gather' gathers them, "
                             "'all_to_all' moves the sequence to the heads, 'auto' lets the cost model choose")
        if not isinstance(self.balance, bool):
            raise TypeError(f"{self.label}: balance must be True (the striped, causally balanced layout) or False "
                            f"(contiguous blocks), got {self.balance!r}")

    def sequence(self, length: int, size: int) -> Placement:
        """The placement of a sequence dim (1) of ``length`` over an axis of ``size`` devices.

        >>> ContextParallel("cp").sequence(8, 1)
        S(1)
        """
        return balanced(length, size) if self.balance else Shard(1)

    def on(self, mesh: Mesh) -> ContextParallel:
        bound = copy.copy(self)
        object.__setattr__(bound, "size", int(mesh.shape[self.axis]))
        return bound

    def inputs(self, args, kwargs):
        return tuple(self._layout(a, f"argument {i}") if is_array(a) else None for i, a in enumerate(args)), {}

    def outputs(self, out):
        found = {self._layout(a, "its output") for a in jax.tree.leaves(out) if is_array(a)}
        if len(found) > 1:
            raise ValueError(f"{self.label}: the module returns arrays whose sequence dims (1) need different layouts "
                             f"{sorted(map(str, found))}; match ContextParallel on a module whose outputs share one "
                             "sequence length")
        return found.pop() if found else None

    def context(self):
        # "auto" pins nothing: an attention_method the caller set around the model still holds inside it
        return contextlib.nullcontext() if self.method == "auto" else attention_method({self.axis: self.method})

    def _layout(self, a: Any, which: str) -> Placement:
        if self.size is None:
            raise RuntimeError(f"{self.label} was called before parallelize told it the mesh; use the style through "
                               "jshard.parallel.parallelize, or ContextParallel(...).on(mesh)")
        if np.ndim(a) < 2:
            raise ValueError(f"{self.label}: {which} has shape {tuple(np.shape(a))}, with no sequence dim (1) to "
                             f"shard over mesh axis {self.axis!r}; context parallelism needs [batch, seq, ...] "
                             "arrays: match ContextParallel on a module that takes them, or add the batch dim")
        return self.sequence(int(np.shape(a)[1]), self.size)


@dataclass(frozen=True)
class ExpertParallel(ParallelStyle):
    """Expert parallelism over ``axis``: matched on a mixture-of-experts module, it places the module's own
    parameters whose leading dim is the expert count (``experts``, or read from its parameters of rank 3, ``[E, D,
    H]``) ``Shard(0)`` on the axis, each device holding ``E / size`` experts, and keeps them there while the module
    runs (``pin``): the tokens travel to their experts' devices, never the experts to the tokens, whether the module
    calls ``jshard.experts`` or dispatches with einsums of its own (GShard's). The module's other parameters (the
    router, inside it) are placed as the other styles say, else replicated. The axis may be one of its own or the
    one sharding the batch (expert ranks drawn from data-parallel ones, as torchtitan and MaxText do); other styles
    on other axes compose with it (``FullyShard`` over the rest).

    >>> import numpy as np
    >>> from flax import nnx
    >>> class MoE(nnx.Module):
    ...     def __init__(self):
    ...         self.w_up, self.w_down = nnx.Param(np.zeros((8, 4, 16))), nnx.Param(np.zeros((8, 16, 4)))
    >>> ExpertParallel("ep").param(MoE(), "w_up", (8, 4, 16))
    S(0)
    """

    axis: str = "ep"
    experts: int | None = None
    keeps: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        e = self.experts
        if e is not None and (not isinstance(e, int) or isinstance(e, bool) or e < 1):
            raise ValueError(f"{self.label}: experts must be the expert count (an int >= 1) or None (read from the "
                             f"module's parameters), got {e!r}")

    def param(self, module, name, shape):
        count = self.experts if self.experts is not None else self._count(module, name, shape)
        return Shard(0) if len(shape) >= 2 and shape[0] == count else R

    def _count(self, module, name, shape) -> int:
        leading = {s[0] for _, s in expert_weights(module)}
        if len(leading) != 1:
            raise self.refuse(module, name, shape, f"it reads the expert count from the module's own parameters of "
                                                   f"rank 3 ([E, D, H]), whose leading dims are {sorted(leading)}; "
                                                   "pass experts=E")
        return leading.pop()


@dataclass(frozen=True)
class ExpertTensorParallel(ParallelStyle):
    """The experts' hidden dim split over ``axis``, as column then row parallelism split a dense MLP (torchtitan's
    expert tensor parallelism): matched on a mixture (the module ``ExpertParallel`` takes), the weights into the
    hidden dim (``[E, D, H]``: ``w_up``, ``w_gate``) ``Shard(2)``, the one out of it (``[E, H, D]``: ``w_down``)
    ``Shard(1)``, kept there while the module runs; its output is a partial sum over the axis. Which is which it
    reads from the shapes: the orientation two weights share (a gated MLP's) goes in; with one of each, the names
    (``down``, ``out``, ``wo``, ``w2`` come out; ``up``, ``gate``, ``in``, ``wi``, ``w1``, ``w3`` go in).

    >>> import numpy as np
    >>> from flax import nnx
    >>> class MoE(nnx.Module):
    ...     def __init__(self):
    ...         self.w_up, self.w_gate = nnx.Param(np.zeros((8, 4, 16))), nnx.Param(np.zeros((8, 4, 16)))
    ...         self.w_down = nnx.Param(np.zeros((8, 16, 4)))
    >>> style = ExpertTensorParallel("tp")
    >>> style.param(MoE(), "w_gate", (8, 4, 16)), style.param(MoE(), "w_down", (8, 16, 4))
    (S(2), S(1))
    """

    axis: str = "tp"
    keeps: ClassVar[bool] = True

    def param(self, module, name, shape):
        experts = expert_weights(module)
        if len(shape) != 3 or not experts or (name, tuple(shape)) not in [(n, tuple(s)) for n, s in experts]:
            return R
        kinds = {}
        for _, s in experts:
            kinds[s[1:]] = kinds.get(s[1:], 0) + 1
        if len(kinds) != 2 or tuple(reversed(next(iter(kinds)))) not in kinds:
            raise self.refuse(module, name, shape, "it reads a mixture's weights by their shapes, [E, D, H] into the "
                                                   "hidden dim and [E, H, D] out of it, and finds "
                                                   f"{sorted(s for _, s in experts)}")
        into = max(kinds, key=kinds.get) if len(set(kinds.values())) == 2 else None
        if into is None:  # one of each: a name says which
            said = {n: _said(n) for n, _ in experts}
            if sorted(said.values(), key=str) != ["in", "out"]:
                raise self.refuse(module, name, shape, "it tells a mixture's two weights apart by their names when "
                                                       "their shapes do not, and no name says which weight comes out "
                                                       "of the hidden dim (down, out, wo, w2) and which goes in (up, "
                                                       f"gate, in, wi, w1, w3): {sorted(said)}")
            return Shard(1) if said[name] == "out" else Shard(2)
        return Shard(2) if tuple(shape[1:]) == into else Shard(1)


def expert_weights(module: nnx.Module) -> list[tuple[str, tuple[int, ...]]]:
    """A mixture's own weights as the expert styles read them: ``(name, shape)`` of each parameter of rank 3 held by
    ``module`` itself (``[E, D, H]``, ``[E, H, D]``); the modules inside it (the router) are not its own.

    >>> import numpy as np
    >>> from flax import nnx
    >>> class MoE(nnx.Module):
    ...     def __init__(self):
    ...         self.router = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    ...         self.w_up, self.w_down = nnx.Param(np.zeros((8, 4, 16))), nnx.Param(np.zeros((8, 16, 4)))
    >>> expert_weights(MoE())
    [('w_up', (8, 4, 16)), ('w_down', (8, 16, 4))]
    """
    return [(n, tuple(np.shape(v.get_value()))) for n, v in vars(module).items()
            if isinstance(v, nnx.Param) and np.ndim(v.get_value()) == 3]


def _said(name: str) -> str | None:
    """Whether a mixture's weight of this name goes into its experts' hidden dim or comes out of it (None: the name
    does not say)."""
    low = name.lower()
    if any(w in low for w in ("down", "out", "wo", "w2")):
        return "out"
    return "in" if any(w in low for w in ("up", "gate", "in", "wi", "w1", "w3")) else None


@dataclass(frozen=True)
class PipelineParallel(ParallelStyle):
    """Pipeline parallelism over ``axis``: matched on a list of identical blocks (``"blocks"``), or on a module that
    stacks its layers (built by ``nnx.vmap``, run by ``nnx.scan``), it splits the layers
    into stages along the axis (stage ``s`` of ``p`` holds blocks ``s*L/p ... (s+1)*L/p - 1``, ``L/p`` rounded up
    where ``p`` does not divide ``L``, the last stages holding fewer; with
    ``virtual_stages=v``, ``v`` chunks per device dealt round-robin), and ``TrainStep`` runs each step as
    ``microbatches`` microbatches flowing stage to stage in ``schedule`` order (``"gpipe"``, ``"1f1b"``,
    ``"interleaved"``; ``jshard.parallel.schedule``), all in the step's one program
    (``jshard.parallel.stages``). The blocks' parameters are placed by the other styles on the other axes;
    what runs before and after the blocks (embeddings, the head) is placed by them too, replicated along ``axis``.
    A stage keeps each layer's input for its microbatches in flight and runs the layer's forward again in the
    backward pass (``remat=True``, ``jax.checkpoint``); ``remat=False`` keeps every activation the backward pass
    reads instead, as ``jax.grad`` keeps them: a quarter less compute for a stage's memory of its layers'
    activations per microbatch in flight (Megatron-LM's default, where memory allows). ``whole``: mesh axes along
    which the stages take every parameter whole, gathered once a step as the pipeline starts, its gradient
    accumulated over the microbatches and reduce-scattered once after: parameters and optimizer state sharded over
    the data axis (``FullyShard`` as the default style) as Megatron-LM's distributed optimizer keeps them, without
    FSDP's gathers in every layer's unit for every microbatch (the ``zero`` role with a pipeline).

    >>> style = PipelineParallel("pp", microbatches=8, whole=("dp",))
    >>> style.microbatches, style.schedule, style.remat, style.whole
    (8, '1f1b', True, ('dp',))
    """

    axis: str = "pp"
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    remat: bool = True
    whole: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.label}: {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.remat, bool):
            raise TypeError(f"{self.label}: remat must be True or False, got {self.remat!r}")
        if isinstance(self.whole, str) or not isinstance(self.whole, (tuple, list)) or not all(
                isinstance(a, str) for a in self.whole) or self.axis in self.whole:
            raise ValueError(f"{self.label}: whole is a tuple of the mesh axes (other than the pipeline's "
                             f"{self.axis!r}) along which the stages take their parameters whole, say ('dp',); got "
                             f"{self.whole!r}")
        object.__setattr__(self, "whole", tuple(self.whole))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{self.label}: schedule {self.schedule!r} is not one of "
                             f"{', '.join(map(repr, SCHEDULES))}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"{self.label}: virtual_stages={self.virtual_stages} needs schedule='interleaved' (the "
                             f"{self.schedule!r} schedule runs one chunk per device)")

    def restructure(self, module, where, mesh):
        if isinstance(module, nnx.List):
            return Stages(self, module, where, mesh)
        return StackedStages(self, module, where, mesh)


class Layout(NamedTuple):
    """What a parameter's dims mean: ``kind`` is ``"weight"`` (a kernel), ``"bias"``, ``"table"`` (an embedding)
    or ``"norm"`` (a norm's scale or bias); ``inputs`` are its dims over the features the layer reads (a kernel's
    contracted dims, a table's vocabulary), ``outputs`` those over the features it makes, outermost first;
    ``stack`` is how many leading dims stack copies of the layer (a module built by ``nnx.vmap`` for
    ``nnx.scan``: ``(layers, in, out)``), which no style splits (each layer is placed as one layer is)."""

    kind: str
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    stack: int = 0


def layout(module: nnx.Module, name: str, shape: tuple[int, ...]) -> Layout | None:
    """What the dims of ``module``'s parameter ``name`` (of ``shape``) mean, read from the Flax layer's own
    attributes (``LinearGeneral``'s batch, input and output features, ``Einsum``'s equation, ``Conv``'s window);
    for a module Flax does not define, guessed from the name: ``kernel`` (in, ..., out), ``bias``, ``embedding``
    (vocab, features). None where neither tells. A Flax layer's parameter with leading dims beyond its own rank is a
    stack of layers (``nnx.vmap``'s, for ``nnx.scan``): its dims are read past the stack (``Layout.stack``).

    >>> from flax import nnx
    >>> out = nnx.LinearGeneral((4, 2), 8, axis=(-2, -1), rngs=nnx.Rngs(0))  # (heads, head_dim, out)
    >>> layout(out, "kernel", (4, 2, 8))
    Layout(kind='weight', inputs=(0, 1), outputs=(2,), stack=0)
    >>> layout(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), "kernel", (6, 8, 32))  # six layers' kernels, stacked
    Layout(kind='weight', inputs=(1,), outputs=(2,), stack=1)
    """
    shape = tuple(shape)
    read = next((read for cls, read in _LAYOUTS.items() if isinstance(module, cls)), None)
    if read is None:
        return _by_name(module, name, shape)
    # a layer's own parameters have the rank its attributes give; leading dims beyond it stack copies of the layer
    for stack in range(len(shape) + 1):
        found = read(module, name, shape[stack:])
        if found is not None:
            return found._replace(inputs=tuple(d + stack for d in found.inputs),
                                  outputs=tuple(d + stack for d in found.outputs), stack=stack)
    return None


def stack_depth(module: nnx.Module, name: str, shape: tuple[int, ...]) -> int:
    """How many leading dims of ``module``'s parameter ``name`` stack copies of the layer (``Layout.stack``; 0
    where ``layout`` cannot tell).

    >>> from flax import nnx
    >>> lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))  # as nnx.vmap builds it, its parameters (layers, ...)
    >>> stack_depth(lin, "kernel", (3, 4, 8)), stack_depth(lin, "bias", (3, 8)), stack_depth(lin, "bias", (8,))
    (1, 1, 0)
    """
    dims = layout(module, name, shape)
    return 0 if dims is None else dims.stack


def style_classes() -> list[type[ParallelStyle]]:
    """Every public subclass of ``ParallelStyle`` defined so far, jshard's and the user's, in definition order.

    >>> [c.__name__ for c in style_classes()][:3]
    ['ColwiseParallel', 'RowwiseParallel', 'SequenceParallel']
    """
    found, todo = [], list(ParallelStyle.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return [c for c in found if not c.__name__.startswith("_")]


class UnplacedParameter(ValueError):
    """A style cannot place a parameter: names the style, the module (its path, once ``at`` gave it), its class,
    the parameter's name and shape, and what to do."""

    def __init__(self, style: ParallelStyle, module: nnx.Module, name: str, shape: tuple[int, ...], why: str,
                 where: str | None = None):
        self.style, self.module, self.name, self.shape, self.why = style, module, name, tuple(shape), why
        at = "" if where is None else f" at {where or 'the root module'}"
        super().__init__(
            f"{style.label}: no placement for parameter {name!r} {self.shape} of {type(module).__name__}{at}; {why}. "
            "Give this module another style (SequenceParallel and FullyShard place any parameter), match the "
            "modules inside it instead, or leave it out of the plan and annotate the parameter with "
            "nnx.with_partitioning")

    def at(self, where: str) -> UnplacedParameter:
        """The same error naming the module's path."""
        return UnplacedParameter(self.style, self.module, self.name, self.shape, self.why, where)


def _check_dim(style: ParallelStyle) -> None:
    dim = style.dim
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{style.label}: dim must be an int, got {dim!r} ({type(dim).__name__})")


def is_array(x: Any) -> bool:
    """Whether a call's argument or result is an array a style places (a ``jax.Array``, tracer, numpy array, DArray)."""
    return isinstance(x, (jax.Array, np.ndarray, DArray))


def _why(module: nnx.Module, dims: Layout | None, side: str) -> str:
    """Why a layer's parameter has no dim over its ``side`` features to cut ("" : the style's general answer)."""
    if isinstance(module, nnx.Conv) and module.feature_group_count > 1 and side == "input":
        return ("a grouped Conv's kernel holds each group's input channels, so cutting it does not cut the input's; "
                "use ColwiseParallel (output channels)")
    if dims is None:
        return ""
    return f"its dims are {dims}, none of them over the {side} features"


def _span(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def _linear(module, name, shape):
    if name == "kernel" and len(shape) == 2:
        return Layout("weight", (0,), (1,))
    if name == "bias" and len(shape) == 1:
        return Layout("bias", (), (0,))
    return None


def _linear_general(module, name, shape):
    # kernel (*batch, *in_features, *out_features), bias (*batch, *out_features)
    batch, ins, outs = len(module.batch_axis), len(module.in_features), len(module.out_features)
    if name == "kernel" and len(shape) == batch + ins + outs:
        return Layout("weight", _span(batch, ins), _span(batch + ins, outs))
    if name == "bias" and len(shape) == batch + outs:
        return Layout("bias", (), _span(batch, outs))
    return None


def _einsum(module, name, shape):
    # the kernel is the equation's second operand: its letters that only the input has are contracted, those only
    # the output has are features it makes; the bias holds the kernel's letters that the output keeps, in its order.
    # The equation is the construction's: a call that passes another one is not seen here
    equation = module.einsum_str.replace(" ", "")
    operands, _, result = equation.partition("->")
    operands = operands.split(",")
    if len(operands) != 2 or "." in operands[1]:
        return None
    lhs, rhs = operands
    if name == "kernel" and len(shape) == len(rhs):
        return Layout("weight", tuple(i for i, c in enumerate(rhs) if c in lhs and c not in result),
                      tuple(i for i, c in enumerate(rhs) if c in result and c not in lhs))
    kept = [c for c in result if c in rhs]
    if name == "bias" and len(shape) == len(kept):
        return Layout("bias", (), tuple(i for i, c in enumerate(kept) if c not in lhs))
    return None


def _conv(module, name, shape):
    # kernel (*window, in_features / groups, out_features): a grouped kernel's input dim is within a group, so
    # cutting it does not cut the input's channels
    window = len(module.kernel_size)
    if name == "kernel" and len(shape) == window + 2:
        return Layout("weight", (window,) if module.feature_group_count == 1 else (), (window + 1,))
    if name == "bias" and len(shape) == 1:
        return Layout("bias", (), (0,))
    return None


def _conv_transpose(module, name, shape):
    window = len(module.kernel_size)  # kernel (*window, in, out), or (*window, out, in) with transpose_kernel
    if name == "kernel" and len(shape) == window + 2:
        ins, outs = (window + 1, window) if module.transpose_kernel else (window, window + 1)
        return Layout("weight", (ins,), (outs,))
    if name == "bias" and len(shape) == 1:
        return Layout("bias", (), (0,))
    return None


def _embed(module, name, shape):
    return Layout("table", (0,), (1,)) if name == "embedding" and len(shape) == 2 else None


def _norm(module, name, shape):
    return Layout("norm") if name in ("scale", "bias") and len(shape) == 1 else None


def _by_name(module, name, shape):
    # a module Flax does not define has no rank of its own to tell a stack by: its dims are read as one layer's
    if name == "kernel" and len(shape) >= 2:
        return Layout("weight", (0,), (len(shape) - 1,))
    if name == "embedding" and len(shape) >= 2:
        return Layout("table", (0,), (len(shape) - 1,))
    if name == "bias":
        return Layout("bias", (), (0,) if len(shape) == 1 else ())
    return None


_LAYOUTS: dict[type, Callable[[nnx.Module, str, tuple], Layout | None]] = {
    nnx.Linear: _linear, nnx.LinearGeneral: _linear_general, nnx.Einsum: _einsum, nnx.Conv: _conv,
    nnx.ConvTranspose: _conv_transpose, nnx.Embed: _embed,
    **dict.fromkeys((nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.BatchNorm, nnx.InstanceNorm), _norm),
}
