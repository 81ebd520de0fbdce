"""One process of the multi-controller test (tests/engine/test_multiprocess.py): 2 processes x 4 CPU devices.

    python tests/multiprocess_worker.py PROCESS_ID PORT RESULT.json

The launcher sets ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. This script
joins the other process through ``jax.distributed.initialize`` before anything touches JAX's devices, then runs
every check in the same order as its peer (each check issues the same collectives on both processes and
compares only afterwards, so a failing comparison cannot leave the peer waiting), and writes
``{"process": i, "checks": {name: "pass" | error}, "digests": {name: hex}, "losses": {...}, "seconds": {...}}``
after every check (so a hang still leaves what ran before it).

Expected local blocks are computed here with numpy from the placements' definitions (torch.chunk sizes, a
``Partial(sum)`` value on coordinate 0 and zeros elsewhere, other Partials' values on every coordinate), not
with jshard's own layout code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import time
import traceback

import jax

PROCESS_ID, PORT, RESULT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# "all", "floor" or "newest" (tests/conftest.py, JSHARD_SUITE): each release's share of the suite checks the
# arrays, programs, attention and checkpoints; the floor's the tensor-parallel, autoplanned, pipelined and resumed
# GPTs, the newest's the tensor-parallel GPT again, the model patterns (scanned, explicit, a mixture, context
# parallel) and the zero role (with and without a pipeline): each GPT but one on one release, as the suite's two
# runs together take CI's time
SHARE = sys.argv[4] if len(sys.argv) > 4 else "all"

from jshard.launch import join  # noqa: E402 - jshard.launch imports no JAX device code

join(PROCESS_ID, PORT)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jshard  # noqa: E402
import jshard.checkpoint  # noqa: E402
from jshard import Partial, Replicate, Shard  # noqa: E402
from jshard.validate.tolerance import assert_close  # noqa: E402

RESULTS: dict = {"process": PROCESS_ID, "checks": {}, "digests": {}, "losses": {}, "seconds": {}}


def save() -> None:
    tmp = RESULT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1, sort_keys=True)
    os.replace(tmp, RESULT)


def check(name: str, fn, *args) -> None:
    """Run one check; record "pass" or the error (the last lines of its traceback)."""
    t0 = time.perf_counter()
    try:
        fn(*args)
        RESULTS["checks"][name] = "pass"
    except Exception as e:  # noqa: BLE001 - every failure is reported by name
        tb = traceback.format_exc().strip().splitlines()
        RESULTS["checks"][name] = f"{type(e).__name__}: {e}\n" + "\n".join(tb[-8:])
    RESULTS["seconds"][name] = round(time.perf_counter() - t0, 3)
    save()


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# meshes: 8 devices, process 0's four then process 1's four; each mesh axis in turn crosses processes

DEVICES = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
assert len(DEVICES) == 8 and jax.process_count() == 2 and len(jax.local_devices()) == 4, jax.devices()
_grid = np.array(DEVICES, dtype=object).reshape(2, 4)  # row = process
MESHES = {
    # (2, 4): axis 0 ("dp") crosses processes, axis 1 stays inside one
    "2x4": Mesh(_grid, ("dp", "tp")),
    # (4, 2): axis 1 ("b") crosses processes (column = process), axis 0 stays inside one
    "4x2": Mesh(_grid.T, ("a", "b")),
    # (8,): the one axis crosses processes (coordinates 0-3 on process 0, 4-7 on process 1)
    "8": Mesh(_grid.reshape(8), ("x",)),
}
CROSSING = {"2x4": 0, "4x2": 1, "8": 0}  # which mesh axis crosses processes
# a dp x sp x tp configuration with sp=1 (issue 37: size-1 axes crashed every gradient); dp crosses processes
SIZE_ONE = Mesh(_grid.reshape(2, 1, 4), ("dp", "sp", "tp"))


def placement(code):
    """"S0" Shard(0), "R" Replicate, "Psum" Partial("sum"), ... (the tests' own notation); a placement as it is."""
    if not isinstance(code, str):
        return code
    if code == "R":
        return Replicate()
    if code.startswith("S"):
        return Shard(int(code[1:]))
    return Partial(code[1:])


def placements(codes) -> list:
    return [placement(c) for c in codes]


def chunk(n: int, k: int, i: int) -> slice:
    """torch.chunk: piece i of k of a length-n dim (size ceil(n/k), trailing pieces short or empty)."""
    size = -(-n // k)
    start = min(i * size, n)
    return slice(start, min(start + size, n))


def expected_block(value: np.ndarray, mesh_shape, codes, coords) -> np.ndarray:
    """The local block at ``coords`` of ``value`` laid out with ``codes`` (or placements): shards split the block
    left to right over the mesh axes (nested torch.chunk; a ``StridedShard(d, sf)`` cuts dim ``d`` into ``sf``
    torch.chunk pieces and takes its chunk of each); a pending sum leaves zeros off coordinate 0."""
    def cut(a, d, piece):
        return a[(slice(None),) * d + (piece,)]

    block = value
    for axis, p in enumerate(placements(codes)):
        if p.is_shard:
            n, c, d = mesh_shape[axis], coords[axis], p.dim
            pieces = [cut(block, d, chunk(block.shape[d], p.split_factor, j)) for j in range(p.split_factor)]
            block = np.concatenate([cut(a, d, chunk(a.shape[d], n, c)) for a in pieces], axis=d)
    if any(p == Partial() and coords[axis] != 0 for axis, p in enumerate(placements(codes))):
        block = np.zeros_like(block)
    return block


def coords_of(mesh: Mesh):
    return [tuple(int(c) for c in np.unravel_index(i, mesh.devices.shape)) for i in range(mesh.devices.size)]


def mine(mesh: Mesh) -> list[bool]:
    return [d.process_index == jax.process_index() for d in mesh.devices.flat]


def expected_locals(value, mesh: Mesh, codes) -> list:
    """Per device in ``mesh.devices.flat`` order: the expected block on this process's devices, None elsewhere."""
    return [expected_block(value, mesh.devices.shape, codes, c) if m else None
            for c, m in zip(coords_of(mesh), mine(mesh))]


def host(blocks) -> list:
    return [None if b is None else np.asarray(b) for b in blocks]


def compare_locals(got: list, want: list, what: str) -> None:
    """Exact: same None pattern, shapes, dtypes and bits."""
    assert len(got) == len(want), f"{what}: {len(got)} local blocks, want {len(want)}"
    errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            if g is not None:
                errors.append(f"device {i} (another process's) gave {g!r}, want None")
        elif g is None:
            errors.append(f"device {i} (this process's) gave None, want {w.shape}")
        elif g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(g, w):
            errors.append(f"device {i}: got {g.dtype}{list(g.shape)} {g.ravel()[:12].tolist()}, want "
                          f"{w.dtype}{list(w.shape)} {w.ravel()[:12].tolist()}")
    assert not errors, f"{what}: " + "; ".join(errors[:4])


# ---------------------------------------------------------------------------------------------------
# values: every process builds the same global values (integer-valued floats: sums of them are exact)

VALUE = np.arange(60, dtype=np.float32).reshape(6, 10) - 17  # 6 rows: uneven over 4 and 8; 10 columns too
EVEN = np.arange(32, dtype=np.float32).reshape(8, 4) * 0.5

DISTRIBUTE_2D = [("S0", "S1"), ("S1", "S0"), ("S0", "R"), ("R", "S0"), ("R", "R"), ("S0", "S0"), ("S1", "S1"),
                 ("Psum", "S0"), ("S1", "Psum"), ("Pmax", "R"), ("R", "Pmin"), ("Pavg", "S1"), ("Psum", "Psum")]
DISTRIBUTE_1D = [("S0",), ("S1",), ("R",), ("Psum",), ("Pmax",), ("Pavg",)]

REDISTRIBUTE_2D = [
    (("S0", "S1"), ("R", "R")), (("R", "R"), ("S0", "S1")), (("S0", "R"), ("S1", "R")), (("R", "S0"), ("R", "S1")),
    (("S0", "S1"), ("S1", "S0")), (("S0", "S0"), ("R", "S1")), (("S1", "R"), ("R", "S0")),
    (("Psum", "S0"), ("R", "S0")), (("S0", "Psum"), ("S0", "R")), (("Psum", "R"), ("S0", "R")),
    (("R", "Psum"), ("S1", "S0")), (("Pmax", "S1"), ("R", "R")), (("Psum", "Psum"), ("S1", "R")),
    (("R", "R"), ("Psum", "R")), (("S0", "R"), ("R", "Psum")),
]
REDISTRIBUTE_1D = [(("S0",), ("R",)), (("R",), ("S1",)), (("S0",), ("S1",)), (("Psum",), ("R",)),
                   (("Psum",), ("S0",)), (("Pmax",), ("S1",)), (("R",), ("Psum",)), (("S1",), ("S0",))]


def name_of(codes) -> str:
    return ",".join(map(str, codes))


def check_distribute(mesh: Mesh, codes, value) -> None:
    x = jshard.distribute(value, mesh, placements(codes))
    got = host(x.to_local())
    assert tuple(x.placements) == tuple(placements(codes)), x.placements
    compare_locals(got, expected_locals(value, mesh, codes), f"distribute {name_of(codes)}")


def check_from_local(mesh: Mesh, codes, value) -> None:
    want = expected_locals(value, mesh, codes)
    x = jshard.from_local(want, mesh, placements(codes), shape=value.shape)
    got = host(x.to_local())
    full = np.asarray(x.full())  # the reduction of the locals: exact here (value + zeros, or equal values)
    compare_locals(got, want, f"from_local {name_of(codes)} round trip")
    assert full.shape == value.shape and np.array_equal(full, value), f"from_local {name_of(codes)}: full() differs"


def check_from_local_needs_shape(mesh: Mesh) -> None:
    """Without shape=, a process that holds only some devices cannot infer the global shape: a clear error."""
    want = expected_locals(VALUE, mesh, ("S0",) * mesh.devices.ndim)
    try:
        jshard.from_local(want, mesh, placements(("S0",) * mesh.devices.ndim))
    except ValueError as e:
        assert "shape=" in str(e), e
    else:
        raise AssertionError("from_local with None for other processes' devices and no shape= did not raise")


def check_redistribute(mesh: Mesh, src, dst, value) -> None:
    x = jshard.distribute(value, mesh, placements(src))
    y = x.redistribute(placements(dst))
    got, full = host(y.to_local()), np.asarray(y.full())
    compare_locals(got, expected_locals(value, mesh, dst), f"{name_of(src)} -> {name_of(dst)}")
    assert np.array_equal(full, value), f"{name_of(src)} -> {name_of(dst)}: full() differs from the value"


def check_reduce_random_partials(mesh: Mesh, tag: str) -> None:
    """Partial(sum) on every mesh axis from different random locals (a real reduction across processes),
    redistributed to Replicate and to Shard: the same sum within the rounding bound, and every replica of the
    reduced value bitwise equal (here and, through the digest, on the other process)."""
    k = mesh.devices.ndim
    rng = np.random.default_rng(7)
    per_device = rng.normal(size=(mesh.devices.size, 6, 10)).astype(np.float32)  # the same on both processes
    locals_ = [per_device[i] if m else None for i, m in enumerate(mine(mesh))]
    x = jshard.from_local(locals_, mesh, [Partial()] * k, shape=(6, 10))
    replicated = host(x.redistribute([Replicate()] * k).to_local())
    sharded = host(x.redistribute([Shard(0)] + [Replicate()] * (k - 1)).to_local())
    want = per_device.astype(np.float64).sum(0)
    terms = np.abs(per_device.astype(np.float64)).sum(0)
    blocks = [b for b in replicated if b is not None]
    for b in blocks:
        assert_close(b, want.astype(np.float32), n=mesh.devices.size, terms=terms, err_msg=f"{tag} Psum -> R")
        assert np.array_equal(b, blocks[0]), f"{tag}: replicas of the reduced value differ within a process"
    RESULTS["digests"][f"reduce/{tag}"] = digest(blocks[0])
    for c, b, m in zip(coords_of(mesh), sharded, mine(mesh)):
        if m:
            rows = chunk(6, mesh.devices.shape[0], c[0])
            assert_close(b, want[rows].astype(np.float32), n=mesh.devices.size, terms=terms[rows],
                         err_msg=f"{tag} Psum -> S0 at {c}")


def my_rows(mesh: Mesh, codes, value) -> tuple[slice, ...]:
    """The part of ``value`` this process's devices hold under ``codes`` (one range per dim: the union of their
    blocks' index ranges), which is what ``from_process_local`` takes from it."""
    spans = []
    for d, n in enumerate(value.shape):
        pieces = []
        for c, m in zip(coords_of(mesh), mine(mesh)):
            if not m:
                continue
            piece = slice(0, n)
            for axis, code in enumerate(codes):
                if code == f"S{d}":
                    inner = chunk(piece.stop - piece.start, mesh.devices.shape[axis], c[axis])
                    piece = slice(piece.start + inner.start, piece.start + inner.stop)
            pieces.append(piece)
        spans.append(slice(min(p.start for p in pieces), max(p.stop for p in pieces)))
    return tuple(spans)


def check_from_process_local(mesh: Mesh, codes, value) -> None:
    """Each process passes only its own rows (a per-host loader's batch); every device gets exactly its block."""
    x = jshard.from_process_local(value[my_rows(mesh, codes, value)], mesh, placements(codes), shape=value.shape)
    compare_locals(host(x.to_local()), expected_locals(value, mesh, codes), f"from_process_local {name_of(codes)}")
    assert np.array_equal(np.asarray(x.full()), value), f"from_process_local {name_of(codes)}: full() differs"


def check_jax_arrays_in(mesh: Mesh, codes, value) -> None:
    """A sharded ``jax.Array`` (a NamedSharding array spanning both processes) passed to ``jshard.jit`` and one
    closed over: taken as they are (no host fetch, which would fail for non-addressable arrays)."""
    sharding = jshard.distribute(value, mesh, placements(codes)).spec.to_named_sharding()
    x = jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    w = jax.make_array_from_callback(value.shape, sharding, lambda index: value[index] * 0.5)
    assert not x.is_fully_addressable
    y = jshard.jit(lambda a: jnp.tanh(a * w).sum(0) + a[0])(x)
    t = np.tanh(value * (value * 0.5))
    assert_close(np.asarray(y.full()), t.sum(0) + value[0], n=value.shape[0] + 1,
                 terms=np.abs(t).sum(0) + np.abs(value[0]), err_msg=f"jax.Array in, {name_of(codes)}")


def check_jax_code_on_darrays(mesh: Mesh, codes, value) -> None:
    """A DArray spanning both processes, read by plain JAX code: a ``jax.tree`` leaf, ``jnp.sum`` of it and
    ``jax.jit`` of it (``DArray.as_jax``: each process gives only the blocks of its own devices) equal float64
    numpy, and an elementwise result stays where the DArray is."""
    x = jshard.distribute(value, mesh, placements(codes))
    assert jax.tree.leaves({"x": x}) == [x] and jax.tree.map(jnp.shape, {"x": x}) == {"x": value.shape}
    total = float(jnp.sum(x))
    assert_close(np.float32(total), value.astype(np.float64).sum(), n=value.size,
                 terms=np.abs(value).sum(), err_msg=f"jnp.sum, {name_of(codes)}")
    twice = jax.jit(lambda a: a * 2)(x)
    assert twice.sharding.device_set == set(mesh.devices.flat)
    for shard in twice.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index] * 2)


