"""Tests run on 8 devices: 8 or more real accelerators when present, else 8 emulated CPU devices."""

import os

# must happen before JAX is imported anywhere; real GPUs/TPUs are left alone (the flag only affects
# the host platform)
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.extend  # noqa: E402
import pytest  # noqa: E402

if len(jax.devices()) < 8:
    # fewer than 8 accelerators (a single GPU, say): run everything on the 8 emulated CPU devices
    jax.extend.backend.clear_backends()
    jax.config.update("jax_platforms", "cpu")

def pytest_report_header(config):
    import importlib.metadata as metadata
    import sys

    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("jax", "jaxlib", "flax", "optax", "numpy"))
    return f"jshard on Python {sys.version.split()[0]}: {versions}; devices: {jax.devices()[0].platform} x8"


MESH_SHAPES = {(8,): ("x",), (2, 4): ("dp", "tp"), (4, 2): ("a", "b"), (2, 2, 2): ("x", "y", "z")}


@pytest.fixture(scope="session", params=list(MESH_SHAPES), ids=lambda s: "x".join(map(str, s)))
def mesh(request):
    shape = request.param
    if len(jax.devices()) < 8:
        pytest.fail(f"the tests need 8 devices, found {jax.devices()}")
    return jax.make_mesh(shape, MESH_SHAPES[shape], devices=jax.devices()[:8])


def make_mesh(shape):
    return jax.make_mesh(shape, MESH_SHAPES[shape], devices=jax.devices()[:8])
