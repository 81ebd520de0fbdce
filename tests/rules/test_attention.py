"""``jshard.attention`` against ``jax.nn.dot_product_attention`` on one device.

Outside ``jshard.jit`` it must be that function (values and gradients). Under ``jshard.jit`` every way it runs
(ring, all-gather, all-to-all, batch, heads, all-Replicate) must give the one-device output and gradients with
respect to query, key and value: causal or not, grouped-query attention, uneven sequence lengths, bias and mask,
on 8, 2x4 (sequence on one axis, batch or heads on the other), 1x8 and one device. The cost model chooses the
way (a slow hop favours the ring's one-hop steps, cheap bytes the all-gather's two collectives, large blocks the
all-to-all's small ones) and ``explain`` must show it; the ring's program must hold far fewer bytes than one that
scores whole sequences, and queued calls of it must not deadlock XLA:CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh, mesh_params
from jshard import AxisCost, CostModel, Replicate, Shard, StridedShard, attention

R = Replicate()
RING = CostModel(default=AxisCost(latency_us=20.0))  # a hop costs more than a launch: one-hop steps pay
GATHER = CostModel(launch_us=100.0, default=AxisCost(bandwidth_gbps=1e6))  # launches dear, bytes free: fewest win
PRIMS = ("jshard.attention", "jshard.attention_fwd", "jshard.attention_bwd", "jshard.attention_masked")


def _qkv(b=2, t=32, heads=4, kv_heads=2, dim=8, tk=None, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, heads, dim)).astype(np.float32)
    k, v = (rng.normal(size=(b, tk or t, kv_heads, dim)).astype(np.float32) for _ in range(2))
    return q, k, v


def _loss(f, **kw):
    return lambda q, k, v, *extra: jnp.sum(jnp.sin(f(q, k, v, *extra, **kw)) * jnp.arange(q.shape[1])[:, None, None])


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


def _rows(e):
    return [r for r in e.rows if r["primitive"] in PRIMS]


def _method(row, seq_axis):
    """Which way an attention equation ran on mesh axis ``seq_axis``."""
    q, k = row["ins"][0].placements[seq_axis], row["ins"][1].placements[seq_axis]
    if row["own"]:
        return "ring"
    if q == Shard(1):
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
    forward, _ = _check(mesh, placements, (q, k, v, bias, mask), model, extra=("bias", "mask"), is_causal=True)
    (row,) = _rows(forward)
    assert row["primitive"] == "jshard.attention_masked"
    n = shape[-1]
    assert _method(row, len(shape) - 1) == (_expected(model, n) if n > 1 else "replicate")


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
    assert ring < scores / 16 and ring < whole / 16


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