def check_explicit_closure(inside: bool) -> None:
    """A function closing over a ``jax.Array`` on Explicit mesh axes (``jax.make_mesh``'s default: the sharding
    is in its type), spanning both processes: an input of the program where it lies, inside
    ``with jax.set_mesh(mesh):`` or not, forward and gradient against float64 numpy."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(_grid, ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(5)
    xv, wv = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)
    w = jax.make_array_from_callback(wv.shape, NamedSharding(mesh, P("dp", "tp")), lambda index: wv[index])
    assert not w.is_fully_addressable and jax.typeof(w).sharding.spec == P("dp", "tp")
    x = jshard.distribute(xv, mesh, placements(("S0", "R")))
    with jax.set_mesh(mesh) if inside else contextlib.nullcontext():
        y = jshard.jit(lambda a: a @ w)(x)
        g = jshard.jit(jax.grad(lambda a: jnp.sin(a @ w).sum()))(x)
    x64, w64 = xv.astype(np.float64), wv.astype(np.float64)
    terms = np.abs(x64) @ np.abs(w64)
    assert_close(np.asarray(y.full()), (x64 @ w64).astype(np.float32), n=16, terms=terms, err_msg="x @ w")
    want = np.cos(x64 @ w64) @ w64.T
    assert_close(np.asarray(g.full()), want.astype(np.float32), n=16 + 8, terms=(np.abs(np.cos(x64 @ w64)) + terms)
                 @ np.abs(w64).T, err_msg="grad of sin(x @ w)")
    RESULTS["digests"][f"explicit_closure/{'set_mesh' if inside else 'no_mesh'}"] = digest(y.full(), g.full())


def check_jax_array_on_another_mesh() -> None:
    """An argument spanning both processes on a mesh other than the call's cannot be fetched to the host: a
    clear error naming it, before any work."""
    x = jshard.distribute(EVEN, MESHES["2x4"], placements(("S0", "R")))
    other = jshard.distribute(EVEN, MESHES["4x2"], placements(("R", "S0"))).to_jax()
    try:
        jshard.jit(lambda a, b: a + b)(x, other)
    except ValueError as e:
        assert "argument 1" in str(e) and "spanning other processes" in str(e), e
    else:
        raise AssertionError("a jax.Array spanning processes on another mesh was not refused")


# ---------------------------------------------------------------------------------------------------
# jshard.jit: a small MLP forward and value_and_grad, against float64 numpy

def mlp_loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def mlp_reference(w1, w2, x, y):
    """Loss and gradients in float64, and the size of what each sums (for the rounding bound)."""
    w1, w2, x, y = (a.astype(np.float64) for a in (w1, w2, x, y))
    h = np.tanh(x @ w1)
    r = h @ w2 - y
    n = r.size
    loss = np.mean(r ** 2)
    d = 2 * r / n
    gw2 = h.T @ d
    dh = (d @ w2.T) * (1 - h ** 2)
    gw1 = x.T @ dh
    # magnitudes of the summed terms: the same chain with absolute values
    ah = np.abs(h)
    ar = ah @ np.abs(w2) + np.abs(y)
    ad = 2 * ar / n
    terms = {"loss": np.mean(ar ** 2), "w2": ah.T @ ad, "w1": np.abs(x).T @ (ad @ np.abs(w2).T)}
    return loss, {"w1": gw1, "w2": gw2}, terms


MLP_LAYOUTS = {
    # mesh: (data placements, w1 placements, w2 placements); data Shard(0) on the crossing axis, weights on the other
    "2x4": (("S0", "R"), ("R", "S1"), ("R", "S0")),
    "4x2": (("R", "S0"), ("S1", "R"), ("S0", "R")),
    "8": (("S0",), ("R",), ("R",)),
    "2x1x4": (("S0", "S0", "R"), ("R", "S1", "S1"), ("R", "R", "S0")),  # a shard on the size-1 axis too
}


def check_mlp(key: str) -> None:
    mesh = SIZE_ONE if key == "2x1x4" else MESHES[key]
    data, l1, l2 = MLP_LAYOUTS[key]
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 4)).astype(np.float32)
    w1 = (rng.normal(size=(16, 32)) / 4).astype(np.float32)
    w2 = (rng.normal(size=(32, 4)) / np.sqrt(32)).astype(np.float32)
    params = {"w1": jshard.distribute(w1, mesh, placements(l1)), "w2": jshard.distribute(w2, mesh, placements(l2))}
    xs, ys = (jshard.distribute(a, mesh, placements(data)) for a in (x, y))
    forward = float(jshard.jit(mlp_loss)(params, xs, ys))
    loss, grads = jshard.jit(jax.value_and_grad(mlp_loss))(params, xs, ys)
    loss = float(loss)
    full = {k: np.asarray(g.full()) for k, g in grads.items()}

    want_loss, want_grads, terms = mlp_reference(w1, w2, x, y)
    n = 16 + 32 + 32  # x @ w1, @ w2, the mean over 8 x 4
    assert_close(np.float32(forward), np.float32(want_loss), n=n, terms=terms["loss"], err_msg=f"{key} forward")
    assert_close(np.float32(loss), np.float32(want_loss), n=n, terms=terms["loss"], err_msg=f"{key} loss")
    for k in ("w1", "w2"):
        assert full[k].shape == want_grads[k].shape, (k, full[k].shape)
        assert_close(full[k], want_grads[k].astype(np.float32), n=n + 8, terms=terms[k], err_msg=f"{key} grad {k}")
    RESULTS["losses"][f"mlp/{key}"] = [forward.hex(), loss.hex()]
    RESULTS["digests"][f"mlp/{key}"] = digest(full["w1"], full["w2"])


# ---------------------------------------------------------------------------------------------------
# jshard.attention: the sequence sharded over a mesh axis "cp" that crosses the processes (the ring's permutes,
# the all-gather and the all-to-all run between them), forward and gradients against jax.nn.dot_product_attention

CP_MESHES = {
    "cp8": Mesh(_grid.reshape(8), ("cp",)),  # the sequence axis crosses the processes
    "dp2xcp4": Mesh(_grid, ("dp", "cp")),  # the batch axis crosses them, the sequence axis stays inside one
}
ATTENTION = {
    # name: (mesh, method pinned on cp, causal). One problem per causal flag, so one reference each: causal on 32
    # tokens striped (``balanced``) with 8 heads, the others on 30 in blocks (uneven: 4 a device, 2 on the last)
    # with 16 query heads reading 8 key/value heads (grouped); all-to-all cuts the heads evenly over 8 devices
    "cp8/ring": ("cp8", "ring", False),
    "cp8/ring_causal": ("cp8", "ring", True),
    "cp8/all_gather": ("cp8", "all_gather", False),
    "cp8/all_gather_causal": ("cp8", "all_gather", True),
    "cp8/all_to_all": ("cp8", "all_to_all", False),
    "cp8/all_to_all_causal": ("cp8", "all_to_all", True),
    "dp2xcp4/ring_causal": ("dp2xcp4", "ring", True),
}
ATTENTION_PRIMITIVES = ("jshard.attention_fwd", "jshard.attention_bwd")


def attention_program(attend, causal: bool):
    """``(loss, output), (dq, dk, dv)`` of ``sum(sin(attend(q, k, v)) * w)``: forward and backward, one program."""
    def loss(q, k, v, w):
        out = attend(q, k, v, is_causal=causal)
        return jnp.sum(jnp.sin(out) * w), out

    return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)


@functools.cache
def attention_problem(causal: bool) -> tuple:
    """The inputs ``(q, k, v, w)`` (the same on both processes) and jax.nn.dot_product_attention's
    ``(loss, output), (dq, dk, dv)`` on them, on this process's first device."""
    t, heads = (32, 8) if causal else (30, 16)
    rng = np.random.default_rng(11)
    q, w = (rng.normal(size=(2, t, heads, 4)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(2, t, 8, 4)).astype(np.float32) for _ in range(2))
    want = jax.jit(attention_program(jax.nn.dot_product_attention, causal))(q, k, v, w)
    return (q, k, v, w), jax.tree.map(np.asarray, want)


