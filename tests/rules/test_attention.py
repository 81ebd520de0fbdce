"""``jshard.attention`` against ``jax.nn.dot_product_attention`` on one device.

Outside ``jshard.jit`` it must be that function (values and gradients). Under ``jshard.jit`` every way it runs
(ring, all-gather, all-to-all, batch, heads, all-Replicate) must give the one-device output and gradients with
respect to query, key and value: causal or not, grouped-query attention, uneven sequence lengths, bias and mask,
on 8, 2x4 (sequence on one axis, batch or heads on the other), 1x8 and one device. The cost model chooses the
way (a slow hop favours the ring's one-hop steps, cheap bytes the all-gather's two collectives, large blocks the
all-to-all's small ones) and ``explain`` must show it; the ring's program must hold far fewer bytes than one that
scores whole sequences, run exactly the permutes it declares, and queued calls of it must not deadlock XLA:CPU.
The striped layout (``balanced``) must give every device the same causal work (``load``, the kernel's own block
geometry and skip rule, within 5%) where contiguous blocks give the last device far more, and the same results.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh, mesh_params
from jshard import AxisCost, CostModel, Replicate, Shard, StridedShard, attention
from jshard.engine import axis_aliases
from jshard.sharded_attention import balanced, load

R = Replicate()
RING = CostModel(default=AxisCost(latency_us=20.0))  # a hop costs more than a launch: one-hop steps pay
GATHER = CostModel(launch_us=100.0, default=AxisCost(bandwidth_gbps=1e6))  # launches dear, bytes free: fewest win
PRIMS = ("jshard.attention", "jshard.attention_fwd", "jshard.attention_bwd", "jshard.attention_masked",
         "jshard.attention_masked_fwd", "jshard.attention_masked_bwd")


def _qkv(b=2, t=32, heads=4, kv_heads=2, dim=8, tk=None, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, heads, dim)).astype(np.float32)
    k, v = (rng.normal(size=(b, tk or t, kv_heads, dim)).astype(np.float32) for _ in range(2))
    return q, k, v


def _loss(f, **kw):
    return lambda q, k, v, *extra: jnp.sum(jnp.sin(f(q, k, v, *extra, **kw)) * jnp.arange(q.shape[1])[:, None, None])


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


def _named(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[:math.prod(shape)])


def _rows(e):
    return [r for r in e.rows if r["primitive"] in PRIMS]


def _method(row, seq_axis):
    """Which way an attention equation ran on mesh axis ``seq_axis``."""
    q, k = row["ins"][0].placements[seq_axis], row["ins"][1].placements[seq_axis]
    if row["own"]:
        return "ring"
    if q.is_shard and q.dim == 1:  # Shard(1) or striped
        return "all-gather" if k == R else "?"
    return {Shard(2): "heads", Shard(0): "batch", R: "replicate"}[q]


def _check(mesh, placements, args, model, extra=(), **kw):
    """Output and gradients under jshard.jit equal one device's; returns the explanations (forward, gradient)."""
    darrays = [jshard.distribute(a, mesh, p) for a, p in zip(args, placements, strict=True)]
    f = jshard.jit(lambda *a: attention(*a, **kw), cost_model=model)
    _close(f(*darrays).full(), jax.nn.dot_product_attention(*args, **kw))
    argnums = tuple(range(len(args) - len(extra) + (1 if "bias" in extra else 0)))
    grad = jax.grad(_loss(attention, **kw), argnums)
    got = jshard.jit(grad, cost_model=model)(*darrays)
    want = jax.grad(_loss(jax.nn.dot_product_attention, **kw), argnums)(*args)
    for g, w in zip(got, want, strict=True):
        _close(g.full(), w, 1e-4)
    return (jshard.explain(lambda *a: attention(*a, **kw), *darrays, cost_model=model),
            jshard.explain(grad, *darrays, cost_model=model))


def _expected(model, n):
    """The way the model picks over a sequence axis of ``n`` devices: a ring of two is one step, one launch
    against the all-gather's two, so it wins under either model."""
    return "ring" if model is RING or n == 2 else "all-gather"


def _seq_placements(shape, seq_dim=1):
    """The sequence (dim ``seq_dim``) on the last mesh axis, the batch on the first of several."""
    return ([Shard(0)] + [R] * (len(shape) - 2) if len(shape) > 1 else []) + [Shard(seq_dim)]


