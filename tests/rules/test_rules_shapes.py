"""Shape rules (jshard.rules.shapes): the validator on every primitive, N-D equations end to end against
the single-device result (uneven, strided and Partial inputs), the strategies select picks, and iota's
local function on sharded outputs."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard, Spec, StridedShard
from jshard.darray import DArray
from jshard.engine import local_equation
from jshard.propagate import select
from jshard.rules.shapes import blocks_reshape, unit_presence
from jshard.spec import block_of, block_sharding, local_of
from jshard.validate.core import collect, run_equation, validate, walk_samples
from jshard.validate.samples import shapes as samples_module
from oracle import check_darray, local_blocks

R = Replicate()
PRIMS = ["broadcast_in_dim", "reshape", "transpose", "squeeze", "rev", "concatenate", "pad", "slice",
         "dynamic_slice", "dynamic_update_slice", "split", "iota"]


def parts(value, mesh, placements, rng):
    """A DArray whose Partial axes hold unequal parts (from the independent oracle)."""
    value = np.asarray(value)
    return jshard.from_local(local_blocks(value, tuple(mesh.devices.shape), placements, rng), mesh, placements,
                             shape=value.shape)


def equation(fn, *args):
    """(primitive, params) of the last equation of ``fn``'s jaxpr."""
    eqn = jax.make_jaxpr(fn)(*args).jaxpr.eqns[-1]
    return eqn.primitive, dict(eqn.params)


def run(fn, values, placements, mesh_shape, seed=0):
    """Run ``fn``'s last equation on DArrays with ``placements``; check every output device by device."""
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(seed)
    prim, params = equation(fn, *values)
    xs = [parts(v, mesh, p, rng) for v, p in zip(values, placements)]
    outs, choice = run_equation(prim, params, xs)
    truth = prim.bind(*map(jnp.asarray, values), **prim.get_bind_params(params))
    for out, want in zip(outs, truth if prim.multiple_results else [truth]):
        check_darray(out, np.asarray(want))
    return outs, choice


def ints(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).integers(-20, 20, shape).astype(dtype)


# -- the validator ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shape_samples():
    """Samples per primitive from the shapes module's programs only (``collect`` traces every family)."""
    found = {}
    for fn, args in samples_module.PROGRAMS:
        closed = jax.make_jaxpr(fn)(*args)
        got = []
        walk_samples(closed.jaxpr, closed.consts, list(args), got, "shapes")
        for s in got:
            found.setdefault(s.prim.name, []).append(s)
    return found


def _report(name, samples, sizes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return validate(name, samples, sizes=sizes)


@pytest.mark.parametrize("name", [p for p in PRIMS if p != "iota"])
def test_validator_quick(name, shape_samples):
    # one sample on a mesh of 3. Missing cases are asserted on all samples (the slow test): one sample
    # alone lists coincidences, such as a Partial start index that a whole-dim slice clamps away
    r = _report(name, shape_samples[name][:1], (3,))
    assert (r.incorrect, r.errors) == (0, []), (r.incorrect_cases, r.errors)
    assert r.correct > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", PRIMS)
def test_validator_all_samples(name):
    samples = collect([name])  # every family's programs: other families' reshapes and slices count too
    r = _report(name, samples.get(name, []), (2, 3, 4))
    assert (r.incorrect, r.missing, r.errors) == (0, 0, []), (r.incorrect_cases, r.missing_cases, r.errors)


# -- reshape --------------------------------------------------------------------------------------------


def test_flatten_of_two_shards_is_strided_by_the_local_size_and_splits_back():
    # [8, 4] on (dp=2, tp=4) as (S(0), S(1)): tp's column shard repeats once per *local* row (4, not 8)
    x = ints((8, 4))
    (flat,), choice = run(lambda a: a.reshape(32), [x], [(Shard(0), Shard(1))], (2, 4))
    assert choice.cost == 0 and flat.placements == (Shard(0), StridedShard(0, 4))
    prim, params = equation(lambda a: a.reshape(8, 4), x.reshape(32))
    (back,), choice = run_equation(prim, params, [flat])
    assert choice.cost == 0 and back.placements == (Shard(0), Shard(1))
    check_darray(back, x)


def test_flatten_when_a_later_mesh_axis_cuts_the_leading_dim():
    (flat,), choice = run(lambda a: a.reshape(32), [ints((8, 4))], [(Shard(1), Shard(0))], (2, 4))
    assert choice.cost == 0 and flat.placements == (StridedShard(0, 8), Shard(0))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (2, 2, 2)])
