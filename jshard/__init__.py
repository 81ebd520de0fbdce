"""jshard: PyTorch DTensor's placement algebra for JAX.

Describe how an array lives on a device mesh with one placement per mesh axis (``Replicate``,
``Shard(d)``, ``StridedShard(d, sf)``, ``Partial(op)``) and move it between layouts with the cheapest
explicit collectives.

>>> import jax, numpy as np, jshard
>>> from jshard import Shard, Partial, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> x = jshard.distribute(np.arange(12.0).reshape(6, 2), mesh, [Shard(0), Replicate()])
>>> y = x.redistribute([Replicate(), Shard(0)])
>>> bool((y.full() == np.arange(12.0).reshape(6, 2)).all())
True
"""

from .api import constrain, explain, jit, same_as
from .caches import clear_caches
from .cost import AxisCost, CostModel
from .darray import DArray, DeletedArrayError, distribute, from_jax, from_local, from_process_local, process_rows
from .explanation import Explanation
from .moe import experts
from .operators import apply
from .placements import Partial, Placement, PlacementError, Replicate, Shard, StridedShard
from .planner import Plan, Step, plan_redistribute
from .sharded_attention import attention, attention_method
from .spec import LayoutError, Spec
from .visualize import visualize

__all__ = [
    "AxisCost",
    "CostModel",
    "DArray",
    "DeletedArrayError",
    "Explanation",
    "LayoutError",
    "Partial",
    "Placement",
    "PlacementError",
    "Plan",
    "Replicate",
    "Shard",
    "Spec",
    "Step",
    "StridedShard",
    "apply",
    "attention",
    "attention_method",
    "clear_caches",
    "constrain",
    "distribute",
    "experts",
    "explain",
    "from_jax",
    "from_local",
    "from_process_local",
    "jit",
    "plan_redistribute",
    "process_rows",
    "same_as",
    "visualize",
]


def __getattr__(name: str):
    # jshard.checkpoint imports Orbax and tensorstore: loaded on first use, not with every `import jshard`
    if name == "checkpoint":
        import importlib

        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module 'jshard' has no attribute {name!r}")