# ---------------------------------------------------------------------------------------------------
# outside jshard.jit: jax.nn.dot_product_attention itself


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.3}], ids=["plain", "causal", "scale"])
def test_plain_arrays_are_jax_dot_product_attention(kw):
    q, k, v = _qkv(t=12, tk=12)
    _close(attention(q, k, v, **kw), jax.nn.dot_product_attention(q, k, v, **kw), 1e-6)
    _close(attention(q[0], k[0], v[0], **kw), jax.nn.dot_product_attention(q[0], k[0], v[0], **kw), 1e-6)
    got = jax.grad(_loss(attention, **kw), (0, 1, 2))(q, k, v)
    for g, w in zip(got, jax.grad(_loss(jax.nn.dot_product_attention, **kw), (0, 1, 2))(q, k, v), strict=True):
        _close(g, w, 1e-5)
    _close(jax.jit(lambda *a: attention(*a, **kw))(q, k, v), jax.nn.dot_product_attention(q, k, v, **kw), 1e-6)


def test_plain_arrays_with_bias_and_mask():
    q, k, v = _qkv(t=12, tk=10)
    rng = np.random.default_rng(1)
    bias = rng.normal(size=(1, 4, 12, 10)).astype(np.float32)
    mask = rng.random((2, 1, 12, 10)) > 0.3
    _close(attention(q, k, v, bias, mask), jax.nn.dot_product_attention(q, k, v, bias, mask), 1e-6)
    got = jax.grad(_loss(attention), (0, 1, 2, 3))(q, k, v, bias, mask)
    want = jax.grad(_loss(jax.nn.dot_product_attention), (0, 1, 2, 3))(q, k, v, bias, mask)
    for g, w in zip(got, want, strict=True):
        _close(g, w, 1e-5)


# ---------------------------------------------------------------------------------------------------
# under jshard.jit, sequence-sharded


@pytest.mark.parametrize("model", [RING, GATHER], ids=["ring", "all-gather"])
@pytest.mark.parametrize("case", [dict(t=32, is_causal=False), dict(t=30, is_causal=True)],
                         ids=["even", "uneven-causal"])
@pytest.mark.parametrize("shape", mesh_params(default=((8,), (2, 4), (1, 8), (1,))))
def test_sequence_sharded_matches_one_device(shape, case, model):
    mesh = make_mesh(shape)
    case = dict(case)
    args = _qkv(t=case.pop("t"))
    placements = [_seq_placements(shape)] * 3
    forward, backward = _check(mesh, placements, args, model, **case)
    seq = len(shape) - 1
    n = mesh.shape[mesh.axis_names[seq]]
    (row,) = _rows(forward)
    if n == 1:
        assert not row["own"]
    else:
        assert _method(row, seq) == _expected(model, n)
        if row["own"]:
            assert row["own"] == [("permute", (mesh.axis_names[seq],), 2 * row["ins"][1].local_bytes, n - 1)]
    if len(shape) > 1 and shape[0] > 1:
        assert row["ins"][0].placements[0] == Shard(0)  # the batch stayed on the other axis
    assert [r["primitive"] for r in _rows(backward)] == ["jshard.attention_fwd", "jshard.attention_bwd"]


def test_ring_backward_returns_gradients_to_their_owners():
    # an update consumes the gradients where the keys live: the backward pass rings too (gathering the keys and
    # reduce-scattering their gradients costs more hops), and each device's gradient ends on its key block
    mesh = make_mesh((8,))
    args = _qkv(t=64, heads=2, kv_heads=1)
    loss = _loss(attention, is_causal=True)

    def step(q, k, v):
        grads = jax.grad(loss, (0, 1, 2))(q, k, v)
        return [a - 0.5 * g for a, g in zip((q, k, v), grads, strict=True)]

    x = [jshard.distribute(a, mesh, [Shard(1)]) for a in args]
    got = jshard.jit(step, cost_model=RING)(*x)
    grads = jax.grad(_loss(jax.nn.dot_product_attention, is_causal=True), (0, 1, 2))(*args)
    for o, a, g in zip(got, args, grads, strict=True):
        _close(o.full(), a - 0.5 * g, 1e-4)
        assert o.placements == (Shard(1),)
    e = jshard.explain(step, *x, cost_model=RING)
    bwd = next(r for r in e.rows if r["primitive"] == "jshard.attention_bwd")
    kv_bytes = bwd["ins"][1].local_bytes
    assert bwd["own"] == [("permute", ("x",), 2 * kv_bytes, 7), ("permute", ("x",), 2 * kv_bytes, 8)]
    assert [o.placements for o in bwd["outs"]] == [(Shard(1),)] * 3
    assert set(e.totals) == {"permute"}


