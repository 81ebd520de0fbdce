"""What the walk's passes choose, against single-device JAX: where pending sums are completed (a transpose, a
bias, a loss gradient), where a gradient is made (scattered into the rows a device keeps), which moves share a
collective, what a loop carry settles on, and what an optimization barrier and pins keep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard
from oracle import assert_close, stablehlo_collectives

R = Replicate()


def _head_loss(x, w, labels):
    """A column-parallel head's cross-entropy: ``x @ w`` split by vocabulary over tp."""
    logits = x @ w
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))


def _head_and_labels(seq: int, vocab: int, seed: int):
    """``_head_loss``'s inputs (batch 8, width 16) as numpy arrays and as DArrays on (dp=2, tp=4): rows split by dp,
    the head's vocabulary by tp."""
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(seed)
    x, w = rng.normal(size=(8, seq, 16)).astype(np.float32), (rng.normal(size=(16, vocab)) / 4).astype(np.float32)
    labels = rng.integers(0, vocab, (8, seq)).astype(np.int32)
    placements = [(Shard(0), R), (R, Shard(1)), (Shard(0), R)]
    return (x, w, labels), [jshard.distribute(a, mesh, p) for a, p in zip((x, w, labels), placements)]


def test_vocabulary_parallel_cross_entropy_keeps_the_logits_sharded():
    # Megatron's loss parallelism: the logits split by vocabulary, the row max and the row sum of exponentials
    # all-reduced (a few bytes a row), the label's logit a masked lookup. Scattering those row statistics over the
    # rows instead (half an all-reduce's bytes each) met the vocabulary-sharded logits they are broadcast against
    # and moved the logits and their gradient with all-to-alls
    (X, W, L), args = _head_and_labels(seq=64, vocab=1024, seed=21)
    step = jax.value_and_grad(_head_loss, argnums=(0, 1))
    f = jshard.jit(step, out_placements=((R, R), ((Shard(0), R), (R, Shard(1)))))
    # the max, the sum, the loss; the input's gradient over tp, the weight's over dp
    assert dict(stablehlo_collectives(f.lower(*args).as_text())) == {"all_reduce": 5}
    value, (gx, gw) = f(*args)
    want_value, (want_x, want_w) = step(X, W, L)
    n = 16 + 1024 + 8 * 64  # the contraction, the row sums, the mean
    assert_close(value.full(), want_value, n=n)
    assert_close(gx.full(), want_x, n=n + 1024)  # and the gradient's contraction over the vocabulary
    assert_close(gw.full(), want_w, n=n + 8 * 64)  # and over the rows


def test_the_loss_gradient_is_made_where_the_head_reads_it_not_whole_and_sliced():
    # take_along_axis's gradient scatter-adds into zeros the logits' shape: made whole over tp and sliced to the
    # vocabulary shard only at the head's contraction, it and the softmax gradient's terms held four whole
    # logits blocks a device; made sharded, one more all-reduce of the (batch, seq) row sums pays for it
    (X, W, L), args = _head_and_labels(seq=128, vocab=8192, seed=5)
    grad = jax.grad(_head_loss, argnums=1)
    ex = jshard.explain(grad, *args)
    logits_sized = [s.placements for r in ex.rows for s in r["outs"] if s.shape == (8, 128, 8192)]
    assert logits_sized and all(p[1] == Shard(2) for p in logits_sized)  # split by vocabulary
    assert ex.totals == {"all_reduce": (3, 3 * 4 * 128 * 4)}  # the row max, the exp-sum, the gradient's row sum
    got = jshard.jit(grad, out_placements=(R, Shard(1)))(*args)
    assert_close(got.full(), grad(X, W, L), n=16 + 8192 + 8 * 128)


