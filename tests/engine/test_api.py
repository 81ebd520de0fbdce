"""``jshard.jit`` against single-device JAX: forward, gradients, nested calls (first engine steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard
from jshard.parallel import TrainStep, parallelize
from oracle import assert_close, stablehlo_collectives

R = Replicate()


def mlp(x, w1, w2):
    return jnp.mean((jax.nn.gelu(x @ w1) @ w2) ** 2)


def attention(q, k):
    s = q @ k.T / 4.0
    s = jnp.where(jnp.tril(jnp.ones((q.shape[0], k.shape[0]), bool)), s, -1e9)
    return jax.nn.softmax(s, axis=-1)


@pytest.mark.parametrize("mesh_shape,px,pw1,pw2", [
    ((2, 4), (Shard(0), R), (R, Shard(1)), (R, Shard(0))),  # data x tensor parallel
    ((8,), (Shard(0),), (R,), (R,)),  # data parallel
    ((2, 2, 2), (Shard(0), Shard(1), R), (Shard(0), R, Shard(1)), (R, R, Shard(0))),  # uneven-ish mixes
    # size-1 axes: data parallel over one device next to tensor parallel, and the reverse; one device
    ((1, 8), (Shard(0), R), (R, Shard(1)), (R, Shard(0))),
    ((8, 1), (Shard(0), Shard(1)), (R, Shard(1)), (Partial(), Shard(0))),
    ((2, 1, 4), (Shard(0), Shard(0), R), (R, Shard(1), Shard(1)), (R, R, Shard(0))),
    ((1,), (Shard(0),), (Shard(1),), (Partial("max"),)),
])
def test_mlp_forward_and_gradients_match_single_device(mesh_shape, px, pw1, pw2):
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(0)
    X, W1, W2 = (rng.normal(size=s).astype(np.float32) for s in [(6, 10), (10, 12), (12, 10)])
    args = [jshard.distribute(a, mesh, p) for a, p in zip((X, W1, W2), (px, pw1, pw2))]
    out = jshard.jit(mlp)(*args)
    n = 10 + 12 + 60  # both contractions, then the mean of 60 squares
    assert_close(out.full(), mlp(X, W1, W2), n=n)
    grads = jshard.jit(jax.grad(mlp, argnums=(0, 1, 2)))(*args)
    for g, want in zip(grads, jax.grad(mlp, argnums=(0, 1, 2))(X, W1, W2)):
        assert_close(g.full(), want, n=n)


def test_attention_with_causal_mask_and_softmax():
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(1)
    Q, K = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
    q, k = jshard.distribute(Q, mesh, (Shard(0), Shard(1))), jshard.distribute(K, mesh, (R, Shard(1)))
    out = jshard.jit(attention)(q, k)
    assert_close(out.full(), attention(Q, K), n=16 + 8)  # scores contract 16, softmax sums 8


def test_partial_inputs_plain_scalars_and_cache():
    mesh = make_mesh((8,))
    parts = [np.full((4,), 0.6, np.float32)] * 2 + [np.zeros(4, np.float32)] * 6
    x = jshard.from_local(parts, mesh, (Partial(),))
    calls = []

    def f(x, c):
        calls.append(1)
        return (x * c).astype(jnp.int32)

    g = jshard.jit(f)
    out = g(x, 2.0)
    np.testing.assert_array_equal(np.asarray(out.full()), np.full(4, 2, np.int32))  # trunc(2.4), not 2 * trunc(0.6)
    g(x, 2.0)
    assert len(calls) == 1  # the second call reuses the compiled program


def test_needs_a_darray():
    with pytest.raises(ValueError, match="no DArray"):
        jshard.jit(lambda a: a + 1)(np.ones(3))


@jax.custom_vjp
def _scaled_sin(x):
    return jnp.sin(x)


_scaled_sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


def test_nested_calls_relu_checkpoint_custom_vjp():
    def f(x, w):
        h = jax.checkpoint(lambda a: jax.nn.relu(a @ w))(x)
        return jnp.sum(_scaled_sin(jax.jit(lambda t: t * 2.0)(h)))

    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(2)
    X, W = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(8, 12)).astype(np.float32)
    args = [jshard.distribute(X, mesh, (Shard(0), Shard(1))), jshard.distribute(W, mesh, (R, Shard(0)))]
    # 72 sines of size ~1 cancel to ~0.2: the bound follows the terms, not the result
    terms = np.abs(np.sin(2 * np.maximum(X @ W, 0))).sum()
    assert_close(jshard.jit(f)(*args).full(), f(X, W), n=8 + 72, terms=terms)
    # the gradients are contractions with G = 2 cos(2h) (h = relu(XW)), which carries h's rounding (terms |X| |W|)
    # times its derivative (up to 4): their terms are (|G| + 4 |X||W|) |W|.T and |X|.T (|G| + 4 |X||W|)
    on = X @ W > 0
    G = np.abs(2 * np.cos(2 * np.maximum(X @ W, 0))) * on + 4 * (np.abs(X) @ np.abs(W)) * on
    gx, gw = jshard.jit(jax.grad(f, argnums=(0, 1)))(*args)
    want_x, want_w = jax.grad(f, argnums=(0, 1))(X, W)
    assert_close(gx.full(), want_x, n=8 + 12, terms=G @ np.abs(W).T)
    assert_close(gw.full(), want_w, n=8 + 6, terms=np.abs(X).T @ G)


def test_embedding_and_cross_entropy_with_a_row_sharded_table():
    def loss(table, ids, labels):
        logits = table[ids] @ table.T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))

    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(3)
    T = rng.normal(size=(20, 8)).astype(np.float32)
    ids, labels = rng.integers(0, 20, 6).astype(np.int32), rng.integers(0, 20, 6).astype(np.int32)
    args = [jshard.distribute(T, mesh, (R, Shard(0))), jshard.distribute(ids, mesh, (Shard(0), R)),
            jshard.distribute(labels, mesh, (Shard(0), R))]
    n = 8 + 20 + 6  # logits contract 8, log-softmax sums 20, the mean 6
    assert_close(jshard.jit(loss)(*args).full(), loss(T, ids, labels), n=n)
    g = jshard.jit(jax.grad(loss))(*args)
    assert_close(g.full(), jax.grad(loss)(T, ids, labels), n=n)














def test_dropout_draws_the_single_device_numbers():
    def f(x, key):
        keep = jax.random.bernoulli(key, 0.7, x.shape)
        return jnp.where(keep, x / 0.7, 0.0)

    mesh = make_mesh((8,))
    X = np.arange(40, dtype=np.float32).reshape(10, 4)
    key = jax.random.key(5)
    out = jshard.jit(lambda x: f(x, key))(jshard.distribute(X, mesh, (Shard(0),)))
    got, want = np.asarray(out.full()), np.asarray(f(X, key))
    np.testing.assert_array_equal(got == 0, want == 0)  # the same draws keep the same elements
    assert_close(got, want, terms=np.abs(want))  # x / 0.7 may compile to x * (1 / 0.7): one rounding each




def test_constrain_pins_an_intermediate_and_is_transparent_to_gradients():
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(5)
    X, W = rng.normal(size=(8, 12)).astype(np.float32), rng.normal(size=(12, 8)).astype(np.float32)

    def f(x, w):
        h = jshard.constrain(x @ w, [Shard(0), Shard(1)])
        return jnp.sum(jnp.tanh(h) ** 2)

    args = [jshard.distribute(X, mesh, (R, R)), jshard.distribute(W, mesh, (R, R))]
    h = jshard.jit(lambda x, w: jshard.constrain(x @ w, [Shard(0), Shard(1)]))(*args)
    assert h.placements == (Shard(0), Shard(1))
    assert_close(h.full(), X @ W, n=12, terms=np.abs(X) @ np.abs(W))
    for g, want in zip(jshard.jit(jax.grad(f, argnums=(0, 1)))(*args), jax.grad(f, argnums=(0, 1))(X, W)):
        assert_close(g.full(), want, n=12 + 8)
    assert_close(f(X, W), jax.jit(f)(X, W), n=12 + 64)  # outside jshard.jit: the identity










STABLEHLO = {"all_gather": "stablehlo.all_gather", "all_reduce": "stablehlo.all_reduce",
             "reduce_scatter": "stablehlo.reduce_scatter", "all_to_all": "stablehlo.all_to_all",
             "permute": "stablehlo.collective_permute", "exchange": "stablehlo.collective_permute"}


# priced by bytes alone (a bandwidth-bound size): what moves the fewest bytes, however many hops it takes
BYTES_FIRST = jshard.CostModel(launch_us=0.0, default=jshard.AxisCost(latency_us=0.0, bandwidth_gbps=19.3))


def test_jit_plans_and_lowers_with_the_cost_model_it_is_given():
    """(S(0), S(0)) -> (S(1), S(1)) on (dp=2, tp=4): by default a gather over tp and an all_to_all over dp (fewer
    hops); priced by bytes, one all_to_all over both axes, a fifth of the bytes. The pinned output moves in the
    program's body, traced at its first call: the model must reach it there too."""
    mesh = make_mesh((2, 4))
    X = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    x = jshard.distribute(X, mesh, (Shard(0), Shard(0)))
    pin = (Shard(1), Shard(1))

    def double(x):
        return x * 2.0

    default = {"all_gather": (1, 192), "all_to_all": (1, 768)}
    assert jshard.explain(double, x, out_placements=pin).totals == default
    assert jshard.explain(double, x, out_placements=pin, cost_model=BYTES_FIRST).totals == {"all_to_all": (1, 192)}
    step = jshard.jit(double, out_placements=pin, cost_model=BYTES_FIRST)
    hlo = step.lower(x).as_text()
    assert hlo.count("all_to_all") == 1 and "all_gather" not in hlo
    out = step(x)
    assert out.placements == pin
    np.testing.assert_array_equal(np.asarray(out.full()), X * 2)
    # plans are kept per model: the default one is unchanged afterwards, and so is its program
    assert jshard.explain(double, x, out_placements=pin).totals == default
    assert "all_gather" in jshard.jit(double, out_placements=pin).lower(x).as_text()