def ran_on_cp(row, axis: int) -> str:
    """How an attention equation crossed mesh axis ``axis``: "ring" (its own permutes there), "all_gather"
    (queries on the sequence, keys whole), "all_to_all" (heads), else the placements."""
    q, k = row["ins"][0].placements[axis], row["ins"][1].placements[axis]
    if any(kind == "permute" and "cp" in axes for kind, axes, _, _ in row["own"]):
        return "ring"
    if q.is_shard and q.dim == 1 and k.is_replicate:
        return "all_gather"
    return "all_to_all" if q.is_shard and q.dim == 2 else f"{q}, {k}"


def check_attention(name: str) -> None:
    """Output, loss and gradients of queries, keys and values on this process's devices against
    jax.nn.dot_product_attention on the host; ``explain`` shows the pinned method on cp, and the loss (a reduced
    value) goes to the cross-process comparison."""
    from jshard.sharded_attention import balanced

    key, method, causal = ATTENTION[name]
    mesh = CP_MESHES[key]
    (q, k, v, w), ((want_loss, want_out), want_grads) = attention_problem(causal)
    t = q.shape[1]
    layout = tuple(Shard(0) if a == "dp" else balanced(t, mesh.shape[a]) if causal else Shard(1)
                   for a in mesh.axis_names)

    def ours(q, k, v, is_causal):
        return jshard.attention(q, k, v, is_causal=is_causal, method={"cp": method})

    args = [jshard.distribute(a, mesh, layout) for a in (q, k, v, w)]
    pins = ((None, layout), (layout,) * 3)  # every result in the inputs' layout, moved there in the program
    (loss, out), grads = jshard.jit(attention_program(ours, causal), out_placements=pins)(*args)
    n = q.shape[3] + 2 * t  # the score's contraction, the softmax's sum and the values' weighted sum
    for what, got, want, terms in [("output", out, want_out, n), ("dq", grads[0], want_grads[0], 2 * n),
                                   ("dk", grads[1], want_grads[1], 2 * n), ("dv", grads[2], want_grads[2], 2 * n)]:
        assert tuple(got.placements) == layout, f"{name} {what}: {got.placements}, pinned {layout}"
        for got_block, want_block in zip(host(got.to_local()), expected_locals(want, mesh, layout), strict=True):
            assert (got_block is None) == (want_block is None), f"{name} {what}: another process's block"
            if want_block is not None:
                assert_close(got_block, want_block, n=terms, err_msg=f"{name} {what}")
    loss = float(loss)
    assert_close(np.float32(loss), want_loss, n=q.size + n, terms=np.abs(np.sin(want_out) * w).sum(),
                 err_msg=f"{name} loss")
    RESULTS["losses"][f"attention/{name}"] = loss.hex()
    explained = jshard.explain(attention_program(ours, causal), *args, out_placements=pins)
    rows = [r for r in explained.rows if r["primitive"] in ATTENTION_PRIMITIVES]
    assert len(rows) == 2, [r["primitive"] for r in rows]  # the forward and the backward unit
    ran = {ran_on_cp(r, mesh.axis_names.index("cp")) for r in rows}
    assert ran == {method}, f"{name}: attention crossed cp by {ran}, not the pinned {method}"


