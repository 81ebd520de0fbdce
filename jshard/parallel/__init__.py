"""Model parallelism for Flax NNX: name placements per module, train with optax, get single-device losses.

``parallelize(model, mesh, plan)`` turns parameters into DArrays placed by parallel styles
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``DataParallel``, ``FullyShard``,
``ContextParallel``, ``ExpertParallel``, ``PipelineParallel``, or a ``ParallelStyle`` subclass of your own: a
style carries its whole behaviour, see ``styles``), placing Flax's own layers by what their dims mean (``layout``);
``TrainStep`` runs ``jshard.jit`` training steps that keep parameters and optimizer state where they are (a
pipelined model's step by its schedule: ``stages``, ``pipeline``, ``schedule``).
"""

from .hardware import Hardware, Link
from .parallelize import parallelize, placements_of
from .plan import Memory, Plan
from .predict import Prediction, predict
from .search import autoplan
from .styles import (
    ColwiseParallel,
    ContextParallel,
    DataParallel,
    ExpertParallel,
    ExpertTensorParallel,
    FullyShard,
    Layout,
    ParallelStyle,
    PipelineParallel,
    RowwiseParallel,
    SequenceParallel,
    UnplacedParameter,
    layout,
    style_classes,
)
from .training import TrainStep, init_optimizer

__all__ = ["ColwiseParallel", "ContextParallel", "DataParallel", "ExpertParallel", "ExpertTensorParallel",
           "FullyShard", "Hardware", "Layout", "Link", "Memory", "ParallelStyle", "PipelineParallel", "Plan",
           "Prediction", "RowwiseParallel", "SequenceParallel", "TrainStep", "UnplacedParameter", "autoplan",
           "init_optimizer", "layout", "parallelize", "placements_of", "predict", "style_classes"]