def test_train_step_plans_with_its_cost_model():
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 24)).astype(np.float32)
    x = jshard.distribute(X, mesh, (Shard(0), Shard(0)))

    def loss_fn(model, x):  # the model's input laid out by feature: the move the cost model decides
        return jnp.mean(model(jshard.constrain(x, (Shard(1), Shard(1)))) ** 2)

    def moves(cost_model):
        model = parallelize(lambda: nnx.Linear(24, 4, rngs=nnx.Rngs(0)), mesh)
        step = TrainStep(model, optax.sgd(0.1), loss_fn, cost_model=cost_model)
        ex = step.explain(x)
        return {(kind, tuple(axes)) for r in ex.rows for _, kind, axes, _ in r["moves"]}, np.asarray(step(x).full())

    default, loss = moves(None)
    bytes_first, loss_bf = moves(BYTES_FIRST)
    assert ("all_to_all", ("dp", "tp")) in bytes_first and ("all_to_all", ("dp", "tp")) not in default
    lin = nnx.Linear(24, 4, rngs=nnx.Rngs(0))
    want = jnp.mean(lin(jnp.asarray(X)) ** 2)
    assert_close(loss, want, n=24 + 64)
    assert_close(loss_bf, want, n=24 + 64)


@pytest.mark.parametrize("pins", [None, "same", "shard"])
def test_explain_lists_the_collectives_of_the_program(pins):
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(6)
    X, W1, W2 = (rng.normal(size=s).astype(np.float32) for s in [(8, 12), (12, 16), (16, 12)])
    args = [jshard.distribute(X, mesh, (Shard(0), R)), jshard.distribute(W1, mesh, (R, Shard(1))),
            jshard.distribute(W2, mesh, (R, Shard(0)))]
    f = jax.grad(mlp, argnums=(1, 2))
    out_placements = {None: None, "same": (jshard.same_as(1), jshard.same_as(2)),
                      "shard": ((Shard(0), Shard(1)), (Shard(1), Shard(0)))}[pins]
    ex = jshard.explain(f, *args, out_placements=out_placements)
    text = jshard.jit(f, out_placements=out_placements).lower(*args).as_text()
    listed = {}
    for kind, (count, _) in ex.totals.items():
        listed[STABLEHLO[kind]] = listed.get(STABLEHLO[kind], 0) + count
    assert listed == {k: text.count(k) for k in set(STABLEHLO.values()) if text.count(k)}
    assert "test_api.py" in " ".join(r["source"] for r in ex.rows) and str(ex)