# ---------------------------------------------------------------------------------------------------
# jshard.parallel: the demo's GPT, 3 AdamW steps against one device: tensor-parallel on a (2, 4) mesh with dp
# crossing processes, context-parallel over all 8 devices (the ring crossing them), and pipelined over pp x dp x
# tp with one stage on each process (the activations and their gradients passing between the processes)

GPT_RUN: dict = {}
# one problem for every parallelism (so one one-device reference): 16 tokens, 2 a device over 8
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS = 32, 16, 2, 1, 16, 4, 3
# the pipelined checks' model has a block per stage (so its own one-device reference); 2 microbatches of 2 rows
PIPELINE_LAYERS, MICROBATCHES = 2, 2
_stages = _grid.reshape(2, 2, 2)  # axis 0 = process
PP_MESHES = {
    # pp crosses the processes (stage 0 on process 0, stage 1 on process 1); dp and tp stay inside each
    "pp_across": Mesh(_stages, ("pp", "dp", "tp")),
    # pp stays inside each process, dp crosses them (the checkpoint resumes here, the stages laid out otherwise)
    "pp_within": Mesh(_stages.transpose(1, 0, 2), ("pp", "dp", "tp")),
}
PP_BATCH = (Replicate(), Shard(0), Replicate())  # the rows over dp, every stage sees them


