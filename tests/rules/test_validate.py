"""Every registered rule against the single-device truth (a fast slice of ``python -m jshard.validate``).

The slice runs a mesh of 3 devices (uneven shards, so padding reaches every local function) and a random
subset of input placement combinations on three samples and asserts that no rule is incorrect (meshes of 2
are the families' quick validators' and the full sweep's); the full sweep (every sample, 2, 3 and 4
devices, every combination) is the slow-marked test and also asserts that the core families miss nothing.
Every registered rule has samples, or a written reason why none can exist (``NOT_SAMPLED``).
"""

import functools
import warnings

import pytest

from jshard.rules import registered, registry
from jshard.rules.functions import function_names
from jshard.validate import NOT_SAMPLED, collect, registered_with_samples, validate, without_samples
from jshard.validate.__main__ import main

# the core set must have no missing rules (the validator's "missing" = valid on every sample, not offered)
CORE_FAMILIES = ("elementwise", "reductions", "contractions", "shapes")
# sample artifacts, not gaps: within a float tolerance nextafter(x, y) is x, so it "keeps" what x would;
# trigamma and betainc are monotone on the positive samples only (not on their whole domain)
# polynomial is non-decreasing in its even-degree coefficients for finite parts only (an infinite part times
# x**2 = 0 is NaN), so its rule keeps P(max) / P(min) in the constant term alone;
# igamma / igammac are monotone in a as well as in x, but only jax >= 0.11 computes them monotonically in a
# at the samples (jax 0.10.2's rounding breaks it, and the validator finds that strategy incorrect there), so
# the rule offers monotonicity in x alone
KNOWN_MISSING = {"nextafter", "polygamma", "regularized_incomplete_beta", "polynomial", "igamma", "igammac"}

# the rules the validator checks: every registered one but those exempt (which the test below keeps true), known
# without tracing the sample programs, so that collecting the suite stays quick; the samples are traced once per
# worker, by the first test that reads them
_PRIMS = sorted(set(registered()) - set(NOT_SAMPLED) - set(function_names()))


_samples = functools.cache(collect)  # every sample program traced, once a worker


def _family(name):
    return _samples()[name][0].source


# primitives of real training steps (transformer, conv, dropout, RNG), traced with jax 0.10.2 / flax 0.12.8
TRAINING_STEP = """abs add add_any and bitcast_convert_type broadcast_in_dim concatenate conv_general_dilated
convert_element_type div dot_general eq erf_inv exp gather ge gt integer_pow iota is_finite log lt max mul neg
or pow random_bits random_fold_in random_split random_wrap reduce_max reduce_sum reshape rev rsqrt scatter-add
select_n shift_right_logical sign slice split sqrt square squeeze stop_gradient sub tanh transpose""".split()


def test_every_training_step_primitive_has_a_rule_and_samples():
    needed = set(TRAINING_STEP)  # jit and custom_jvp_call are calls: the engine recurses into them
    assert needed <= set(registered()), sorted(needed - set(registered()))
    assert needed <= set(_samples()), sorted(needed - set(_samples()))


def test_every_rule_has_samples_or_a_written_reason():
    unchecked = without_samples(_samples())
    assert not unchecked, (
        f"rules that the validator never checks: {unchecked}. Add a program that emits each primitive to its "
        "family's module in jshard/validate/samples (PROGRAMS), or, where no single-device result exists, an "
        "entry with the reason to jshard.validate.core.NOT_SAMPLED")
    # an exemption is for a rule that exists and cannot be sampled: a stale one hides nothing, so it goes
    assert set(NOT_SAMPLED) <= set(registered()) - set(_samples()), sorted(set(NOT_SAMPLED) & set(_samples()))
    assert all(reason.strip() for reason in NOT_SAMPLED.values())
    assert _PRIMS == registered_with_samples(_samples())  # the slices below check every rule with samples


def test_a_new_rule_without_samples_is_reported():
    # the check above can fail: a rule (all-Replicate only, so correct) for a primitive no sample program emits
    with registry.override("reduce_window_sum", registry.Rule("reduce_window_sum", lambda ins, outs, params: [])):
        assert without_samples(_samples()) == ["reduce_window_sum"]
        assert "reduce_window_sum" not in registered_with_samples(_samples())
    assert without_samples(_samples()) == []


@pytest.mark.parametrize("name", _PRIMS)
def test_rule_slice(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = validate(name, _samples()[name][:3], sizes=(3,), max_combos=10, seed=0)
    assert r.incorrect == 0, "\n\n".join(repro for _, repro in r.incorrect_cases[:2])
    assert not r.errors, r.errors[:3]
    # "missing" needs every sample to rule out coincidences: it is asserted by the full sweep below


def test_validator_catches_a_wrong_rule():
    # a rule claiming exp keeps P(sum) must be reported incorrect: the validator can fail
    from jshard.placements import Partial

    rule = registry.rule_for("exp")
    claims_sum = lambda ins, outs, params: rule.strategies(ins, outs, params) + [(Partial(), Partial())]
    with registry.override("exp", registry.Rule("exp", claims_sum)):
        r = validate("exp", _samples()["exp"][:1], sizes=(2,))
    assert registry.rule_for("exp") is rule  # put back
    assert r.incorrect == 1 and r.incorrect_cases[0][0] == (("P(sum)",), ("P(sum)",))


def test_cli_runs(capsys):
    assert main(["--prim", "neg,max", "--sizes", "2", "--max-combos", "5"]) == 0
    out = capsys.readouterr().out
    assert "neg" in out and "total" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", _PRIMS)
def test_rule_full(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = validate(name, _samples()[name], sizes=(2, 3, 4))
    assert r.incorrect == 0, "\n\n".join(repro for _, repro in r.incorrect_cases[:2])
    if _family(name) in CORE_FAMILIES and name not in KNOWN_MISSING:
        assert r.missing == 0, [k for k, _ in r.missing_cases]
