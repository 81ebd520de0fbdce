"""``jshard.experts`` against a dense mixture of experts on one device.

Outside ``jshard.jit`` it must be the mixture itself (every expert run on every token, weighted by the routing):
values, load and gradients, gated or not, softmax or sigmoid routing, a balancing bias that chooses without
weighing. Under ``jshard.jit`` each way it runs (data: experts whole; dispatch: tokens sent to their experts by
all-to-all in rounds; gather: every token, a device's experts, a partial sum; tensor: the hidden dim split) must
give the one-device output and gradients on 8, 2x4, 1x8 and one device, under routing skewed onto one device's
experts too (more rounds, no token dropped). The same holds through the ragged transport
(``lax.ragged_all_to_all``, which XLA:CPU lacks: here an emulation from ``all_to_all``, itself checked against the
primitive's semantics in numpy; the real primitive is only lowered).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard
from jshard.moe import route

R = Replicate()
T, D, H, E, K = 32, 8, 16, 8, 2


def _inputs(seed=0, skew=False, e=E):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(T, D)).astype(np.float32)
    logits = rng.normal(size=(T, e)).astype(np.float32)
    if skew:  # every token's two experts are 0 and 1, held by one device of the expert axis
        logits[:, 0] += 8.0
        logits[:, 1] += 6.0
    up, gate = (rng.normal(size=(e, D, H)).astype(np.float32) / 3 for _ in range(2))
    down = rng.normal(size=(e, H, D)).astype(np.float32) / 4
    return x, logits, up, down, gate


def _dense(x, logits, up, down, gate=None, *, top_k=K, act=jax.nn.silu, router="softmax", bias=None):
    """Every expert on every token, each weighted by its routing weight (zero where not chosen)."""
    idx, w = route(logits, top_k, router=router, bias=bias)
    out = 0
    for e in range(up.shape[0]):
        h = x @ up[e]
        h = act(x @ gate[e]) * h if gate is not None else act(h)
        out = out + jnp.sum(w * (idx == e), axis=-1)[..., None] * (h @ down[e])
    return out


def _loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a)) * jnp.arange(1, D + 1))


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("gated,router,biased", [(True, "softmax", False), (False, "sigmoid", True)])
def test_outside_jit_it_is_the_dense_mixture(gated, router, biased):
    x, logits, up, down, gate = _inputs()
    gate = gate if gated else None
    bias = np.linspace(-1, 1, E).astype(np.float32) if biased else None
    x3, l3 = x.reshape(4, 8, D), logits.reshape(4, 8, E)  # leading dims are any tokens' shape

    def moe(x, logits, up, down, gate):
        return jshard.experts(x, logits, up, down, top_k=K, w_gate=gate, router=router, bias=bias)

    def dense(x, logits, up, down, gate):
        return _dense(x, logits, up, down, gate, router=router, bias=bias)

    _close(moe(x3, l3, up, down, gate), dense(x3, l3, up, down, gate))
    args = (x3, l3, up, down, gate)
    n = 5 if gated else 4
    got = jax.grad(_loss(moe), argnums=tuple(range(n)))(*args)
    want = jax.grad(_loss(dense), argnums=tuple(range(n)))(*args)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


def test_the_load_counts_the_tokens_each_expert_takes_and_none_is_dropped():
    x, logits, up, down, gate = _inputs(skew=True)
    out, load = jshard.experts(x, logits, up, down, top_k=K, w_gate=gate, return_load=True)
    assert load.tolist() == [T, T] + [0] * (E - 2)  # every token to experts 0 and 1: all computed
    _close(out, _dense(x, logits, up, down, gate))
    # the bias steers the choice to the last experts, and never enters a weight
    bias = np.array([0.0] * (E - 2) + [20.0, 20.0], np.float32)
    out, load = jshard.experts(x, logits, up, down, top_k=K, w_gate=gate, bias=bias, return_load=True)
    assert load.tolist() == [0] * (E - 2) + [T, T]
    _close(out, _dense(x, logits, up, down, gate, bias=bias))


MESHES = [(8,), (2, 4), (1, 8), (1,)]


def _placed(mesh, how, x, logits, up, down, gate):
    """The arrays on ``mesh`` for one way: the experts on the last axis, the tokens on the first where the mesh has
    two (a data-parallel axis besides)."""
    names = mesh.axis_names
    last = len(names) - 1

    def on(a, dim_last, dim_first=None):
        placements = [R] * len(names)
        if len(names) > 1 and dim_first is not None:
            placements[0] = Shard(dim_first)
        if dim_last is not None:
            placements[last] = Shard(dim_last)
        return jshard.distribute(a, mesh, placements)

    tokens = {"dispatch": 0, "data": 0, "gather": None, "tensor": None}[how]
    experts = {"dispatch": (0, 0), "data": (None, None), "gather": (0, 0), "tensor": (2, 1)}[how]
    return (on(x, tokens, 0), on(logits, tokens, 0), on(up, experts[0]), on(down, experts[1]), on(gate, experts[0]))


# every way on 8 and 2x4 (another axis beside), dispatch on 1x8 and one device; the rest under -m slow
WAYS = [pytest.param(shape, how, id=f"{'x'.join(map(str, shape))}-{how}",
                     marks=() if shape in ((8,), (2, 4)) or how == "dispatch" else pytest.mark.slow)
        for shape in MESHES for how in ("dispatch", "gather", "tensor", "data")]


def _matches_dense(args, x, logits, up, down, gate):
    """``jshard.experts`` on the placed ``args`` gives the dense mixture's output and gradients on one device;
    returns the function it ran."""
    def moe(x, logits, up, down, gate):
        return jshard.experts(x, logits, up, down, top_k=K, w_gate=gate)

    _close(jshard.jit(moe)(*args).full(), _dense(x, logits, up, down, gate))
    got = jshard.jit(jax.grad(_loss(moe), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.grad(_loss(lambda *a: _dense(*a)), argnums=(0, 1, 2, 3, 4))(x, logits, up, down, gate)
    for g, w in zip(got, want, strict=True):
        _close(g.full(), w, tol=5e-5)
    return moe


@pytest.mark.parametrize("shape,how", WAYS)
def test_every_way_gives_the_one_device_output_and_gradients(shape, how):
    mesh = make_mesh(shape)
    x, logits, up, down, gate = _inputs(seed=1, skew=how == "dispatch")
    args = _placed(mesh, how, x, logits, up, down, gate)

    moe = _matches_dense(args, x, logits, up, down, gate)
    ex = jshard.explain(jax.grad(_loss(moe), argnums=(2, 3, 4)), *args)
    rows = [r for r in ex.rows if r["primitive"].startswith("jshard.experts")]
    assert {r["primitive"] for r in rows} == {"jshard.experts_fwd", "jshard.experts_bwd"}
    size = mesh.shape[mesh.axis_names[-1]]
    for r in rows:
        w_up = r["ins"][3]
        if how == "dispatch" and size > 1:  # the experts stay where they are; the tokens travel to them
            assert w_up.placements[-1] == Shard(0) and r["ins"][0].placements[-1] == Shard(0)
        if how == "tensor" and size > 1:
            assert w_up.placements[-1] == Shard(2)
    if how == "dispatch" and size > 1:
        assert ex.totals["all_to_all"][0] >= 6  # a round's three each way, forward and backward
        assert "all_gather" not in ex.totals or all(
            m[1] != "all_gather" for r in rows for m in r["moves"])  # the weights are never gathered


def test_a_gathered_mixture_leaves_a_partial_sum_for_the_next_equation():
    mesh = make_mesh((8,))
    x, logits, up, down, gate = _inputs()
    args = _placed(mesh, "gather", x, logits, up, down, gate)
    out = jshard.jit(lambda *a: jshard.experts(*a[:4], top_k=K, w_gate=a[4]), out_placements=None)(*args)
    rows = [r for r in jshard.explain(lambda *a: jshard.experts(*a[:4], top_k=K, w_gate=a[4]), *args).rows
            if r["primitive"] == "jshard.experts"]
    assert rows and rows[0]["outs"][0].placements == (Partial(),)
    _close(out.full(), _dense(x, logits, up, down, gate))


@pytest.mark.parametrize("kwargs,match", [
    (dict(top_k=0), r"top_k must be an int in \[1, 8\]"),
    (dict(top_k=2, router="relu"), r"router='relu' is not one of"),
    (dict(top_k=2, bias=np.zeros(3)), r"bias must be \[E\] = \[8\]"),
    (dict(top_k=2, w_gate=np.zeros((E, D, 3))), r"w_gate must be shaped as w_up"),
])
def test_bad_arguments_are_refused_naming_the_shapes(kwargs, match):
    x, logits, up, down, _ = _inputs()
    with pytest.raises(ValueError, match=match):
        jshard.experts(x, logits, up, down, **kwargs)
    with pytest.raises(ValueError, match=r"x float32\[32, 8\].*w_down must be \[E, H, D\] = \[8, 16, 8\]"):
        jshard.experts(x, logits, up, down[:, :4], top_k=2)


@pytest.mark.parametrize("sizes,m", [((3, 0, 5, 1), 12), ((0, 0, 0, 0), 5), ((7, 0, 0, 0), 7), ((1, 1, 1, 1), 40)])
def test_the_tiled_grouped_product_is_ragged_dots(sizes, m):
    """XLA:CPU's ragged_dot multiplies every row by every group's matrix; the tiled form must give its values,
    the rows past the groups zero, and its gradients."""
    from jshard.moe import _grouped_dot

    rng = np.random.default_rng(0)
    rows, w = rng.normal(size=(m, 5)).astype(np.float32), rng.normal(size=(4, 5, 3)).astype(np.float32)
    sizes = np.array(sizes, np.int32)
    _close(_grouped_dot(rows, w, sizes, True), jax.lax.ragged_dot(rows, w, sizes))
    grads = [jax.grad(lambda r, w: jnp.sum(jnp.sin(_grouped_dot(r, w, sizes, t))), argnums=(0, 1))(rows, w)
             for t in (True, False)]
    for a, b in zip(*grads, strict=True):
        _close(a, b)


# --- the ragged transport: lax.ragged_all_to_all where the platform has it (not XLA:CPU), so here through the
# emulation written from all_to_all, which must be the primitive; the real one is only lowered

@pytest.mark.parametrize("shape,per_device", [((8,), 1), ((2, 4), 2)])
def test_the_emulated_ragged_all_to_all_is_the_primitive(shape, per_device):
    """Against the primitive's semantics in numpy: slice j of each sender goes to device j // per_device, at the
    offset the sender gives, as many rows as the receiver expects; the rest of the output is kept."""
    from jshard.moe import emulated_ragged_all_to_all

    mesh = make_mesh(shape)
    axes = mesh.axis_names
    n, rng = mesh.size, np.random.default_rng(0)
    k, m = n * per_device, 8
    big = k * 3 + 4  # each receiver's output: room for every slice it gets, with gaps
    operand = rng.normal(size=(n, m, 2)).astype(np.float32)
    output = rng.normal(size=(n, big, 2)).astype(np.float32)
    sizes = rng.integers(0, 4, size=(n, k)).astype(np.int32)  # sender i's slice j
    input_offsets = rng.integers(0, m - sizes + 1).astype(np.int32)
    output_offsets, recv_sizes = np.zeros((n, k), np.int32), np.zeros((n, k), np.int32)
    for d in range(n):  # the slices device d receives, laid out in a random order with random gaps
        at = 0
        for i, j in rng.permutation([(i, j) for i in range(n) for j in range(d * per_device, (d + 1) * per_device)]):
            at += int(rng.integers(0, 2))
            output_offsets[i, j], at = at, at + sizes[i, j]
            recv_sizes[d, i * per_device + j - d * per_device] = sizes[i, j]
    want = output.copy()
    for i in range(n):
        for j in range(k):
            d, o, s = j // per_device, output_offsets[i, j], sizes[i, j]
            want[d, o:o + s] = operand[i, input_offsets[i, j]:input_offsets[i, j] + s]

    def ragged(*blocks):
        return emulated_ragged_all_to_all(*blocks, axis_name=axes if len(axes) > 1 else axes[0])

    run = jax.shard_map(ragged, mesh=mesh, in_specs=jax.P(axes), out_specs=jax.P(axes))
    per_device = jax.sharding.NamedSharding(mesh, jax.P(axes))
    args = [jax.device_put(a.reshape(n * a.shape[1], *a.shape[2:]), per_device)
            for a in (operand, output, input_offsets, sizes, output_offsets, recv_sizes)]
    np.testing.assert_array_equal(np.asarray(run(*args)).reshape(want.shape), want)


@pytest.fixture
def ragged(monkeypatch):
    """The ragged path on CPU, through the emulation: the axes of each call it makes."""
    from jshard import moe

    calls = []

    def counted(*args, axis_name):
        calls.append(axis_name)
        return moe.emulated_ragged_all_to_all(*args, axis_name=axis_name)

    monkeypatch.setattr(moe, "RAGGED_ALL_TO_ALL", counted)
    return calls


@pytest.mark.parametrize("shape,how", [((8,), "last"), ((2, 4), "last"), ((2, 4), "both"), ((1,), "last")],
                         ids=["8", "2x4-tp", "2x4-both", "1"])
def test_the_ragged_dispatch_gives_the_one_device_output_and_gradients(ragged, shape, how):
    """Skewed routing (every token to experts 0 and 1, one or two devices': several rounds). On 2x4 the experts
    on tp alone (dispatch on tp, data on dp) or on both axes (the engine chooses there: dispatch on tp and gather on
    dp at this size, whose devices skip the other group's copies)."""
    mesh = make_mesh(shape)
    x, logits, up, down, gate = _inputs(seed=1, skew=True)
    args = _placed(mesh, "dispatch", x, logits, up, down, gate)
    if how == "both":
        args = [jshard.distribute(a, mesh, [Shard(0), Shard(0)]) for a in (x, logits, up, down, gate)]

    moe = _matches_dense(args, x, logits, up, down, gate)
    assert bool(ragged) == (mesh.size > 1)  # the copies went by the ragged path (none to send on one device)
    if shape == (8,):  # priced as sent: each device's T k copies once each way, and the counts met first
        copies = T // 8 * K
        widths = D + D + (2 * D + 1) + (D + 1)  # forward out and home, backward out and home
        ex = jshard.explain(jax.grad(_loss(moe), argnums=(2, 3, 4)), *args)
        assert ex.totals["all_to_all"] == (6, 4 * (copies * widths + 2 * 8 * (E // 8 + 1)))


def _local_unit(mesh, placements, x, logits, up, down, gate):
    """The experts unit's forward and backward local forms run by hand with every input at ``placements`` (the
    engine prices its own choice; this pins one), and their one-device counterparts: (got, want) pairs."""
    from jshard.moe import _backward_local, _experts, _forward_local
    from jshard.spec import Spec

    idx, weights = route(logits, K)
    args = (x, idx, weights, up, gate, down)
    specs = [Spec.create(mesh, placements, a.shape, a.dtype) for a in args]
    parts = [s.to_partition_spec() for s in specs]
    params = {"gated": True, "activation": jax.nn.silu}
    dy = np.random.default_rng(2).normal(size=x.shape).astype(np.float32)

    def on(local, ins, outs):
        return jax.shard_map(local(params, [specs[i] for i in ins], None), mesh=mesh,
                             in_specs=tuple(parts[i] for i in ins), out_specs=[parts[i] for i in outs],
                             check_vma=False)

    forward = on(_forward_local, (0, 1, 2, 3, 4, 5), (0,))
    backward = on(_backward_local, (0, 1, 2, 3, 4, 5, 0), (0, 2, 3, 4, 5))  # dy placed as x; x's, weights', mats'
    placed = [jax.device_put(a, s.to_named_sharding()) for a, s in zip((*args, dy), [*specs, specs[0]], strict=True)]
    whole = lambda x, w, *mats: _experts(x, idx, w, *mats, activation=jax.nn.silu, gated=True)  # noqa: E731
    y, pull = jax.vjp(whole, x, weights, up, gate, down)
    return forward, backward, (placed[:-1], placed), (y, pull(dy))


@pytest.mark.slow
def test_the_ragged_dispatch_over_both_axes_of_a_2d_mesh(ragged):
    """Tokens and experts sharded over both axes of 2x4: one ragged exchange over their tuple (the engine prefers
    another way at a test's size, so the unit's local forms run by hand), two experts a device (slots worked out
    on the receiver), skewed onto device 0's: four rounds."""
    mesh = make_mesh((2, 4))
    x, logits, up, down, gate = _inputs(seed=3, skew=True, e=16)
    forward, backward, (fwd_args, bwd_args), (y, grads) = _local_unit(mesh, [Shard(0), Shard(0)], x, logits, up,
                                                                      down, gate)
    _close(forward(*fwd_args)[0], y)
    for g, w in zip(backward(*bwd_args), grads, strict=True):
        _close(g, w, tol=5e-5)
    assert set(ragged) == {("dp", "tp")}


def test_the_real_ragged_all_to_all_lowers(monkeypatch):
    """XLA:CPU cannot compile ragged-all-to-all, so here the real primitive is traced and lowered only: it takes
    the arguments the ragged path gives it (over a tuple of axes too), forward and backward."""
    from jshard import moe

    monkeypatch.setattr(moe, "RAGGED_ALL_TO_ALL", jax.lax.ragged_all_to_all)
    mesh = make_mesh((2, 4))
    x, logits, up, down, gate = _inputs(seed=3, skew=True, e=16)
    forward, backward, (fwd_args, bwd_args), _ = _local_unit(mesh, [Shard(0), Shard(0)], x, logits, up, down, gate)
    for fn, args in ((forward, fwd_args), (backward, bwd_args)):
        text = jax.jit(fn).lower(*args).as_text()
        assert text.count("ragged_all_to_all") == 2  # out and home, in the rounds' loop
