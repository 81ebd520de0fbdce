"""Sharding rules, one module per family of JAX primitives.

A rule answers, for one mesh axis and without seeing the mesh, which tuples (outputs..., inputs...) of
placements are correct for a primitive, using ``Replicate``, ``Partial(op)`` and ``ShardPlaceholder``
(see ``jshard.rules.registry``); ``jshard.propagate`` expands them to the N-D mesh and picks the
cheapest. Why each tuple is correct (linear maps keep sums, monotone maps keep max and min) is stated once,
in ``jshard.rules.algebra``. Importing this package registers every family. ``function`` gives a whole function
a rule of its own, whose local form may communicate (``jshard.rules.functions``).
"""

# importing a family registers its rules
from . import contractions, elementwise, indexing, random, reductions, shapes  # noqa: F401
from .functions import function, function_names
from .registry import Column, Rule, ShardPlaceholder, fill, override, register, registered, rule_for

__all__ = ["Column", "Rule", "ShardPlaceholder", "fill", "function", "function_names", "override", "register",
           "registered", "rule_for"]
