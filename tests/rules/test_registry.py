"""Rule registration is checked: a misspelt primitive or a second rule for one primitive fails at registration
(not as a silently replicated or silently replaced rule), a primitive of a newer JAX is skipped on an older one,
``override`` swaps a rule and puts it back, and every change of the registry forgets the selections made before.

``reduce_window_sum`` has no rule in jshard: the tests give it one inside an ``override("reduce_window_sum", None)``
block, which puts the registry back as it was when the block ends.
"""

import re
import warnings

import jax
import numpy as np
import pytest
from jax import lax

import jshard
from conftest import make_mesh, mesh_params
from jshard import Partial, Replicate, Shard
from jshard.rules import registry
from jshard.rules.registry import INTRODUCED, has_rule, override, register, registered, rule_for
from jshard.rules.registry import ShardPlaceholder as Φ
from jshard.validate.core import run_equation
from oracle import check_darray, local_blocks

# the meshes: one axis cutting, a size-1 axis beside it, one device (where no placement moves anything)
MESHES = mesh_params([(8,), (1, 8), (1,)], default=[(8,), (1, 8), (1,)])


def _windows_apart(ins, outs, params):
    """A shard on every dim that no window crosses (a window of 1 at stride 1, no padding, no dilation): each
    output element sums a window of its own device's rows."""
    alone = zip(params["window_dimensions"], params["window_strides"], params["padding"], params["base_dilation"],
                params["window_dilation"], strict=True)
    return [(Φ(d), Φ(d)) for d, w in enumerate(alone) if w == (1, 1, (0, 0), 1, 1)]


def _on_last_axis(mesh, p):
    """``p`` on the mesh's last axis, Replicate on the others."""
    return (Replicate(),) * (mesh.devices.ndim - 1) + (p,)


def test_unruled_primitive_is_unruled():
    # the premise of the tests below: if jshard gains a rule for it, pick another primitive without one
    assert not has_rule("reduce_window_sum") and not has_rule(lax.reduce_window_sum_p)


def test_misspelt_name_is_an_error_at_registration():
    before = registered()
    with pytest.raises(ValueError, match=r"register\('epx'\): jax \S+ has no primitive named 'epx' "
                                         r"\(did you mean 'exp'.*make_jaxpr.*INTRODUCED"):
        register("epx")(_windows_apart)
    with pytest.raises(ValueError, match=r"register\('reduce_window_summ'\).*did you mean 'reduce_window_sum'"):
        # nothing is registered unless every name is right
        register("reduce_window_sum", "reduce_window_summ")(_windows_apart)
    with pytest.raises(ValueError, match=r"override\('epx'\): jax \S+ has no primitive named 'epx'"):
        with override("epx", None):
            pass
    with pytest.raises(TypeError, match=r"register\(\): a primitive is a jax.extend.core.Primitive or its name"):
        register(42)(_windows_apart)
    assert registered() == before and not has_rule("reduce_window_sum")


def test_second_rule_for_a_primitive_is_an_error():
    first = rule_for("exp")
    qualified = f"{first.strategies.__module__}.{first.strategies.__qualname__}"
    for prim in ("exp", lax.exp_p):  # by name or by object: one primitive
        with pytest.raises(ValueError, match=rf"register\('exp'\): primitive 'exp' already has a rule, "
                                             rf"{re.escape(qualified)}; a second one, "
                                             rf"{re.escape(__name__)}\._windows_apart, would silently replace "
                                             r"it.*override"):
            register(prim)(_windows_apart)
        assert rule_for("exp") is first
    with override("reduce_window_sum", None):
        with pytest.raises(ValueError, match=r"primitive 'reduce_window_sum' already has a rule"):
            register("reduce_window_sum", lax.reduce_window_sum_p)(_windows_apart)  # twice in one call
        assert not has_rule("reduce_window_sum")


def test_primitive_object_registers_under_its_name():
    with override("reduce_window_sum", None):
        register(lax.reduce_window_sum_p)(_windows_apart)
        assert rule_for("reduce_window_sum").strategies is _windows_apart and has_rule(lax.reduce_window_sum_p)
    assert not has_rule("reduce_window_sum")  # the override put the registry back


