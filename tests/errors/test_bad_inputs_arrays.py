"""Bad input at the array entry points: a clear error before any work, and nothing lost.

Every case below calls one public entry point (placements, ``Spec.create``, ``distribute``, ``from_local``,
``from_jax``, ``to_jax``, ``redistribute``, ``plan_redistribute``, ``visualize``, ``float``/``int``) with one bad
argument and checks three things:

- the exception is a ValueError or TypeError (or jshard's subclasses: PlacementError, LayoutError,
  DeletedArrayError), never an internal error from numpy, JAX or XLA;
- its message starts with the operation and names the offending argument (the ``match`` pattern);
- every input survives: the DArray keeps its placements and value and is not deleted, numpy arrays and
  the list of locals are unchanged.

Then the regressions behind some of the cases: 0-size dims flow through every constructor and
redistribution like any other, Partial(max|min) reductions keep NaN as ``np.maximum`` / ``np.minimum`` do (in
one all_reduce), a DArray whose storage was donated raises ``DeletedArrayError`` instead of crashing XLA, and
an integer Partial(avg) is divided once, after every sum (``tests/errors/test_fuzz_inputs.py`` found it floored part
by part).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh
from jshard import DeletedArrayError, LayoutError, Partial, PlacementError, Replicate, Shard, Spec, StridedShard
from jshard.lowering import compile_plan
from oracle import check_darray, local_blocks

R = Replicate()


@dataclass
class Inputs:
    """What a case may pass: a DArray ``x`` of ``value`` on ``mesh``, and each device's local array of it."""

    mesh: jax.sharding.Mesh
    value: np.ndarray
    x: jshard.DArray
    locals: list

    @classmethod
    def make(cls) -> Inputs:
        mesh = make_mesh((2, 4))
        value = np.arange(32.0, dtype=np.float32).reshape(8, 4)
        x = jshard.distribute(value, mesh, [Shard(0), R])
        return cls(mesh, value, x, [np.asarray(a) for a in x.to_local()])


def _deleted_jax_array():
    a = jnp.arange(4.0)
    a.delete()
    return a