def test_scan_rnn_forward_and_gradients():
    def rnn(h0, xs, w, u):
        def step(h, x):
            h = jnp.tanh(h @ w + x @ u)
            return h, h.sum(-1)

        h, ys = jax.lax.scan(step, h0, xs)
        return jnp.sum(h ** 2) + jnp.sum(ys)

    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(7)
    H0, XS, W, U = (rng.normal(size=s).astype(np.float32) * 0.5 for s in [(4, 8), (5, 4, 6), (8, 8), (6, 8)])
    args = [jshard.distribute(H0, mesh, (Shard(0), R)), jshard.distribute(XS, mesh, (Shard(1), Shard(2))),
            jshard.distribute(W, mesh, (R, Shard(1))), jshard.distribute(U, mesh, (R, R))]
    n = 5 * (8 + 6) + 32 + 20  # five steps contracting 8 + 6, then the sums
    assert_close(jshard.jit(rnn)(*args).full(), rnn(H0, XS, W, U), n=n)
    grads = jshard.jit(jax.grad(rnn, argnums=(0, 2, 3)))(*args)
    for g, want in zip(grads, jax.grad(rnn, argnums=(0, 2, 3))(H0, XS, W, U)):
        assert_close(g.full(), want, n=n)


def _tanh_loop(x, w):
    """At most 3 steps of h <- tanh(h @ w), stopping early once the sum reaches 100."""
    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ w)

    return jax.lax.while_loop(lambda c: (c[0] < 3) & (jnp.sum(c[1]) < 100.0), body, (0, x))[1]


