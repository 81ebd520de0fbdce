"""Specs against an independent reference of torch.chunk semantics (``oracle.reference_indices``): every device's
global indices (nested and strided shards, uneven sizes), printing, and the round trip to ``PartitionSpec``."""

import itertools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import MESH_SHAPES, make_mesh
from jshard import LayoutError, Partial, PlacementError, Replicate, Shard, Spec, StridedShard
from jshard.spec import chunk_sizes, dim_layout, even_length, padded_length
from oracle import reference_indices, torch_chunk


@pytest.mark.parametrize("length, sizes", [(8, [2, 2, 2, 2]), (10, [3, 3, 3, 1]), (9, [3, 3, 3, 0]),
                                           (5, [2, 2, 1, 0]), (2, [1, 1, 0, 0])])
def test_torch_chunk_sizes(length, sizes):
    assert chunk_sizes(length, 4) == sizes
    spec = Spec.create(make_mesh((2, 4)), (Replicate(), Shard(0)), (length,), "float32")
    assert [spec.local_shape((0, c))[0] for c in range(4)] == sizes


def test_nested_sharding_rechunks():
    spec = Spec.create(make_mesh((2, 4)), (Shard(0), Shard(0)), (10, 3), "float32")
    coords = list(itertools.product(range(2), range(4)))
    assert [spec.local_shape(c)[0] for c in coords] == [2, 2, 1, 0, 2, 2, 1, 0]
    firsts = [int(i[0][0]) if len(i[0]) else 10 for i in map(spec.global_indices, coords)]
    assert firsts == [0, 2, 4, 10, 5, 7, 9, 10]
    assert spec.local_shape((1, 3)) == (0, 3) and spec.local_block_shape == (2, 3)


def test_strided_shard_examples():
    m2 = jax.make_mesh((2,), ("a",), devices=jax.devices()[:2])
    held = lambda spec, n: [spec.global_indices((c,))[0].tolist() for c in range(n)]
    assert held(Spec.create(m2, (StridedShard(0, 2),), (8,), "f4"), 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert held(Spec.create(m2, (StridedShard(0, 4),), (8,), "f4"), 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    m3 = jax.make_mesh((3,), ("a",), devices=jax.devices()[:3])
    assert held(Spec.create(m3, (StridedShard(0, 2),), (10,), "f4"), 3) == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9]]
    m22 = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    table = {
        (Shard(0), Shard(0)): [[0, 1], [2, 3], [4, 5], [6, 7]],
        (StridedShard(0, 2), Shard(0)): [[0, 1], [4, 5], [2, 3], [6, 7]],
        (Shard(0), StridedShard(0, 2)): [[0, 2], [1, 3], [4, 6], [5, 7]],
    }
    for placements, want in table.items():
        spec = Spec.create(m22, placements, (8,), "f4")
        assert [spec.global_indices(c)[0].tolist() for c in itertools.product(range(2), range(2))] == want
    m23 = jax.make_mesh((2, 3), ("dp", "tp"), devices=jax.devices()[:6])
    spec = Spec.create(m23, (StridedShard(0, 3), Replicate()), (12,), "f4")
    assert spec.global_indices((0, 0))[0].tolist() == [0, 1, 4, 5, 8, 9]
    spec = Spec.create(m23, (StridedShard(0, 3), Shard(0)), (12,), "f4")
    assert spec.global_indices((1, 2))[0].tolist() == [10, 11]


placement_st = lambda rank: st.one_of(
    st.just(Replicate()), st.builds(Shard, st.integers(0, rank - 1)),
    st.builds(StridedShard, st.integers(0, rank - 1), st.integers(1, 4)), st.just(Partial()))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(list(MESH_SHAPES)), st.lists(st.integers(0, 13), min_size=1, max_size=3),
       st.data())