def test_heads_and_batch_on_the_other_axis():
    mesh = make_mesh((2, 4))
    args = _qkv(t=32, heads=4, kv_heads=2)
    forward, _ = _check(mesh, [[Shard(2), Shard(1)]] * 3, args, RING, is_causal=True)
    (row,) = _rows(forward)
    assert row["ins"][0].placements == (Shard(2), Shard(1)) and _method(row, 1) == "ring"
    # grouped heads that do not shard evenly are gathered over dp instead of read from the wrong device
    args = _qkv(t=32, heads=6, kv_heads=3)
    forward, _ = _check(mesh, [[Shard(2), Shard(1)]] * 3, args, RING)
    assert _rows(forward)[0]["ins"][1].placements[0] != Shard(2)


def test_cross_attention_strided_and_bfloat16():
    # queries and keys of different lengths, a strided sequence layout, half-precision inputs
    mesh = make_mesh((2, 4))
    args = _qkv(t=24, tk=40)
    strided = [StridedShard(1, 4), Shard(1)]
    forward, _ = _check(mesh, [strided] * 3, args, RING, is_causal=True)
    (row,) = _rows(forward)
    assert row["ins"][1].placements[1] == Shard(1) and row["own"]  # a ring over tp at least
    q, k, v = (a.astype(jnp.bfloat16) for a in _qkv(t=64))
    x = [jshard.distribute(a, make_mesh((8,)), [Shard(1)]) for a in (q, k, v)]
    got = jshard.jit(lambda *a: attention(*a, is_causal=True), cost_model=RING)(*x).full()
    assert got.dtype == jnp.bfloat16
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_all_to_all_where_blocks_are_large():
    mesh = make_mesh((8,))
    q, k, v = _qkv(b=1, t=512, heads=8, kv_heads=8, dim=64)  # 128 KiB blocks: bytes outweigh launches
    forward, _ = _check(mesh, [[Shard(1)]] * 3, (q, k, v), None, is_causal=True)
    (row,) = _rows(forward)
    assert _method(row, 0) == "heads" and set(forward.totals) == {"all_to_all"}
    assert "all_to_all" in str(forward)


@pytest.mark.parametrize("shape", mesh_params(default=((8,), (2, 4), (1,))))
@pytest.mark.parametrize("model", [RING, GATHER], ids=["ring", "all-gather"])
def test_bias_and_mask_with_the_sequence_sharded(shape, model):
    mesh = make_mesh(shape)
    q, k, v = _qkv(t=30)
    rng = np.random.default_rng(2)
    bias = rng.normal(size=(2, 1, 30, 30)).astype(np.float32)
    mask = rng.random((1, 4, 30, 30)) > 0.4
    mask[0, 1, 3] = False  # a row with every key masked: jax averages all values
    seq = _seq_placements(shape)
    placements = [seq, seq, seq, _seq_placements(shape, 2), [R] * len(shape)]
    forward, backward = _check(mesh, placements, (q, k, v, bias, mask), model, extra=("bias", "mask"),
                               is_causal=True)
    (row,) = _rows(forward)
    assert row["primitive"] == "jshard.attention_masked"
    n = shape[-1]
    assert _method(row, len(shape) - 1) == (_expected(model, n) if n > 1 else "replicate")
    # the gradient is blockwise too: a forward and a backward unit, and no score matrix anywhere else
    rows = _rows(backward)
    assert [r["primitive"] for r in rows] == ["jshard.attention_masked_fwd", "jshard.attention_masked_bwd"]
    assert not [r for r in backward.rows if r["primitive"] in ("exp", "dot_general")]
    assert _method(rows[0], len(shape) - 1) == (_expected(model, n) if n > 1 else "replicate")
    assert n == 1 or _method(rows[1], len(shape) - 1) in ("ring", "all-gather")  # the backward's own choice


_BIASES = {"full": (2, 8, 32, 32), "shared": (1, 1, 32, 32), "per-key": (2, 1, 1, 32), "per-query": (1, 8, 32, 1)}
_METHODS = ("ring", "all_gather", "all_to_all")