def test_while_loop_and_cond():
    def f(x, w):
        h = _tanh_loop(x, w)
        return jax.lax.cond(jnp.sum(h) > 0, lambda a: a * 2.0, lambda a: a - 1.0, h)

    mesh = make_mesh((2, 2, 2))
    rng = np.random.default_rng(8)
    X, W = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32) * 0.5
    for px in [(Shard(0), Shard(1), R), (R, R, Partial())]:
        x = jshard.distribute(X, mesh, px) if not px[2].is_partial else jshard.from_local(
            [X / 2] * 4 + [X / 2] * 4, mesh, (R, R, Partial()))
        out = jshard.jit(f)(x, jshard.distribute(W, mesh, (R, Shard(1), R)))
        assert_close(out.full(), f(X, W), n=3 * 8 + 2)  # three steps contracting 8, from two halves


def test_eager_operators_match_numpy():
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(9)
    A, B = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(8, 5)).astype(np.float32)
    a = jshard.from_local([A / 2] * 8, mesh, (Partial(), R))  # each dp coordinate holds half of A
    b = jshard.distribute(B, mesh, (R, Shard(1)))
    c = jshard.distribute(A, mesh, (Shard(0), R))
    # (got, want, terms summed per element): a holds A as two halves, so even a + 1 sums two terms
    checks = [(a + 1.0, A + 1, 2), (2.0 * a, 2 * A, 2), (a - c, A - A, 2), (c / 2.0, A / 2, 1), (-c, -A, 1),
              (c ** 2, A ** 2, 1), (c > 0, A > 0, 1), (c[1:4, ::2], A[1:4, ::2], 1), (c.T, A.T, 1),
              (a.sum(0), A.sum(0), 12), (c.mean(), A.mean(), 48), (c.max(1), A.max(1), 1),
              (a.astype(jnp.int32), A.astype(np.int32), 1), (c.reshape(3, 16), A.reshape(3, 16), 1)]
    for got, want, n in checks:
        assert_close(got.full(), want, n=n, terms=np.abs(A).max() * n)
    assert_close((a @ b).full(), A @ B, n=2 * 8, terms=np.abs(A) @ np.abs(B))