# (id, call, exception, message pattern): the pattern starts with the operation and names the argument
CASES = [
    # placements
    ("shard-str", lambda i: Shard("a"), PlacementError, r"^Shard\(dim='a'\): dim must be an int"),
    ("shard-float", lambda i: Shard(1.5), PlacementError, r"^Shard\(dim=1.5\): dim must be an int"),
    ("shard-bool", lambda i: Shard(True), PlacementError, r"^Shard\(dim=True\): dim must be an int"),
    ("strided-sf0", lambda i: StridedShard(0, 0), PlacementError, r"^StridedShard\(0, split_factor=0\)"),
    ("strided-sf-float", lambda i: StridedShard(0, 2.0), PlacementError, r"^StridedShard\(0, split_factor=2.0\)"),
    ("strided-dim-str", lambda i: StridedShard("x", 2), PlacementError, r"^StridedShard\(dim='x'\)"),
    ("partial-prod", lambda i: Partial("prod"), PlacementError, r"^Partial\('prod'\): unknown reduce op"),
    ("partial-list", lambda i: Partial(["sum"]), PlacementError, r"^Partial\(\['sum'\]\): unknown reduce op"),
    ("partial-none", lambda i: Partial(None), PlacementError, r"^Partial\(None\): unknown reduce op"),
    # Spec.create
    ("spec-mesh", lambda i: Spec.create("mesh", [R], (4,), "float32"), TypeError, r"^Spec: mesh must be"),
    ("spec-negative", lambda i: Spec.create(i.mesh, [R, R], (-5, 3), "float32"), ValueError,
     r"^Spec: shape \(-5, 3\) has -5 at dim 0"),
    ("spec-float-dim", lambda i: Spec.create(i.mesh, [R, R], (16.7, 3), "float32"), TypeError,
     r"^Spec: shape \(16.7, 3\) has 16.7 at dim 0"),
    ("spec-bool-dim", lambda i: Spec.create(i.mesh, [R, R], (True, 3), "float32"), TypeError,
     r"^Spec: shape \(True, 3\) has True"),
    ("spec-str-shape", lambda i: Spec.create(i.mesh, [R, R], "16", "float32"), TypeError,
     r"^Spec: shape must be a tuple of ints, got '16'"),
    ("spec-int-shape", lambda i: Spec.create(i.mesh, [R, R], 16, "float32"), TypeError,
     r"^Spec: shape must be a tuple of ints, got 16; for a 1-d array write \(16,\)"),
    ("spec-object-dtype", lambda i: Spec.create(i.mesh, [R, R], (4, 4), object), TypeError,
     r"^Spec: dtype object is not a numeric or bool dtype"),
    ("spec-unknown-dtype", lambda i: Spec.create(i.mesh, [R, R], (4, 4), "foo"), TypeError,
     r"^Spec: dtype 'foo' is not a numeric or bool dtype"),
    ("spec-complex-max", lambda i: Spec.create(i.mesh, [Partial("max"), R], (4,), "complex64"), PlacementError,
     r"^Spec: \(P\(max\), R\) puts a Partial\(max\|min\) on a complex64 array"),
    ("spec-key-partial", lambda i: Spec.create(i.mesh, [Partial(), R], (), jax.random.key(0).dtype), PlacementError,
     r"^Spec: \(P\(sum\), R\) puts a Partial on a key<fry> array"),
    ("spec-bool-partial", lambda i: Spec.create(i.mesh, [Partial(), R], (4,), "bool"), PlacementError,
     r"^Spec: \(P\(sum\), R\) puts a Partial on a bool array"),
    # distribute
    ("distribute-mesh", lambda i: jshard.distribute(i.value, "mesh", [Shard(0), R]), TypeError,
     r"^distribute: mesh must be a jax.sharding.Mesh"),
    ("distribute-str", lambda i: jshard.distribute("abc", i.mesh, [R, R]), TypeError,
     r"^distribute: x must be an array .* got str 'abc'"),
    ("distribute-object", lambda i: jshard.distribute(np.array([object()] * 4), i.mesh, [R, R]), TypeError,
     r"^distribute: dtype object is not a numeric or bool dtype"),
    ("distribute-ragged", lambda i: jshard.distribute([[1.0], [1.0, 2.0]], i.mesh, [R, R]), TypeError,
     r"^distribute: x must be an array .* got list"),
    ("distribute-darray", lambda i: jshard.distribute(i.x, i.mesh, [R, R]), TypeError,
     r"^distribute: x is already a DArray .*x.redistribute"),
    ("distribute-length", lambda i: jshard.distribute(i.value, i.mesh, [Shard(0)]), PlacementError,
     r"^distribute: \(S\(0\)\) has 1 placements but the mesh has 2 axes"),
    ("distribute-not-a-list", lambda i: jshard.distribute(i.value, i.mesh, Shard(0)), PlacementError,
     r"^distribute: expected a sequence of 2 placements"),
    ("distribute-str-placements", lambda i: jshard.distribute(i.value, i.mesh, "RR"), PlacementError,
     r"^distribute: entry 0 of \('R', 'R'\) is 'R', not a placement"),
    ("distribute-dim-out-of-range", lambda i: jshard.distribute(i.value, i.mesh, [Shard(5), R]), PlacementError,
     r"^distribute: S\(5\) on mesh axis 0 .* names dim 5, but the array has rank 2"),
    ("distribute-mixed-partials", lambda i: jshard.distribute(i.value, i.mesh, [Partial("max"), Partial()]),
     PlacementError, r"^distribute: \(P\(max\), P\(sum\)\) mixes"),
    ("distribute-bool-partial", lambda i: jshard.distribute(i.value > 3, i.mesh, [Partial(), R]), PlacementError,
     r"^distribute: .* bool array"),
    # from_local
    ("from_local-mesh", lambda i: jshard.from_local(i.locals, "mesh", [Shard(0), R]), TypeError,
     r"^from_local: mesh must be a jax.sharding.Mesh"),
    ("from_local-generator", lambda i: jshard.from_local((a for a in i.locals), i.mesh, [Shard(0), R]), TypeError,
     r"^from_local: locals must be a list .* got generator; pass list"),
    ("from_local-str-locals", lambda i: jshard.from_local("abcdefgh", i.mesh, [Shard(0), R]), TypeError,
     r"^from_local: locals must be a list .* got str"),
    ("from_local-count", lambda i: jshard.from_local(i.locals[:3], i.mesh, [Shard(0), R]), ValueError,
     r"^from_local: got 3 local arrays for mesh\(dp=2, tp=4\) with 8 devices"),
    ("from_local-none", lambda i: jshard.from_local([None] * 8, i.mesh, [Shard(0), R]), ValueError,
     r"^from_local: local array 0 \(device \(0, 0\) of mesh\(dp=2, tp=4\)\) is None.*shape="),
    ("from_local-strings", lambda i: jshard.from_local(["a"] * 8, i.mesh, [Shard(0), R]), TypeError,
     r"^from_local: local array 0 .*: dtype <U1 is not a numeric or bool dtype"),
    ("from_local-darray", lambda i: jshard.from_local([i.x] * 8, i.mesh, [R, R]), TypeError,
     r"^from_local: local array 0 .* is a DArray"),
    ("from_local-dtypes", lambda i: jshard.from_local(i.locals[:4] + [a.astype(np.int32) for a in i.locals[4:]],
                                                      i.mesh, [Shard(0), R]), ValueError,
     r"^from_local: local array 4 is int32\[4, 4\] but local array 0 is float32\[4, 4\]"),
    ("from_local-ranks", lambda i: jshard.from_local(i.locals[:7] + [i.locals[7][0]], i.mesh, [Shard(0), R]),
     ValueError, r"^from_local: local array 7 is float32\[4\] but local array 0 is float32\[4, 4\]"),
    ("from_local-negative-shape", lambda i: jshard.from_local(i.locals, i.mesh, [Shard(0), R], shape=(-5, 4)),
     ValueError, r"^from_local: shape \(-5, 4\) has -5 at dim 0; sizes must be >= 0"),
    ("from_local-float-shape", lambda i: jshard.from_local(i.locals, i.mesh, [Shard(0), R], shape=(16.7, 4)),
     TypeError, r"^from_local: shape \(16.7, 4\) has 16.7 at dim 0"),
    ("from_local-str-shape", lambda i: jshard.from_local(i.locals, i.mesh, [Shard(0), R], shape="84"),
     TypeError, r"^from_local: shape must be a tuple of ints, got '84'"),
    ("from_local-wrong-shape", lambda i: jshard.from_local(i.locals, i.mesh, [Shard(0), R], shape=(17, 4)),
     ValueError, r"^from_local: device \(0, 0\) of mesh\(dp=2, tp=4\) has a local array of shape \(4, 4\)"),
    ("from_local-placements", lambda i: jshard.from_local(i.locals, i.mesh, [Shard(2), R]), PlacementError,
     r"^from_local: S\(2\) on mesh axis 0 .* names dim 2"),
    # from_jax / to_jax
    ("from_jax-numpy", lambda i: jshard.from_jax(i.value), TypeError, r"^from_jax: expected a jax.Array"),
    ("from_jax-single-device", lambda i: jshard.from_jax(jnp.asarray(i.value)), LayoutError,
     r"^from_jax: expected a NamedSharding, got SingleDeviceSharding"),
    ("from_jax-deleted", lambda i: jshard.from_jax(_deleted_jax_array()), DeletedArrayError,
     r"^from_jax: x \(float32\[4\]\) has been deleted"),
    ("distribute-deleted", lambda i: jshard.distribute(_deleted_jax_array(), i.mesh, [R, R]), DeletedArrayError,
     r"^distribute: x \(float32\[4\]\) has been deleted"),
    ("from_local-deleted", lambda i: jshard.from_local([_deleted_jax_array()] * 8, i.mesh, [R, R]),
     DeletedArrayError, r"^from_local: local array 0 \(device \(0, 0\) of mesh\(dp=2, tp=4\)\) \(float32\[4\]\) has "
                        r"been deleted"),
    ("to_jax-uneven", lambda i: jshard.distribute(i.value[:5], i.mesh, [Shard(0), Shard(1)]).to_jax(), LayoutError,
     r"^to_jax: f32\[5,4\] \(S\(0\), S\(1\)\) on mesh\(dp=2, tp=4\): dim 0 of size 5 is split unevenly"),
    ("to_jax-partial-max", lambda i: i.x.redistribute([Shard(0), Partial("max")]).to_jax(), LayoutError,
     r"^to_jax: .*Partial\(max\) has no JAX sharding equivalent"),
    ("to_jax-strided", lambda i: i.x.redistribute([Shard(0), StridedShard(0, 2)]).to_jax(), LayoutError,
     r"^to_jax: .* not a shard order"),
    # redistribute
    ("redistribute-cost-model", lambda i: i.x.redistribute([R, R], cost_model="fast"), TypeError,
     r"^redistribute: cost_model must be a jshard.CostModel or None, got 'fast'"),
    ("redistribute-length", lambda i: i.x.redistribute([R]), PlacementError,
     r"^redistribute from f32\[8,4\] \(S\(0\), R\) on mesh\(dp=2, tp=4\): \(R\) has 1 placements"),
    ("redistribute-not-a-list", lambda i: i.x.redistribute(R), PlacementError,
     r"^redistribute from .*: expected a sequence of 2 placements"),
    ("redistribute-dim", lambda i: i.x.redistribute([Shard(5), R]), PlacementError,
     r"^redistribute from .*: S\(5\) on mesh axis 0 .* names dim 5"),
    ("redistribute-class", lambda i: i.x.redistribute([Replicate, R]), PlacementError,
     r"^redistribute from .*: entry 0 of .* not a placement"),
    ("redistribute-mixed-partials", lambda i: i.x.redistribute([Partial("min"), Partial("avg")]), PlacementError,
     r"^redistribute from .*: \(P\(min\), P\(avg\)\) mixes"),
    ("redistribute-bool-partial", lambda i: jshard.distribute(i.value > 3, i.mesh, [R, R]).redistribute(
        [Partial(), R]), PlacementError, r"^redistribute from bool\[8,4\] .* bool array"),
    # plan_redistribute
    ("plan-cost-model", lambda i: jshard.plan_redistribute(i.x, [R, R], cost_model={"dp": 1.0}), TypeError,
     r"^plan_redistribute: cost_model must be a jshard.CostModel or None"),
    ("cost-model-memory", lambda i: jshard.CostModel(memory_gbps=0), ValueError,
     r"^CostModel: memory_gbps is a device's bandwidth to its own memory in GB/s, a positive number; got 0"),
    ("cost-model-kernel", lambda i: jshard.CostModel(kernel_us="4"), ValueError,
     r"^CostModel: kernel_us is what one more local kernel costs in µs besides its bytes, a number >= 0; got '4'"),
    ("cost-model-kernel-bool", lambda i: jshard.CostModel(kernel_us=True), ValueError,
     r"^CostModel: kernel_us is what one more local kernel costs in µs besides its bytes, a number >= 0; got True"),
    ("cost-model-scatter-rows", lambda i: jshard.CostModel(scatter_first_rows=512.0), ValueError,
     r"^CostModel: scatter_first_rows is a count of rows a contraction sums on a device, an int >= 0; got 512.0 "
     r"\(the default is 1024\)"),
    ("cost-model-scatter-rows-negative", lambda i: jshard.CostModel(scatter_first_rows=-1), ValueError,
     r"^CostModel: scatter_first_rows is a count of rows .* got -1"),
    ("plan-src", lambda i: jshard.plan_redistribute(i.value, [R, R]), TypeError,
     r"^plan_redistribute: src must be a DArray or a Spec, got ndarray"),
    ("plan-target-none", lambda i: jshard.plan_redistribute(i.x, None), PlacementError,
     r"^plan_redistribute from .*: expected a sequence of 2 placements .*, got None"),
    ("plan-target-dim", lambda i: jshard.plan_redistribute(i.x, [Shard(9), R]), PlacementError,
     r"^plan_redistribute from .*: S\(9\) on mesh axis 0"),
    # visualize, float, int
    ("visualize-numpy", lambda i: jshard.visualize(i.value), TypeError,
     r"^visualize: takes a DArray .* got ndarray; .*jshard.distribute"),
    ("visualize-str", lambda i: jshard.visualize("x"), TypeError, r"^visualize: takes a DArray .* got str"),
    ("float-not-scalar", lambda i: float(i.x), TypeError, r"^float: DArray\(f32\[8,4\] .*\) is not a scalar"),
    ("int-not-scalar", lambda i: int(i.x), TypeError, r"^int: DArray\(f32\[8,4\] .*\) is not a scalar"),
]