@pytest.mark.parametrize("shape", [(8,), (1, 8)])
def test_the_zeros_a_gradient_is_scattered_into_are_made_as_the_scatter_writes(shape):
    # take_along_axis's gradient scatter-adds into zeros the logits' shape, in place; with the rows split, the
    # scatter writes its rows' block, and its zeros were made whole on every device (a logits-sized block more
    # than the step holds, which the memory prediction counted): they are made as the scatter's output now
    mesh = make_mesh(shape)
    rng = np.random.default_rng(3)
    logits, labels = rng.normal(size=(16, 32, 64)).astype(np.float32), rng.integers(0, 64, (16, 32)).astype(np.int32)
    rows = (R,) * (len(shape) - 1) + (Shard(0),)
    args = [jshard.distribute(a, mesh, rows) for a in (logits, labels)]
    grad = jax.grad(lambda lg, lb: jnp.take_along_axis(jax.nn.log_softmax(lg), lb[..., None], axis=-1).mean())
    ex = jshard.explain(grad, *args)
    made = {(r["primitive"], s.placements) for r in ex.rows for s in r["outs"] if s.shape == logits.shape}
    assert ("broadcast_in_dim", rows) in made and all(p == rows for _, p in made)
    assert_close(jshard.jit(grad)(*args).full(), grad(logits, labels), n=64 + 16 * 32)


def test_an_embedding_gradient_is_scattered_into_the_rows_a_device_keeps():
    # the vocabulary-parallel table's gradient: each device scatter-adds only the ids in its rows (gathering the
    # small updates over dp, where they are split by batch) instead of scattering into the whole table over tp
    def loss(table, ids):
        return jnp.sum(jnp.tanh(table[ids]))

    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(6)
    T = rng.normal(size=(4096, 256)).astype(np.float32)
    ids = rng.integers(0, 4096, (8, 64)).astype(np.int32)
    args = [jshard.distribute(T, mesh, (R, Shard(0))), jshard.distribute(ids, mesh, (Shard(0), R))]
    grad = jax.grad(loss)
    f = jshard.jit(grad, out_placements=(R, Shard(0)))
    rows = jshard.explain(grad, *args, out_placements=(R, Shard(0))).rows
    scatters = [r["outs"][0].placements for r in rows if r["primitive"] == "scatter-add"]
    assert scatters == [(R, Shard(0))]
    assert_close(f(*args).full(), grad(T, ids), n=8)


def test_a_fully_sharded_table_gradient_gathers_the_updates_not_the_table():
    # FSDP's embedding gradient: scatter-adding each device's updates into a whole zero table and reduce-scattering
    # it moves (n - 1) / n of the table; gathering the updates (batch x width) and scattering into the rows a
    # device keeps moves far less and never holds the table whole
    def table_grad(table, ids, g):
        return jax.vjp(lambda t: t[ids], table)[1](g)[0]

    mesh = make_mesh((8,))
    rng = np.random.default_rng(7)
    T, G = rng.normal(size=(8192, 128)).astype(np.float32), rng.normal(size=(8, 32, 128)).astype(np.float32)
    ids = rng.integers(0, 8192, (8, 32)).astype(np.int32)
    args = [jshard.distribute(a, mesh, (Shard(0),)) for a in (T, ids, G)]
    ex = jshard.explain(table_grad, *args, out_placements=(Shard(0),))
    assert [r["outs"][0].placements for r in ex.rows if r["primitive"] == "scatter-add"] == [(Shard(0),)]
    assert ex.totals == {"all_gather": (2, 32 * 4 + 32 * 128 * 4)}  # each device's ids and updates
    got = jshard.jit(table_grad, out_placements=(Shard(0),))(*args)
    assert_close(got.full(), table_grad(T, ids, G), n=8)