def test_a_jitted_helper_called_twice_keeps_its_values_apart():
    # the inner jaxpr is cached, so both call sites share its Vars: values must not be named by Vars
    # (the bug: the second call reused the first call's reduced input)
    inner = jax.jit(lambda a: jnp.exp(a - 1.0))

    def f(x, y):
        return inner(x).sum() + 10.0 * inner(y * 2.0).sum()

    mesh = make_mesh((2, 4))
    X = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    Y = X[::-1] + 0.5
    args = [jshard.from_local([X / 8] * 8, mesh, (Partial(), Partial())),
            jshard.from_local([Y / 8] * 8, mesh, (Partial(), Partial()))]
    assert_close(jshard.jit(f)(*args).full(), f(X, Y), n=8 + 2 * 12)  # parts of 8, two sums of 12 exps


def test_constant_and_passthrough_outputs():
    mesh = make_mesh((8,))
    x = jshard.distribute(np.arange(8.0, dtype=np.float32), mesh, (Shard(0),))
    const, same = jshard.jit(lambda a: (jnp.float32(3.0), a))(x)
    assert const.placements == (R,) and float(const.full()) == 3.0
    np.testing.assert_array_equal(np.asarray(same.full()), np.arange(8.0))


def test_static_and_donated_arguments():
    mesh = make_mesh((2, 4))
    X = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    x = jshard.distribute(X, mesh, (Shard(0), R))
    calls = []

    def f(x, n, axis):
        calls.append(n)
        return jnp.sum(x ** n, axis=axis)

    g = jshard.jit(f, static_argnums=(1, 2))
    for n, axis in [(2, 0), (3, 1), (2, 0)]:
        assert_close(g(x, n, axis).full(), np.sum(X ** n, axis=axis), n=8)
    assert calls == [2, 3]  # one trace per static value, none for the repeat
    with pytest.raises(TypeError, match=r"static argument\(s\) \[2\].*not hashable \(list\)"):
        g(x, 2, [0])
    with pytest.raises(ValueError, match="both in static_argnums"):
        jshard.jit(f, static_argnums=1, donate_argnums=1)
    assert g.explain(x, 2, 0).rows[-1]["outs"][0].placements == (Partial(), R)  # explain takes the same arguments
    assert jshard.explain(f, x, 2, 0, static_argnums=(1, 2), out_placements=(R, R)).totals == {"all_reduce": (1, 16)}

    step = jshard.jit(lambda p, d: jax.tree.map(lambda a, b: a - b, p, d), donate_argnums=0)
    params = {"w": jshard.distribute(X, mesh, (Shard(0), R)), "b": jshard.distribute(X[0], mesh, (R, Shard(0)))}
    new = step(params, {"w": 1.0, "b": 2.0})
    np.testing.assert_array_equal(np.asarray(new["w"].full()), X - 1)
    np.testing.assert_array_equal(np.asarray(new["b"].full()), X[0] - 2)
    with pytest.raises(jshard.DeletedArrayError, match=r"donated to argument 0\['w'\] of .*<lambda> \(test_api.py"):
        params["w"].full()  # the donated storage now belongs to the outputs


