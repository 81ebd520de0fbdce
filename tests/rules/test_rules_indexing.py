"""Indexing rules (jshard.rules.indexing): the validator on gather and the scatter family, N-D equations
end to end against the single-device result (uneven, strided and Partial inputs, padding filled with
garbage, out-of-range ids in every mode), and the strategies select picks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jshard
import jshard.validate.samples
from conftest import make_mesh
from jshard import Partial, Replicate, Shard, Spec, StridedShard
from jshard.darray import DArray
from jshard.propagate import select
from jshard.rules.indexing import local_position
from jshard.spec import block_sharding
from jshard.validate.core import collect, run_equation, validate
from oracle import check_darray, local_blocks

R = Replicate()
PRIMS = ["gather", "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"]


def garbage(x: DArray) -> DArray:
    """``x`` with its padding overwritten by NaN (floats) or a large int: a local function must never
    read it as a value."""
    block = np.array(x.block).reshape(x.spec.mesh_shape + x.spec.local_block_shape)  # a block per device
    k = x.mesh.devices.ndim
    bad = np.nan if block.dtype.kind == "f" else np.iinfo(block.dtype).max // 3 + 7
    for d, lay in enumerate(x.spec.layouts):  # lay: mesh_shape + (padded,), -1 on padding
        shape = list(lay.shape[:k]) + [1] * (block.ndim - k)
        shape[k + d] = lay.shape[-1]
        block = np.where((lay < 0).reshape(shape), bad, block)
    return DArray(jax.device_put(block.reshape(x.spec.block_shape), block_sharding(x.mesh)), x.spec)


def parts(value, mesh, placements, rng):
    """A DArray whose Partial axes hold unequal parts (independent oracle) and whose padding is garbage."""
    value = np.asarray(value)
    x = jshard.from_local(local_blocks(value, tuple(mesh.devices.shape), placements, rng), mesh, placements,
                          shape=value.shape)
    return garbage(x)


def equation(fn, *args):
    """(primitive, params) of the last equation of ``fn``'s jaxpr (nested jit bodies unwrapped)."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    while eqns[-1].primitive.name == "jit":
        eqns = eqns[-1].params["jaxpr"].jaxpr.eqns
    return eqns[-1].primitive, dict(eqns[-1].params)


def run(fn, values, placements, mesh_shape, seed=0, trace=None):
    """Run the last equation of ``fn`` (traced on ``trace``, default ``values``) with operands ``values``
    as DArrays with ``placements``; check the output device by device against the single-device result."""
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(seed)
    prim, params = equation(fn, *(values if trace is None else trace))
    xs = [parts(v, mesh, p, rng) for v, p in zip(values, placements)]
    (out,), choice = run_equation(prim, params, xs)
    want = prim.bind(*map(jnp.asarray, values), **prim.get_bind_params(params))
    check_darray(out, np.asarray(want))
    return out, choice


def table(shape=(7, 5), dtype=np.float32, seed=0):
    return np.random.default_rng(seed).integers(-20, 20, shape).astype(dtype)


IDS = np.array([[3, 0, 6, 3], [2, 5, 2, 0], [4, 1, 1, 6]], np.int32)[..., None]  # gather-ready (..., 1)
OOB = np.array([2, 9, -1, 6, -9, 0, 7], np.int32)[:, None]  # 9, -1, -9 and 7 are outside 7 rows


def lookup(mode, fill=None):
    """The embedding gather ``table[ids]`` on rows, with ``mode`` (and ``fill_value``)."""

    def f(t, i):
        dn = lax.GatherDimensionNumbers(offset_dims=(i.ndim - 1,), collapsed_slice_dims=(0,), start_index_map=(0,))
        return lax.gather(t, i, dn, (1, t.shape[1]), mode=mode, fill_value=fill)

    return f