def test_data_parallel_gradients_stay_partial_and_reduce_once_per_parameter_when_pinned():
    from oracle import hlo_collectives

    mesh = make_mesh((8,))
    rng = np.random.default_rng(4)
    X, W1, W2 = (rng.normal(size=s).astype(np.float32) for s in [(16, 10), (10, 12), (12, 10)])
    x = jshard.distribute(X, mesh, (Shard(0),))
    params = (jshard.distribute(W1, mesh, (R,)), jshard.distribute(W2, mesh, (R,)))
    grad = jax.grad(lambda p, x: jnp.mean((jax.nn.gelu(x @ p[0]) @ p[1]) ** 2))
    free = jshard.jit(grad)(params, x)
    assert [g.placements for g in free] == [(Partial(),), (Partial(),)]  # nothing reduced yet
    pinned = jshard.jit(grad, out_placements=jshard.same_as(0))
    out = pinned(params, x)
    for g, want in zip(out, grad((W1, W2), X)):
        assert g.placements == (R,)
        assert_close(g.full(), want, n=10 + 12 + 16 * 10)  # the batch's mean over 160 outputs
    lowered = pinned.lower(params, x)
    # one psum per parameter and nothing in the backward pass (XLA's combiner may then merge the two)
    assert lowered.as_text().count("stablehlo.all_reduce") == 2
    assert set(hlo_collectives(lowered.compile().as_text())) == {"all-reduce"}
    # the outputs' moves are made together at the end: two small ones over eight devices go one by one by the
    # default model (sharing would save a quarter of their cost), and share one reduce-scatter where kernels are free
    for model, scatters in [(None, 2), (jshard.CostModel(kernel_us=0.0), 1)]:
        sharded = jshard.jit(grad, out_placements=((Shard(0),), (Shard(0),)), cost_model=model).lower(params, x)
        assert sharded.as_text().count("stablehlo.reduce_scatter") == scatters
        assert "all_reduce" not in sharded.as_text()


def test_consecutive_constraints_move_together_in_order():
    # constraints one after another (TrainStep's gradients) share one reduce-scatter; one constraining a value
    # again, and one reading an earlier constraint's output, still get their own values. Kernels priced free: by
    # the default model two small arrays over two devices do not pay for packing one buffer (test_redistribute)
    free_kernels = jshard.CostModel(kernel_us=0.0)
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(8)
    X, W = rng.normal(size=(16, 12)).astype(np.float32), rng.normal(size=(12, 8)).astype(np.float32)

    def f(x, w):
        g1, g2 = x.T @ x, x.T @ (x @ w)  # Partial(sum) over dp: rows of x are split there
        c1 = jshard.constrain(g1, [Shard(0), R])
        c2 = jshard.constrain(g2, [Shard(1), R])
        c3 = jshard.constrain(g2, [Shard(1), R])  # the same move again
        c4 = jshard.constrain(c1, [R, Shard(1)])  # reads c1: after the others
        return c1, c2, c3, c4

    args = [jshard.distribute(X, mesh, (Shard(0), R)), jshard.distribute(W, mesh, (R, R))]
    ex = jshard.explain(f, *args, cost_model=free_kernels)
    assert ex.totals["reduce_scatter"][0] == 1  # as in the program
    assert [shared for r in ex.rows for shared in r["shared"]] == [True, True, False]  # c1, c2; then c4's gather
    assert str(ex).count("one collective with other moves") == 2
    outs = jshard.jit(f, cost_model=free_kernels)(*args)
    assert [o.placements for o in outs] == [(Shard(0), R), (Shard(1), R), (Shard(1), R), (R, Shard(1))]
    A = np.abs(X)
    terms = [A.T @ A, A.T @ (A @ np.abs(W))]
    for o, want, t in zip(outs, jax.jit(f)(X, W), [terms[0], terms[1], terms[1], terms[0]]):
        assert_close(o.full(), want, n=16 + 12, terms=t)
    assert jshard.jit(f, cost_model=free_kernels).lower(*args).as_text().count("stablehlo.reduce_scatter") == 1
    assert jshard.jit(f).lower(*args).as_text().count("stablehlo.reduce_scatter") == 2  # the default: one each


