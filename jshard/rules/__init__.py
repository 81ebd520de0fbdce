"""Sharding rules, one module per family of JAX primitives.

A rule answers, for one mesh axis and without seeing the mesh, which tuples (outputs..., inputs...) of
placements are correct for a primitive, using ``Replicate``, ``Partial(op)`` and ``ShardPlaceholder``
(see ``jshard.rules.registry``); ``jshard.propagate`` expands them to the N-D mesh and picks the
cheapest. Importing this package registers every family.
"""

from . import contractions, elementwise, indexing, random, reductions, shapes  # noqa: F401  (they register rules)
from .registry import Column, Rule, ShardPlaceholder, fill, register, registered, rule_for

__all__ = ["Column", "Rule", "ShardPlaceholder", "fill", "register", "registered", "rule_for"]
