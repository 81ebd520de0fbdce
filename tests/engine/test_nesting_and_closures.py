"""jshard where a JAX user expects JAX's own behaviour: ``jshard.constrain`` outside ``jshard.jit``, a
``jshard.jit`` function called inside another trace, and a function closing over an array on Explicit mesh axes.

- ``constrain`` on a plain value checks its placements against the value's rank wherever it runs (eagerly,
  under ``jax.jit``), raising what ``jshard.jit`` raises, and is the identity once they pass.
- A ``jshard.jit`` function called with tracers (inside an enclosing ``jshard.jit``, ``jax.jit`` or
  ``jax.grad``) runs inline, as a nested ``jax.jit`` does; its ``out_placements`` pin its outputs.
- A closed-over ``jax.Array`` sharded on Explicit axes (``jax.make_mesh``'s default, its sharding in its
  type) is an input of the program like any sharded constant, inside ``with jax.set_mesh(mesh):`` and outside.

Every result is checked against the same computation on one device.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard
from conftest import make_mesh
from jshard import Partial, PlacementError, Replicate, Shard, StridedShard, same_as
from oracle import assert_close

R = Replicate()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 16)).astype(np.float32)
W = RNG.normal(size=(16, 8)).astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# jshard.constrain outside jshard.jit

BAD_CONSTRAINTS = [
    ("dim", [Shard(9)], r"jshard.constrain: S\(9\) on mesh axis 0 .* names dim 9, but the array has rank 2"),
    ("negative-dim", [R, Shard(-3)], r"jshard.constrain: S\(-3\) on mesh axis 1 .* names dim -3, .* rank 2"),
    ("strided-dim", [None, StridedShard(2, 2)], r"jshard.constrain: SS\(2,2\) on mesh axis 1 .* dim 2, .* rank 2"),
    ("dict-dim", {"tp": Shard(5)}, r"jshard.constrain: S\(5\) on mesh axis 'tp' names dim 5, but the array has rank 2"),
    ("partials", {"dp": Partial("max"), "tp": Partial("sum")}, r"jshard.constrain: .* mixes Partial\(max\), "
                                                               r"Partial\(sum\)"),
]


@pytest.mark.parametrize("where", ["eager", "jax.jit", "jax.grad", "jshard.jit"])
@pytest.mark.parametrize("placements,match", [c[1:] for c in BAD_CONSTRAINTS], ids=[c[0] for c in BAD_CONSTRAINTS])
def test_constrain_checks_placements_against_the_rank_wherever_it_runs(where, placements, match):
    def f(x):
        return jshard.constrain(x * 2.0, placements).sum()

    runs = {"eager": lambda: f(jnp.ones((2, 3))), "jax.jit": lambda: jax.jit(f)(jnp.ones((2, 3))),
            "jax.grad": lambda: jax.grad(f)(jnp.ones((2, 3))),
            "jshard.jit": lambda: jshard.jit(f)(jshard.distribute(np.ones((2, 3), np.float32), make_mesh((2, 4)),
                                                                  [R, R]))}
    with pytest.raises(PlacementError, match=match):
        runs[where]()


def test_constrain_of_a_plain_value_is_the_identity_once_checked():
    x = jnp.arange(6.0).reshape(2, 3)
    for placements in ([Shard(1), None], [Shard(-1), Partial()], {"tp": StridedShard(0, 2)}, [], 2 * [R]):
        assert jshard.constrain(x, placements) is x
    assert float(jshard.constrain(2.0, [R])) == 2.0
    np.testing.assert_array_equal(jax.jit(lambda a: jshard.constrain(a, [Shard(0)]) * 2)(x), x * 2)
    np.testing.assert_array_equal(jax.grad(lambda a: jshard.constrain(a, {"dp": Shard(1)}).sum())(x), np.ones((2, 3)))


# ---------------------------------------------------------------------------------------------------
# a jshard.jit function called inside another trace

def layer(x, w, power):
    return jnp.tanh(x @ w) ** power


def inputs(mesh_shape=(2, 4)):
    mesh = make_mesh(mesh_shape)
    return (jshard.distribute(X, mesh, [Shard(0)] + [R] * (mesh.devices.ndim - 1)),
            jshard.distribute(W, mesh, [R] * (mesh.devices.ndim - 1) + [Shard(1)]))


def terms_of_layer():
    """The magnitudes summed by ``layer`` and by its gradient wrt ``w`` (for the rounding bound)."""
    return np.abs(X) @ np.abs(W), np.abs(X).T @ (4 * np.abs(np.tanh(X @ W)) + np.abs(X) @ np.abs(W))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8), (1,)], ids=lambda s: "x".join(map(str, s)))
def test_a_jshard_jit_function_called_inside_another_runs_inline(mesh_shape):
    x, w = inputs(mesh_shape)
    inner = jshard.jit(layer, static_argnums=2)
    outer = jshard.jit(lambda x, w: inner(x, w, 2).sum(1) + inner(x, w, 1).sum(1))
    want = (np.tanh(X @ W) ** 2).sum(1) + np.tanh(X @ W).sum(1)
    assert_close(outer(x, w).full(), want, n=16 + 8, terms=terms_of_layer()[0].sum(1))
    # gradients through the nested call, and the nested call under jax.grad inside the enclosing jshard.jit
    g = jshard.jit(jax.grad(lambda x, w: inner(x, w, 2).sum(), argnums=1))(x, w)
    want = jax.grad(lambda w: layer(X, w, 2).sum())(W)
    assert_close(g.full(), want, n=8 + 16, terms=terms_of_layer()[1])
    g = jshard.jit(lambda x, w: jax.grad(lambda w: inner(x, w, 2).sum())(w) * 2)(x, w)
    assert_close(g.full(), want * 2, n=8 + 16, terms=2 * terms_of_layer()[1])


def test_out_placements_of_a_nested_call_pin_its_outputs():
    x, w = inputs()
    pinned = jshard.jit(layer, static_argnums=2, out_placements=(Shard(0), Shard(0)))
    y = jshard.jit(lambda x, w: pinned(x, w, 1))(x, w)
    assert y.placements == (Shard(0), Shard(0))  # the enclosing output is free: it takes the inner pin
    assert_close(y.full(), np.tanh(X @ W), n=16, terms=terms_of_layer()[0])
    gathered = jshard.jit(lambda x, w: {"y": jnp.tanh(x @ w), "n": x.sum()}, out_placements={"y": (R, R), "n": None})
    ex = jshard.explain(lambda x, w: gathered(x, w)["y"] + 1.0, x, w)
    pins = [r for r in ex.rows if r["primitive"] == "jshard_constrain"]
    assert len(pins) == 1 and pins[0]["outs"][0].placements == (R, R), ex
    # same_as names an argument's placements, which inside the enclosing plan are the plan's: left free
    kept = jshard.jit(lambda x: x * 2.0, out_placements=same_as(0))
    z = jshard.jit(lambda x: kept(x) + 1.0)(x)
    np.testing.assert_array_equal(np.asarray(z.full()), X * 2 + 1)


def test_a_jshard_jit_function_under_plain_jax_jit_and_grad_is_the_function():
    pinned = jshard.jit(layer, static_argnums=2, out_placements=(Shard(0), R))  # the pins: the identity here
    got = jax.jit(pinned, static_argnums=2)(X, W, 2)
    assert isinstance(got, jax.Array)
    assert_close(got, np.tanh(X @ W) ** 2, n=16, terms=terms_of_layer()[0])
    got = jax.grad(lambda w: pinned(X, w, 2).sum())(W)
    assert_close(got, jax.grad(lambda w: layer(X, w, 2).sum())(W), n=8 + 16, terms=terms_of_layer()[1])
    assert_close(jax.vmap(jshard.jit(jnp.sin))(X), np.sin(X))


def test_a_nested_call_given_a_closed_over_darray_names_the_fix():
    x, w = inputs()
    inner = jshard.jit(layer, static_argnums=2)
    with pytest.raises(TypeError, match=r"argument 0 of layer \(.*\) is a JAX tracer: a DArray reached .*closed "
                                        r"over by a jshard.jit function.*pass every DArray it uses as an argument"):
        jshard.jit(lambda x: inner(x, w, 1))(x)


# ---------------------------------------------------------------------------------------------------
# a closed-over jax.Array on Explicit mesh axes

EXPLICIT_MESHES = [(2, 4), (1, 8), (1,), (8,)]


def explicit_mesh(shape):
    mesh = make_mesh(shape)
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}  # jax.make_mesh's default
    return mesh


@pytest.mark.parametrize("inside", [True, False], ids=["set_mesh", "no_mesh_context"])
@pytest.mark.parametrize("mesh_shape", EXPLICIT_MESHES, ids=lambda s: "x".join(map(str, s)))
def test_a_closed_over_explicitly_sharded_array_runs_as_under_jax_jit(mesh_shape, inside):
    mesh = explicit_mesh(mesh_shape)
    w = jax.device_put(W, NamedSharding(mesh, P(None, mesh.axis_names[-1])))
    assert jax.typeof(w).sharding.spec == P(None, mesh.axis_names[-1])  # the sharding is in its type
    x = jshard.distribute(X, mesh, [Shard(0)] + [R] * (len(mesh_shape) - 1))
    forward = jshard.jit(lambda x: x @ w)
    backward = jshard.jit(jax.grad(lambda x: jnp.sin(x @ w).sum()))
    with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
        y, g = forward(x), backward(x)
        g_again = backward(x)  # the cached program
    assert_close(y.full(), X @ W, n=16, terms=np.abs(X) @ np.abs(W))
    want = np.cos(X @ W) @ W.T
    terms = (np.abs(np.cos(X @ W)) + np.abs(X) @ np.abs(W)) @ np.abs(W).T
    assert_close(g.full(), want, n=16 + 8, terms=terms)
    np.testing.assert_array_equal(np.asarray(g_again.full()), np.asarray(g.full()))
    if not w.is_fully_replicated:  # a literal otherwise: one device holds all of it anyway
        assert len(forward.trace(x).lifted) == 1  # an input of the program, taken where it lies


def test_a_closed_over_explicitly_sharded_array_in_a_larger_function():
    mesh = explicit_mesh((2, 4))
    bias = np.arange(8.0, dtype=np.float32)

    def loss_of(w, b):
        def loss(x):
            h = jax.nn.relu(x @ (jnp.zeros_like(w) + w * 2.0) + b)
            return jnp.mean(h ** 2) + jnp.sum(w) * 0.1

        return loss

    w = jax.device_put(W, NamedSharding(mesh, P("dp", "tp")))
    b = jax.device_put(bias, NamedSharding(mesh, P("tp")))
    x = jshard.distribute(X, mesh, [Shard(0), R])
    with jax.set_mesh(mesh):
        got = jshard.jit(jax.value_and_grad(loss_of(w, b)))(x)
    want = jax.value_and_grad(loss_of(jnp.asarray(W), jnp.asarray(bias)))(jnp.asarray(X))  # one device
    h = np.abs(X) @ np.abs(2 * W) + bias
    assert_close(got[0].full(), want[0], n=16 + 64, terms=np.mean(h ** 2) + 0.1 * np.abs(W).sum())
    assert_close(got[1].full(), want[1], n=16 + 8, terms=2 * h @ np.abs(2 * W).T / 64)