@pytest.mark.parametrize("call, error, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_error_and_loses_nothing(call, error, pattern):
    inputs = Inputs.make()
    value, locals_ = inputs.value.copy(), [a.copy() for a in inputs.locals]
    with pytest.raises(error, match=pattern) as e:
        call(inputs)
    assert isinstance(e.value, (ValueError, TypeError))
    assert not inputs.x.block.is_deleted() and inputs.x.placements == (Shard(0), R)
    np.testing.assert_array_equal(np.asarray(inputs.x.full()), value)
    np.testing.assert_array_equal(inputs.value, value)
    assert all(np.array_equal(a, b) for a, b in zip(inputs.locals, locals_, strict=True))


def test_numpy_integers_are_accepted_where_ints_are():
    mesh = make_mesh((2, 4))
    spec = Spec.create(mesh, [Shard(np.int64(1)), StridedShard(np.int32(0), np.int64(2))],
                       np.array([6, 8]), "float32")
    assert spec.placements == (Shard(1), StridedShard(0, 2)) and spec.shape == (6, 8)
    assert all(type(n) is int for n in (*spec.shape, spec.placements[0].dim, spec.placements[1].split_factor))
    assert hash(Shard(np.int64(1))) == hash(Shard(1))


# ---------------------------------------------------------------------------------------------------
# deleted (donated) DArrays


def _donated():
    mesh = make_mesh((2, 4))
    x = jshard.distribute(np.arange(8.0, dtype=np.float32), mesh, [Shard(0), R])
    x.full()  # full()'s program is now cached: the crash needed a cached program handed a deleted buffer
    y = jshard.jit(lambda a: a + 1, donate_argnums=0)(x)
    assert x.block.is_deleted()
    return x, y


@pytest.mark.parametrize("use, op", [
    (lambda x: x.full(), "full"),
    (lambda x: x.redistribute([R, R]), "redistribute"),
    (lambda x: x.to_local(), "to_local"),
    (lambda x: x.to_jax(), "to_jax"),
    (lambda x: float(x), "float"),
    (lambda x: int(x), "int"),
    (lambda x: jshard.visualize(x), "visualize"),
], ids=["full", "redistribute", "to_local", "to_jax", "float", "int", "visualize"])
def test_a_donated_darray_raises_instead_of_crashing(use, op):
    x, y = _donated()
    for _ in range(2):  # the second time with the program cached
        with pytest.raises(DeletedArrayError, match=rf"^{op}: DArray\(f32\[8\] \(S\(0\), R\) on mesh\(dp=2, tp=4\)\) "
                                                    r"was donated to argument 0 of .*donate_argnums.*Use the outputs"):
            use(x)
    np.testing.assert_array_equal(np.asarray(y.full()), np.arange(8.0) + 1)


def test_a_deleted_darray_not_donated_by_jshard_says_so():
    x = jshard.distribute(np.arange(8.0, dtype=np.float32), make_mesh((8,)), [Shard(0)])
    x.block.delete()
    with pytest.raises(DeletedArrayError, match=r"^full: DArray\(f32\[8\] \(S\(0\)\) on mesh\(x=8\)\) has been "
                                                r"deleted"):
        x.full()


# ---------------------------------------------------------------------------------------------------
# 0-size dims work like any other


ZERO_SIZE = [
    ((8,), (0, 5), [(Shard(0),), (Shard(1),), (Partial(),), (StridedShard(1, 2),), (R,)]),
    ((2, 4), (0, 3), [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Partial("max"), Shard(0)), (R, Partial("avg")),
                      (Shard(0), Shard(0)), (R, R)]),
    ((2, 2, 2), (3, 0, 2), [(Shard(0), Shard(1), Shard(2)), (Shard(1), Partial(), Shard(0)),
                            (StridedShard(0, 2), Shard(0), R), (Partial("min"),) * 3, (R, R, Shard(1))]),
]