@pytest.mark.parametrize("target,rows,width,moved_at", [(R, 16, 12, "transpose"), (Shard(0), 16, 12, "output pin"),
                                                        (Shard(0), 16, 512, "output pin"),
                                                        (Shard(0), 2048, 12, "transpose"),
                                                        (Shard(0), 2048, 512, "transpose")])
def test_a_transpose_reduces_its_input_where_its_consumers_would_reduce_its_output(target, rows, width, moved_at):
    # a weight gradient: a contraction over the data-parallel rows, then a transpose. Its sums are all-reduced
    # before the transpose (where the contraction made them, as GSPMD does; XLA then keeps the contraction in
    # its fast form), the same bytes as after it; so are they reduce-scattered where the contraction sums 1024
    # rows a device or more (CostModel.scatter_first_rows), small or large; with fewer rows the scatter stays with
    # the pin (XLA's copy to scatter a non-leading dim would cost more than the faster dot saves)
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(9)
    X, Y = rng.normal(size=(rows, width)).astype(np.float32), rng.normal(size=(rows, width - 4)).astype(np.float32)
    args = [jshard.distribute(X, mesh, (Shard(0), R)), jshard.distribute(Y, mesh, (Shard(0), R))]

    def f(x, y):
        return jax.lax.dot_general(y, x, (((0,), (0,)), ((), ()))).T

    ex = jshard.explain(f, *args, out_placements=(target, R))
    kind = "all_reduce" if target == R else "reduce_scatter"
    where = {("transpose" if r["primitive"] == "transpose" else "output pin"): [m[1] for m in r["moves"]]
             for r in ex.rows if r["moves"]}
    assert where == {moved_at: [kind]}
    assert ex.totals == {kind: (1, width * (width - 4) * 4)}  # the same collective and bytes either way
    out = jshard.jit(f, out_placements=(target, R))(*args)
    assert out.placements == (target, R)
    assert_close(out.full(), X.T @ Y, n=rows, terms=np.abs(X).T @ np.abs(Y))
    if moved_at == "output pin" and width == 12:  # the threshold is the cost model's: from 8 rows, it scatters first
        ex = jshard.explain(f, *args, out_placements=(target, R), cost_model=jshard.CostModel(scatter_first_rows=8))
        assert [r["primitive"] for r in ex.rows if r["moves"]] == ["transpose"]


@pytest.mark.parametrize("rows", [16, 14])  # 14: 7 rows a dp coordinate, scattered unevenly over tp
@pytest.mark.parametrize("target", [R, Shard(0)])
def test_a_bias_is_added_after_the_sum_it_would_be_masked_into(target, rows):
    # a row-parallel Linear: the contraction leaves sums pending over tp; adding the replicated bias to them would
    # put the bias on one coordinate (a masked add over every device's whole block). The sums are completed
    # first, with the same collective and bytes, so the add runs on the reduced block (a quarter after a
    # reduce-scatter) and XLA fuses it with what follows. Two pending sums added together still reduce once
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(10)
    X, W, V = (rng.normal(size=s).astype(np.float32) for s in [(rows, 32), (32, 24), (32, 24)])
    b = rng.normal(size=(24,)).astype(np.float32)
    args = [jshard.distribute(X, mesh, (Shard(0), Shard(1))), jshard.distribute(W, mesh, (R, Shard(0))),
            jshard.distribute(V, mesh, (R, Shard(0))), jshard.distribute(b, mesh, (R, R))]

    def f(x, w, v, b):
        y = jshard.constrain(x @ w + b, [Shard(0), target])
        z = jshard.constrain(x @ w + x @ v, [Shard(0), target])
        return y, z

    ex = jshard.explain(f, *args)
    adds = [r for r in ex.rows if r["primitive"] == "add"]
    assert [[p.is_partial for s in r["ins"] for p in s.placements] for r in adds] == [[False] * 4, [False, True] * 2]
    kind = "all_reduce" if target == R else "reduce_scatter"
    assert [m[1] for r in adds for m in r["moves"]] == [kind]  # the bias's sum, completed at the add
    # what a device receives: the same as reducing the contraction alone, once per output
    alone = jshard.explain(lambda x, w: jshard.constrain(x @ w, [Shard(0), target]), *args[:2]).totals[kind]
    assert ex.totals == {kind: (2, 2 * alone[1])} and alone[0] == 1
    y, z = jshard.jit(f)(*args)
    assert y.placements == z.placements == (Shard(0), target)
    A = np.abs(X)
    assert_close(y.full(), X @ W + b, n=32, terms=A @ np.abs(W) + np.abs(b))
    assert_close(z.full(), X @ W + X @ V, n=64, terms=A @ np.abs(W) + A @ np.abs(V))


