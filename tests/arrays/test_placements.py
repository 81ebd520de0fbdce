"""Placement types (``Replicate``, ``Shard``, ``StridedShard``, ``Partial``): printing, hashing, normalisation of
negative dims, and the validation errors, against hand-written expectations."""

import pytest

from jshard import Partial, PlacementError, Replicate, Shard, StridedShard
from jshard.placements import format_placements, normalize_placements


def test_compact_printing():
    assert format_placements((Replicate(), Shard(0), StridedShard(1, 2), Partial(), Partial("max"))) == \
        "(R, S(0), SS(1,2), P(sum), P(max))"


def test_immutable_and_hashable():
    assert {Shard(0), Shard(0), Partial("sum"), Partial()} == {Shard(0), Partial()}
    assert Shard(0) != StridedShard(0, 2) and Shard(0) != Replicate()
    with pytest.raises(AttributeError):
        Shard(0).dim = 1


def test_kinds():
    assert Shard(1).is_shard and StridedShard(0, 2).is_shard and not Replicate().is_shard
    assert Partial().is_partial and Replicate().is_replicate


@pytest.mark.parametrize("make, words", [
    (lambda: Partial("prod"), ["unknown reduce op", "sum, avg, max, min"]),
    (lambda: StridedShard(0, 0), ["split_factor", ">= 1"]),
    (lambda: Shard("0"), ["must be an int"]),
])
def test_construction_errors(make, words):
    with pytest.raises(PlacementError) as e:
        make()
    for w in words:
        assert w in str(e.value)


def test_negative_dims_normalised():
    assert normalize_placements([Shard(-1), StridedShard(-2, 2)], 2, 3) == (Shard(2), StridedShard(1, 2))
    assert normalize_placements([StridedShard(0, 1)], 1, 1) == (Shard(0),)


@pytest.mark.parametrize("placements, rank, words", [
    ([Shard(0)], 1, ["1 placements", "mesh has 2 axes"]),
    ([Shard(2), Replicate()], 2, ["S(2)", "rank 2", "[-2, 2)"]),
    ([Shard(-3), Replicate()], 2, ["rank 2"]),
    ([Partial("max"), Partial("sum")], 1, ["mixes", "only sum and avg", "commute"]),
    ([Partial("min"), Partial("max")], 1, ["mixes"]),
    (["S(0)", Replicate()], 1, ["not a placement"]),
    (Shard(0), 1, ["sequence"]),
])
def test_validation_errors(placements, rank, words):
    with pytest.raises(PlacementError) as e:
        normalize_placements(placements, 2, rank, where="distribute")
    assert str(e.value).startswith("distribute:")
    for w in words:
        assert w in str(e.value)


def test_sum_and_avg_may_mix():
    assert normalize_placements([Partial("sum"), Partial("avg")], 2, 0) == (Partial(), Partial("avg"))
