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
import hashlib
import json
import os
import sys
import time
import traceback

import jax

PROCESS_ID, PORT, RESULT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

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


def placement(code: str):
    """"S0" Shard(0), "R" Replicate, "Psum" Partial("sum"), ... (the tests' own notation)."""
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
    """The local block at ``coords`` of ``value`` laid out with ``codes``: shards split the block left to right
    over the mesh axes (nested torch.chunk); a pending sum leaves zeros off coordinate 0."""
    block = value
    for axis, code in enumerate(codes):
        if code.startswith("S"):
            d = int(code[1:])
            index = [slice(None)] * block.ndim
            index[d] = chunk(block.shape[d], mesh_shape[axis], coords[axis])
            block = block[tuple(index)]
    if any(code == "Psum" and coords[axis] != 0 for axis, code in enumerate(codes)):
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
    return ",".join(codes)


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
# jshard.parallel: the demo's GPT, tensor-parallel on a (2, 4) mesh with dp crossing processes, 3 AdamW steps

GPT_RUN: dict = {}


def check_gpt() -> None:
    import optax
    from flax import nnx

    from jshard.demo import corpus
    from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
    from jshard.parallel import TrainStep, parallelize
    from jshard.validate.tolerance import assert_within_ulps, curve_ratio

    vocab, dim, heads, layers, seq, batch, steps = 32, 16, 2, 1, 8, 4, 3
    mesh = MESHES["2x4"]

    def make():
        return GPT(vocab, dim, heads, layers, seq, rngs=nnx.Rngs(0))

    def loss_fn(model, ids, labels):
        return cross_entropy(model(ids), labels)

    windows = corpus(vocab, steps * batch * (seq + 1)).reshape(steps, batch, seq + 1)
    styles, default = plan("tp", dp="dp", tp="tp")
    tx = optax.adamw(3e-3, eps=1e-6)
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
    t0 = time.perf_counter()
    train = TrainStep(model, tx, loss_fn)
    ours = []
    for step in range(steps):
        ids, labels = (jshard.distribute(a, mesh, [Shard(0), Replicate()])
                       for a in (windows[step, :, :-1], windows[step, :, 1:]))
        ours.append(float(train(ids, labels)))
        if step == 0:  # checkpoint_gpt_resume picks the run up from here under another parallelism
            jshard.checkpoint.save(os.path.join(CKPT, "gpt_step1"), train.state)
            GPT_RUN.update(make=make, loss_fn=loss_fn, windows=windows, tx=tx)
        label = f"gpt: step {step}" + (" (with trace, plan, compile)" if step == 0 else "")
        RESULTS["seconds"][label] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
    reference = one_device_trainer(make(), tx, loss_fn)
    theirs = [reference(jnp.asarray(windows[s, :, :-1]), jnp.asarray(windows[s, :, 1:])) for s in range(steps)]
    RESULTS["seconds"]["gpt: one-device reference"] = round(time.perf_counter() - t0, 3)
    RESULTS["losses"]["gpt"] = [v.hex() for v in ours]
    GPT_RUN["losses"] = ours
    RESULTS["losses"]["gpt_one_device"] = [v.hex() for v in theirs]
    ratio = curve_ratio(ours, theirs, n_per_step=summed_terms(vocab, dim, layers, seq, batch))
    assert ratio <= 1, f"GPT losses {ours} vs one device {theirs}: {ratio:.2f} of the rounding bound"


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
    check("from_process_local/2x1x4/S0,S0,R", check_from_process_local, SIZE_ONE, ("S0", "S0", "R"), VALUE)
    check("jax_arrays_in/another_mesh", check_jax_array_on_another_mesh)
    for inside in (True, False):
        check(f"jax_arrays_in/explicit_closure_{'set_mesh' if inside else 'no_mesh'}", check_explicit_closure, inside)
    for key in MLP_LAYOUTS:
        check(f"jit_mlp/{key}", check_mlp, key)
    check("gpt/tp_2x4", check_gpt)
    for key in MESHES:
        check(f"checkpoint/save_{key}", check_checkpoint_save, key)
    for saved_key, target_key in [("2x4", "4x2"), ("4x2", "8"), ("8", "2x4"), ("2x4", "2x4")]:
        check(f"checkpoint/{saved_key}->{target_key}", check_checkpoint_restore, saved_key, target_key)
    for saved_key in MESHES:
        check(f"checkpoint/{saved_key}->orbax", check_checkpoint_read_by_orbax, saved_key)
    check("checkpoint/local_devices", check_checkpoint_on_local_devices)
    check("checkpoint/gpt_resume", check_gpt_resume)
    RESULTS["seconds"]["total"] = round(time.perf_counter() - t0, 3)
    RESULTS["done"] = True
    save()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