@pytest.mark.parametrize("src, dst, placements", [
    ((2, 8, 16), (2, 8, 4, 4), (Shard(0), Shard(2))),  # split heads: no communication
    ((2, 8, 4, 4), (2, 8, 16), (Partial("max"), Shard(2))),  # merge heads, a Partial passes
    ((5, 3), (15,), (Shard(0), Replicate())),  # uneven merge: must move, never be wrong
    ((7, 2), (14,), (Replicate(), Shard(0))),  # 7 rows over 4 -> 2,2,2,1 = 4,4,4,2 of 14: exact
    ((6, 4), (4, 6), (Shard(0), Shard(1))),  # first dims of a 2-to-2 group
    ((2, 6), (4, 3), (Replicate(), Shard(1))),  # a later dim of a 2-to-2 group: offered nothing
    ((24,), (2, 3, 4), (StridedShard(0, 2), Shard(0))),
    ((3, 1, 4), (12, 1), (Shard(1), Partial("avg"))),  # a sharded unit dim: whole on coordinate 0
])
def test_reshape_nd(mesh_shape, src, dst, placements):
    if len(mesh_shape) == 3:
        placements = placements + (Shard(len(src) - 1),)
    run(lambda a: a.reshape(dst), [ints(src)], [placements], mesh_shape)


def test_reshape_keeps_shards_without_moving():
    cases = [((2, 8, 16), (2, 8, 4, 4), (Shard(0), Shard(2)), (Shard(0), Shard(2))),
             ((7, 2), (14,), (Replicate(), Shard(0)), (Replicate(), Shard(0))),
             ((1, 6), (6, 1), (Shard(0), Shard(1)), (Shard(1), Shard(0)))]
    for src, dst, placements, want in cases:
        (out,), choice = run(lambda a: a.reshape(dst), [ints(src)], [placements], (2, 4))
        assert choice.cost == 0 and out.placements == want, (src, dst, choice)


def test_uneven_merge_is_refused_exactly():
    mesh_shape = (2, 4)
    assert not blocks_reshape((5, 3), (15,), mesh_shape, (((0, 1),), ()), (((0, 1),), ()))
    assert blocks_reshape((8, 4), (32,), mesh_shape, (((0, 1),), ((1, 1),)), (((0, 1), (1, 4)),))
    assert not blocks_reshape((8, 4), (32,), mesh_shape, (((0, 1),), ((1, 1),)), (((0, 1), (1, 8)),))
    # pytorch#179502: a shard on the wrong dim; (4, 6) -> (6, 4) S(1) is not S(1) of the output
    assert not blocks_reshape((4, 6), (6, 4), mesh_shape, ((), ((1, 1),)), ((), ((1, 1),)))


def test_reshape_with_a_fused_transpose():
    x = ints((2, 3, 4, 5))
    fn = lambda a: lax.reshape(a, (2, 4, 15), dimensions=(0, 2, 1, 3))
    (out,), choice = run(fn, [x], [(Shard(0), Shard(2), Partial())], (2, 2, 2))
    assert choice.cost == 0 and out.placements == (Shard(0), Shard(1), Partial())


def test_reshape_int_and_partial_avg():
    run(lambda a: a.reshape(4, 6), [ints((24,), dtype=np.int32)], [(Partial("avg"), Shard(0))], (2, 4))


# -- renumbering ----------------------------------------------------------------------------------------


def test_transpose_renumbers_any_shard_kind():
    x = ints((4, 6, 5))
    (out,), choice = run(lambda a: jnp.transpose(a, (2, 0, 1)), [x], [(Shard(0), StridedShard(1, 2), Partial("min"))],
                         (2, 2, 2))
    assert choice.cost == 0 and out.placements == (Shard(1), StridedShard(2, 2), Partial("min"))