def test_an_optimization_barrier_keeps_each_operand_as_it_is():
    # remat and erf's derivative put barriers between values of any placement: a Partial passes unreduced
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(7)
    X, Y = rng.normal(size=(8, 12)).astype(np.float32), rng.normal(size=(8, 12)).astype(np.float32)
    x = jshard.distribute(X, mesh, (Shard(0), R))
    y = jshard.distribute(Y, mesh, (R, Shard(1)))

    def f(x, y):
        a, b = jax.lax.optimization_barrier((x @ y.T, y))
        return a, b

    a, b = jshard.jit(f)(x, y)
    assert (a.placements, b.placements) == ((Shard(0), Partial()), (R, Shard(1)))
    assert jshard.explain(f, x, y).totals == {}
    assert_close(a.full(), X @ Y.T, n=12, terms=np.abs(X) @ np.abs(Y).T)
    np.testing.assert_array_equal(b.full(), Y)


def test_loop_carry_settles_where_the_body_needs_no_communication():
    # the carry comes in replicated, but the body keeps producing a row-sharded value: carrying it sharded
    # costs one scatter before the loop instead of a gather on every trip
    def f(h, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=6)[0]

    mesh = make_mesh((8,))
    rng = np.random.default_rng(12)
    H, W = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32) * 0.3
    args = [jshard.distribute(H, mesh, (R,)), jshard.distribute(W, mesh, (R,))]
    x = jshard.from_local([H / 8] * 8, mesh, (Partial(),))  # a Partial carry: reduce-scattered once up front
    for a in (args[0], x):
        ex = jshard.explain(f, a, args[1])
        out = jshard.jit(f)(a, args[1])
        assert_close(out.full(), f(H, W), n=8 + 6 * 8)  # parts of 8, six steps contracting 8
        body = [r for r in ex.rows if r["primitive"].startswith("scan body")]
        assert body and not any(r["moves"] for r in body)  # nothing moves inside the loop


def test_dropout_masks_are_drawn_only_where_the_activations_are():
    # the mask's consumers want it sharded like x: the draw itself is made sharded (each device draws its own
    # elements by their global index), not drawn whole and sliced; the numbers are the single-device ones
    mesh = make_mesh((2, 4))
    X = np.random.default_rng(13).normal(size=(8, 16)).astype(np.float32)
    key = np.asarray(jax.random.key_data(jax.random.key(7)))

    def f(x, k):
        keep = jax.random.bernoulli(jax.random.wrap_key_data(k), 0.7, x.shape)
        return jnp.where(keep, x / 0.7, 0)

    args = [jshard.distribute(X, mesh, (Shard(0), Shard(1))), jshard.distribute(key, mesh, (R, R))]
    ex = jshard.explain(f, *args)
    bits = [r for r in ex.rows if r["primitive"] == "random_bits"]
    assert [r["outs"][0].placements for r in bits] == [(Shard(0), Shard(1))]
    assert ex.totals == {}
    got, want = np.asarray(jshard.jit(f)(*args).full()), np.asarray(f(X, key))
    np.testing.assert_array_equal(got == 0, want == 0)
    assert_close(got, want, terms=np.abs(want))