def gpt_problem(layers: int = LAYERS) -> tuple:
    """The GPT checks' model maker, loss, optimizer and corpus windows ``[steps, batch, seq + 1]``."""
    import optax
    from flax import nnx

    from jshard.demo import corpus
    from jshard.gpt import GPT, cross_entropy

    def make():
        return GPT(VOCAB, DIM, HEADS, layers, SEQ, rngs=nnx.Rngs(0))

    def loss_fn(model, ids, labels):
        return cross_entropy(model(ids), labels)

    windows = corpus(VOCAB, STEPS * BATCH * (SEQ + 1)).reshape(STEPS, BATCH, SEQ + 1)
    return make, loss_fn, optax.adamw(3e-3, eps=1e-6), windows


def train_gpt(train, mesh: Mesh, layout, windows, tag: str, after_first=lambda: None) -> list[float]:
    """The losses of ``train`` (a ``TrainStep``) over the windows, each batch laid out as ``layout``."""
    t0, losses = time.perf_counter(), []
    for step in range(len(windows)):
        ids, labels = (jshard.distribute(a, mesh, layout) for a in (windows[step, :, :-1], windows[step, :, 1:]))
        losses.append(float(train(ids, labels)))
        if step == 0:
            after_first()
        RESULTS["seconds"][f"{tag}: step {step}" + (" (with trace, plan, compile)" if step == 0 else "")] = round(
            time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
    return losses


def match_one_device(tag: str, ours: list[float], layers: int = LAYERS) -> None:
    """``ours`` are the losses of the same training (of ``gpt_problem(layers)``) on one device (trained once, by
    the first check that asks), within the rounding bound; both are recorded (the processes must agree on them
    bitwise)."""
    from jshard.gpt import one_device_trainer, summed_terms
    from jshard.validate.tolerance import curve_ratio

    name = "gpt_one_device" if layers == LAYERS else f"gpt_one_device_{layers}_layers"
    if name not in GPT_RUN:
        make, loss_fn, tx, windows = gpt_problem(layers)
        t0 = time.perf_counter()
        reference = one_device_trainer(make(), tx, loss_fn)
        GPT_RUN[name] = [reference(jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:])) for w in windows]
        RESULTS["seconds"][f"gpt: one-device reference, {layers} layers"] = round(time.perf_counter() - t0, 3)
        RESULTS["losses"][name] = [v.hex() for v in GPT_RUN[name]]
    theirs = GPT_RUN[name]
    RESULTS["losses"][tag] = [v.hex() for v in ours]
    ratio = curve_ratio(ours, theirs, n_per_step=summed_terms(VOCAB, DIM, layers, SEQ, BATCH))
    assert ratio <= 1, f"{tag}: losses {ours} vs one device {theirs}: {ratio:.2f} of the rounding bound"


def check_gpt() -> None:
    from flax import nnx

    from jshard.gpt import plan
    from jshard.parallel import TrainStep, parallelize
    from jshard.validate.tolerance import assert_within_ulps

    mesh = MESHES["2x4"]
    make, loss_fn, tx, windows = gpt_problem()
    styles, default = plan("tp", dp="dp", tp="tp")
    t0 = time.perf_counter()
    model = parallelize(make, mesh, styles, default=default)  # sharded initialisation: the scalable path
    RESULTS["seconds"]["gpt: sharded init"] = round(time.perf_counter() - t0, 3)
    ours = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param),
                                               is_leaf=lambda a: isinstance(a, jshard.DArray))
    eager = jax.tree.leaves(nnx.state(make(), nnx.Param))
    assert len(ours) == len(eager) and all(isinstance(v, jshard.DArray) for _, v in ours), ours
    for (path, got), want in zip(ours, eager):  # each device drew exactly its elements (the same bits)
        assert_within_ulps(np.asarray(got.full()), np.asarray(want), err_msg=f"sharded init of {path}")
    RESULTS["digests"]["gpt/init"] = digest(*[np.asarray(v.full()) for _, v in ours])
    train = TrainStep(model, tx, loss_fn)

    def save_first():  # checkpoint_gpt_resume picks the run up from here under another parallelism
        jshard.checkpoint.save(os.path.join(CKPT, "gpt_step1"), train.state)
        GPT_RUN.update(make=make, loss_fn=loss_fn, windows=windows, tx=tx)

    losses = train_gpt(train, mesh, [Shard(0), Replicate()], windows, "gpt", save_first)
    GPT_RUN["losses"] = losses
    match_one_device("gpt", losses)


