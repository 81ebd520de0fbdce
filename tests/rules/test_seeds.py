"""The cases of the DTensor pull requests the project grew from (bugs and fixes) through ``jshard.jit``, against
single device.

- 000: a dtype cast of a ``Partial(sum)`` value is not linear: ``trunc(a + b) != trunc(a) + trunc(b)``.
- 002: ``P(sum) * R`` stays ``P(sum)`` (multiplication is linear in each operand); ``P(sum) + R`` must not add
  ``R`` once per part.
- elementwise monotone maps keep ``P(max)``; a decreasing one turns it into ``P(min)`` (or reduces it).
- 001: the gradient of a Replicate parameter that comes out transposed (``x @ w.T``, ``w[1:]``, ``take``)
  stays ``Partial`` and is reduced once, at the end, when pinned: no early all-reduce in the backward pass.
- 004: a reduction over several mesh axes is one collective over all of them, so every replica holds the
  bitwise-same result.
"""

from __future__ import annotations

import itertools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard
from oracle import assert_close, partial_parts, reference_indices

R = Replicate()


def full(x) -> np.ndarray:
    return np.asarray(x.full())


def from_parts(parts: dict, shape, mesh, placements):
    """A DArray from global ``parts`` keyed by the coordinates on the Partial axes (each device holds its
    part at its indices)."""
    ms = tuple(mesh.devices.shape)
    axes = [a for a, p in enumerate(placements) if p.is_partial]
    blocks = []
    for coords in itertools.product(*map(range, ms)):
        idx = reference_indices(shape, ms, placements, coords)
        blocks.append(parts[tuple(coords[a] for a in axes)][np.ix_(*idx)])
    return jshard.from_local(blocks, mesh, placements, shape=shape)


def random_sum_parts(rng, shape, mesh, placements):
    """Parts that differ per coordinate of the Partial(sum) axes, and the value they sum to."""
    ms = tuple(mesh.devices.shape)
    axes = [a for a, p in enumerate(placements) if p.is_partial]
    keys = list(itertools.product(*[range(ms[a]) for a in axes]))
    parts = {k: rng.normal(size=shape).astype(np.float32) for k in keys}
    value = np.sum([parts[k].astype(np.float64) for k in keys], axis=0).astype(np.float32)
    return parts, value


# ---------------------------------------------------------------------------------------------------
# 000: astype(int32) of a Partial(sum) value truncates the full sum


def _cast_operands():
    """x @ w with the contraction dim split over the devices of one axis. Column 0 has two parts of 0.6
    (1.2 -> 1, parts 0 + 0), column 1 parts of 1.5 and -0.7 (0.8 -> 0, parts 1 + 0), column 2 eight
    parts of 0.3 (2.4 -> 2); row 1 is the negation (truncation toward zero)."""
    X = np.stack([np.ones(8, np.float32), -np.ones(8, np.float32)])
    W = np.zeros((8, 3), np.float32)
    W[[0, 7], 0] = 0.6
    W[0, 1], W[7, 1] = 1.5, -0.7
    W[:, 2] = 0.3
    return X, W


@pytest.mark.parametrize("mesh_shape,px,pw", [
    ((8,), (Shard(1),), (Shard(0),)),
    ((2, 4), (R, Shard(1)), (R, Shard(0))),
    ((2, 4), (R, Shard(1)), (Shard(0), R)),  # contraction split over different axes
    ((2, 2, 2), (Shard(1), R, Shard(1)), (Shard(0), R, Shard(0))),
])
def test_astype_int32_of_a_partial_matmul_truncates_the_full_sum(mesh_shape, px, pw):
    mesh = make_mesh(mesh_shape)
    X, W = _cast_operands()
    x, w = jshard.distribute(X, mesh, px), jshard.distribute(W, mesh, pw)
    product = jshard.jit(lambda x, w: x @ w)(x, w)
    assert any(p.is_partial for p in product.placements), product  # the cast really sees a pending sum
    want = (X @ W).astype(np.int32)
    np.testing.assert_array_equal(want, [[1, 0, 2], [-1, 0, -2]])
    # the wrong answer (each device truncates its part) differs from it
    parts = [np.asarray(p) for p in product.to_local()]
    assert not np.array_equal(sum(p.astype(np.int32) for p in parts), want)
    out = jshard.jit(lambda x, w: (x @ w).astype(jnp.int32))(x, w)
    assert np.dtype(out.dtype) == np.int32
    np.testing.assert_array_equal(full(out), want)