def test_python_scalars_are_weakly_typed_like_in_jax():
    mesh = make_mesh((8,))
    x = jshard.distribute(np.arange(8.0).astype(jnp.bfloat16), mesh, (Shard(0),))
    y = jshard.jit(lambda a, c: a * c)(x, 3.0)
    assert y.dtype == jnp.bfloat16  # a float32 scalar would promote the product
    np.testing.assert_array_equal(np.asarray(y.full(), np.float32), np.arange(8.0) * 3)


def test_a_primitive_without_a_rule_warns_once_with_the_source_line():
    from jshard.rules import registry

    mesh = make_mesh((8,))
    X = np.arange(16.0, dtype=np.float32)
    x = jshard.distribute(X, mesh, (Shard(0),))
    with registry.override("cumsum", None):
        with pytest.warns(UserWarning, match=r"no sharding rule for primitive 'cumsum' \(at .*test_api.py:\d+"):
            out = jshard.jit(lambda a: jnp.cumsum(a) * 2)(x)
    np.testing.assert_array_equal(np.asarray(out.full()), np.cumsum(X) * 2)  # small integers: exact


def test_explain_lists_collectives_inside_loops_and_branches():
    def f(x, w):
        h, ys = jax.lax.scan(lambda c, _: (c * 0.5 + c.sum(0), c.max()), _tanh_loop(x, w), None, length=2)
        return jax.lax.cond(jnp.sum(h) > 0, lambda a: a * 2.0, lambda a: a.sum(0, keepdims=True) - a, h) + ys.sum()

    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(11)
    X, W = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(4, 4)).astype(np.float32) * 0.5
    args = [jshard.distribute(X, mesh, (Shard(0), R)), jshard.distribute(W, mesh, (R, Shard(0)))]
    ex = jshard.explain(f, *args)
    prims = [r["primitive"] for r in ex.rows]
    assert any(p.startswith("while body | dot_general") for p in prims)
    assert any(p.startswith("scan body | ") for p in prims) and any(p.startswith("cond branch 1 | ") for p in prims)
    listed = {k.replace("permute", "collective_permute").replace("exchange", "collective_permute"): c
              for k, (c, _) in ex.totals.items()}
    assert listed and listed == dict(stablehlo_collectives(jshard.jit(f).lower(*args).as_text()))
    assert_close(jshard.jit(f)(*args).full(), f(X, W), n=3 * 4 + 2 * 8 + 32)  # while, scan, then the sums



@pytest.mark.parametrize("shape", [(8,), (1, 8)])
def test_explain_counts_what_a_call_runs_beside_what_the_program_holds(shape):
    """``totals`` lists each body's collectives once, as the program holds them; ``per_call`` as a call runs them:
    a scan's once per trip, the branch of a cond that moves most, a while loop's once (its trips are unknown)."""
    def f(x):
        c = jax.lax.scan(lambda c, _: (jnp.tanh(c + x.sum()), None), 0.0, None, length=5)[0]  # an all-reduce a trip
        y = jax.lax.cond(c > 0, lambda a: jnp.tanh(a.sum(0)), lambda a: a[0] * 2.0, x)
        return jax.lax.while_loop(lambda k: k[0] < 3, lambda k: (k[0] + 1, jnp.tanh(k[1] + x.sum())), (0, c))[1] \
            + y.sum()

    mesh = make_mesh(shape)
    X = np.random.default_rng(3).normal(size=(8, 4)).astype(np.float32)
    x = jshard.distribute(X, mesh, (R,) * (len(shape) - 1) + (Shard(0),))
    ex = jshard.explain(f, x)
    branches = {r["primitive"].split(" | ")[0]: [k for _, k, _, _ in r["moves"]] for r in ex.rows if r["moves"]}
    assert branches == {"scan body": ["all_reduce"], "cond branch 0": ["all_to_all"],
                        "cond branch 1": ["all_reduce"], "while body": ["all_reduce"]}
    assert ex.totals == {"all_reduce": (3, 4 + 16 + 4), "all_to_all": (1, 32)}
    assert ex.per_call == {"all_reduce": (5 + 1, 5 * 4 + 4), "all_to_all": (1, 32)}  # branch 0 moves 32 B, 1 16 B
    assert {r["runs"] for r in ex.rows if r["primitive"].startswith("scan body")} == {5}
    assert {r["runs"] for r in ex.rows if r["primitive"].startswith("while")} == {None, 1}
    assert "a call runs: all_reduce x6 (24 B), all_to_all x1 (32 B)" in str(ex)
    assert_close(jshard.jit(f)(x).full(), f(X), n=64)