def check_gpt_model_patterns(kind: str) -> None:
    """Models of the patterns users write, on 2x4 with the data axis crossing the processes, against the same model
    on one device: the GPT with scanned blocks (``scan=True``, fsdp+tp: the stack placed as one layer, FSDP
    gathering a layer a scan step), a Gemma-shaped model annotated for JAX's explicit sharding (its
    annotations the plan, its calls' ``out_sharding=`` pins), and a mixture-of-experts GPT with its experts over
    the axis that crosses the processes (balanced by its routing bias, carried from step to step)."""
    from flax import nnx

    from jshard.gpt import GPT, one_device_trainer, plan, summed_terms
    from jshard.parallel import TrainStep, parallelize
    from jshard.validate.tolerance import curve_ratio

    _, loss_fn, tx, windows = gpt_problem()
    layout = [Shard(0), Replicate()]
    if kind == "scanned":
        make = lambda: GPT(VOCAB, DIM, HEADS, LAYERS, SEQ, rngs=nnx.Rngs(0), scan=True)  # noqa: E731
        styles, default = plan("fsdp+tp", dp="dp", tp="tp", scan=True)
    elif kind == "moe":  # 8 experts over dp, 4 a process: the tokens cross the processes to their experts and back
        make = lambda: GPT(VOCAB, DIM, HEADS, LAYERS, SEQ, rngs=nnx.Rngs(0), experts=8, top_k=2,  # noqa: E731
                           balance=1e-2)
        styles, default = plan("ep+tp", ep="dp", tp="tp")
    else:
        from modules import ExplicitGemma

        make = lambda: ExplicitGemma(vocab=VOCAB, dim=DIM, layers=LAYERS, rngs=nnx.Rngs(0))  # noqa: E731
        styles, default = {}, ()
        reference = lambda: ExplicitGemma(vocab=VOCAB, dim=DIM, layers=LAYERS, sharded=False,  # noqa: E731
                                          rngs=nnx.Rngs(0))
    mesh = MESHES["2x4"]
    train = TrainStep(parallelize(make, mesh, styles, default=default), tx, loss_fn)
    ours = train_gpt(train, mesh, layout, windows, f"gpt_{kind}")
    one = one_device_trainer((reference if kind == "explicit" else make)(), tx, loss_fn)
    theirs = [one(jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:])) for w in windows]
    RESULTS["losses"][f"gpt_{kind}"] = [v.hex() for v in ours]
    # the Gemma's MLP and heads are wider than the GPT's terms count: twice the GPT's count bounds both
    ratio = curve_ratio(ours, theirs, n_per_step=2 * summed_terms(VOCAB, DIM, LAYERS, SEQ, BATCH))
    assert ratio <= 1, f"{kind}: losses {ours} vs one device {theirs}: {ratio:.2f} of the rounding bound"


def check_gpt_context_parallel() -> None:
    """Context parallelism over all 8 devices (``plan("cp")``, attention by ring): the ids and labels striped
    over cp (``balanced``), the key/value blocks passing between the processes at every layer, forward and
    backward."""
    from jshard.gpt import plan
    from jshard.parallel import TrainStep, parallelize
    from jshard.sharded_attention import balanced

    mesh = CP_MESHES["cp8"]
    make, loss_fn, tx, windows = gpt_problem()
    styles, default = plan("cp", method="ring")
    train = TrainStep(parallelize(make, mesh, styles, default=default), tx, loss_fn)
    losses = train_gpt(train, mesh, [balanced(SEQ, mesh.shape["cp"])], windows, "gpt_cp8_ring")
    match_one_device("gpt_cp8_ring", losses)


def check_gpt_autoplan() -> None:
    """``autoplan`` in multi-controller mode: both processes search (each measuring its devices) and find the same
    plan (process 0's measurements rank the candidates on both), which trains like one device. Under a budget both
    compile the plan on specs alone, across the processes, and agree on its bytes."""
    import zlib

    from jax.experimental import multihost_utils

    from jshard.parallel import TrainStep, autoplan, parallelize

    mesh = MESHES["2x4"]
    make, loss_fn, tx, windows = gpt_problem()
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    t0 = time.perf_counter()
    plan = autoplan(make, mesh, loss_fn, ids, ids, tx=tx, memory_budget=2**40)
    RESULTS["seconds"]["gpt: autoplan search"] = round(time.perf_counter() - t0, 3)
    assert plan.compiled_bytes is not None and plan.compiled_bytes > 0, plan.compiled_bytes
    mine = np.array([zlib.crc32(f"{plan.name} {plan.compiled_bytes}".encode()) % 2**31], np.int32)  # no x64
    assert int(multihost_utils.broadcast_one_to_all(mine)[0]) == int(mine[0]), f"process plans differ: {plan.name}"
    RESULTS["digests"]["gpt/autoplan"] = plan.name
    train = TrainStep(parallelize(make, mesh, plan), tx, loss_fn)
    losses = train_gpt(train, mesh, list(plan.batch[0]), windows, "gpt_autoplan")
    match_one_device("gpt_autoplan", losses)


def check_gpt_pipeline() -> None:
    """Pipelined (``plan("pp+dp+tp")``, 1F1B, 2 microbatches) with pp crossing the processes: each process holds
    its own stage's blocks and no other's (the stacked parameters' blocks here are the eager model's blocks of
    this process's stage), and the schedule's ppermutes carry the activations and input gradients between the
    processes every tick; the losses of 3 steps against one device. The state after the first step is saved
    for ``check_gpt_pipeline_resume``."""
    from jshard.gpt import plan
    from jshard.parallel import TrainStep, parallelize

    mesh = PP_MESHES["pp_across"]
    make, loss_fn, tx, windows = gpt_problem(PIPELINE_LAYERS)
    styles, default = plan("pp+dp+tp", microbatches=MICROBATCHES)
    model = parallelize(make, mesh, styles, default=default)
    kernel = model.blocks.layers.q.kernel.get_value()
    eager = make()
    stacked = np.stack([np.asarray(eager.blocks[i].q.kernel.get_value()) for i in range(PIPELINE_LAYERS)])
    assert kernel.spec.local_block_shape[0] == PIPELINE_LAYERS // mesh.shape["pp"], kernel.spec
    compare_locals(host(kernel.to_local()), expected_locals(stacked, mesh, kernel.placements),
                   "the stacked q kernels this process holds")
    assert all(c[0] == jax.process_index() for c, m in zip(coords_of(mesh), mine(mesh), strict=True) if m), \
        "pp does not cross the processes: a process holds devices of two stages"
    train = TrainStep(model, tx, loss_fn)

    def save_first():
        jshard.checkpoint.save(os.path.join(CKPT, "gpt_pipeline_step1"), train.state)

    losses = train_gpt(train, mesh, PP_BATCH, windows, "gpt_pp_across", save_first)
    GPT_RUN["pipeline_losses"] = losses
    match_one_device("gpt_pp_across", losses, PIPELINE_LAYERS)


