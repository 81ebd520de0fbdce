"""The DArray against the oracle of its blocks (``oracle.local_blocks``, written independently of jshard's shard
math): ``distribute`` / ``from_local`` / ``full`` / ``to_local`` give back each device's reference block and the
global value, printing and ``visualize`` show the layout, and the runs of indices a device holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh
from jshard import DArray, LayoutError, Partial, PlacementError, Replicate, Shard, StridedShard
from jshard.darray import index_runs
from oracle import check_darray, local_blocks

RNG = np.random.default_rng(0)


def ints(shape, dtype=np.float32):
    return RNG.integers(-20, 20, size=shape).astype(dtype)


@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (Shard(0), Shard(0)), (StridedShard(1, 2), Replicate()),
                                        (Partial(), Shard(1)), (Partial("max"), Partial("max")),
                                        (Partial("avg"), Partial()), (Replicate(), Partial("min"))])
@pytest.mark.parametrize("shape", [(6, 10), (16, 24), (1, 3)])
def test_distribute_full_round_trip(placements, shape):
    mesh = make_mesh((2, 4))
    value = ints(shape)
    x = jshard.distribute(value, mesh, placements)
    assert x.shape == shape and x.dtype == np.float32 and x.placements == placements and x.mesh is mesh
    assert np.array_equal(np.asarray(x.full()), value)
    check_darray(x, value)


def test_distribute_partial_is_exact():
    mesh = make_mesh((2, 4))
    value = np.array([1, 2, 3], dtype=np.int32)
    x = jshard.distribute(value, mesh, [Replicate(), Partial()])
    assert [a.tolist() for a in x.to_local()][:4] == [[1, 2, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert x.dtype == np.int32 and np.asarray(x.full()).tolist() == [1, 2, 3]
    for op in ("avg", "max", "min"):
        y = jshard.distribute(value, mesh, [Partial(op), Replicate()])
        assert all(a.tolist() == [1, 2, 3] for a in y.to_local())
        assert np.asarray(y.full()).tolist() == [1, 2, 3]


def test_distribute_accepts_jax_arrays_and_scalars():
    mesh = make_mesh((8,))
    x = jshard.distribute(jnp.arange(10.0), mesh, [Shard(0)])
    assert [a.shape for a in x.to_local()] == [(2,)] * 5 + [(0,)] * 3
    s = jshard.distribute(3.5, mesh, [Partial()])
    assert s.shape == () and float(s.full()) == 3.5


def test_from_local_uneven_and_inferred_shape():
    mesh = make_mesh((2, 4))
    value = ints((10, 3))
    locals_ = local_blocks(value, (2, 4), (Shard(0), Shard(0)), RNG)
    assert [a.shape[0] for a in locals_] == [2, 2, 1, 0, 2, 2, 1, 0]
    x = jshard.from_local(locals_, mesh, [Shard(0), Shard(0)])
    assert x.shape == (10, 3)
    assert all(np.array_equal(a, b) for a, b in zip(x.to_local(), locals_))
    assert np.array_equal(np.asarray(x.full()), value)


def test_from_local_partial_takes_parts_unchanged():
    mesh = make_mesh((2, 4))
    parts = [np.full((2, 2), float(i)) for i in range(8)]
    x = jshard.from_local(parts, mesh, [Partial(), Partial("avg")])
    np.testing.assert_array_equal(np.asarray(x.full()), np.full((2, 2), sum(range(8)) / 4))  # small integers: exact


@pytest.mark.parametrize("locals_, placements, shape, words", [
    ([np.zeros(2)] * 7, [Shard(0), Replicate()], None, ["7 local arrays", "8 devices"]),
    ([np.zeros(2)] * 7 + [np.zeros(3)], [Replicate(), Replicate()], None, ["device (1, 3)", "(3,)", "(2,)"]),
    ([np.zeros(2)] * 8, [Shard(0), Replicate()], (5,), ["device (0, 0)", "(3,)"]),
    ([np.zeros(2, np.float32)] * 7 + [np.zeros(2, np.int32)], [Replicate(), Replicate()], None, ["dtype"]),
    ([np.zeros(2)] * 8, [Shard(3), Replicate()], None, ["rank 1"]),
])
def test_from_local_errors(locals_, placements, shape, words):
    with pytest.raises((ValueError, PlacementError)) as e:
        jshard.from_local(locals_, make_mesh((2, 4)), placements, shape=shape)
    assert str(e.value).startswith("from_local:")
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("placements", [(Shard(0), Shard(1)), (StridedShard(0, 4), Shard(0)), (Replicate(), Partial()),
                                        (Shard(1), Shard(1))])
def test_to_jax_and_back_without_collectives(placements):
    mesh = make_mesh((2, 4))
    value = ints((16, 8))
    x = jshard.distribute(value, mesh, placements)
    j = x.to_jax()
    assert j.sharding == x.spec.to_named_sharding()
    for shard in j.addressable_shards:  # each device's data is the NamedSharding's slice of the value
        if not x.spec.to_partition_spec().unreduced:
            assert np.array_equal(np.asarray(shard.data), value[shard.index])
    back = jshard.from_jax(j)
    assert back.spec == x.spec
    assert all(np.array_equal(a, b) for a, b in zip(back.to_local(), x.to_local()))
    assert np.array_equal(np.asarray(back.full()), value)


def test_from_jax_of_xla_sharded_array():
    mesh = make_mesh((2, 4))
    value = ints((8, 8))
    arr = jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("tp", "dp"))))
    x = jshard.from_jax(arr)
    assert x.placements == (StridedShard(0, 4), Shard(0))
    check_darray(x, value)


def test_to_jax_errors():
    x = jshard.distribute(ints((6, 10)), make_mesh((2, 4)), [Shard(0), Shard(1)])
    with pytest.raises(LayoutError, match="unevenly"):
        x.to_jax()
    with pytest.raises(TypeError, match="jax.Array"):
        jshard.from_jax(np.zeros(3))


def test_a_darray_is_a_leaf_of_jax_tree_utilities():
    mesh = make_mesh((2, 4))
    value = ints((6, 10))
    x = jshard.distribute(value, mesh, [Shard(0), Shard(1)])
    tree = {"w": x, "b": [x, 3.0]}
    leaves, treedef = jax.tree.flatten(tree)
    assert leaves[0] is x and leaves[2] is x and treedef.num_leaves == 3
    assert jax.tree.map(lambda v: np.shape(v), tree) == {"w": (6, 10), "b": [(6, 10), ()]}
    assert jax.tree.structure(tree) == jax.tree.structure({"w": 0, "b": [0, 0]})
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]] == \
        ["['b'][0]", "['b'][1]", "['w']"]
    assert jax.tree.unflatten(treedef, leaves)["w"] is x
    # a function of the leaves sees the global value, as on a jax.Array
    means = jax.tree.map(lambda v: float(jnp.mean(v)), tree)
    assert means["w"] == pytest.approx(float(value.mean())) and means["b"][1] == 3.0
    y = jax.jit(lambda t: jax.tree.map(lambda b: b * 2, t))({"w": x})["w"]
    assert isinstance(y, jax.Array) and np.array_equal(np.asarray(y), value * 2)


def test_repr_and_attributes():
    x = jshard.distribute(np.zeros((16, 8), np.float32), make_mesh((2, 4)), [Shard(0), Partial()])
    assert repr(x) == "DArray(f32[16,8] (S(0), P(sum)) on mesh(dp=2, tp=4))"
    # the 8 devices' (8, 8) blocks one after another on dim 0, each device holding its own
    assert x.spec.block_shape == (64, 8) and x.block.shape == (64, 8)
    assert all(s.data.shape == (8, 8) for s in x.block.addressable_shards)


@pytest.mark.parametrize("shape", [(), (5,), (6, 10), (3, 4, 5), (2, 3, 4, 5)])
def test_visualize_any_rank(shape):
    placements = [Shard(len(shape) - 1) if shape else Replicate(), Partial()]
    x = jshard.distribute(np.zeros(shape, np.float32), make_mesh((2, 4)), placements)
    text = jshard.visualize(x)
    lines = text.splitlines()
    assert lines[0] == str(x.spec) and len(lines) == 3 + 8 + 1
    assert lines[1].split()[:3] == ["device", "dp", "tp"]
    assert "sum over tp" in lines[-1]
    if shape:
        last = shape[-1]
        assert lines[3].split()[-1] == f"0:{-(-last // 2)}"


def test_visualize_strided_ranges():
    mesh = jax.make_mesh((2,), ("a",), devices=jax.devices()[:2])
    x = jshard.distribute(np.zeros(8, np.float32), mesh, [StridedShard(0, 2)])
    assert jshard.visualize(x).splitlines()[3].split()[-2:] == ["0:2", "4:6"]


def test_visualize_shows_an_empty_shard_as_a_dash():
    x = jshard.distribute(np.zeros(3, np.float32), make_mesh((8,)), [Shard(0)])  # 3 rows on 8: five hold none
    assert [line.split()[-1] for line in jshard.visualize(x).splitlines()[3:]] == ["0:1", "1:2", "2:3"] + ["-"] * 5


@pytest.mark.parametrize("idx", [[], [4], [0, 1, 2, 8, 9, 10], [3, 1, 2], [5, 6, 0, 1], list(range(7))])
def test_index_runs_are_the_maximal_runs_of_consecutive_indices(idx):
    idx = np.array(idx, np.int64)
    runs = index_runs(idx)
    assert np.array_equal(np.concatenate([np.arange(a, b) for a, b in runs] + [np.zeros(0, np.int64)]), idx)
    assert all(b > a for a, b in runs)
    assert all(b != c for (_, b), (c, _) in zip(runs, runs[1:]))  # no two runs that join up


@pytest.mark.parametrize("bad, words", [
    ([Shard(2), Replicate()], ["S(2)", "rank 2"]),
    ([Partial("max"), Partial()], ["mixes", "only sum and avg"]),
    ([Shard(0)], ["1 placements", "2 axes"]),
    ([Partial(), "R"], ["not a placement"]),
])
def test_bad_redistribute_names_op_and_spec_and_leaves_input_untouched(bad, words):
    x = jshard.distribute(ints((6, 10)), make_mesh((2, 4)), [Shard(0), Shard(1)])
    before = [np.asarray(a).copy() for a in x.to_local()]
    with pytest.raises(PlacementError) as e:
        x.redistribute(bad)
    assert str(e.value).startswith("redistribute from f32[6,10] (S(0), S(1)) on mesh(dp=2, tp=4):")
    for w in words:
        assert w in str(e.value)
    assert x.placements == (Shard(0), Shard(1))
    assert all(np.array_equal(a, b) for a, b in zip(x.to_local(), before))


def test_bad_distribute_names_op():
    value = ints((4, 4))
    with pytest.raises(PlacementError, match="^distribute: .*mixes"):
        jshard.distribute(value, make_mesh((2, 4)), [Partial("min"), Partial("avg")])
    with pytest.raises(PlacementError, match="^distribute: .*bool"):
        jshard.distribute(value > 0, make_mesh((2, 4)), [Partial(), Replicate()])
    assert value.dtype == np.float32 and value.shape == (4, 4)


def test_spec_dtype_is_what_jax_stores():
    x = jshard.distribute(np.arange(4.0), make_mesh((8,)), [Shard(0)])  # float64 input, x64 off
    assert x.dtype == x.block.dtype == np.float32 and str(x.spec).startswith("f32[4]")


def test_survives_flax_nnx_containers():
    from flax import nnx

    mesh = make_mesh((2, 4))
    value = ints((6, 10))
    x = jshard.distribute(value, mesh, [Shard(0), Shard(1)])

    class Holder(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(w)

    graphdef, state = nnx.split(Holder(x))
    assert jax.tree.leaves(state) == [x] and nnx.merge(graphdef, state).w.get_value() is x
    doubled = jax.jit(lambda s: jax.tree.map(lambda b: b * 2, s))(state)  # plain JAX: a jax.Array comes out
    w = nnx.merge(graphdef, doubled).w.get_value()
    assert isinstance(w, jax.Array) and np.array_equal(np.asarray(w), value * 2)
    twice = jshard.jit(lambda s: jax.tree.map(lambda b: b * 2, s))(state)  # jshard's: a DArray, where it was
    w = nnx.merge(graphdef, twice).w.get_value()
    assert isinstance(w, DArray) and w.spec == x.spec
    assert np.array_equal(np.asarray(w.full()), value * 2)