@pytest.mark.parametrize("mesh_shape,placements", [((8,), (Partial(),)), ((2, 4), (Shard(0), Partial()))])
def test_astype_of_partial_parts_casts_the_value(mesh_shape, placements):
    """Parts 0.6 + 0.6 (int: 1, not 0) and 0.5 + -0.5 (bool: False, not True), through jit and eagerly."""
    mesh = make_mesh(mesh_shape)
    n = mesh_shape[-1]
    first = np.array([[0.6, 0.5, -0.6, 2.0]] * 2, np.float32)
    second = np.array([[0.6, -0.5, -0.6, 0.0]] * 2, np.float32)
    parts = {(0,): first, (1,): second}
    parts.update({(i,): np.zeros_like(first) for i in range(2, n)})
    a = from_parts(parts, first.shape, mesh, placements)
    value = first + second
    for out in [jshard.jit(lambda a: a.astype(jnp.int32))(a), a.astype(jnp.int32)]:
        np.testing.assert_array_equal(full(out), value.astype(np.int32))  # [1, 0, -1, 2]
    assert not np.array_equal(first.astype(np.int32) + second.astype(np.int32), value.astype(np.int32))
    out = jshard.jit(lambda a: a.astype(jnp.bool_))(a)
    np.testing.assert_array_equal(full(out), value.astype(bool))  # [True, False, True, True]


# ---------------------------------------------------------------------------------------------------
# 002: P(sum) * R keeps P(sum); P(sum) + R adds R once


@pytest.mark.parametrize("mesh_shape,pa,pr", [
    ((8,), (Partial(),), (R,)),
    ((2, 4), (Shard(0), Partial()), (Shard(0), R)),
    ((2, 4), (Partial(), Shard(1)), (R, R)),
    ((2, 2, 2), (Partial(), Shard(0), Partial()), (R, Shard(0), R)),
])
def test_partial_sum_times_and_plus_replicate(mesh_shape, pa, pr):
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(zlib.crc32(repr((mesh_shape, pa)).encode()))
    parts, A = random_sum_parts(rng, (6, 5), mesh, pa)
    a = from_parts(parts, A.shape, mesh, pa)
    Rv = rng.normal(size=A.shape).astype(np.float32) + 2.0
    r = jshard.distribute(Rv, mesh, pr)
    # every result sums the parts (in another order than the host did): the bound follows their size
    n, size = len(parts), sum(np.abs(p) for p in parts.values())
    # the sum's error times what multiplies it (P*P: 2A), and (P+R)*R's rounding of A+R times R
    scale = size * (np.abs(Rv) + 2 * np.abs(A) + 1) + Rv ** 2
    assert_close(full(a), A, n=n, terms=size)
    for name, f in [("P*R", lambda a, r: a * r), ("R*P", lambda a, r: r * a)]:
        out = jshard.jit(f)(a, r)
        assert_close(full(out), A * Rv, n=n, terms=scale, err_msg=name)
        assert out.placements == pa, (name, out)  # linear in the Partial operand: nothing reduced
    cases = [("P+R", lambda a, r: a + r, A + Rv), ("R+P", lambda a, r: r + a, A + Rv),
             ("P-R", lambda a, r: a - r, A - Rv), ("R-P", lambda a, r: r - a, Rv - A),
             ("P*P", lambda a, r: a * a, A * A), ("(P+R)*R", lambda a, r: (a + r) * r, (A + Rv) * Rv)]
    for name, f, want in cases:
        assert_close(full(jshard.jit(f)(a, r)), want, n=n, terms=scale, err_msg=name)
    # the DArray operators (eager single-call programs)
    assert_close(full(a * r), A * Rv, n=n, terms=scale)
    assert_close(full(a + r), A + Rv, n=n, terms=scale)
    assert_close(full(r - a), Rv - A, n=n, terms=scale)


# ---------------------------------------------------------------------------------------------------
# monotone maps of P(max)