@pytest.mark.parametrize("mesh_shape, shape, layouts", ZERO_SIZE, ids=["8", "2x4", "2x2x2"])
def test_zero_size_dims_work_like_any_other(mesh_shape, shape, layouts):
    mesh = make_mesh(mesh_shape)
    value = np.zeros(shape, np.float32)
    rng = np.random.default_rng(0)
    for src in layouts:
        x = jshard.distribute(value, mesh, src)
        check_darray(x, value)
        assert np.asarray(x.full()).shape == shape
        y = jshard.from_local(local_blocks(value, mesh_shape, src, rng), mesh, src)
        assert y.shape == shape
        check_darray(y, value)
        for dst in layouts:
            plan = jshard.plan_redistribute(x, dst)
            assert plan.collective_count == 0, str(plan)  # nothing to move
            check_darray(x.redistribute(dst), value)


def test_zero_size_next_to_uneven_shards_keeps_local_shapes():
    x = jshard.distribute(np.zeros((5, 0, 3), np.int32), make_mesh((2, 4)), [Shard(0), Shard(2)])
    assert [tuple(a.shape) for a in x.to_local()] == [(3, 0, 1)] * 3 + [(3, 0, 0)] + [(2, 0, 1)] * 3 + [(2, 0, 0)]
    y = x.redistribute([Shard(2), Shard(0)])
    assert [tuple(a.shape) for a in y.to_local()][:4] == [(2, 0, 2), (2, 0, 2), (1, 0, 2), (0, 0, 2)]
    assert jshard.from_local(y.to_local(), y.mesh, y.placements).shape == (5, 0, 3)  # inferred from the locals