@pytest.mark.parametrize("shape", MESHES)
def test_override_swaps_a_rule_and_puts_it_back(shape):
    # floor keeps P(max) (it is non-decreasing); with its rule removed the pending max is reduced first, and the
    # selection made under the override must not outlive it (nor the one made before survive into it)
    mesh = make_mesh(shape)
    rng = np.random.default_rng(0)
    a = rng.uniform(-2, 2, (8, 6)).astype(np.float32)
    placements = _on_last_axis(mesh, Partial("max"))
    x = jshard.from_local(local_blocks(a, tuple(mesh.devices.shape), placements, rng), mesh, placements, shape=a.shape)
    rule = rule_for("floor")
    cuts = mesh.devices.shape[-1] > 1  # on one device a max is never pending: nothing to change
    (kept,), with_rule = run_equation(lax.floor_p, {}, [x])
    with override("floor", None):
        assert not has_rule("floor")
        with pytest.warns(UserWarning, match="no sharding rule for primitive 'floor'"):
            (reduced,), without = run_equation(lax.floor_p, {}, [x])
    (again,), restored = run_equation(lax.floor_p, {}, [x])
    assert rule_for("floor") is rule and with_rule.rule is restored.rule is rule and without.rule is None
    assert kept.placements == again.placements
    if cuts:
        assert kept.placements == x.placements and reduced.placements == _on_last_axis(mesh, Replicate())
    else:
        assert kept.placements == reduced.placements
    for out in (kept, reduced, again):
        check_darray(out, np.floor(a))  # exact: the blocks equal the single-device result bit for bit


@pytest.mark.parametrize("shape", MESHES)
def test_registering_a_rule_forgets_the_selections_made_without_it(shape):
    mesh = make_mesh(shape)
    a = (np.arange(-24, 24, dtype=np.int32) * 97_531_357).reshape(8, 6)  # sums of neighbours wrap
    placements = _on_last_axis(mesh, Shard(0))
    x = jshard.distribute(a, mesh, placements)
    pairs = lambda v: lax.reduce_window(v, np.int32(0), lax.add, (1, 2), (1, 1), "VALID")
    truth = np.asarray(jax.jit(pairs)(a))
    cuts = mesh.devices.shape[-1] > 1

    def run():
        out = jshard.jit(pairs)(x)  # a new jshard.jit each time: only jshard's shared caches remember
        check_darray(out, truth)
        return out.placements

    with override("reduce_window_sum", None):
        with pytest.warns(UserWarning, match="no sharding rule for primitive 'reduce_window_sum'"):
            gathered = run()
        with pytest.MonkeyPatch.context() as mp:  # a registration that kept the caches: the old choice stands
            mp.setattr(registry, "clear_caches", lambda: None)
            register("reduce_window_sum")(_windows_apart)
            stale = run()
    with override("reduce_window_sum", None):
        with pytest.warns(UserWarning, match="no sharding rule for primitive 'reduce_window_sum'"):
            assert run() == gathered  # the same selection, cached again
        register("reduce_window_sum")(_windows_apart)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the rule is found: no warning
            kept = run()
    assert stale == gathered
    assert (kept != gathered) == cuts and kept == (placements if cuts else gathered)


def test_primitive_of_a_newer_jax_is_skipped_on_an_older_one(monkeypatch):
    for name, since in INTRODUCED.items():  # the real table, on whichever JAX runs the suite
        assert has_rule(name) == (jax.__version_info__[:3] >= since), (name, since, jax.__version__)
    monkeypatch.setitem(INTRODUCED, "jshard_test_future", (999, 0, 0))
    with override("reduce_window_sum", None):
        # skipped, while the known one beside it registers
        assert register("jshard_test_future", "reduce_window_sum")(_windows_apart) is _windows_apart
        assert has_rule("reduce_window_sum") and not has_rule("jshard_test_future")
    with pytest.raises(ValueError, match=r"override\('jshard_test_future'\): primitive 'jshard_test_future' is "
                                         r"new in jax 999\.0\.0; jax \S+ cannot emit it"):
        with override("jshard_test_future", None):
            pass
    # a name listed as introduced in a release this JAX has reached, yet missing: renamed or removed
    monkeypatch.setitem(INTRODUCED, "jshard_test_future", (0, 4, 0))
    with pytest.raises(ValueError, match=r"register\('jshard_test_future'\): .* though INTRODUCED lists it since "
                                         r"jax 0\.4\.0: JAX renamed or removed it"):
        register("jshard_test_future")(_windows_apart)



def test_a_function_body_may_hold_higher_level_primitives():
    """JAX 0.12 traces ``jnp.searchsorted`` to a higher-level primitive, lowered where it is bound; a
    ``rules.function`` whose body holds one is bound with its body lowered (it was "is_high=True but no to_lojax"),
    and runs as the same code does without jshard, under ``jshard.jit`` too."""
    import jax.numpy as jnp

    def rank(x):
        return jnp.searchsorted(jnp.sort(x), x).astype(x.dtype)

    unit = jshard.rules.function(lambda ins, outs, params: [], local=lambda params, ins, outs: lambda x: [rank(x)],
                                 name="tests.rank")(rank)
    x = np.array([3.0, 1.0, 2.0, 0.0, 7.0, 5.0, 6.0, 4.0], np.float32)
    want = np.asarray(rank(x))
    assert np.array_equal(np.asarray(unit(x)), want)
    mesh = make_mesh((8,))
    assert np.array_equal(jshard.jit(unit)(jshard.distribute(x, mesh, [Replicate()])).full(), want)
