"""Reading JAX's control-flow params across the JAX versions jshard supports (0.10.2 to the newest).

Equation params are JAX internals and change between releases: jax 0.11 replaced scan's ``num_consts`` /
``num_carry`` by ``ft_in`` / ``ft_out`` flat trees of (consts, carry, xs) and (carry, ys). The engine reads
them here, in one place, never by ``params[...]`` where they differ.
"""

from __future__ import annotations

__all__ = ["scan_counts"]


def scan_counts(params: dict) -> tuple[int, int]:
    """``(number of consts, number of carry values)`` of a ``scan`` equation's operands (consts, carry, xs)."""
    if "num_consts" in params:  # jax <= 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax >= 0.11: a flat tree of (consts, carry, xs)
    return len(consts), len(carry)
