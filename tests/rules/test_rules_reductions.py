"""Reduction, scan and sort rules: the validator on 1-D meshes, one equation end to end on 2-D and 3-D
meshes against the single-device result (padding poisoned, Partials from unequal parts), and the
strategies ``select`` picks."""

import functools
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard, StridedShard
from jshard.propagate import select
from jshard.rules.reductions import sort_strategies
from jshard.validate import samples as sample_modules
from jshard.validate.core import Sample, collect, run_equation, validate
from oracle import assert_close, magnitude
from oracle import poisoned as darray

R = Replicate()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
SUM, AVG, MAX, MIN = (Partial(op) for op in ("sum", "avg", "max", "min"))

REDUCTIONS = ["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"]
SCANS = ["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"]
OTHERS = ["argmax", "argmin", "sort", "top_k"]


# -- helpers --------------------------------------------------------------------------------------------


@functools.cache
def family_samples(shapes=None) -> dict:
    """The validator's samples of this family only, from the programs whose first argument has one of
    ``shapes`` (None: all); tracing every family's programs takes a while."""
    module = sample_modules.reductions
    programs = [(f, a) for f, a in module.PROGRAMS if shapes is None or np.shape(a[0]) in shapes]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sample_modules, "MODULES", (SimpleNamespace(__name__=module.__name__, PROGRAMS=programs),))
        return collect(REDUCTIONS + SCANS + OTHERS)


