"""Primitive coverage does not regress: the programs of real training steps never fall back to the no-rule
path (an equation without a sharding rule runs replicated, with a warning; here that warning is an error).

Each JAX release may emit new primitives for the same code (jax 0.11.2's ``one_minus_square`` for tanh's
derivative and ``log2`` for ``jnp.log2``, jax 0.12's ``polynomial`` for erf's), so this runs on every JAX the suite
runs on: the engine corpus forward and backward, the GPT training step with AdamW, and the layers and initialisers
of common models.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from corpus import PROGRAMS, grad_fn, make_args
from flax import nnx

import jshard
from conftest import make_mesh
from jshard import Replicate, Shard
from jshard.gpt import GPT, cross_entropy
from oracle import assert_close


def assert_every_equation_has_a_rule(fn, *args):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="jshard has no sharding rule")
        traced = jshard.jit(fn).trace(*args)
    assert traced.plan.without_rules() == [], f"ran replicated for want of a rule: {traced.plan.without_rules()}"


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_corpus_programs_have_rules_forward_and_backward(name):
    args, _ = make_args(name, (2, 4), "tp")
    assert_every_equation_has_a_rule(PROGRAMS[name].fwd, *args)
    assert_every_equation_has_a_rule(grad_fn(PROGRAMS[name]), *args)


def test_gpt_training_step_has_rules():
    mesh = make_mesh((2, 4))
    model = GPT(vocab=32, dim=16, heads=2, layers=1, seq=8, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)
    opt = tx.init(params)

    def step(params, opt, ids, labels):
        loss, grads = jax.value_and_grad(lambda p: cross_entropy(nnx.merge(graphdef, p)(ids), labels))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    ids = jshard.distribute(np.arange(32, dtype=np.int32).reshape(4, 8) % 32, mesh, [Shard(0), Replicate()])
    assert_every_equation_has_a_rule(step, params, opt, ids, ids)


# name: (function of an (8, 16) array with values in [-2, 2], terms summed along its longest chain, their size)
LAYERS = {
    "gelu (erf)": (lambda x: jax.nn.gelu(x, approximate=False), 1, None),
    "gelu (tanh)": (jax.nn.gelu, 1, None),
    "silu": (jax.nn.silu, 1, None),
    "log2 / exp2": (lambda x: jnp.log2(jnp.abs(x) + 1.0) * jnp.exp2(x), 1, None),
    "erfc / erfinv": (lambda x: jax.scipy.special.erfc(x) + jax.scipy.special.erfinv(jnp.tanh(x) * 0.5), 1, None),
    "rms norm": (lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6), 16, None),
    "log-softmax": (jax.nn.log_softmax, 16, None),
    # |sin y| @ |y|.T and |tanh(y @ y.T)| @ |y| sum at most 16 terms of size 2, and 8 terms of size 2
    "checkpoint": (lambda x: jax.checkpoint(lambda y: jnp.sin(y) @ y.T)(x), 16, 32.0),
    "checkpoint, dots saved": (lambda x: jax.checkpoint(lambda y: jnp.tanh(y @ y.T) @ y,
                                                        policy=jax.checkpoint_policies.dots_saveable)(x), 24, 16.0),
    "optimization barrier": (lambda x: jax.lax.optimization_barrier((x, x * 2.0))[1], 1, None),
    "truncated normal init": (lambda x: x + jax.random.truncated_normal(jax.random.key(1), -2.0, 2.0, x.shape), 1,
                              None),
    "clip by global norm": (lambda x: optax.clip_by_global_norm(1.0).update({"w": x}, optax.EmptyState())[0]["w"],
                            128, None),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_common_layers_have_rules_forward_and_backward(name):
    f, n, terms = LAYERS[name]
    x = jshard.distribute(np.linspace(-2, 2, 8 * 16, dtype=np.float32).reshape(8, 16), make_mesh((2, 4)),
                          [Shard(0), Shard(1)])
    assert_every_equation_has_a_rule(f, x)
    assert_every_equation_has_a_rule(jax.grad(lambda y: jnp.sum(f(y))), x)
    assert_close(np.asarray(jshard.jit(f)(x).full()), np.asarray(jax.jit(f)(x.full())), n=n, terms=terms)

