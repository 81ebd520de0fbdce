"""Parallel styles: how one module's parameters and activations live on one mesh axis.

A style names a mesh axis and says, for each parameter of the module it is given, the placement on that
axis, plus the placements the module's input and output are constrained to there (None: whatever the
engine finds cheapest). Styles on different axes compose: ``[FullyShard("dp"), ColwiseParallel("tp")]``
shards a kernel's rows over ``dp`` and its columns over ``tp``. Everything else follows from the engine's
rules — a row-parallel matmul's output is ``Partial(sum)`` and is reduced where the output constraint (or
the next consumer) asks for it.

Flax stores a ``Linear`` kernel as ``(in, out)`` (PyTorch: ``(out, in)``), so column parallel shards dim 1
here where DTensor shards dim 0.

A style is checked when it is made: the axis must be a name, ``input`` / ``output`` placements (or None),
dims ints — a mistake shows up where the plan is written, not inside a training step.

>>> from flax import nnx
>>> lin = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
>>> ColwiseParallel("tp").param(lin, "kernel", (8, 16)), RowwiseParallel("tp").param(lin, "bias", (16,))
(S(1), R)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..placements import Placement, Replicate, Shard

__all__ = ["ColwiseParallel", "DataParallel", "FullyShard", "ParallelStyle", "RowwiseParallel", "SequenceParallel"]

R = Replicate()


@dataclass(frozen=True)
class ParallelStyle:
    """Base of the styles: ``axis`` is the mesh axis name; ``input`` / ``output`` constrain the module's first
    positional input and its output on that axis (None leaves them to the engine). Gradients are constrained
    like the values, except the input gradient where ``pin_input_gradient`` is False. ``compute`` is where the
    module's own parameters are while it runs (FSDP: gathered)."""

    axis: str = "tp"
    input: Placement | None = None
    output: Placement | None = None
    pin_input_gradient: ClassVar[bool] = True
    compute: ClassVar[Placement | None] = None  # the module's parameters while it runs (None: as stored)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"{name}: axis must be a mesh axis name (a str such as 'tp'), got {self.axis!r} "
                            f"({type(self.axis).__name__})")
        for which in ("input", "output"):
            value = getattr(self, which)
            if value is not None and not isinstance(value, Placement):
                raise TypeError(f"{name}({self.axis!r}): {which} must be a placement (Replicate(), Shard(d), ...) or "
                                f"None, got {value!r} ({type(value).__name__})")
        dim = getattr(self, "dim", 0)
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"{name}({self.axis!r}): dim must be an int, got {dim!r} ({type(dim).__name__})")

    def param(self, module, name: str, shape: tuple[int, ...]) -> Placement:
        """The placement on ``self.axis`` of parameter ``name`` (of ``shape``) of ``module``."""
        return R

    def _unknown(self, module, name, shape):
        return ValueError(
            f"{type(self).__name__}({self.axis!r}): no placement for parameter {name!r} {tuple(shape)} of "
            f"{type(module).__name__}; it knows Linear-like 'kernel'/'bias' and Embed-like 'embedding'. "
            "Give this module another style, or distribute the parameter yourself")


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Column parallel: a kernel ``(in, out)`` sharded on ``out`` (and its bias), an embedding table
    ``(vocab, features)`` on ``features``. The input is replicated on the axis (a sequence-sharded input is
    gathered first, as DTensor does), the output comes out sharded on its last dim.

    >>> ColwiseParallel("tp").input
    R
    """

    input: Placement | None = R
    # the input gradient is Partial(sum): q, k and v's are summed first and reduced once, further back
    pin_input_gradient: ClassVar[bool] = False

    def param(self, module, name, shape):
        if name in ("kernel", "embedding") and len(shape) >= 2:
            return Shard(len(shape) - 1)
        if name == "bias" and len(shape) == 1:
            return Shard(0)
        raise self._unknown(module, name, shape)


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Row parallel: a kernel ``(in, out)`` sharded on ``in`` with its bias replicated (added once, after the
    reduction); an embedding table sharded on ``vocab`` (the vocabulary-parallel embedding: each device looks
    up the ids it owns, the rest add zeros). The output is reduced to ``output``: Replicate (an all-reduce)
    or, for sequence parallelism, ``Shard(1)`` (a reduce-scatter).

    >>> RowwiseParallel("tp", output=Shard(1)).output
    S(1)
    """

    output: Placement | None = R

    def param(self, module, name, shape):
        if name in ("kernel", "embedding") and len(shape) >= 2:
            return Shard(0)
        if name == "bias":
            return R
        raise self._unknown(module, name, shape)


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
        object.__setattr__(self, "input", Shard(self.dim))
        object.__setattr__(self, "output", Shard(self.dim))


@dataclass(frozen=True)
class DataParallel(ParallelStyle):
    """Data parallel on one axis: parameters replicated, the input's batch dim (``dim``) sharded. Gradients
    come out ``Partial(sum)`` over the axis and are all-reduced once each where the step pins them.

    >>> DataParallel("dp").input
    S(0)
    """

    axis: str = "dp"
    input: Placement | None = field(default=None, init=False)  # set from dim
    dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "input", Shard(self.dim))


@dataclass(frozen=True)
class FullyShard(ParallelStyle):
    """FSDP / ZeRO-3 on one axis (usually the data axis): every parameter of rank >= 1 sharded on its dim
    ``dim`` (default 0; negative counts from the last dim); the engine gathers it where a computation needs it
    whole and the gradient, a ``Partial(sum)`` over the data axis, is reduce-scattered back to the shard.
    Parameters without that dim (scalars) stay replicated.

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
    compute: ClassVar[Placement | None] = R  # gathered while the module runs, one module at a time

    def param(self, module, name, shape):
        return Shard(self.dim % len(shape)) if -len(shape) <= self.dim < len(shape) else R