@pytest.mark.parametrize("bias,method", [
    pytest.param(b, m, id=f"{m}-{b}", marks=() if (i + j) % 3 == 0 else pytest.mark.slow)  # each shape, each way
    for i, b in enumerate(_BIASES) for j, m in enumerate(_METHODS)])
def test_a_bias_gets_its_gradient_blockwise_whatever_it_broadcasts_on(bias, method):
    """The bias's gradient is each device's block of the score gradient, added at its keys' columns as the key
    blocks visit, and summed over the devices where the bias broadcasts (a Partial the engine reduces)."""
    mesh = _named((2, 4), ("dp", "cp"))
    q, k, v = _qkv(heads=8, kv_heads=4)
    rng = np.random.default_rng(3)
    bias_shape = _BIASES[bias]
    bias = rng.normal(size=bias_shape).astype(np.float32)
    mask = rng.random((2, 1, 32, 32)) > 0.2
    mask[1, 0, 5] = False  # a query that attends nothing
    seq = [Shard(0), balanced(32, 4)]
    bias_at = [Shard(0) if bias_shape[0] > 1 else R, Shard(2) if bias_shape[2] > 1 else R]
    args = [jshard.distribute(a, mesh, p) for a, p in zip((q, k, v, bias, mask), [seq] * 3 + [bias_at, seq])]
    grad = jax.grad(_loss(attention, is_causal=True, method={"cp": method}), (0, 1, 2, 3))
    want = jax.grad(_loss(jax.nn.dot_product_attention, is_causal=True), (0, 1, 2, 3))(q, k, v, bias, mask)
    for g, w in zip(jshard.jit(grad)(*args), want, strict=True):
        _close(g.full(), w, 1e-4)
    rows = _rows(jshard.explain(grad, *args))
    assert len(rows) == 2 and rows[1]["primitive"] == "jshard.attention_masked_bwd"


def test_explain_names_the_ring_and_the_gather():
    mesh = make_mesh((8,))
    x = [jshard.distribute(a, mesh, [Shard(1)]) for a in _qkv()]
    text = str(jshard.explain(lambda *a: attention(*a, is_causal=True), *x, cost_model=RING))
    assert "jshard.attention" in text and "own: permute x7 over (x)" in text
    e = jshard.explain(lambda *a: attention(*a, is_causal=True), *x)
    assert e.totals == {"all_gather": (2, 2 * x[1].spec.local_bytes)}  # small blocks: two gathers


def test_ring_keeps_per_device_temporaries_small():
    mesh = make_mesh((8,))
    q = np.zeros((1, 4096, 3, 64), np.float32)

    def temp(placements, model):
        x = [jshard.distribute(q, mesh, placements) for _ in range(3)]
        f = jshard.jit(lambda *a: attention(*a, is_causal=True), cost_model=model)
        return f.lower(*x).compile().memory_analysis().temp_size_in_bytes

    ring, whole = temp([Shard(1)], RING), temp([R], None)
    scores = 3 * 4096 * 4096 * 4  # one device's float32 scores of the whole sequence
    # score blocks of [128, 128] per head: what remains is the device's eighth of q, k, v, out and the running
    # state (and the next key/value block in flight), where one device holds them whole
    assert ring < scores / 32 and ring < whole / 4


def test_queued_ring_calls_do_not_deadlock():
    mesh = make_mesh((8,))
    args = _qkv(t=64)
    x = [jshard.distribute(a, mesh, [Shard(1)]) for a in args]
    f = jshard.jit(lambda *a: attention(*a, is_causal=True) * 2.0, cost_model=RING)
    assert "stablehlo.case" in f.lower(*x).as_text()  # causal: a key block after every query is skipped
    outs = [f(*x) for _ in range(20)]  # queued without waiting
    want = 2.0 * np.asarray(jax.nn.dot_product_attention(*args, is_causal=True))
    for o in outs:
        _close(o.full(), want)


# ---------------------------------------------------------------------------------------------------
# causal load balance: the striped layout, the kernel's blocks and their skip


def _striped(shape, length):
    """``_seq_placements`` with the sequence striped (``balanced``) over the last mesh axis."""
    return _seq_placements(shape)[:-1] + [balanced(length, shape[-1])]


