"""Model parallelism for Flax NNX: name placements per module, train with optax, get single-device losses.

``parallelize(model, mesh, plan)`` turns parameters into DArrays placed by parallel styles
(``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``DataParallel``, ``FullyShard``);
``TrainStep`` runs ``jshard.jit`` training steps that keep parameters and optimizer state where they are.
"""

from .parallelize import parallelize, placements_of
from .styles import ColwiseParallel, DataParallel, FullyShard, ParallelStyle, RowwiseParallel, SequenceParallel
from .training import TrainStep, init_optimizer

__all__ = ["ColwiseParallel", "DataParallel", "FullyShard", "ParallelStyle", "RowwiseParallel", "SequenceParallel",
           "TrainStep", "init_optimizer", "parallelize", "placements_of"]