def test_broadcast_keeps_mapped_dims_and_squeeze_drops_unit_dims():
    (out,), choice = run(lambda a: jnp.broadcast_to(a, (5, 4, 3)), [ints((5, 1, 3))], [(Shard(0), Partial("sum"))],
                         (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(0), Partial("sum"))
    (out,), choice = run(lambda a: lax.broadcast_in_dim(a, (5, 4, 3), (0, 2)), [ints((5, 3))],
                         [(Shard(0), Shard(1))], (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(0), Shard(2))
    (out,), choice = run(lambda a: jnp.squeeze(a, 1), [ints((5, 1, 7))], [(Shard(2), Shard(0))], (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(1), Shard(0))


@pytest.mark.parametrize("operand, shape, dims, src, dst", [
    ((), (5, 7), (), (R, R), (Shard(0), Shard(1))),  # a scalar to uneven shards of both new dims
    ((7,), (5, 7), (1,), (R, Shard(0)), (Shard(0), Shard(1))),  # a new leading dim next to a mapped one
    ((5, 1), (5, 6), (0, 1), (R, Shard(0)), (StridedShard(1, 2), Shard(0))),  # broadcast from 1, strided
    ((), (3, 2), (), (R, R), (Shard(0), Shard(0))),  # 3 rows over 8 devices: empty shards
])
def test_broadcast_makes_each_device_its_shard_of_a_new_dim(operand, shape, dims, src, dst):
    mesh = make_mesh((2, 4))
    x = jshard.distribute(ints(operand), mesh, src)
    prim, params = equation(lambda a: lax.broadcast_in_dim(a, shape, dims), x.full())
    spec = Spec.create(mesh, dst, shape, "float32")
    fn = local_equation(prim, params, (x.spec,), (spec,))
    body = lambda b: [block_of(o) for o in fn(local_of(b, x.spec))]
    block = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=block_sharding(mesh).spec,
                                  out_specs=[block_sharding(mesh).spec], check_vma=False))(x.block)[0]
    check_darray(DArray(block, spec), np.asarray(lax.broadcast_in_dim(x.full(), shape, dims)))


def test_a_broadcast_constant_meets_sharded_operands_without_a_slice():
    # jnp.maximum's gradient broadcasts 1.0 and 0.0 to the global shape: each device makes its block
    mesh = make_mesh((2, 4))
    x = jshard.distribute(ints((5, 6)), mesh, [Shard(0), Shard(1)])
    f = jshard.jit(lambda a: jnp.where(a > 0, jnp.ones(a.shape), jnp.zeros(a.shape)))
    check_darray(f(x), np.where(np.asarray(x.full()) > 0, 1.0, 0.0))
    assert "dynamic_slice" not in f.lower(x).as_text()


def test_rev_keeps_only_unreversed_shards():
    (out,), choice = run(lambda a: lax.rev(a, (0,)), [ints((5, 6))], [(Shard(0), Shard(1))], (2, 4))
    assert out.placements[1] == Shard(1) and out.placements[0] != Shard(0)


# -- cutting and joining ------------------------------------------------------------------------------


def test_slice_keeps_whole_dims_and_the_head_of_a_sharded_dim():
    (out,), choice = run(lambda a: a[:, 1:4], [ints((7, 6))], [(Shard(0), Partial("avg"))], (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(0), Partial("avg"))
    (out,), choice = run(lambda a: a[:1], [ints((7, 6))], [(Shard(0), Shard(1))], (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(0), Shard(1))  # x[:1] sits on coordinate 0
    (out,), choice = run(lambda a: a[5:6], [ints((7, 6))], [(Shard(0), Shard(0))], (2, 4))
    assert out.placements[0] != Shard(0)  # index 5 is not on coordinate 0


def test_slice_sharded_dim_moves():
    run(lambda a: a[1:6:2, :], [ints((7, 6))], [(Shard(0), StridedShard(0, 2))], (2, 4))


def test_dynamic_slice_x_i_keeps_the_row_shard():
    x, i = ints((5, 6)), np.int32(3)
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(0)
    prim, params = equation(lambda a, k: lax.dynamic_slice(a, (k, 0), (1, 6)), x, i)
    xs = [parts(x, mesh, (Partial(), Shard(1)), rng), jshard.distribute(i, mesh, (R, R)),
          jshard.distribute(np.int32(0), mesh, (R, R))]
    (out,), choice = run_equation(prim, params, xs)
    assert choice.cost == 0 and out.placements == (Partial(), Shard(1))
    check_darray(out, x[3:4])


def test_dynamic_update_slice_with_partials_and_shards():
    x, u = ints((5, 6)), ints((2, 6), 1)
    mesh = make_mesh((2, 2, 2))
    rng = np.random.default_rng(0)
    prim, params = equation(lambda a, b, k: lax.dynamic_update_slice(a, b, (k, 0)), x, u, np.int32(2))
    xs = [parts(x, mesh, (Partial("avg"), Shard(1), R), rng), parts(u, mesh, (R, Shard(1), R), rng),
          jshard.distribute(np.int32(2), mesh, (R, R, R)), jshard.distribute(np.int32(0), mesh, (R, R, R))]
    (out,), choice = run_equation(prim, params, xs)
    assert choice.cost == 0 and out.placements == (Partial("avg"), Shard(1), R)
    want = x.copy()
    want[2:4] = u
    check_darray(out, want)


def test_pad_keeps_untouched_dims_and_a_matching_partial():
    fn = lambda a, v: lax.pad(a, v, ((1, 2, 1), (0, 0, 0)))
    (out,), choice = run(fn, [ints((5, 7)), np.float32(-3)], [(Partial("max"), Shard(1)), (R, R)], (2, 4))
    assert choice.cost == 0 and out.placements == (Partial("max"), Shard(1))
    run(fn, [ints((5, 7)), np.float32(2)], [(Partial("sum"), Shard(0)), (Partial("sum"), R)], (2, 4))


def test_concatenate_and_split():
    a, b = ints((2, 7, 3)), ints((2, 7, 2), 1)
    (out,), choice = run(lambda p, q: jnp.concatenate([p, q], 2), [a, b],
                         [(Shard(0), StridedShard(1, 2), Partial()), (Shard(0), StridedShard(1, 2), Partial())],
                         (2, 2, 2))
    assert choice.cost == 0 and out.placements == (Shard(0), StridedShard(1, 2), Partial())
    outs, choice = run(lambda p: jnp.split(p, [1, 3], axis=1), [ints((5, 4))], [(Shard(0), Partial("min"))],
                       (2, 4))
    assert choice.cost == 0 and [o.placements for o in outs] == [(Shard(0), Partial("min"))] * 3
    run(lambda p: jnp.split(p, [1, 3], axis=0), [ints((5, 4))], [(Shard(0), Shard(1))], (2, 4))


# -- unit dims --------------------------------------------------------------------------------------


def test_unit_presence_tuples():
    f = jax.core.ShapedArray
    got = unit_presence((f((1, 3, 1), jnp.float32),), (f((3, 1), jnp.float32),))
    assert got == [(Shard(1), Shard(0)), (Shard(1), Shard(2))]


# -- iota ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, dimension, placements", [
    ((5, 7), 1, (Shard(0), Shard(1))),
    ((5, 7), 0, (Shard(0), Shard(0))),  # 5 over 8: empty shards
    ((9, 3), 0, (StridedShard(0, 2), Shard(1))),
    ((6,), 0, (Replicate(), Shard(0))),
])
def test_iota_local_on_sharded_outputs(shape, dimension, placements):
    mesh = make_mesh((2, 4))
    prim, params = equation(lambda: lax.broadcasted_iota(jnp.int32, shape, dimension))
    spec = Spec.create(mesh, placements, shape, "int32")
    fn = local_equation(prim, params, (), (spec,))
    body = lambda: [block_of(o) for o in fn()]
    block = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=[block_sharding(mesh).spec],
                                  check_vma=False))()[0]
    check_darray(DArray(block, spec), np.asarray(lax.broadcasted_iota(jnp.int32, shape, dimension)))