@pytest.mark.parametrize("mesh_shape,placements", [
    ((8,), (Partial("max"),)),
    ((2, 4), (Partial("max"), Shard(0))),
    ((2, 4), (Shard(1), Partial("max"))),
])
def test_monotone_maps_of_partial_max(mesh_shape, placements):
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(11)
    V = rng.normal(size=(6, 5)).astype(np.float32)
    parts = partial_parts(V, mesh_shape, placements, rng)
    assert len({p.tobytes() for p in parts.values()}) == len(parts) > 1  # the parts differ
    x = from_parts(parts, V.shape, mesh, placements)
    np.testing.assert_array_equal(full(x), V)
    Rv = rng.normal(size=V.shape).astype(np.float32)
    r = jshard.distribute(Rv, mesh, (R,) * len(mesh_shape))
    keeps = [("exp", lambda x, r: jnp.exp(x), np.exp(V)), ("tanh", lambda x, r: jnp.tanh(x), np.tanh(V)),
             ("x*2", lambda x, r: x * 2.0, V * 2), ("x+R", lambda x, r: x + r, V + Rv)]
    for name, f, want in keeps:
        out = jshard.jit(f)(x, r)
        assert_close(full(out), want, terms=np.abs(want), err_msg=name)  # one rounding per element
        assert out.placements == placements, (name, out)  # increasing: the max passes through
    flips = [("-x", lambda x, r: -x, -V), ("x*-2", lambda x, r: x * -2.0, V * -2), ("R-x", lambda x, r: r - x, Rv - V)]
    for name, f, want in flips:
        out = jshard.jit(f)(x, r)
        assert_close(full(out), want, terms=np.abs(want), err_msg=name)
        assert Partial("max") not in out.placements, (name, out)  # P(min), or reduced
    # a product with a replicated factor of either sign is not monotone: the value must still be right
    assert_close(full(jshard.jit(lambda x, r: x * r)(x, r)), V * Rv, terms=np.abs(V * Rv))
    np.testing.assert_array_equal(full(-x), -V)  # the eager operator; negation is exact


# ---------------------------------------------------------------------------------------------------
# 001: transposed gradients of Replicate parameters stay Partial; pinned, one all-reduce per parameter


def _transposed(p, x):
    return jnp.sum(x @ p[0].T)


def _sliced_taken(p, x):
    w, v = p
    idx = jnp.array([0, 2, 2, 4])
    return (jnp.sum(jnp.tanh(x @ w[1:].T)) + jnp.sum(jnp.take(w, idx, axis=0) @ x.T)
            + jnp.sum(jnp.tanh(x @ w.T) @ v.T))


@pytest.mark.parametrize("loss,n_params", [(_transposed, 1), (_sliced_taken, 2)], ids=["x@w.T", "slice+take"])
def test_transposed_gradient_of_a_replicate_parameter_stays_partial(loss, n_params):
    mesh = make_mesh((8,))
    rng = np.random.default_rng(12)
    X = rng.normal(size=(16, 6)).astype(np.float32)
    P = [rng.normal(size=(5, 6)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)][:n_params]
    x = jshard.distribute(X, mesh, (Shard(0),))
    params = tuple(jshard.distribute(a, mesh, (R,)) for a in P)
    grad = jax.grad(loss)
    want = grad(tuple(P), X)
    free = jshard.jit(grad)(params, x)
    assert [g.placements for g in free] == [(Partial(),)] * n_params  # nothing reduced in the backward pass
    n = 16 + 6 + 5 + 3  # the batch, and the contractions on the way
    for g, w in zip(free, want):
        assert_close(full(g), w, n=n)
    pinned = jshard.jit(grad, out_placements=jshard.same_as(0))
    out = pinned(params, x)
    for g, w in zip(out, want):
        assert g.placements == (R,)
        assert_close(full(g), w, n=n)
    text = pinned.lower(params, x).as_text()
    assert text.count("stablehlo.all_reduce") == n_params  # one per parameter, at the end
    for other in ["all_gather", "reduce_scatter", "all_to_all", "collective_permute"]:
        assert f"stablehlo.{other}" not in text
    ex = jshard.explain(grad, params, x, out_placements=jshard.same_as(0))
    assert {k: c for k, (c, _) in ex.totals.items()} == {"all_reduce": n_params}


# ---------------------------------------------------------------------------------------------------
# 004: a reduction over several mesh axes is one collective; the replicas agree bitwise


