"""``jshard.experts`` against a dense mixture of experts on one device.

Outside ``jshard.jit`` it must be the mixture itself (every expert run on every token, weighted by the routing):
values, load and gradients, gated or not, softmax or sigmoid routing, a balancing bias that chooses without
weighing. Under ``jshard.jit`` each way it runs (data: experts whole; dispatch: tokens sent to their experts by
all-to-all in rounds; gather: every token, a device's experts, a partial sum; tensor: the hidden dim split) must
give the one-device output and gradients on 8, 2x4, 1x8 and one device, under routing skewed onto one device's
experts too (more rounds, no token dropped).
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


@pytest.mark.parametrize("shape,how", WAYS)
def test_every_way_gives_the_one_device_output_and_gradients(shape, how):
    mesh = make_mesh(shape)
    x, logits, up, down, gate = _inputs(seed=1, skew=how == "dispatch")
    args = _placed(mesh, how, x, logits, up, down, gate)

    def moe(x, logits, up, down, gate):
        return jshard.experts(x, logits, up, down, top_k=K, w_gate=gate)

    _close(jshard.jit(moe)(*args).full(), _dense(x, logits, up, down, gate))
    got = jshard.jit(jax.grad(_loss(moe), argnums=(0, 1, 2, 3, 4)))(*args)
    want = jax.grad(_loss(lambda *a: _dense(*a)), argnums=(0, 1, 2, 3, 4))(x, logits, up, down, gate)
    for g, w in zip(got, want, strict=True):
        _close(g.full(), w, tol=5e-5)
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
