"""Small Flax modules the tests share."""

import jax.numpy as jnp
from flax import nnx


class Gain(nnx.Module):
    """A learned gain per feature: a module of the user's own, whose parameter no style can tell the dims of."""

    def __init__(self, n: int):
        self.gain = nnx.Param(jnp.linspace(0.5, 1.5, n))

    def __call__(self, x):
        return x * self.gain[...]
