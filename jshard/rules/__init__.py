"""Sharding rules, one module per family of JAX primitives (arrives with the rules issue).

A rule answers, for one mesh axis and without seeing the mesh, which tuples (outputs..., inputs...) of
placements are correct for a primitive, using Replicate, Partial(op) and shard placeholders; the
propagator (``jshard.propagate``) expands them to the N-D mesh and picks the cheapest with the
redistribution cost model of ``jshard.planner``. Nothing is registered yet.
"""