@pytest.mark.parametrize("length, size", [(64, 8), (30, 8), (1000, 8), (12, 4), (5, 1)])
def test_balanced_puts_token_t_on_device_t_mod_size(length, size):
    mesh = make_mesh((8,) if size == 8 else (2, 4) if size == 4 else (1,))
    ids = jshard.distribute(np.arange(length)[None], mesh, [R] * (mesh.devices.ndim - 1) + [balanced(length, size)])
    layout = ids.spec.layouts[1]
    for device in range(size):
        held = layout[(0,) * (mesh.devices.ndim - 1) + (device,)]
        np.testing.assert_array_equal(held[held >= 0], np.arange(device, length, size))


@pytest.mark.parametrize("bad", [(0, 8), (64, 0), (64.0, 8)])
def test_balanced_rejects_what_is_no_length_or_size(bad):
    with pytest.raises(ValueError, match=r"jshard.sharded_attention.balanced: length .* must be positive ints"):
        balanced(*bad)


@pytest.mark.parametrize("shape", mesh_params(default=((8,), (2, 4), (1, 8), (1,))))
def test_striped_causal_load_is_even_and_blocks_are_not(shape):
    # each device's 512 / n queries are cut in c = 4 blocks, the keys in chunks as long; counted by hand: device i
    # of contiguous blocks computes every pair of the i blocks before its own (c * c each) and the lower triangle
    # of its own (c (c + 1) / 2), the last one 1.44x the average at n = 2, 1.71x at 4, 1.85x at 8; striped, every
    # device computes a lower triangle of every block
    mesh, length, n, c = make_mesh(shape), 512, shape[-1], 4
    x = np.zeros((2, length, 2, 8), np.float32)

    def loads(placements, keys):
        q = jshard.distribute(x, mesh, placements)
        k = q if keys is None else jshard.distribute(x, mesh, keys)
        return load(q, k, is_causal=True), load(q, k, is_causal=False)

    triangle = c * (c + 1) // 2
    for keys in (None, [R] * len(shape)):  # the ring's key blocks, the all-gather's whole keys
        striped, every = loads(_striped(shape, length), keys)
        np.testing.assert_array_equal(striped, np.full(shape, n * triangle))
        assert striped.max() <= 1.05 * striped.mean()
        np.testing.assert_array_equal(every, np.full(shape, n * c * c))  # without causal, nothing is skipped
        blocks, _ = loads(_seq_placements(shape), keys)
        np.testing.assert_array_equal(blocks, np.broadcast_to(c * c * np.arange(n) + triangle, shape))


@pytest.mark.parametrize("case", [
    dict(t=64, is_causal=True, model=RING),
    dict(t=30, is_causal=True, model=GATHER),
    dict(t=64, is_causal=False, model=RING),
], ids=["causal-ring", "uneven-causal-gather", "plain-ring"])
@pytest.mark.parametrize("shape", mesh_params(default=((8,), (2, 4), (1, 8), (1,))))
def test_striped_sequence_matches_one_device(shape, case):
    mesh = make_mesh(shape)
    case = dict(case)
    t, model = case.pop("t"), case.pop("model")
    forward, _ = _check(mesh, [_striped(shape, t)] * 3, _qkv(t=t), model, **case)
    (row,) = _rows(forward)
    n = shape[-1]
    if n > 1:
        assert _method(row, len(shape) - 1) == _expected(model, n)
        assert row["ins"][0].placements[-1] == balanced(t, n)  # the queries stayed striped


@pytest.mark.slow
def test_striped_long_uneven_sequence_matches_one_device():
    mesh = make_mesh((8,))
    _check(mesh, [_striped((8,), 1000)] * 3, _qkv(b=1, t=1000, heads=2, kv_heads=1), RING, is_causal=True)


def test_striped_sequence_with_bias_and_mask():
    mesh = make_mesh((8,))
    q, k, v = _qkv(t=32)
    rng = np.random.default_rng(3)
    bias = rng.normal(size=(2, 1, 32, 32)).astype(np.float32)
    mask = rng.random((1, 4, 32, 32)) > 0.4
    striped = _striped((8,), 32)
    placements = [striped, striped, striped, [R], [R]]
    _check(mesh, placements, (q, k, v, bias, mask), RING, extra=("bias", "mask"), is_causal=True)
    _check(mesh, placements[:4], (q, k, v, bias), RING, extra=("bias",), is_causal=True)  # bias alone: skips


