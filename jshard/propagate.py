"""Placement propagation through a jaxpr (arrives with the rules and engine issues).

It will expand the single-mesh-axis rules of ``jshard.rules`` to the N-D mesh, choose per equation the
strategy of least redistribution cost (``jshard.planner``) and produce the plan that ``jshard.lowering``
turns into one ``shard_map`` program. Nothing here runs yet.
"""