def _replica_groups(text: str, mesh) -> list[set]:
    """Per stablehlo.all_reduce: its device groups. jax <= 0.10 writes them as a dense list ("[[0, 1, ...]]");
    jax >= 0.11 names the mesh axes it reduces over (replica_group_mesh_axes)."""
    groups = []
    for dense, axes in re.findall(r'"stablehlo\.all_reduce".*?replica_groups = (?:dense<(\[\[.*?\]\])>|'
                                  r'#stablehlo\.replica_group_mesh_axes<[^>]*?axes = \[(.*?)\]>)', text):
        if dense:
            groups.append(_parse_groups(dense))
        else:
            names = re.findall(r'name = "(\w+)"', axes)
            groups.append(_groups(mesh, [list(mesh.axis_names).index(n) for n in names]))
    return groups


def _groups(mesh, axes) -> set:
    """The device groups (flat mesh positions) that reduce together over ``axes``."""
    ms = tuple(mesh.devices.shape)
    pos = np.arange(np.prod(ms)).reshape(ms)
    moved = np.moveaxis(pos, axes, list(range(len(ms) - len(axes), len(ms))))
    return {frozenset(int(i) for i in g) for g in moved.reshape(-1, int(np.prod([ms[a] for a in axes])))}


def _parse_groups(groups_text: str) -> set:
    return {frozenset(int(i) for i in g.split(",")) for g in re.findall(r"\[([\d,\s]+)\]", groups_text)}


def _assert_replicas_bitwise_equal(out):
    blocks = np.asarray(out.block).reshape((-1,) + out.spec.device_block_shape)
    assert len(blocks) == 8
    for b in blocks[1:]:
        assert b.tobytes() == blocks[0].tobytes()


@pytest.mark.parametrize("reduce", [jnp.sum, jnp.max], ids=["sum", "max"])
def test_a_reduction_over_two_mesh_axes_is_one_collective(reduce):
    mesh = make_mesh((2, 4))
    rng = np.random.default_rng(13)
    # values across magnitudes (the summation order shows in the bits); all negative, so a max that read
    # the padding of the uneven shards (10 columns over 4) would show
    Y = (-np.abs(rng.normal(size=(6, 10))) * 10.0 ** rng.integers(-4, 4, size=(6, 10))).astype(np.float32)
    y = jshard.distribute(Y, mesh, (Shard(0), Shard(1)))
    f = jshard.jit(reduce, out_placements=(R, R))
    out = f(y)
    assert out.placements == (R, R)
    if reduce is jnp.max:
        assert float(full(out)) == Y.max()
    else:
        assert_close(full(out), Y.astype(np.float64).sum(), n=Y.size, terms=np.abs(Y).sum(), dtype=np.float32)
    _assert_replicas_bitwise_equal(out)
    text = f.lower(y).as_text()
    groups = _replica_groups(text, mesh)
    assert text.count("stablehlo.all_reduce") == 1 and len(groups) == 1, groups
    assert groups[0] == _groups(mesh, [0, 1])  # over both axes at once


def test_partial_on_two_of_three_axes_reduces_with_one_collective():
    """(P, R, P) on (2, 2, 2) to Replicate: one all-reduce over axes 0 and 2 (groups of 4), replicas bitwise equal."""
    mesh = make_mesh((2, 2, 2))
    rng = np.random.default_rng(14)
    pl = (Partial(), R, Partial())
    parts = {k: (rng.normal(size=(5, 3)) * 10.0 ** rng.integers(-4, 4, size=(5, 3))).astype(np.float32)
             for k in itertools.product(range(2), range(2))}
    value = np.sum([p.astype(np.float64) for p in parts.values()], axis=0)
    a = from_parts(parts, (5, 3), mesh, pl)
    f = jshard.jit(lambda a: jnp.tanh(a), out_placements=(R, R, R))
    out = f(a)
    # tanh' <= 1: the sum's rounding (4 parts across magnitudes) passes through at most unchanged
    assert_close(full(out), np.tanh(value), n=4, terms=sum(np.abs(p) for p in parts.values()), dtype=np.float32)
    _assert_replicas_bitwise_equal(out)
    text = f.lower(a).as_text()
    groups = _replica_groups(text, mesh)
    assert text.count("stablehlo.all_reduce") == 1 and len(groups) == 1, groups
    assert groups[0] == _groups(mesh, [0, 2])
