"""Contraction rules (dot_general, conv_general_dilated): the validator on 1-D meshes, one equation end to
end on 2-D and 3-D meshes against the single-device result, and the strategies ``select`` picks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jc

from conftest import make_mesh
from jshard import Partial, Replicate, Shard, Spec, StridedShard
from jshard.propagate import select
from jshard.validate.core import collect, run_equation, validate
from oracle import assert_close, magnitude
from oracle import poisoned as darray

R = Replicate()
MATMUL = (((1,), (0,)), ((), ()))
NHWC = ("NHWC", "HWIO", "NHWC")


# -- helpers --------------------------------------------------------------------------------------------


def contraction(fn, *args):
    """The last contraction equation of ``fn`` on ``args`` (a gradient's, after the forward one): its
    primitive, params and operand values."""
    closed = jax.make_jaxpr(fn)(*args)
    env = dict(zip(closed.jaxpr.constvars, closed.consts)) | dict(zip(closed.jaxpr.invars, args))
    found = None
    for eqn in closed.jaxpr.eqns:
        vals = [v.val if isinstance(v, jc.Literal) else env[v] for v in eqn.invars]
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            found = eqn.primitive, eqn.params, [np.asarray(v) for v in vals]
        out = eqn.primitive.bind(*vals, **eqn.params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
    assert found is not None
    return found


def check_equation(fn, args, mesh_shape, placements, *, free=True):
    """Run the contraction of ``fn(*args)`` on DArrays with ``placements`` and compare with the
    single-device result; ``free``: the inputs already match a strategy, so nothing is redistributed
    (and the poisoned padding reaches the local function)."""
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(0)
    prim, params, values = contraction(fn, *args)
    inputs = [darray(v, mesh, p, rng) for v, p in zip(values, placements)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs, choice = run_equation(prim, params, inputs)
    truth = np.asarray(prim.bind(*values, **params))
    got = np.asarray(outs[0].full())
    assert got.dtype == truth.dtype
    # each output sums products of the operands' parts: the bound follows the contraction of their sizes
    sizes = [jnp.asarray(magnitude(v, mesh_shape, p), v.dtype) for v, p in zip(values, placements)]
    terms = np.asarray(prim.bind(*sizes, **params))
    assert_close(got, truth, n=max(np.size(v) for v in values), terms=terms)
    if free:
        moved = [s.placements for s in choice.ins] != [x.placements for x in inputs]
        assert choice.cost == 0.0 and not moved, choice
    return choice


def arr(shape, dtype=np.float32, lo=-6, hi=6, seed=0):
    return np.random.default_rng(seed).integers(lo, hi + 1, size=shape).astype(dtype)


# -- the validator ----------------------------------------------------------------------------------------


def _samples(name, keep):
    return [s for s in collect([name])[name] if keep(s)]


def test_validator_dot_general_quick():
    """Matmul (float32 and int8 -> int32), a gradient layout, a vector dot and an outer product on meshes
    of 2 and 3."""
    shapes = {((5, 7), (7, 3)), ((5, 3), (5, 7)), ((7,), (7,)), ((5,), (3,))}
    samples = _samples("dot_general", lambda s: tuple(v.shape for v in s.values) in shapes)
    assert {str(s.values[0].dtype) for s in samples} == {"float32", "int8"}
    r = validate("dot_general", samples, sizes=(2, 3))
    assert not r.errors, r.errors[:3]
    assert r.incorrect == 0, r.incorrect_cases[0][1]
    assert r.missing == 0, r.missing_cases[0][1]
    assert r.correct >= 10


def test_validator_conv_quick():
    """The forward NHWC conv and its kernel gradient (which contracts the batch) on a mesh of 2."""
    samples = _samples("conv_general_dilated",
                       lambda s: tuple(v.shape for v in s.values) in {((3, 5, 5, 3), (3, 3, 3, 4)),
                                                                      ((3, 5, 5, 3), (3, 5, 5, 4))})
    assert len(samples) == 2
    r = validate("conv_general_dilated", samples, sizes=(2,))
    assert not r.errors, r.errors[:3]
    assert r.incorrect == 0, r.incorrect_cases[0][1]
    assert r.correct >= 8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dot_general", "conv_general_dilated"])
def test_validator_full(name):
    r = validate(name, collect([name])[name])
    assert not r.errors, r.errors[:3]
    assert r.incorrect == 0, r.incorrect_cases[0][1]
    if name == "dot_general":
        assert r.missing == 0, r.missing_cases[0][1]


# -- N-D meshes end to end --------------------------------------------------------------------------------

S0, S1, S2, S3 = Shard(0), Shard(1), Shard(2), Shard(3)
SUM, AVG = Partial("sum"), Partial("avg")


def matmul(a, b):
    return lax.dot_general(a, b, MATMUL)


@pytest.mark.parametrize("mesh_shape, x, w", [
    ((2, 4), (S0, S1), (R, S0)),  # row-sharded activations, contraction over tp: uneven 10 over 4
    ((2, 4), (S1, S1), (S0, S0)),  # the contraction split by both axes (nested chunks, 2 * 4 over 10)
    ((2, 4), (StridedShard(1, 2), R), (StridedShard(0, 2), S1)),  # strided contraction, column-sharded w
    ((2, 4), (SUM, S0), (R, R)),  # a pending sum passes, rows sharded on the other axis
    ((2, 4), (R, AVG), (S1, R)),
    ((2, 2, 2), (S0, S1, R), (R, S0, S1)),
    ((2, 2, 2), (S1, SUM, S0), (S0, R, R)),
    ((2, 2, 2), (S1, S1, S1), (S0, S0, S0)),  # 10 over 8: some devices hold nothing of the contraction
])
def test_matmul_uneven(mesh_shape, x, w):
    check_equation(matmul, [arr((6, 10)), arr((10, 5), seed=1)], mesh_shape, [x, w])


@pytest.mark.parametrize("mesh_shape, q, k", [
    ((2, 4), (S0, S1), (S0, S1)),  # batch and heads
    ((2, 4), (S0, S3), (S0, S3)),  # batch, and the head dim contracted
    ((2, 2, 2), (S2, S1, S3), (R, S1, S3)),  # queries, heads, head dim
    ((2, 2, 2), (S0, R, AVG), (S0, S2, R)),  # keys sharded, queries a pending average
])
def test_attention_scores(mesh_shape, q, k):
    fn = lambda a, b: jnp.einsum("bhqd,bhkd->bhqk", a, b)
    check_equation(fn, [arr((2, 3, 5, 6)), arr((2, 3, 7, 6), seed=1)], mesh_shape, [q, k])


def test_int8_accumulates_in_int32():
    fn = lambda a, b: lax.dot_general(a, b, MATMUL, preferred_element_type=jnp.int32)
    a, b = arr((6, 10), np.int8, -120, 120), arr((10, 5), np.int8, -120, 120, seed=1)
    check_equation(fn, [a, b], (2, 4), [(S0, S1), (R, S0)])
    # a pending int8 sum would be accumulated unwrapped in int32: the rules reduce it first
    choice = check_equation(fn, [a, b], (2, 4), [(SUM, R), (R, R)], free=False)
    assert choice.ins[0].placements[0] != SUM


def test_bf16_accumulates_in_f32():
    fn = lambda a, b: lax.dot_general(a, b, MATMUL, preferred_element_type=jnp.float32)
    a, b = arr((6, 10), jnp.bfloat16), arr((10, 5), jnp.bfloat16, seed=1)
    check_equation(fn, [a, b], (2, 2, 2), [(S0, S1, SUM), (R, S0, R)])


def conv(strides, padding, groups=1):
    return lambda x, w: lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=NHWC,
                                                 feature_group_count=groups)


@pytest.mark.parametrize("mesh_shape, x, w", [
    ((2, 4), (S0, S3), (R, S2)),  # batch over dp, input channels contracted over tp
    ((2, 4), (S0, R), (R, S3)),  # batch over dp, output features over tp
    ((2, 2, 2), (S0, SUM, S3), (R, R, S2)),
])
def test_conv_forward(mesh_shape, x, w):
    check_equation(conv((2, 2), "SAME"), [arr((3, 7, 6, 5)), arr((3, 3, 5, 6), seed=1)], mesh_shape, [x, w])


def test_conv_kernel_gradient_is_a_pending_sum_of_the_batch():
    """Data parallel: activations and output gradients batch-sharded give a P(sum) kernel gradient with
    no communication (the gradient conv contracts the batch: lhs_spec=(3, 0, 1, 2))."""
    f = conv((2, 2), "SAME")
    x, w = arr((6, 7, 6, 5)), arr((3, 3, 5, 4), seed=1)
    g = arr(jax.eval_shape(f, x, w).shape, seed=2)
    kernel_grad = lambda a, b: jax.vjp(lambda ww: f(a, ww), w)[1](b)[0]
    assert contraction(kernel_grad, x, g)[1]["dimension_numbers"].lhs_spec == (3, 0, 1, 2)
    for mesh_shape in [(2, 4), (2, 2, 2)]:
        placements = (S0,) * len(mesh_shape)  # 6 rows over 8 devices: uneven, some empty
        choice = check_equation(kernel_grad, [x, g], mesh_shape, [placements, placements])
        assert choice.outs[0].placements == (SUM,) * len(mesh_shape)


def test_grouped_conv_gradients():
    """feature_group_count=2 forward and input gradient, batch_group_count=2 kernel gradient."""
    f = conv((1, 1), "SAME", groups=2)
    x, w = arr((4, 5, 5, 4)), arr((3, 3, 2, 6), seed=1)
    g = arr(jax.eval_shape(f, x, w).shape, seed=2)
    kernel_grad = lambda a, b: jax.vjp(lambda ww: f(a, ww), w)[1](b)[0]
    input_grad = lambda b, ww: jax.vjp(lambda a: f(a, ww), x)[1](b)[0]
    assert contraction(kernel_grad, x, g)[1]["batch_group_count"] == 2
    check_equation(f, [x, w], (2, 4), [(S0, SUM), (R, R)])
    check_equation(kernel_grad, [x, g], (2, 4), [(S0, SUM), (S0, R)])  # contracts the batch
    check_equation(input_grad, [g, w], (2, 4), [(S0, R), (R, AVG)])
    # grouped features are not split: the search replicates them
    check_equation(f, [x, w], (2, 4), [(S0, S3), (R, S3)], free=False)


def test_conv_1x1_spatial_dims():
    """A 1x1 window reads no neighbours: the forward conv keeps spatial shards, and its kernel gradient
    (one output position, the window the whole image) contracts them into P(sum)."""
    f = conv((1, 1), "VALID")
    x, w = arr((3, 5, 6, 4)), arr((1, 1, 4, 5), seed=1)
    g = arr(jax.eval_shape(f, x, w).shape, seed=2)
    choice = check_equation(f, [x, w], (2, 4), [(S1, S2), (R, R)])
    assert choice.outs[0].placements == (S1, S2)
    kernel_grad = lambda a, b: jax.vjp(lambda ww: f(a, ww), w)[1](b)[0]
    choice = check_equation(kernel_grad, [x, g], (2, 2, 2), [(S1, S2, S0), (S1, S2, S0)])
    assert choice.outs[0].placements == (SUM, SUM, SUM)


# -- selection ------------------------------------------------------------------------------------------


def aval(shape, dtype=jnp.float32):
    return jax.core.ShapedArray(shape, dtype)


def test_megatron_mlp_needs_no_communication():
    """x (S(0) on dp) @ w1 (column-parallel) -> (S0, S1); then @ w2 (row-parallel) -> (S0, P(sum))."""
    mesh = make_mesh((2, 4))
    x = Spec.create(mesh, (S0, R), (8, 16), "float32")
    w1 = Spec.create(mesh, (R, S1), (16, 32), "float32")
    w2 = Spec.create(mesh, (R, S0), (32, 16), "float32")
    c1 = select(lax.dot_general_p, dict(dimension_numbers=MATMUL, precision=None, preferred_element_type=None,
                                        out_sharding=None), [x, w1], [aval((8, 32))])
    assert c1.cost == 0.0 and c1.ins == (x, w1)
    assert c1.outs[0].placements == (S0, S1)
    c2 = select(lax.dot_general_p, dict(dimension_numbers=MATMUL, precision=None, preferred_element_type=None,
                                        out_sharding=None), [c1.outs[0], w2], [aval((8, 16))])
    assert c2.cost == 0.0 and c2.ins == (c1.outs[0], w2)
    assert c2.outs[0].placements == (S0, SUM)


def test_select_contraction_mismatch_moves_the_cheaper_operand():
    """lhs contraction-sharded, rhs replicated: slicing the replicated rhs is free (R -> S is local)."""
    mesh = make_mesh((2, 4))
    x = Spec.create(mesh, (R, S1), (8, 30), "float32")
    w = Spec.create(mesh, (R, R), (30, 16), "float32")
    c = select(lax.dot_general_p, dict(dimension_numbers=MATMUL, precision=None, preferred_element_type=None,
                                       out_sharding=None), [x, w], [aval((8, 16))])
    assert c.cost == 0.0 and c.ins[0] == x
    assert c.ins[1].placements == (R, S0) and c.outs[0].placements == (R, SUM)


def test_select_no_partial_max_through_a_product():
    mesh = make_mesh((2, 4))
    x = Spec.create(mesh, (Partial("max"), R), (8, 16), "float32")
    w = Spec.create(mesh, (R, R), (16, 4), "float32")
    c = select(lax.dot_general_p, dict(dimension_numbers=MATMUL, precision=None, preferred_element_type=None,
                                       out_sharding=None), [x, w], [aval((8, 4))])
    assert not any(p.is_partial for p in c.ins[0].placements + c.outs[0].placements)
    assert c.cost > 0
