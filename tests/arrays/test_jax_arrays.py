"""``jax.Array``s laid out on a mesh (``NamedSharding``), passed to ``jshard.jit`` or closed over: taken as they
are (``from_jax``: no host round trip, no collective), with the values of one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jshard
from conftest import make_mesh
from jshard import Replicate, Shard
from oracle import assert_close

RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 16)).astype(np.float32)
W = RNG.normal(size=(16, 4)).astype(np.float32)


def put(value, mesh, *spec):
    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


@pytest.mark.parametrize("x_spec,w_spec", [(("dp", "tp"), ("tp", None)), ((None, ("dp", "tp")), (None, None)),
                                            ((("tp", "dp"),), (None, "tp"))])
def test_arguments_keep_their_layout(x_spec, w_spec):
    mesh = make_mesh((2, 4))
    x, w = put(X, mesh, *x_spec), put(W, mesh, *w_spec)
    fn = jshard.jit(lambda x, w: jnp.tanh(x @ w))
    y = fn(x, w)
    assert_close(y.full(), np.tanh(X @ W), n=16)
    # the program reads the shards where they are: no collective for a layout it can use as it is
    z = jshard.jit(lambda x: x * 2)(x)
    assert z.placements == jshard.from_jax(x).placements
    np.testing.assert_array_equal(np.asarray(z.full()), X * 2)


def auto_mesh():
    """The ``make_mesh((2, 4))`` devices with Auto axes (``jax.sharding.Mesh``'s default): arrays on it have
    unsharded types, so a function may close over them."""
    mesh = make_mesh((2, 4))
    return Mesh(mesh.devices, mesh.axis_names)


def test_closed_over_sharded_arrays_become_inputs_not_constants():
    mesh = auto_mesh()
    w = put(W, mesh, "tp", None)
    x = jshard.distribute(X, mesh, [Shard(0), Replicate()])
    fn = jshard.jit(lambda x: jax.nn.relu(x @ w))
    y = fn(x)
    assert_close(y.full(), np.maximum(X @ W, 0), n=16)
    text = fn.lower(x).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "%arg0: tensor<32x4xf32>" in main  # w is the program's first input: each device's (4, 4) rows
    assert not re.search(r"dense<[^>]*> : tensor<[0-9x]*xf32>", text)  # and no float constant
    # gradients through a closed-over weight (a frozen table, say) come out as usual
    g = jshard.jit(jax.grad(lambda x: jnp.sum(jnp.sin(x @ w))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x @ W)))(X)
    assert_close(g.full(), want, n=16 + 4)


def test_an_array_on_the_same_devices_under_another_mesh_object_is_adopted():
    mesh = make_mesh((2, 4))
    auto = Mesh(mesh.devices, mesh.axis_names)  # jax.sharding.Mesh: other axis types, same devices
    x = jshard.distribute(X, mesh, [Shard(0), Replicate()])
    w = put(W, auto, None, "tp")
    y = jshard.jit(lambda x, w: x @ w)(x, w)
    assert y.mesh == mesh
    assert_close(y.full(), X @ W, n=16)


def test_an_array_on_other_devices_is_copied_through_the_host_in_one_process():
    mesh = make_mesh((2, 4))
    few = Mesh(np.array(jax.devices()[:2]), ("a",))
    x = jshard.distribute(X, mesh, [Shard(0), Replicate()])
    w = put(W, few, "a")
    y = jshard.jit(lambda x, w: x @ w)(x, w)
    assert_close(y.full(), X @ W, n=16)


def test_from_jax_onto_a_mesh_of_other_devices_is_refused():
    x = put(X, make_mesh((2, 4)), "dp")
    with pytest.raises(ValueError, match="not mesh="):
        jshard.from_jax(x, Mesh(np.array(jax.devices()[:4]), ("dp",)))


def test_an_explicitly_sharded_array_closed_over_or_passed_gives_the_same_value():
    mesh = make_mesh((2, 4))  # jax.make_mesh: Explicit axes, the sharding is in the array's type
    w = put(W, mesh, "tp", None)
    x = jshard.distribute(X, mesh, [Shard(0), Replicate()])
    closed = jshard.jit(lambda x: x @ w)(x)
    passed = jshard.jit(lambda x, w: x @ w)(x, w)
    assert_close(closed.full(), X @ W, n=16)
    np.testing.assert_array_equal(np.asarray(closed.full()), np.asarray(passed.full()))