def _executed_permutes(hlo: str) -> tuple[int, int]:
    """(count, bytes) of the collective-permutes a compiled program runs: each one in a loop body counts as many
    times as the loop's known trip count; none may sit in a conditional branch (it would run or not)."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    entry = re.search(r"ENTRY %(\S+) ", hlo).group(1)
    sizes = {"f32": 4, "bf16": 2, "f16": 2}

    def run(name, depth=0):
        count = size = 0
        for line in bodies[name]:
            permute = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} collective-permute(?:-start)?\(", line)
            if permute:
                assert depth == 0 or "branch" not in name
                count += 1
                size += sizes[permute.group(1)] * math.prod(int(d) for d in permute.group(2).split(",") if d)
            loop = re.search(r"while\(.*body=%([\w.\-]+).*known_trip_count\":\{\"n\":\"(\d+)\"", line)
            if loop:
                c, b = run(loop.group(1), depth + 1)
                count, size = count + int(loop.group(2)) * c, size + int(loop.group(2)) * b
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                assert all(run(b.strip().lstrip("%"))[0] == 0 for b in branches.split(","))
        return count, size

    return run(entry)


@pytest.mark.parametrize("shape", mesh_params(((8,), (2, 4), (1, 8)), default=((8,), (2, 4))))
def test_ring_runs_exactly_the_permutes_it_declares(shape):
    # the next key/value block (and, backward, the gradient a step behind it) is sent before the held block is
    # computed on; the sends are as many and as large as communicates declares, so explain's totals are the
    # program's. (A ring of two runs one send fewer than declared in a forward-and-backward program: XLA merges
    # the forward's one send of the key/value block with the backward's first, the same permute of the same
    # residuals.)
    mesh = make_mesh(shape)
    x = [jshard.distribute(a, mesh, p) for a, p in zip(_qkv(t=32), [_striped(shape, 32)] * 3, strict=True)]
    axis = mesh.axis_names[-1]
    for f in (lambda *a: attention(*a, is_causal=True, method={axis: "ring"}),
              jax.grad(_loss(attention, is_causal=True, method={axis: "ring"}), (0, 1, 2))):
        totals = jshard.explain(f, *x).totals
        assert set(totals) == {"permute"}
        assert _executed_permutes(jshard.jit(f).lower(*x).compile().as_text()) == totals["permute"]


# ---------------------------------------------------------------------------------------------------
# method: a string offers one sequence method, a mapping pins it per axis


@pytest.mark.parametrize("shape", [(2, 4), (1, 4), (1,)], ids=["2x4", "1x4", "1"])
@pytest.mark.parametrize("method", ["ring", "all_gather", "all_to_all"])
def test_a_pinned_method_runs_on_its_axis_forward_and_backward(shape, method):
    """``{"cp": method}`` on a (dp, cp) mesh: batch on dp, the method on cp, in the forward and the backward
    equation alike; values and gradients are one device's. Striped GQA inputs reach heads for all-to-all."""
    mesh = _named(shape, ("dp", "cp")[-len(shape):])
    q, k, v = _qkv(b=2, t=32, heads=8, kv_heads=4)
    n = mesh.shape["cp"]
    args = [jshard.distribute(a, mesh, [Shard(0), balanced(32, n)][-len(shape):]) for a in (q, k, v)]
    pinned = {"cp": method}
    _close(jshard.jit(lambda *a: attention(*a, is_causal=True, method=pinned))(*args).full(),
           jax.nn.dot_product_attention(q, k, v, is_causal=True))
    grad = jax.grad(_loss(attention, is_causal=True, method=pinned), (0, 1, 2))
    want = jax.grad(_loss(jax.nn.dot_product_attention, is_causal=True), (0, 1, 2))(q, k, v)
    for got, w in zip(jshard.jit(grad)(*args), want, strict=True):
        _close(got.full(), w, tol=1e-4)
    rows = _rows(jshard.explain(grad, *args))
    assert len(rows) == 2  # the forward unit and the backward unit
    if n > 1:
        expected = {"ring": "ring", "all_gather": "all-gather", "all_to_all": "heads"}[method]
        assert all(_method(r, len(shape) - 1) == expected for r in rows), rows


