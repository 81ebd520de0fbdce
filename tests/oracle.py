"""Single-device oracles for the tests, written independently of jshard's own shard math.

- ``reference_indices``: which global indices a device holds, from the torch.chunk formula with Python
  lists (jshard uses numpy index arrays and a cache).
- ``partial_parts``: per combination of Partial-axis coordinates, a global "part" array; a device's local
  block is its part at its indices, so replicas agree and the parts reduce to the value. Values are
  small integers stored as floats, so sums are exact and every check is bitwise.
- ``check_darray``: a DArray's per-device blocks against the value, reducing Partial groups on the host.
- ``assert_close``: float results against single-device ones within the rounding a reordered computation
  explains (``jshard.validate.tolerance``: from the number and size of the summed terms, never a fixed rtol);
  exact dtypes exactly.
"""

from __future__ import annotations

import collections
import itertools
import math
import re

import numpy as np

from jshard import Partial, Replicate, Shard, StridedShard
from jshard.validate.tolerance import assert_close, rounding_bound  # noqa: F401 - the suite's one tolerance


def torch_chunk(items: list, n: int) -> list[list]:
    """torch.chunk sizes: chunk c has clamp(L - c*k, 0, k) items starting at min(c*k, L), k = ceil(L/n)."""
    k = -(-len(items) // n) if items else 0
    return [items[min(c * k, len(items)): min(c * k, len(items)) + max(0, min(len(items) - c * k, k))]
            for c in range(n)]


def reference_indices(shape, mesh_shape, placements, coords) -> list[list[int]]:
    out = []
    for d, length in enumerate(shape):
        idx = list(range(length))
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and p.dim == d:
                idx = torch_chunk(idx, mesh_shape[axis])[coords[axis]]
            elif isinstance(p, StridedShard) and p.dim == d:
                blocks = torch_chunk(idx, p.split_factor)
                idx = [i for b in blocks for i in torch_chunk(b, mesh_shape[axis])[coords[axis]]]
        out.append(idx)
    return out


def partial_axes(placements):
    return [a for a, p in enumerate(placements) if isinstance(p, Partial)]


def partial_parts(value: np.ndarray, mesh_shape, placements, rng) -> dict:
    """Parts keyed by the coordinates on the Partial axes, reducing (with the placements' ops) to value."""
    axes = partial_axes(placements)
    keys = list(itertools.product(*[range(mesh_shape[a]) for a in axes]))
    if not axes:
        return {(): value}
    ops = {placements[a].op for a in axes}
    if ops <= {"sum", "avg"}:
        n_avg = math.prod(mesh_shape[a] for a in axes if placements[a].op == "avg")
        target = value * n_avg
        parts = {k: rng.integers(-9, 10, size=value.shape).astype(value.dtype) for k in keys[1:]}
        parts[keys[0]] = (target - sum(parts.values(), np.zeros_like(value))).astype(value.dtype)
        return parts
    op = ops.pop()
    winner = rng.integers(0, len(keys), size=value.shape)
    sign = -1 if op == "max" else 1
    return {k: np.where(winner == i, value, value + sign * rng.integers(1, 5, size=value.shape)).astype(value.dtype)
            for i, k in enumerate(keys)}


def magnitude(value: np.ndarray, mesh_shape, placements) -> np.ndarray:
    """Per element, the sum of |part| over the parts ``partial_parts`` splits ``value`` into: what reducing the
    parts rounds relative to (an unsplit value: ``|value|``). Sum parts beyond the first are integers in
    [-9, 9], and the first makes up the rest; max/min parts reduce exactly."""
    axes = partial_axes(placements)
    mag = np.abs(np.asarray(value)).astype(np.float64)
    if not axes or np.asarray(value).dtype.kind not in "fcV" or placements[axes[0]].op not in ("sum", "avg"):
        return mag
    k = math.prod(mesh_shape[a] for a in axes)
    n_avg = math.prod(mesh_shape[a] for a in axes if placements[a].op == "avg")
    return mag * n_avg + 18.0 * (k - 1)


def local_blocks(value: np.ndarray, mesh_shape, placements, rng) -> list[np.ndarray]:
    """Each device's local array (mesh device order) for ``value`` under ``placements``."""
    parts = partial_parts(value, mesh_shape, placements, rng)
    axes = partial_axes(placements)
    out = []
    for coords in itertools.product(*map(range, mesh_shape)):
        idx = reference_indices(value.shape, mesh_shape, placements, coords)
        part = parts[tuple(coords[a] for a in axes)]
        out.append(part[np.ix_(*idx)] if idx else part)
    return out


def reduce(op: str, arrays: list[np.ndarray], n_avg: int = 1) -> np.ndarray:
    if op in ("sum", "avg"):
        total = sum(arrays[1:], arrays[0].copy())
        return total / n_avg if n_avg != 1 else total
    return np.maximum.reduce(arrays) if op == "max" else np.minimum.reduce(arrays)


def check_darray(x, value: np.ndarray) -> None:
    """Every device block of ``x`` against ``value``: local shapes from the reference chunk rule,
    Partial groups reduced on the host, replicas bitwise equal."""
    mesh_shape = tuple(x.mesh.devices.shape)
    placements = x.placements
    locals_ = [np.asarray(a) for a in x.to_local()]
    coords_list = list(itertools.product(*map(range, mesh_shape)))
    by_coords = dict(zip(coords_list, locals_))
    axes = partial_axes(placements)
    groups = collections.defaultdict(list)
    for coords, local in by_coords.items():
        idx = reference_indices(value.shape, mesh_shape, placements, coords)
        assert local.shape == tuple(map(len, idx)), (x, coords, local.shape, tuple(map(len, idx)))
        key = tuple(c for a, c in enumerate(coords) if a not in axes)
        groups[key].append((coords, local, idx))
    for key, members in groups.items():
        idx = members[0][2]
        want = value[np.ix_(*idx)] if idx else value
        if axes:
            ops = {placements[a].op for a in axes}
            op = "sum" if ops <= {"sum", "avg"} else ops.pop()
            n_avg = math.prod(mesh_shape[a] for a in axes if placements[a].op == "avg")
            got = reduce(op, [m[1] for m in members], n_avg)
        else:
            got = members[0][1]
        assert np.array_equal(got, want), f"{x}: devices {key} (non-Partial coords) hold\n{got}\nwant\n{want}"
    # replicas: devices that differ only on Replicate axes hold bitwise-equal blocks
    rep_axes = [a for a, p in enumerate(placements) if isinstance(p, Replicate)]
    replicas = collections.defaultdict(list)
    for coords, local in by_coords.items():
        replicas[tuple(c for a, c in enumerate(coords) if a not in rep_axes)].append(local)
    for members in replicas.values():
        for m in members[1:]:
            assert m.tobytes() == members[0].tobytes(), f"{x}: replicas differ"


HLO_KINDS = {"all_gather": "all-gather", "all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter",
             "all_to_all": "all-to-all", "permute": "collective-permute", "exchange": "collective-permute"}


def hlo_collectives(compiled_text: str) -> collections.Counter:
    pat = r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
    return collections.Counter(re.findall(pat, compiled_text))


def stablehlo_collectives(lowered_text: str) -> collections.Counter:
    """Collectives of a lowered (not compiled) program, by their StableHLO names."""
    return collections.Counter(re.findall(
        r"stablehlo\.(all_gather|all_reduce|reduce_scatter|all_to_all|collective_permute)", lowered_text))


def plan_collectives(plan) -> collections.Counter:
    return collections.Counter(HLO_KINDS[s.emitted] for s in plan.collectives for _ in range(s.count))


def poisoned(value: np.ndarray, mesh, placements, rng):
    """A DArray holding ``value`` with ``placements``, Partials from unequal parts, and its padding
    poisoned (NaN, a large integer, True) so a local function that reads padding shows."""
    import jax

    import jshard
    from jshard import DArray
    from jshard.spec import block_sharding

    x = jshard.from_local(local_blocks(value, tuple(mesh.devices.shape), placements, rng), mesh, placements,
                          shape=value.shape)
    block = np.array(x.block).reshape(x.spec.mesh_shape + x.spec.device_block_shape)
    kind = block.dtype.kind
    poison = np.iinfo(block.dtype).max // 3 if kind in "iu" else True if kind == "b" else np.nan  # bf16: 'V'
    for coords in np.ndindex(*x.spec.mesh_shape):
        valid = np.ones((), dtype=bool)
        for d, lay in enumerate(x.spec.layouts):
            valid = valid & (lay[coords] >= 0).reshape([-1 if a == d else 1 for a in range(x.ndim)])
        block[coords].reshape(x.spec.local_block_shape)[~np.broadcast_to(valid, x.spec.local_block_shape)] = poison
    return DArray(jax.device_put(block.reshape(x.spec.block_shape), block_sharding(mesh)), x.spec)


def placement_st(rank, split_factors=(2, 3)):
    """Hypothesis strategy: one placement for an array of ``rank`` (every kind, StridedShard included)."""
    from hypothesis import strategies as st

    kinds = [st.just(Replicate()), st.sampled_from([Partial(op) for op in ("sum", "avg", "max", "min")])]
    if rank:
        kinds += [st.builds(Shard, st.integers(0, rank - 1)),
                  st.builds(StridedShard, st.integers(0, rank - 1), st.sampled_from(split_factors))]
    return st.one_of(*kinds)


def valid(placements, mesh_shape, rank) -> bool:
    from jshard.placements import PlacementError, normalize_placements

    try:
        normalize_placements(placements, len(mesh_shape), rank)
        return True
    except PlacementError:
        return False


def tree_scale(tree) -> float:
    """The largest magnitude in a gradient (or parameter) tree: what every element's rounding is relative to. A
    gradient that is zero up to rounding (the key bias's: softmax ignores a constant shift) sums terms of the
    network's scale, not of its own."""
    import jax

    return max(float(np.max(np.abs(np.asarray(a)))) for a in jax.tree.leaves(tree))


def train_alongside(step, reference, mesh, layout, batches) -> tuple[list[float], list[float]]:
    """The losses of ``step`` (a ``TrainStep``, each batch's arrays placed as ``layout`` on ``mesh``) and of
    ``reference`` (``jshard.gpt.one_device_trainer``) over ``batches``, step by step."""
    import jshard

    ours, theirs = [], []
    for batch in batches:
        ours.append(float(step(*(jshard.distribute(a, mesh, layout) for a in batch))))
        theirs.append(reference(*batch))
    return ours, theirs


def token_batches(n: int, vocab: int, batch: int, seq: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` language-model batches, the same in every test that asks: random ids ``[batch, seq]`` below
    ``vocab`` and their labels, the ids shifted by one."""
    rng = np.random.default_rng(0)
    return [(ids, np.roll(ids, -1, 1)) for ids in (rng.integers(0, vocab, (batch, seq)).astype(np.int32)
                                                   for _ in range(n))]