def equation(fn, *args):
    """The one equation of ``fn(*args)`` (inside its ``jit`` wrapper, for cumsum and sort)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    while len(jaxpr.eqns) == 1 and "jaxpr" in jaxpr.eqns[0].params:
        jaxpr = jaxpr.eqns[0].params["jaxpr"].jaxpr
    (eqn,) = jaxpr.eqns
    return eqn


def _reduced_sizes(eqn, values, mesh_shape, placements):
    """What a float reduction's rounding scales with: the same reduction of the inputs' part sizes (a sum of
    Partial parts rounds relative to the parts, not to their sum); None (the result's scale) where the
    primitive takes no such input (integer operands, several outputs)."""
    if eqn.primitive.multiple_results or any(np.asarray(v).dtype.kind not in "fV" for v in values):
        return None
    sizes = [jnp.asarray(magnitude(v, mesh_shape, p), np.asarray(v).dtype) for v, p in zip(values, placements)]
    return np.asarray(eqn.primitive.bind(*sizes, **eqn.params))


def check(fn, values, mesh_shape, placements, *, free=True):
    """Run the equation of ``fn(*values)`` on DArrays with ``placements`` and compare every output with
    the single-device result; ``free``: the inputs already match a strategy, so nothing moves and the
    poisoned padding reaches the local function. Returns the choice."""
    mesh = make_mesh(mesh_shape)
    rng = np.random.default_rng(0)
    eqn = equation(fn, *values)
    inputs = [darray(v, mesh, p, rng) for v, p in zip(values, placements)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs, choice = run_equation(eqn.primitive, eqn.params, inputs)
    truths = eqn.primitive.bind(*values, **eqn.params)
    terms = _reduced_sizes(eqn, values, mesh_shape, placements)
    for got, truth in zip(outs, truths if eqn.primitive.multiple_results else [truths]):
        got, truth = np.asarray(got.full()), np.asarray(truth)
        assert got.dtype == truth.dtype
        assert_close(got, truth, n=max(np.size(v) for v in values), terms=terms)
    if free:
        assert choice.cost == 0.0 and [s.placements for s in choice.ins] == [x.placements for x in inputs], choice
    return choice


def arr(shape, dtype=np.float32, lo=-6, hi=6, seed=0):
    return np.random.default_rng(seed).integers(lo, hi + 1, size=shape).astype(dtype)


# -- the validator ----------------------------------------------------------------------------------------


def test_validator_quick():
    """Every primitive on a mesh of 3, on its uneven (5, 3) samples and the size-1 ones (sorts: along
    dim 0 only)."""
    samples = family_samples(shapes=((5, 3), (5, 1)))
    for name in REDUCTIONS + SCANS + OTHERS:
        picked = [s for s in samples[name] if s.params.get("dimension", 0) == 0]
        r = validate(name, picked, sizes=(3,))
        assert not r.errors, r.errors[:3]
        assert r.incorrect == 0, r.incorrect_cases[0][1]
        assert not _real_missing(name, r), r.missing_cases[0][1]
        assert r.correct >= 2, name


@pytest.mark.slow
@pytest.mark.parametrize("name", REDUCTIONS + SCANS + OTHERS)
def test_validator_full(name):
    r = validate(name, family_samples()[name])
    assert not r.errors, r.errors[:3]
    assert r.incorrect == 0, r.incorrect_cases[0][1]
    assert not _real_missing(name, r), r.missing_cases[0][1]


def _real_missing(name, report) -> list:
    """The missing cases, less sort's Replicate outputs read as ``P(avg|max|min)``: true (every device
    holds the same sorted operand) but never useful, since R -> P is free. They show where some payloads
    are pending and the keys Replicate."""
    def relabel(key):
        ins, outs = key
        return name == "sort" and all(o == i or (i == "R" and o in ("P(avg)", "P(max)", "P(min)"))
                                      for i, o in zip(ins, outs))

    return [k for k, _ in report.missing_cases if not relabel(k)]


@pytest.mark.slow
def test_validator_sort_with_two_payloads():
    """Key, float payload, int payload: every mix of the payloads' Partials (not in the sample programs:
    6**3 input combinations times 6**3 output combinations take minutes)."""
    values = [arr((7,)), arr((7,), seed=1), arr((7,), np.int32, seed=2)]
    eqn = equation(lambda a, b, c: lax.sort((a, b, c), num_keys=1), *values)
    sample = Sample(eqn.primitive, dict(eqn.params), values, [False] * 3, [v.aval for v in eqn.outvars])
    r = validate("sort", [sample], sizes=(2, 3))
    assert not r.errors, r.errors[:3]
    assert r.incorrect == 0, r.incorrect_cases[0][1]
    assert r.correct >= 24  # the 5 * 5 - 1 payload mixes, and more
    assert not _real_missing("sort", r), r.missing_cases[0][1]


def test_sort_rule_lists_payload_mixes():
    f = jax.core.ShapedArray((5, 6), jnp.float32)
    for payloads, mixes in ((2, 5 * 5 - 1), (4, 4 * 4 + 4)):  # beyond 3 payloads: one, or all alike
        n = 1 + payloads
        t = sort_strategies((f,) * n, (f,) * n, {"dimension": 1, "num_keys": 1})
        pending = [c for c in t if any(p.is_partial for p in c)]
        assert len(t) == 1 + mixes and len(pending) == mixes
        assert all(c[0] == R and c[n] == R and c[:n] == c[n:] for c in pending)  # key Replicate, outs = ins


# -- N-D meshes end to end --------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape, shape, axes, placements", [
    ((2, 4), (7, 5), (0,), (S0, S0)),  # the reduced dim split by both axes: nested uneven chunks of 7
    ((2, 4), (6, 7), (1,), (S0, StridedShard(1, 2))),  # a strided split of the reduced dim, rows kept
    ((2, 2, 2), (5, 6, 7), (0, 2), (AVG, S2, S1)),  # pending avg, a reduced and a kept (renumbered) dim
    ((2, 4), (9, 4), (0,), (SUM, S0)),
])
def test_reduce_sum_end_to_end(mesh_shape, shape, axes, placements):
    check(lambda a: jnp.sum(a, axis=axes), [arr(shape)], mesh_shape, [placements])


@pytest.mark.parametrize("op, fn, pending", [("max", jnp.max, MAX), ("min", jnp.min, MIN)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_reduce_max_min_end_to_end(op, fn, pending, dtype):
    # negative values: zero padding would win a max, the poison (NaN, large) a min
    value = arr((9, 6), dtype, lo=-9, hi=-1)
    check(lambda a: fn(a, axis=0), [value], (2, 4), [(pending, S0)])
    check(lambda a: fn(a, axis=(0, 1)), [value], (2, 2, 2), [(S1, pending, S0)])


def test_reductions_without_a_pending_kind_gather_the_reduced_dim():
    choice = check(lambda a: jnp.prod(a, axis=0), [arr((5, 3), lo=-2, hi=2)], (2, 4), [(S0, S1)], free=False)
    assert S0 not in choice.ins[0].placements  # gathered, or moved to the kept dim by an all-to-all
    check(lambda a: jnp.any(a, axis=1), [arr((5, 7), lo=0, hi=3) > 2], (2, 2, 2), [(S0, S1, R)], free=False)
    check(lambda a: lax.reduce_xor(a, (0,)), [arr((5, 7), np.int32)], (2, 4), [(S0, S1)], free=False)
    choice = check(lambda a: jnp.argmax(a, axis=1), [arr((6, 7), np.int32, lo=0, hi=3)], (2, 4), [(S1, S0)],
                   free=False)  # ties: the first index wins, as on one device
    assert S1 not in choice.ins[0].placements


@pytest.mark.parametrize("fn, placements", [
    (lambda a: lax.cumsum(a, axis=0), (SUM, S1)),
    (lambda a: lax.cumsum(a, axis=1, reverse=True), (S0, AVG)),
    (lambda a: lax.cummax(a, axis=1, reverse=True), (MAX, S0)),
    (lambda a: lax.cummin(a, axis=0), (StridedShard(1, 2), MIN)),
    (lambda a: lax.cumprod(a, axis=0), (S1, S1)),
])
def test_scans_end_to_end(fn, placements):
    check(fn, [arr((7, 5), lo=-2, hi=2)], (2, 4), [placements])


def test_scans_gather_the_scan_dim():
    choice = check(lambda a: lax.cumlogsumexp(a, axis=1), [arr((7, 5))], (2, 4), [(S0, S1)], free=False)
    assert S1 not in choice.ins[0].placements


def test_sort_payloads_keep_pending_reductions():
    # key replicated on axes 1 and 2; the payloads pending there (each its own kind); rows sharded on axis 0
    values = [arr((5, 6)), arr((5, 6), seed=1), arr((5, 6), np.int32, seed=2)]
    check(lambda a, b, c: lax.sort((a, b, c), dimension=1, num_keys=1), values, (2, 2, 2),
          [(S0, R, R), (S0, SUM, R), (S0, R, MIN)])


def test_argsort_and_top_k_end_to_end():
    x = np.random.default_rng(3).permutation(35).astype(np.float32).reshape(7, 5)  # no ties
    iota = np.broadcast_to(np.arange(7, dtype=np.int32)[:, None], x.shape)
    check(lambda a, i: lax.sort((a, i), dimension=0, num_keys=1), [x, iota], (2, 4), [(S1, S1)] * 2)  # argsort
    choice = check(lambda a: lax.top_k(a, 3, axis=0), [x], (2, 4), [(S1, S0)], free=False)
    assert S0 not in choice.ins[0].placements
    assert choice.outs[0].placements == choice.outs[1].placements == choice.ins[0].placements


# -- select ----------------------------------------------------------------------------------------------


def _select(fn, value, placements, mesh_shape=(2, 4), **kw):
    eqn = equation(fn, value)
    spec = jshard.Spec.create(make_mesh(mesh_shape), placements, value.shape, value.dtype)
    return select(eqn.primitive, eqn.params, [spec], [v.aval for v in eqn.outvars], **kw)


def test_select_splits_reductions_without_moving_anything():
    x = np.zeros((8, 16), np.float32)
    c = _select(lambda a: jnp.sum(a, axis=0), x, (S0, S1))
    assert c.cost == 0 and c.outs[0].placements == (SUM, S0)
    c = _select(lambda a: jnp.max(a, axis=1), x, (MAX, S1))
    assert c.cost == 0 and c.outs[0].placements == (MAX, MAX)
    c = _select(lambda a: lax.cumsum(a, axis=1), x, (AVG, S0))
    assert c.cost == 0 and c.outs[0].placements == (AVG, S0)


def test_select_resolves_what_does_not_pass():
    x = np.zeros((8, 16), np.float32)
    c = _select(lambda a: jnp.max(a, axis=1), x, (S0, SUM))  # a max of sums needs the sum first
    assert c.cost > 0 and SUM not in c.ins[0].placements
    c = _select(lambda a: jnp.sum(a, axis=1), x.astype(np.int32), (S0, AVG))  # integer averages round
    assert c.cost > 0 and AVG not in c.ins[0].placements
    c = _select(lambda a: lax.cumsum(a, axis=1), x, (S1, S0))  # a prefix needs every earlier element
    assert S1 not in c.ins[0].placements and c.outs[0].placements == c.ins[0].placements
