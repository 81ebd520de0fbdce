"""The engine's corpus: plain-JAX programs at global shapes through ``jshard.jit`` against single device.

Nine programs (MLP, causal multi-head attention, LayerNorm + RMSNorm, embedding + cross-entropy, a scan
RNN, a scan whose carry is uneven (4 rows over 8 devices), a while loop, a cond, dropout) run on the meshes
(8,), (2, 4) and (2, 2, 2) under three placement sets each:

- ``dp``: the batch ``Shard``-ed over the data axes (every axis but the last; on (2, 2, 2) one dim over
  two axes), parameters ``Replicate``;
- ``tp``: Megatron-style column / row ``Shard``s of the weights on the last axis (the batch on the others);
- ``mixed``: one input ``Partial(sum)`` built with ``jshard.from_local`` from parts that differ per device,
  weights sharded on the last axis.

Shapes are chosen so that many dims are uneven on their mesh axes (6 or 10 over 4, 6 or 12 over 8).

For every case: the forward outputs and every gradient (``jax.value_and_grad`` inside the function; the
while loop, which JAX cannot reverse-differentiate, uses ``jax.jacfwd``) equal the single-device result on
numpy arrays (within the rounding bound of each program's summation chain, ``Program.n``), dropout masks
exactly; and ``jshard.explain`` lists exactly the collectives of the lowered
program. The default run covers every program on every mesh once (the placement set rotates); the rest of
the cross product is ``slow``.
"""

from __future__ import annotations

import collections
import itertools

import jax
import numpy as np
import pytest
from corpus import MESHES, PROGRAMS, STABLEHLO, STYLES, WHILE_LIMIT, cond_fwd, grad_fn, make_args, while_fwd

import jshard
from oracle import assert_close

# ---------------------------------------------------------------------------------------------------
# checks


def full(x) -> np.ndarray:
    return np.asarray(x.full())


def assert_same_tree(got, want, n):
    got_leaves, got_tree = jax.tree.flatten(got, is_leaf=lambda a: isinstance(a, jshard.DArray))
    want_leaves, want_tree = jax.tree.flatten(want)
    assert got_tree == want_tree, (got_tree, want_tree)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert isinstance(g, jshard.DArray), type(g)
        w = np.asarray(w)
        assert g.shape == w.shape and np.dtype(g.dtype) == w.dtype, (i, g, w.shape, w.dtype)
        # Partial parts (value / k plus integers up to 3) add up to values of size ~1 at least
        terms = max(1.0, float(np.max(np.abs(w), initial=0.0)))
        assert_close(full(g), w, n=n + 8, terms=terms, err_msg=f"output leaf {i}")


def assert_explain_matches_lowering(fn, jitted, args):
    ex = jshard.explain(fn, *args)
    text = jitted.lower(*args).as_text()
    listed = collections.Counter()
    for kind, (count, _) in ex.totals.items():
        listed[STABLEHLO[kind]] += count
    lowered = {k: text.count(k) for k in set(STABLEHLO.values()) if text.count(k)}
    assert dict(listed) == lowered, f"explain lists {dict(listed)}, the lowered program has {lowered}\n{ex}"


def cases():
    out = []
    for (p, name), (m, ms) in itertools.product(enumerate(PROGRAMS), enumerate(MESHES)):
        for s, style in enumerate(STYLES):
            default = s == (p + m) % len(STYLES)  # every program on every mesh once; the styles rotate
            out.append(pytest.param(name, ms, style, id=f"{name}-{'x'.join(map(str, ms))}-{style}",
                                    marks=() if default else pytest.mark.slow))
    return out


CASES = cases()


@pytest.mark.parametrize("name,mesh_shape,style", CASES)
def test_forward_matches_single_device(name, mesh_shape, style):
    prog = PROGRAMS[name]
    args, values = make_args(name, mesh_shape, style)
    want = prog.fwd(*values)
    f = jshard.jit(prog.fwd)
    got = f(*args)
    for i in prog.masks:  # the same draws drop the same elements (exactly)
        assert 0 < np.mean(np.asarray(want[i]) == 0) < 1
        np.testing.assert_array_equal(full(got[i]) == 0, np.asarray(want[i]) == 0)
    assert_same_tree(got, want, prog.n)
    assert_explain_matches_lowering(prog.fwd, f, args)


@pytest.mark.parametrize("name,mesh_shape,style", CASES)
def test_gradients_match_single_device(name, mesh_shape, style):
    prog = PROGRAMS[name]
    args, values = make_args(name, mesh_shape, style)
    fn = grad_fn(prog)
    want = fn(*values)
    f = jshard.jit(fn)
    got = f(*args)
    assert_same_tree(got, want, 2 * prog.n)
    assert_explain_matches_lowering(fn, f, args)


# ---------------------------------------------------------------------------------------------------
# the programs themselves are not trivial: every data-dependent branch and stop is exercised


def test_the_corpus_exercises_its_control_flow():
    """The loop stops on its data-dependent condition (not the counter) in every case, and the first cond's
    predicate comes out both ways across the cases (the second cond always takes the other branch)."""
    preds = set()
    for ms, style in itertools.product(MESHES, STYLES):
        _, values = make_args("while", ms, style)
        assert 0 < int(while_fwd(*values)[0]) < WHILE_LIMIT
        _, values = make_args("cond", ms, style)
        preds.add(bool(cond_fwd(*values)[0]))
    assert preds == {True, False}