def check_gpt_zero(pipelined: bool) -> None:
    """The ``zero`` role (Megatron-LM's distributed optimizer) over the axis that crosses the processes, as
    ``predict`` plans it: the whole model gathered once a step, or with ``pp`` crossing them too, every stage taking
    its parameters whole as the pipeline starts; the losses of 3 steps against one device."""
    import jax.numpy as jnp_

    from jshard.parallel import Hardware, TrainStep, parallelize, predict

    layers = PIPELINE_LAYERS if pipelined else LAYERS
    make, loss_fn, tx, windows = gpt_problem(layers)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), jnp_.int32)
    if pipelined:
        mesh = Mesh(_stages, ("pp", "zero", "tp"))  # pp crosses the processes, as in check_gpt_pipeline
        roles, micro = {"pp": 2, "zero": 2, "tp": 2}, MICROBATCHES
    else:
        mesh = Mesh(_grid, ("zero", "tp"))  # the data axis crosses them
        roles, micro = {"zero": 2, "tp": 4}, None
    plan = predict(make, loss_fn, ids, ids, hardware=Hardware.h100(), roles=roles, microbatches=micro).plan
    assert plan.axis_names == mesh.axis_names, (plan.axis_names, mesh.axis_names)
    train = TrainStep(parallelize(make, mesh, plan), tx, loss_fn)
    tag = "gpt_zero_pp" if pipelined else "gpt_zero"
    match_one_device(tag, train_gpt(train, mesh, list(plan.batch[0]), windows, tag), layers)


# ---------------------------------------------------------------------------------------------------
# jshard.checkpoint: each process writes its own devices' blocks into one checkpoint (a directory both see) and
# reads back exactly the blocks of any target layout, on any of the meshes

CKPT = os.path.join(os.path.dirname(os.path.abspath(RESULT)), "checkpoints")
SAVED = {"uneven": ("S0", "S0"), "cols": ("S1", "R"), "partial": ("Psum", "S1")}  # codes on a 2-axis mesh


def saved_codes(mesh: Mesh, codes):
    return codes if mesh.devices.ndim == 2 else codes[:1]


def check_checkpoint_save(key: str) -> None:
    """Save under ``key``'s mesh; both processes' OCDBT stores hold data (each wrote its own blocks)."""
    mesh = MESHES[key]
    tree = {name: jshard.distribute(VALUE, mesh, placements(saved_codes(mesh, codes))) for name, codes in SAVED.items()}
    tree["step"] = 7
    path = os.path.join(CKPT, key)
    jshard.checkpoint.save(path, tree)
    stores = sorted(n for n in os.listdir(path) if n.startswith("ocdbt.process_"))
    assert stores == ["ocdbt.process_0", "ocdbt.process_1"], f"per-process stores: {stores}"


def check_checkpoint_restore(saved_key: str, target_key: str) -> None:
    """Restore a checkpoint saved under one mesh into other layouts on another: every block this process holds
    is the expected block of the value (numpy oracle), the others None."""
    mesh = MESHES[target_key]
    targets = {"uneven": ("S1", "S0"), "cols": ("R", "S1"), "partial": ("S0", "Psum")}
    like = {name: jshard.Spec.create(mesh, placements(saved_codes(mesh, codes)), VALUE.shape, VALUE.dtype)
            for name, codes in targets.items()}
    back = jshard.checkpoint.restore(os.path.join(CKPT, saved_key), like={**like, "step": 0})
    assert back["step"] == 7, back["step"]
    for name, codes in targets.items():
        compare_locals(host(back[name].to_local()), expected_locals(VALUE, mesh, saved_codes(mesh, codes)),
                       f"checkpoint {saved_key} -> {target_key}: {name}")


def check_checkpoint_read_by_orbax(saved_key: str) -> None:
    """A JAX user's Orbax restore of a jshard checkpoint (``StandardCheckpointer``, NamedSharding targets whose
    columns cross the processes): every shard this process holds is the value's (numpy oracle). The checkpoint
    mixes layouts Orbax's own handler wrote (a NamedSharding expressed them) with jshard's uneven ones."""
    import orbax.checkpoint as ocp

    mesh = MESHES["2x4"]
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "dp"))
    target = {name: jax.ShapeDtypeStruct(VALUE.shape, VALUE.dtype, sharding=sharding) for name in SAVED}
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(os.path.join(CKPT, saved_key), {**target, "step": 0})
    assert back["step"] == 7, back["step"]
    for name in SAVED:
        assert back[name].sharding == sharding, back[name].sharding
        for shard in back[name].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), VALUE[shard.index]), f"orbax {saved_key}: {name}"


def check_checkpoint_on_local_devices() -> None:
    """Every process restores the whole checkpoint onto a mesh of its own 4 devices (a (4,) mesh)."""
    mesh = Mesh(np.array(jax.local_devices()), ("x",))
    like = {name: jshard.Spec.create(mesh, [Shard(1)], VALUE.shape, VALUE.dtype) for name in SAVED}
    back = jshard.checkpoint.restore(os.path.join(CKPT, "2x4"), like={**like, "step": 0})
    for name in SAVED:
        assert np.array_equal(np.asarray(back[name].full()), VALUE), f"checkpoint 2x4 -> local (4,): {name}"