def test_iota_without_inputs_is_replicated():
    mesh = make_mesh((2, 4))
    prim, params = equation(lambda: lax.iota(jnp.int32, 6))
    choice = select(prim, params, [], [jax.core.ShapedArray((6,), jnp.int32)], mesh=mesh)
    assert choice.outs[0].placements == (R, R)


# -- random reshapes on N-D meshes ----------------------------------------------------------------------


def _factor(n, rng):
    """A random shape with product ``n`` (prime factors grouped at random, unit dims sprinkled in)."""
    primes, k = [], n
    for p in (2, 3, 5, 7):
        while k % p == 0:
            primes.append(p)
            k //= p
    rng.shuffle(primes)
    dims, cur = [], 1
    for p in primes:
        cur *= p
        if rng.random() < 0.5:
            dims.append(cur)
            cur = 1
    dims += [cur] if cur > 1 or not dims else []
    for _ in range(rng.integers(0, 2)):
        dims.insert(int(rng.integers(0, len(dims) + 1)), 1)
    return tuple(int(d) for d in dims)


def _placement(rank, rng, op):
    kind = rng.integers(0, 4)
    if kind == 0:
        return R
    if kind == 1:
        return Partial(op)
    d = int(rng.integers(0, rank))
    return Shard(d) if kind == 2 else StridedShard(d, int(rng.integers(2, 4)))


def _random_reshapes(n, seed):
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < n:
        total = int(rng.choice([12, 16, 24, 30, 36, 48]))
        src, dst = _factor(total, rng), _factor(total, rng)
        if src == dst:
            continue
        mesh_shape = [(2, 4), (2, 2, 2), (4, 2)][int(rng.integers(0, 3))]
        op = str(rng.choice(["sum", "avg", "max", "min"]))
        placements = tuple(_placement(len(src), rng, op) for _ in mesh_shape)
        cases.append((src, dst, mesh_shape, placements))
    return cases


@pytest.mark.parametrize("src, dst, mesh_shape, placements", _random_reshapes(6, 0))
def test_random_reshapes(src, dst, mesh_shape, placements):
    run(lambda a: a.reshape(dst), [ints(src)], [placements], mesh_shape)


@pytest.mark.slow
@pytest.mark.parametrize("src, dst, mesh_shape, placements", _random_reshapes(80, 1))
def test_random_reshapes_sweep(src, dst, mesh_shape, placements):
    run(lambda a: a.reshape(dst), [ints(src)], [placements], mesh_shape)