def add_rows(mode):
    """``table.at[ids].add(updates)`` on rows, as a scatter-add with ``mode``."""

    def f(t, i, u):
        dn = lax.ScatterDimensionNumbers(update_window_dims=(u.ndim - 1,), inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0,))
        return lax.scatter_add(t, i, u, dn, mode=mode)

    return f


# -- the validator ------------------------------------------------------------------------------------


def _report(name, samples, sizes, max_combos=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return validate(name, samples, sizes=sizes, max_combos=max_combos)


@pytest.fixture(scope="module")
def samples():
    """The samples of this family's programs only (collecting every family's would take a while)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jshard.validate.samples, "MODULES", (jshard.validate.samples.indexing,))
        return collect(PRIMS)


@pytest.mark.parametrize("name", PRIMS)
def test_validator_quick(name, samples):
    # the first sample (an uneven 7-row table) on 2 devices; for the three-input scatters a fixed random
    # third of the input combinations (all of them: the slow test below)
    r = _report(name, samples[name][:1], (2,), max_combos=None if name == "gather" else 120)
    assert (r.incorrect, r.errors) == (0, []), (r.incorrect_cases, r.errors)
    assert r.correct > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", PRIMS)
def test_validator_all_samples(name, samples):
    r = _report(name, samples[name], (2, 3, 4))
    assert (r.incorrect, r.missing, r.errors) == (0, 0, []), (r.incorrect_cases, r.missing_cases, r.errors)


# -- gather -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, fill", [(lax.GatherScatterMode.PROMISE_IN_BOUNDS, None),
                                        (lax.GatherScatterMode.CLIP, None),
                                        (lax.GatherScatterMode.FILL_OR_DROP, -100.0)])
@pytest.mark.parametrize("mesh_shape, placements", [
    ((2, 4), (Shard(0), Shard(0))),  # 7 rows over 8 devices: one of them empty
    ((2, 4), (StridedShard(0, 2), Shard(0))),  # rows not contiguous: the inverse table
    ((2, 2, 2), (Shard(0), Partial(), Shard(1))),  # row-sharded, a pending sum, column-sharded
])
def test_embedding_row_sharded_table_gives_pending_sum(mode, fill, mesh_shape, placements):
    ids = OOB if mode != lax.GatherScatterMode.PROMISE_IN_BOUNDS else OOB % 7
    out, choice = run(lookup(mode, fill), [table(), ids], [placements, (R,) * len(mesh_shape)], mesh_shape)
    assert choice.cost == 0
    assert out.placements[0] == Partial() and choice.ins[0].placements == placements


def test_embedding_int_fill_is_counted_once():
    # the default int fill is the lowest int32: n copies of it would wrap around
    out, choice = run(lookup(lax.GatherScatterMode.FILL_OR_DROP, np.iinfo(np.int32).min),
                      [table(dtype=np.int32), OOB], [(Partial(), Shard(0)), (R, R)], (2, 4))
    assert choice.cost == 0 and out.placements == (Partial(), Partial())


def test_gather_batch_and_passthrough_shards():
    # ids sharded on their batch dims (uneven), table columns sharded: no communication at all
    out, choice = run(lookup("clip"), [table(), IDS], [(Shard(1), R), (R, Shard(1))], (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(2), Shard(1))


@pytest.mark.parametrize("mesh_shape, x_pl, i_pl", [
    ((2, 4), (Shard(0), R), (Shard(0), R)),
    ((2, 4), (R, R), (Shard(0), Shard(0))),  # operand rows taken locally
    ((2, 4), (Shard(0), R), (Shard(0), Shard(0))),  # operand rows held are a superset
    ((2, 4), (R, Shard(0)), (Shard(0), Shard(0))),  # not a superset: the check refuses, inputs move
    ((2, 2, 2), (Shard(0), Partial("max"), Shard(1)), (Shard(0), R, R)),
])
def test_take_along_axis(mesh_shape, x_pl, i_pl):
    x = table((5, 6))
    idx = np.random.default_rng(1).integers(-2, 8, (5, 3)).astype(np.int32)
    fn = lambda a, i: jnp.take_along_axis(a, i, axis=1, mode="fill", fill_value=-100.0)
    out, choice = run(fn, [x, idx[..., None]], [x_pl, i_pl], mesh_shape, trace=[x, idx])
    if x_pl[1] != Shard(0):
        assert choice.cost == 0


def test_two_component_index_on_two_sharded_dims():
    x = table((7, 6))
    ij = np.array([[1, 0], [6, 5], [3, 3], [0, 9]], np.int32)
    dn = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    fn = lambda a, i: lax.gather(a, i, dn, (1, 1), mode="fill", fill_value=-1.0)
    out, choice = run(fn, [x, ij], [(Shard(0), Shard(1)), (R, R)], (2, 4))
    assert choice.cost == 0 and out.placements == (Partial(), Partial())


# -- scatter family -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["clip", "drop", "promise_in_bounds"])
def test_embedding_gradient_stays_pending(mode):
    # zeros (R -> P(sum) is free) + updates and ids sharded on the batch dim (5 ids over 4: uneven, padded
    # with garbage ids that must never be applied)
    ids = np.array([[3], [0], [6], [3], [9]], np.int32)
    if mode == "promise_in_bounds":
        ids = ids % 7
    upd = table((5, 4), seed=2)
    out, choice = run(add_rows(mode), [np.zeros((7, 4), np.float32), ids, upd],
                      [(R, R), (Shard(0), Shard(0)), (Shard(0), Shard(0))], (2, 4))
    assert choice.cost == 0 and out.placements == (Partial(), Partial())


def test_scatter_add_into_a_row_sharded_table():
    ids = np.array([[3], [0], [6], [3], [-2], [8]], np.int32)
    out, choice = run(add_rows("drop"), [table(), ids, table((6, 5), seed=3)],
                      [(StridedShard(0, 2), Shard(0)), (R, R), (R, R)], (2, 4))
    assert choice.cost == 0 and out.placements == (StridedShard(0, 2), Shard(0))


@pytest.mark.parametrize("fn, placements, want", [
    (lambda a, i, u: a.at[i[:, 0]].set(u), [(Partial("max"), Shard(1)), (R, R), (Partial("max"), Shard(1))],
     (Partial("max"), Shard(1))),
    (lambda a, i, u: a.at[i[:, 0]].max(u), [(R, R), (Shard(0), Shard(0)), (Shard(0), Shard(0))],
     (Partial("max"), Partial("max"))),
    (lambda a, i, u: a.at[i[:, 0]].multiply(u), [(Partial(), Shard(1)), (R, R), (R, Shard(1))],
     (Partial(), Shard(1))),
    (lambda a, i, u: a.at[i[:, 0]].add(u, mode="clip"), [(Shard(0), R), (R, R), (R, R)], (Shard(0), R)),
    # updates split on dp (pending sum), table rows on tp: each device adds its updates to its rows
    (lambda a, i, u: a.at[i[:, 0]].add(u, mode="clip"), [(R, Shard(0)), (Shard(0), R), (Shard(0), R)],
     (Partial(), Shard(0))),
])
def test_scatter_combiners(fn, placements, want):
    ids = np.array([[5], [1], [8], [2], [5]], np.int32)
    out, choice = run(fn, [table(), ids, table((5, 5), seed=4)], placements, (2, 4))
    assert choice.cost == 0 and out.placements == want


def test_take_along_axis_gradient_keeps_batch_shards():
    x, idx = table((5, 6)), np.random.default_rng(2).integers(0, 6, (5, 3)).astype(np.int32)
    g = jax.grad(lambda a, i: jnp.take_along_axis(a, i, axis=1).sum())
    prim, params = equation(g, x, idx)
    assert prim.name == "scatter-add"
    upd = table((5, 3), seed=5)
    dn = params["dimension_numbers"]
    fn = lambda a, i, u: lax.scatter_add(a, i, u, dn, mode=params["mode"])
    out, choice = run(fn, [x, idx[..., None], upd], [(Shard(0), R), (Shard(0), Shard(0)), (Shard(0), Shard(0))],
                      (2, 4))
    assert choice.cost == 0 and out.placements == (Shard(0), Shard(0))


# -- selection ----------------------------------------------------------------------------------------


def _select(fn, values, placements, mesh_shape=(2, 4), trace=None):
    mesh = make_mesh(mesh_shape)
    prim, params = equation(fn, *(values if trace is None else trace))
    specs = [Spec.create(mesh, p, np.shape(v), np.asarray(v).dtype) for v, p in zip(values, placements)]
    out = jax.eval_shape(lambda *a: prim.bind(*a, **prim.get_bind_params(params)),
                         *[jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for v in values])
    return select(prim, params, specs, [jax.core.ShapedArray(out.shape, out.dtype)])


def test_select_embedding_strategies_need_no_communication():
    t, ids = table((64, 32)), np.zeros((8, 16, 1), np.int32)
    cases = [((Shard(0), R), (R, R), (Partial(), R)),  # vocab-parallel: pending sum
             ((Shard(1), R), (R, R), (Shard(2), R)),  # column-parallel
             ((R, R), (Shard(0), Shard(1)), (Shard(0), Shard(1)))]  # data-parallel ids
    for t_pl, i_pl, want in cases:
        c = _select(lookup("fill", 0.0), [t, ids], [t_pl, i_pl])
        assert c.cost == 0 and c.outs[0].placements == want, (t_pl, i_pl, c)


def test_select_embedding_gradient_is_pending_sum():
    upd = np.zeros((8, 16, 32), np.float32)
    dn = lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0,),
                                     scatter_dims_to_operand_dims=(0,))
    fn = lambda t, i, u: lax.scatter_add(t, i, u, dn, mode="drop")
    c = _select(fn, [np.zeros((64, 32), np.float32), np.zeros((8, 16, 1), np.int32), upd],
                [(R, R), (Shard(0), Shard(1)), (Shard(0), Shard(1))])
    assert c.cost == 0 and c.outs[0].placements == (Partial(), Partial())


def test_select_take_along_axis_follows_the_batch_shard():
    x, idx = table((8, 6)), np.zeros((8, 3), np.int32)
    c = _select(lambda a, i: jnp.take_along_axis(a, i, axis=1), [x, idx[..., None]], [(Shard(0), R), (Shard(0), R)],
                trace=[x, idx])
    assert c.cost == 0 and c.outs[0].placements == (Shard(0), R)
    c = _select(lambda a, i: jnp.take_along_axis(a, i, axis=1), [x, idx[..., None]], [(R, R), (Shard(0), Shard(0))],
                trace=[x, idx])  # the operand's rows are taken on each device: still nothing moves
    assert c.cost == 0 and c.outs[0].placements == (Shard(0), Shard(0))


# -- helpers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placements", [(Shard(0), Shard(0)), (StridedShard(0, 2), Shard(0)), (R, Shard(0))])
def test_local_position_finds_each_device_its_rows(placements):
    mesh = make_mesh((2, 4))
    spec = Spec.create(mesh, placements, (7, 3), np.float32)
    g = jnp.arange(-2, 10, dtype=jnp.int32)
    f = jax.vmap(jax.vmap(lambda _: local_position(spec, 0, g), axis_name="tp"), axis_name="dp")
    pos, own = (np.asarray(a) for a in f(jnp.zeros((2, 4))))
    for c in np.ndindex(2, 4):
        held = spec.global_indices(c)[0].tolist()
        want_own = [int(x) in held for x in np.asarray(g)]
        assert own[c].tolist() == want_own
        assert [held.index(int(x)) for x in np.asarray(g)[own[c]]] == pos[c][own[c]].tolist()
