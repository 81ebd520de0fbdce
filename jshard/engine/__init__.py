"""The engine behind ``jshard.jit``: a jaxpr at global shapes in, one compiled ``shard_map`` program over block
storage out. It works on specs and block arrays; ``jshard.api`` wraps blocks as DArrays.

Each module is a step of the way:

- ``walk``: every equation's strategy (``jshard.propagate.select``), calls followed inline, consumers pulling
  placements into their producers, then every operand's move (``jshard.planner``): a ``JaxprPlan``, as data
  (``jshard.explain`` prints it);
- ``control``: ``scan`` / ``while`` / ``cond``, their bodies planned as jaxprs of their own, loop carries and
  branch results settled at least cost;
- ``kernel``: a plan's per-device function (moves as explicit collectives, equations on local blocks);
- ``program``: tracing a function to a plan, compiling it as ``jax.jit(jax.shard_map(...))``, running it;
- ``constrain``: the primitive behind ``jshard.constrain``.
"""

from .constrain import axis_aliases, constrain_p, constrain_target
from .control import WHILE_TRIPS  # importing it registers scan, while and cond with the walk
from .kernel import communicates, local_equation, local_function, moved_together, out_moves, own_collectives
from .program import (
    TRACED_DARRAY,
    Program,
    Traced,
    compile_program,
    paused_collector,
    shared_trace,
    trace,
    tracing_mesh,
)
from .walk import REUSED, Body, EquationPlan, JaxprPlan, Operand, Value, plan_jaxpr, replicated

__all__ = ["WHILE_TRIPS", "Body", "EquationPlan", "JaxprPlan", "Operand", "Program", "REUSED", "TRACED_DARRAY",
           "Traced", "Value",
           "axis_aliases", "communicates", "compile_program", "constrain_p", "constrain_target", "local_equation",
           "local_function", "moved_together", "out_moves", "own_collectives", "paused_collector", "plan_jaxpr",
           "replicated", "shared_trace", "trace", "tracing_mesh"]