def check_gpt_resume() -> None:
    """The GPT run saved after its first step, resumed fully sharded over the (8,) mesh: the uninterrupted run's
    losses (rtol 1e-6: another parallelism sums in another order)."""
    from jshard.gpt import plan
    from jshard.parallel import TrainStep, parallelize

    mesh = MESHES["8"]
    styles, default = plan("fsdp", dp="x", tp="x")
    train = TrainStep(parallelize(GPT_RUN["make"], mesh, styles, default=default), GPT_RUN["tx"], GPT_RUN["loss_fn"])
    train.state = jshard.checkpoint.restore(os.path.join(CKPT, "gpt_step1"), like=train.state)
    windows, again = GPT_RUN["windows"], []
    for step in range(1, len(windows)):
        ids, labels = (jshard.distribute(a, mesh, [Shard(0)]) for a in (windows[step, :, :-1], windows[step, :, 1:]))
        again.append(float(train(ids, labels)))
    RESULTS["losses"]["gpt_resumed_fsdp8"] = [v.hex() for v in again]
    np.testing.assert_allclose(again, GPT_RUN["losses"][1:], rtol=1e-6)


def check_gpt_pipeline_resume() -> None:
    """The pipelined run saved after its first step (each process wrote its own stage's blocks) resumed with the
    stages inside each process and dp across them (each process reads both stages' blocks): the uninterrupted
    run's losses (rtol 1e-6: the reductions cross other devices), and so one device's."""
    from jshard.gpt import plan
    from jshard.parallel import TrainStep, parallelize

    mesh = PP_MESHES["pp_within"]
    make, loss_fn, tx, windows = gpt_problem(PIPELINE_LAYERS)
    styles, default = plan("pp+dp+tp", microbatches=MICROBATCHES)
    train = TrainStep(parallelize(make, mesh, styles, default=default), tx, loss_fn)
    train.state = jshard.checkpoint.restore(os.path.join(CKPT, "gpt_pipeline_step1"), like=train.state)
    again = train_gpt(train, mesh, PP_BATCH, windows[1:], "gpt_pp_within_resumed")
    RESULTS["losses"]["gpt_pp_within_resumed"] = [v.hex() for v in again]
    np.testing.assert_allclose(again, GPT_RUN["pipeline_losses"][1:], rtol=1e-6)


def main() -> None:
    t0 = time.perf_counter()
    for key, mesh in MESHES.items():
        cases = DISTRIBUTE_2D if mesh.devices.ndim == 2 else DISTRIBUTE_1D
        for codes in cases:
            check(f"distribute/{key}/{name_of(codes)}", check_distribute, mesh, codes, VALUE)
        check(f"distribute/{key}/even", check_distribute, mesh, ("S0",) * mesh.devices.ndim, EVEN)
    for codes in [("S0", "S0", "S1"), ("Psum", "Psum", "S0"), ("R", "Pavg", "R")]:
        check(f"distribute/2x1x4/{name_of(codes)}", check_distribute, SIZE_ONE, codes, VALUE)
    for key, mesh in MESHES.items():
        cases = DISTRIBUTE_2D if mesh.devices.ndim == 2 else DISTRIBUTE_1D
        for codes in cases[:: 2]:
            check(f"from_local/{key}/{name_of(codes)}", check_from_local, mesh, codes, VALUE)
        check(f"from_local/{key}/needs_shape", check_from_local_needs_shape, mesh)
    for key, mesh in MESHES.items():
        cases = REDISTRIBUTE_2D if mesh.devices.ndim == 2 else REDISTRIBUTE_1D
        for src, dst in cases:
            check(f"redistribute/{key}/{name_of(src)}->{name_of(dst)}", check_redistribute, mesh, src, dst, VALUE)
        check(f"redistribute/{key}/random_partial_sums", check_reduce_random_partials, mesh, key)
    for src, dst in [(("S0", "S0", "S1"), ("R", "S1", "S0")), (("Psum", "S0", "R"), ("S0", "R", "Psum"))]:
        check(f"redistribute/2x1x4/{name_of(src)}->{name_of(dst)}", check_redistribute, SIZE_ONE, src, dst, VALUE)
    for key, mesh in MESHES.items():
        data = MLP_LAYOUTS[key][0]
        for codes in (data, ("S1",) + data[1:]):
            check(f"from_process_local/{key}/{name_of(codes)}", check_from_process_local, mesh, codes, VALUE)
        check(f"jax_arrays_in/{key}", check_jax_arrays_in, mesh, data, EVEN)
        check(f"jax_arrays_out/{key}", check_jax_code_on_darrays, mesh, data, VALUE)
        check(f"jax_arrays_out/{key}/partial", check_jax_code_on_darrays, mesh, ("Psum",) + data[1:], VALUE)
    check("from_process_local/2x1x4/S0,S0,R", check_from_process_local, SIZE_ONE, ("S0", "S0", "R"), VALUE)
    check("jax_arrays_in/another_mesh", check_jax_array_on_another_mesh)
    for inside in (True, False):
        check(f"jax_arrays_in/explicit_closure_{'set_mesh' if inside else 'no_mesh'}", check_explicit_closure, inside)
    for key in MLP_LAYOUTS:
        check(f"jit_mlp/{key}", check_mlp, key)
    for name in ATTENTION:
        check(f"attention/{name}", check_attention, name)
    check("gpt/tp_2x4", check_gpt)
    if SHARE != "floor":
        for kind in ("scanned", "explicit", "moe"):
            check(f"gpt/{kind}_2x4", check_gpt_model_patterns, kind)
        check("gpt/cp8_ring", check_gpt_context_parallel)
        check("gpt/zero2xtp4", check_gpt_zero, False)
        check("gpt/pp2xzero2xtp2_pp_across", check_gpt_zero, True)
    if SHARE != "newest":
        check("gpt/autoplan_2x4", check_gpt_autoplan)
        check("gpt/pp2xdp2xtp2_pp_across", check_gpt_pipeline)
    for key in MESHES:
        check(f"checkpoint/save_{key}", check_checkpoint_save, key)
    for saved_key, target_key in [("2x4", "4x2"), ("4x2", "8"), ("8", "2x4"), ("2x4", "2x4")]:
        check(f"checkpoint/{saved_key}->{target_key}", check_checkpoint_restore, saved_key, target_key)
    for saved_key in MESHES:
        check(f"checkpoint/{saved_key}->orbax", check_checkpoint_read_by_orbax, saved_key)
    check("checkpoint/local_devices", check_checkpoint_on_local_devices)
    if SHARE != "newest":
        check("checkpoint/gpt_resume", check_gpt_resume)
        check("checkpoint/gpt_pipeline_resume", check_gpt_pipeline_resume)
    RESULTS["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    RESULTS["done"] = True
    save()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