def test_layout_matches_independent_reference(mesh_shape, shape, data):
    mesh = make_mesh(mesh_shape)
    placements = tuple(data.draw(placement_st(len(shape))) for _ in mesh_shape)
    spec = Spec.create(mesh, placements, shape, "float32")
    for coords in itertools.product(*map(range, mesh_shape)):
        want = reference_indices(shape, mesh_shape, spec.placements, coords)
        got = [i.tolist() for i in spec.global_indices(coords)]
        assert got == want, (spec, coords)
        assert spec.local_shape(coords) == tuple(map(len, want))
    assert spec.local_block_shape == tuple(np.max(spec.local_shapes.reshape(-1, len(shape)), axis=0))


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (2, 2, 2), (1, 8)])
def test_a_dims_layout_in_any_cut_order_and_its_padded_length(mesh_shape):
    """``dim_layout`` computes each index list once per coordinate of the chain's own axes and broadcasts it over
    the others, with the chain's axes cutting in the chain's order (the planner asks for orders other than the
    mesh's); ``padded_length`` follows only the lengths. Both against cutting every device's list afresh."""
    for length in range(0, 19):
        for r in range(len(mesh_shape) + 1):
            for axes in itertools.permutations(range(len(mesh_shape)), r):
                for factors in itertools.product((1, 2, 4), repeat=r):
                    chain = tuple(zip(axes, factors, strict=True))
                    table = dim_layout(length, mesh_shape, chain)
                    for coords in itertools.product(*map(range, mesh_shape)):
                        idx = list(range(length))
                        for a, sf in chain:
                            blocks = torch_chunk(idx, sf)
                            idx = [i for b in blocks for i in torch_chunk(b, mesh_shape[a])[coords[a]]]
                        row = table[coords]
                        assert row[row >= 0].tolist() == idx, (length, chain, coords)
                    assert padded_length(length, mesh_shape, chain) == table.shape[-1], (length, chain)
                    even = even_length(length, mesh_shape, chain)
                    assert even is None or (table >= 0).sum(-1).min() == even == table.shape[-1], (length, chain)


def test_compact_printing():
    spec = Spec.create(make_mesh((2, 4)), (Shard(0), Partial()), (16, 8), "float32")
    assert str(spec) == "f32[16,8] (S(0), P(sum)) on mesh(dp=2, tp=4)"
    assert str(Spec.create(make_mesh((8,)), (Replicate(),), (), "bfloat16")) == "bf16[] (R) on mesh(x=8)"
    assert str(Spec.create(make_mesh((8,)), (Replicate(),), (3,), "int32")).startswith("i32[3]")


@pytest.mark.parametrize("placements, pspec", [
    ((Shard(0), Shard(1)), P("dp", "tp")),
    ((Shard(0), Shard(0)), P(("dp", "tp"), None)),
    ((StridedShard(0, 4), Shard(0)), P(("tp", "dp"), None)),
    ((Replicate(), Shard(1)), P(None, "tp")),
    ((Shard(1), Partial()), P(None, "dp", unreduced={"tp"})),
    ((Partial(), Partial()), P(None, None, unreduced={"dp", "tp"})),
])
def test_partition_spec_round_trip(placements, pspec):
    mesh = make_mesh((2, 4))
    spec = Spec.create(mesh, placements, (16, 8), "float32")
    assert spec.to_partition_spec() == pspec
    back = Spec.from_named_sharding(NamedSharding(mesh, pspec), (16, 8), "float32")
    assert back == spec


@pytest.mark.parametrize("placements, shape, words", [
    ((Shard(0), Replicate()), (5, 8), ["unevenly", "dim 0"]),
    ((Partial("max"), Replicate()), (4, 8), ["Partial(max)", "no JAX sharding equivalent"]),
    ((Shard(0), StridedShard(0, 2)), (16, 8), ["not a shard order"]),
])
def test_partition_spec_errors(placements, shape, words):
    spec = Spec.create(make_mesh((2, 4)), placements, shape, "float32")
    with pytest.raises(LayoutError) as e:
        spec.to_partition_spec()
    assert str(spec) in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_spec_errors():
    mesh = make_mesh((2, 4))
    with pytest.raises(PlacementError, match="bool"):
        Spec.create(mesh, (Partial(), Replicate()), (4,), "bool")
    with pytest.raises(TypeError, match="Mesh"):
        Spec.create("mesh", (Replicate(),), (4,), "float32")