def test_method_string_context_and_bad_method():
    """A string leaves heads available; ``attention_method`` sets the default and nests by adding axes; an
    unknown method is refused by name."""
    mesh = _named((8,), ("cp",))
    q, k, v = _qkv(b=1, t=64, heads=8, kv_heads=8)
    args = [jshard.distribute(a, mesh, [Shard(1)]) for a in (q, k, v)]
    f = lambda *a: attention(*a, method="all_gather")  # noqa: E731
    assert {_method(r, 0) for r in _rows(jshard.explain(f, *args))} <= {"all-gather", "heads"}
    with jshard.attention_method({"cp": "ring"}):
        assert [_method(r, 0) for r in _rows(jshard.explain(lambda *a: attention(*a), *args))] == ["ring"]
    # nested, the pins add up; an axis the mesh lacks is refused, never ignored
    with jshard.attention_method({"cp": "ring"}), jshard.attention_method({"dp": "all_gather"}):
        with pytest.raises(ValueError, match=r"pins mesh axis 'dp', but the mesh is mesh\(cp=8\)"):
            jshard.explain(lambda *a: attention(*a), *args)
    for bad in ("zigzag", {"cp": "fast"}):
        with pytest.raises(ValueError, match="jshard.attention: method .* must be one of 'auto', 'ring'"):
            attention(q, k, v, method=bad)


def test_a_pin_names_the_users_axis_under_renamed_axes():
    """Under ``axis_aliases`` (autoplan prices each candidate on axes renamed by role), ``{"cp": "ring"}`` pins the
    axis the user calls ``cp``, and an axis the user's mesh lacks is refused in the user's names."""
    mesh = _named((2, 4), ("x0", "x1"))
    q, k, v = _qkv(b=2, t=32, heads=8, kv_heads=8)
    args = [jshard.distribute(a, mesh, [Shard(0), Shard(1)]) for a in (q, k, v)]
    with axis_aliases({"dp": "x0", "cp": "x1"}):
        rows = _rows(jshard.explain(lambda *a: attention(*a, method={"cp": "ring"}), *args))
        assert [_method(r, 1) for r in rows] == ["ring"]
        with pytest.raises(ValueError, match=r"pins mesh axis 'tp', but the mesh is mesh\(dp=2, cp=4\)"):
            jshard.explain(lambda *a: attention(*a, method={"tp": "ring"}), *args)


def test_a_pin_the_shapes_cannot_meet_names_the_check():
    """All-to-all pinned on 8 devices for 6 query heads over 3 key/value heads (they must shard evenly): the
    planner names the equation, its inputs and the check that vetoed every way."""
    mesh = _named((8,), ("cp",))
    q, k, v = _qkv(b=1, t=32, heads=6, kv_heads=3)
    args = [jshard.distribute(a, mesh, [balanced(32, 8)]) for a in (q, k, v)]
    with pytest.raises(ValueError, match=r"jshard.attention: no placement on mesh\(cp=8\) .*f32\[1,32,6,8\].*"
                                         r"_pinned\) vetoes every combination"):
        jshard.explain(lambda *a: attention(*a, method={"cp": "all_to_all"}), *args)


# ---------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("shapes, match", [
    (((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2)), "rank 4"),
    (((2, 8, 4, 8), (2, 8, 2, 8), (2, 6, 2, 8)), "key and value must have the same shape"),
    (((2, 8, 4, 8), (3, 8, 2, 8), (3, 8, 2, 8)), "batch sizes differ"),
    (((2, 8, 4, 8), (2, 8, 2, 4), (2, 8, 2, 4)), "head_dim differ"),
    (((2, 8, 4, 8), (2, 8, 3, 8), (2, 8, 3, 8)), "multiple of key/value heads"),
])
def test_bad_shapes_name_the_argument(shapes, match):
    with pytest.raises(ValueError, match=match) as err:
        attention(*(np.zeros(s, np.float32) for s in shapes))
    assert "jshard.attention" in str(err.value) and "query[2, 8, 4, 8]" in str(err.value)


def test_bad_bias_and_mask():
    q, k, v = _qkv(t=8)
    with pytest.raises(ValueError, match=r"bias of shape \[2, 4, 8, 5\] does not broadcast to .*\[2, 4, 8, 8\]"):
        attention(q, k, v, bias=np.zeros((2, 4, 8, 5), np.float32))
    with pytest.raises(TypeError, match="mask must be boolean"):
        attention(q, k, v, mask=np.ones((8, 8), np.float32))
    with pytest.raises(TypeError, match="share one floating dtype"):
        attention(q, k.astype(np.float16), v)