# ---------------------------------------------------------------------------------------------------
# Partial(max|min) keeps NaN, as single-device max/min do


def _nan_parts(n: int, dtype, rng) -> list[np.ndarray]:
    """``n`` parts of 12 elements: NaN in one part at elements 0, 1 (with +inf elsewhere at 1) and 8, the
    infinities, signed zeros, and random values elsewhere."""
    parts = [rng.normal(size=12).astype(np.float32) for _ in range(n)]
    parts[n // 2][0] = np.nan
    parts[1][1], parts[0][1] = -np.nan, np.inf
    parts[0][2], parts[1][3] = np.inf, -np.inf
    for j, p in enumerate(parts):
        p[4], p[5], p[6], p[7] = -np.inf, np.inf, -0.0 if j % 2 else 0.0, -0.0
    parts[n - 1][8] = np.nan
    return [p.astype(dtype) for p in parts]


NAN_LAYOUTS = [((8,), lambda op: (Partial(op),)), ((2, 4), lambda op: (Partial(op), Partial(op))),
               ((2, 4), lambda op: (R, Partial(op)))]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("mesh_shape, layout", NAN_LAYOUTS, ids=["8-P", "2x4-PP", "2x4-RP"])
def test_partial_max_min_keep_nan(dtype, op, mesh_shape, layout):
    mesh = make_mesh(mesh_shape)
    placements = layout(op)
    groups = int(np.prod([n for n, p in zip(mesh_shape, placements) if p.is_partial]))
    parts = _nan_parts(groups, dtype, np.random.default_rng(1))
    reduce = np.maximum if op == "max" else np.minimum
    want = reduce.reduce([p.astype(np.float32) for p in parts])
    assert np.isnan(want[[0, 1, 8]]).all() and not np.isnan(want[2:8]).any()
    # device c holds part (its coordinate on the Partial axes): replicas along R axes hold the same part
    partial_axes = [a for a, p in enumerate(placements) if p.is_partial]
    locals_ = [parts[int(np.ravel_multi_index([c[a] for a in partial_axes], [mesh_shape[a] for a in partial_axes]))]
               for c in itertools.product(*map(range, mesh_shape))]
    x = jshard.from_local(locals_, mesh, placements)
    as_f32 = lambda a: np.asarray(a).astype(np.float32)  # numpy compares bfloat16 NaNs as unequal
    np.testing.assert_array_equal(as_f32(x.full()), want)
    y = x.redistribute([R] * len(mesh_shape))
    blocks = [as_f32(a) for a in y.to_local()]
    for b in blocks:
        np.testing.assert_array_equal(b, want)
        assert b.tobytes() == blocks[0].tobytes()  # replicas bitwise equal
    assert (as_f32(x.full())[6:8] == 0).all()  # -0.0 against +0.0: a zero either way
    plan = jshard.plan_redistribute(x, [R] * len(mesh_shape))
    assert compile_plan(plan).lower(x.block).as_text().count("stablehlo.all_reduce") == 1
    jitted = jshard.jit(lambda a: a * 1.0, out_placements=(R,) * len(mesh_shape))
    np.testing.assert_array_equal(as_f32(jitted(x).full()), want)
    assert jitted.lower(x).as_text().count("stablehlo.all_reduce") == 1


def test_partial_max_of_integers_is_unchanged():
    mesh = make_mesh((8,))
    parts = [np.array([i, -i, 7], np.int32) for i in range(8)]
    x = jshard.from_local(parts, mesh, [Partial("max")])
    np.testing.assert_array_equal(np.asarray(x.full()), np.maximum.reduce(parts))


# ---------------------------------------------------------------------------------------------------
# found by the fuzz: an integer average divides last


@pytest.mark.parametrize("src, dst", [
    ((Partial(), Partial("avg")), (R, Partial())),
    ((Partial(), Partial("avg")), (Partial(), R)),
    ((Partial("avg"), Partial("avg")), (Partial("avg"), R)),
    ((Partial("avg"), Partial()), (Shard(0), Partial())),
], ids=["sum-avg-to-R-sum", "sum-avg-to-sum-R", "avg-avg-to-avg-R", "avg-sum-to-S-sum"])
def test_integer_average_is_not_floored_part_by_part(src, dst):
    """``floor(a / 4) + floor(b / 4)`` is not ``floor((a + b) / 4)``: the planner divides only once every other
    sum or avg axis is reduced (in the same collective or before), as ``full()`` does."""
    mesh_shape, rng = (2, 4), np.random.default_rng(4)
    value = rng.integers(-30, 30, size=(4, 3)).astype(np.int32)
    x = jshard.from_local(local_blocks(value, mesh_shape, src, rng), make_mesh(mesh_shape), src)
    check_darray(x, value)
    check_darray(x.redistribute(dst), value)


def test_a_scalar_darray_converts_to_python_numbers(monkeypatch):
    x = jshard.distribute(np.float32(2.5), make_mesh((2, 4)), [Partial("max"), R])
    assert float(x) == 2.5 and int(x) == 2
    # a replicated one (a training step's loss) is read from one device, with no program to compile
    monkeypatch.setattr(jshard.darray, "compile_plan", lambda *a, **k: pytest.fail("compiled a program"))
    y = jshard.distribute(np.float32(-3.75), make_mesh((2, 4)), [R, R])
    assert float(y) == -3.75 and int(y) == -3
    with pytest.raises(pytest.fail.Exception):
        float(x)  # a pending max does go through a program