def test_a_long_loop_of_collective_programs_with_donation_keeps_running():
    # XLA:CPU aborts when too many collective programs wait on its thread pool; jshard bounds the queue
    mesh = make_mesh((2, 4))
    x = jshard.distribute(np.ones((64, 64), np.float32), mesh, (Shard(0), Shard(1)))
    w = jshard.distribute(np.full((64, 64), 1 / 64, np.float32), mesh, (Shard(0), R))
    f = jshard.jit(lambda x, w: x @ w, out_placements=(Shard(0), Shard(1)), donate_argnums=0)
    for _ in range(2000):
        x = f(x, w)
    np.testing.assert_array_equal(np.asarray(x.full()), np.ones((64, 64)))  # 64 x 1/64 adds up exactly


def test_cached_programs_are_told_apart_by_specs_trees_and_keywords():
    mesh = make_mesh((2, 4))
    X = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    traces = []  # one per program compiled

    def g(a, b=None):
        traces.append(1)
        return a * 2 if b is None else a * 2 + b["w"]

    f = jshard.jit(g)
    ways = [(Shard(0), R), (R, Shard(1)), (Shard(1), Shard(0)), (Shard(0), R)]
    for p in ways:  # flat calls: one program per spec, each result laid out as its input
        out = f(jshard.distribute(X, mesh, p))
        assert out.placements == p
        np.testing.assert_array_equal(np.asarray(out.full()), X * 2)
    w = {"w": jshard.distribute(X, mesh, (R, Shard(0)))}
    for p in ways:  # keyword pytrees go through the tree-structure cache
        out = f(jshard.distribute(X, mesh, p), b=w)
        np.testing.assert_array_equal(np.asarray(out.full()), X * 3)
    out = f(jshard.distribute(X, mesh, ways[0]), b={"w": X})  # a plain array leaf: replicated, not confused
    np.testing.assert_array_equal(np.asarray(out.full()), X * 3)
    assert len(traces) == 7  # 3 + 3 specs, and the plain array leaf




def test_typed_key_arguments_draw_the_single_device_numbers():
    # a typed key travels as its key data and is wrapped again inside: the draws are the single-device ones
    mesh = make_mesh((2, 4))
    X = np.random.default_rng(14).normal(size=(8, 16)).astype(np.float32)
    x = jshard.distribute(X, mesh, (Shard(0), Shard(1)))

    def f(x, k):
        return jnp.where(jax.random.bernoulli(k, 0.7, x.shape), x, 0.0), jax.random.split(k)[0]

    for key in (jax.random.key(3), jax.random.key(3, impl="rbg")):
        out, nxt = jshard.jit(f)(x, key)
        want, want_next = f(X, key)
        np.testing.assert_array_equal(np.asarray(out.full()), want)
        assert jax.random.key_impl(nxt.full()) == jax.random.key_impl(key)
        np.testing.assert_array_equal(jax.random.key_data(nxt.full()), jax.random.key_data(want_next))
