"""Tests run on 8 devices: 8 or more real accelerators when present, else 8 emulated CPU devices."""

import math
import os

# must happen before JAX is imported anywhere; real GPUs/TPUs are left alone (the flag only affects
# the host platform)
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# the suite compiles thousands of small programs that run once: LLVM's fuller optimisations of their code cost
# more than they save (test_parallel.py and test_flax_layers.py: 150 s at the default level, 115 s at 1). It
# changes no HLO pass, so plans, buffers and memory analyses are the same; level 0 would change the bits of some
# elementwise math between fused and unfused code, which the sharded initialisers' bitwise tests catch, level 1
# does not. The processes and notebook kernels the tests start inherit it.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"

# one persistent compilation cache for the run: the two workers, the notebooks' kernels and the processes the
# tests start compile many of the same programs (one model's step in several files), and each reads what another
# compiled; XLA's own caches and its small programs included. A fresh directory per run, removed at its end
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jshard-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

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


# The suite's mesh matrix: every shape a test may name, with its axis names. Size-1 axes and one device are what
# users have (one GPU, a dp x tp configuration scaled down to one host), so they are in the matrix beside the
# 8-device meshes; ``MESH_SHAPES`` is what every property test draws from.
MESH_SHAPES = {(8,): ("x",), (2, 4): ("dp", "tp"), (4, 2): ("a", "b"), (2, 2, 2): ("x", "y", "z"),
               (1, 8): ("dp", "tp"), (8, 1): ("dp", "tp"), (2, 1, 4): ("dp", "sp", "tp"), (1,): ("x",),
               (1, 1): ("dp", "tp")}
# the meshes a parametrized sweep runs by default: one of each kind (a 1-D, a 2-D, a 3-D mesh, a size-1 axis on
# each side, one device); ``mesh_params`` marks the others slow
DEFAULT_MESH_SHAPES = ((8,), (2, 4), (2, 2, 2), (1, 8), (8, 1), (1,))


def make_mesh(shape):
    """The matrix's mesh of ``shape`` on the first ``prod(shape)`` devices."""
    n = math.prod(shape)
    if len(jax.devices()) < n:
        pytest.fail(f"the tests need {n} devices, found {jax.devices()}")
    return jax.make_mesh(shape, MESH_SHAPES[shape], devices=jax.devices()[:n])


def mesh_params(shapes=tuple(MESH_SHAPES), default=DEFAULT_MESH_SHAPES) -> list:
    """``shapes`` as pytest params with readable ids (``2x4``), those outside ``default`` marked slow."""
    return [pytest.param(s, id="x".join(map(str, s)), marks=() if s in default else pytest.mark.slow) for s in shapes]


@pytest.fixture(scope="session", params=mesh_params())
def mesh(request):
    """Every mesh of the matrix: the default ones in the default suite, the others under ``-m slow``."""
    return make_mesh(request.param)


# the files whose tests start processes of their own (notebook kernels, two JAX processes, the demo, a benchmark) run
# longest: dealt first, whole files in their own order, so that the two workers finish together rather than one
# waiting out the other's last long test
_DEALT_FIRST = ("test_multiprocess.py", "test_notebooks.py", "test_readme.py", "test_demo.py",
                "test_autoplan_benchmark.py", "test_pipeline_benchmark.py")


# CI runs the suite in two JAX environments (the floor and the newest releases) and shares it out between them
# (JSHARD_SUITE=floor or newest; unset, as under a plain `pytest tests`, every test runs). The newest releases run
# what depends on JAX, Flax and Orbax's own code: the rules of the primitives, arrays and their layouts, the engine
# (jaxprs, lowering, several processes), checkpoints, the models written with Flax's transforms and explicit
# sharding, every docstring; and the end-to-end runs that sit on all of it (the notebooks, the demo, parallelize's
# and autoplan's training sweeps), which the floor leaves to them. The floor runs everything else.
_BOTH = ("rules", "arrays", "engine", "checkpoints", "test_explicit_sharding.py", "test_scanned_layers.py",
         "test_doctests.py")
_NEWEST_ONLY = ("test_notebooks.py", "test_demo.py", "test_parallel.py", "test_autoplan.py")


def _runs_in(item, suite: str) -> bool:
    names = {item.path.name, item.path.parent.name}
    if suite == "newest":
        return bool(names & set(_BOTH + _NEWEST_ONLY))
    return not names & set(_NEWEST_ONLY)


def pytest_collection_modifyitems(config, items):
    suite = os.environ.get("JSHARD_SUITE")
    if suite is not None:
        if suite not in ("floor", "newest"):
            raise pytest.UsageError(f"JSHARD_SUITE={suite!r}: use floor or newest (or leave it unset: every test)")
        kept = [item for item in items if _runs_in(item, suite)]
        config.hook.pytest_deselected(items=[item for item in items if not _runs_in(item, suite)])
        items[:] = kept
    items.sort(key=lambda item: item.path.name not in _DEALT_FIRST)  # a stable sort
