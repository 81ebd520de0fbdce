"""Every public entry point under bad or unusual input: a clear error, never a crash or a wrong number.

A clear error is a ``ValueError`` / ``TypeError`` (or a jshard subclass of one) raised before any work, whose
message names the operation and the offending argument. Each case also checks that its inputs are as they
were: DArrays keep their placements and values and are not deleted, models keep their parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh
from jshard import Partial, Replicate, Shard

R = Replicate()
X = np.arange(32.0, dtype=np.float32).reshape(8, 4)


@pytest.fixture
def x():
    """A fresh (S(0), R) DArray on (dp=2, tp=4) per case, checked unchanged afterwards."""
    d = jshard.distribute(X, make_mesh((2, 4)), (Shard(0), R))
    yield d
    assert not d.block.is_deleted() and d.placements == (Shard(0), R)
    np.testing.assert_array_equal(np.asarray(d.full()), X)


def two(a, b):
    return a + b


def _star(*args):
    return args[0] * 2


# (case id, call(x) raising, exception type, regex the message matches)
JIT_CASES = [
    ("jit-not-callable", lambda x: jshard.jit("f"), TypeError, r"jshard.jit: fn must be callable"),
    ("jit-cost-model", lambda x: jshard.jit(two, cost_model="fast"), TypeError,
     r"^jshard.jit: cost_model must be a jshard.CostModel or None, got 'fast'; e.g. jshard.CostModel\(axes="),
    ("static-out-of-range", lambda x: jshard.jit(two, static_argnums=3), ValueError,
     r"static_argnums 3 is out of range for two .*takes 2"),
    ("donate-out-of-range", lambda x: jshard.jit(two, donate_argnums=2), ValueError,
     r"donate_argnums 2 is out of range for two"),
    ("static-negative-out-of-range", lambda x: jshard.jit(two, static_argnums=-3), ValueError, r"static_argnums -3"),
    ("static-out-of-range-at-call", lambda x: jshard.jit(_star, static_argnums=2)(x, 1), ValueError,
     r"static_argnums 2 is out of range for _star .*takes 2 positional argument\(s\) here"),
    ("donate-out-of-range-at-call", lambda x: jshard.jit(_star, donate_argnums=5)(x), ValueError,
     r"donate_argnums 5 is out of range for _star"),
    ("static-argnums-string", lambda x: jshard.jit(two, static_argnums="a"), TypeError,
     r"static_argnums must be an int or a sequence of ints"),
    ("static-argnums-float", lambda x: jshard.jit(two, static_argnums=1.5), TypeError, r"static_argnums must be"),
    ("donate-argnums-bool", lambda x: jshard.jit(two, donate_argnums=[True]), TypeError, r"donate_argnums must be"),
    ("static-and-donated", lambda x: jshard.jit(two, static_argnums=1, donate_argnums=1), ValueError,
     r"both in static_argnums"),
    ("static-unhashable", lambda x: jshard.jit(lambda a, n: a * len(n), static_argnums=1)(x, [1, 2]), TypeError,
     r"static argument\(s\) \[1\] of .*not hashable \(list\)"),
    ("static-as-keyword", lambda x: jshard.jit(lambda a, n: a * n, static_argnums=1)(x, n=2), TypeError,
     r"takes \['n'\] as static .*passed as keywords"),
    ("string-argument", lambda x: jshard.jit(two)(x, "abc"), TypeError,
     r"argument 1 of two .* is a str .*not an array.*static_argnums"),
    ("object-in-a-tree", lambda x: jshard.jit(lambda d: d["w"] * 2)({"w": x, "o": object()}), TypeError,
     r"argument 0\['o'\] of .* is a object"),
    ("string-keyword", lambda x: jshard.jit(lambda a, b=None: a)(x, b="s"), TypeError, r"keyword 'b' of .* is a str"),
    ("no-darray", lambda x: jshard.jit(two)(np.ones(3), np.ones(3)), ValueError,
     r"no DArray \(or jax.Array on a mesh\) among the arguments of two .* jshard.jit\(fn, mesh=mesh\)"),
    ("returns-a-string", lambda x: jshard.jit(lambda a: "done")(x), TypeError,
     r"<lambda> \(test_bad_inputs.py:\d+\) returned a str .*returns arrays"),
    ("returns-an-object-in-a-tree", lambda x: jshard.jit(lambda a: {"y": a, "f": print})(x), TypeError,
     r"returned a builtin_function_or_method .* at output\['f'\]"),
    ("out-placements-not-a-tree", lambda x: jshard.jit(two, out_placements=Shard(0)), TypeError,
     r"out_placements must be a pytree prefix"),
    ("out-placements-structure", lambda x: jshard.jit(lambda a: (a, a), out_placements=((Shard(0), R),) * 3)(x),
     ValueError, r"out_placements .* is not a prefix of the outputs' tree"),
    ("out-placements-leaf", lambda x: jshard.jit(lambda a: (a, a), out_placements=("S0", None))(x), TypeError,
     r"out_placements has 'S0' where a placement tuple"),
    ("out-placements-length", lambda x: jshard.jit(lambda a: a, out_placements=(Shard(0),))(x), ValueError,
     r"out_placements \(output 0\)"),
    ("same-as-out-of-range", lambda x: jshard.jit(lambda a: a, out_placements=jshard.same_as(99))(x), ValueError,
     r"same_as\(99\), but the function was called with 1"),
    ("same-as-string", lambda x: jshard.same_as("a"), TypeError, r"same_as: argnum must be the int position"),
    ("same-as-count", lambda x: jshard.jit(lambda a: (a, a), out_placements=jshard.same_as(0))(x), ValueError,
     r"same_as\(0\) pins 2 outputs, but argument 0 has 1"),
    ("explain-bad-static", lambda x: jshard.explain(two, x, 1, static_argnums=5), ValueError, r"static_argnums 5"),
    ("explain-string", lambda x: jshard.explain(two, x, "s"), TypeError, r"argument 1 of two .* is a str"),
    ("lower-string", lambda x: jshard.jit(two).lower(x, "s"), TypeError, r"argument 1 of two .* is a str"),
]

CONSTRAIN_CASES = [
    ("constrain-none", lambda x: jshard.constrain(x, None), TypeError,
     r"constrain: placements must be a sequence .* got None"),
    ("constrain-bare-placement", lambda x: jshard.constrain(x, Shard(0)), TypeError,
     r"constrain: placements must be a sequence.*write \(S\(0\),\)"),
    ("constrain-string-entry", lambda x: jshard.constrain(x, [Shard(0), "R"]), TypeError,
     r"constrain: placements holds 'R'"),
    ("constrain-dict-values", lambda x: jshard.constrain(x, {"dp": "S0"}), TypeError, r"constrain: a placements dict"),
    ("constrain-unknown-axis", lambda x: jshard.constrain(x, {"model": Shard(0)}), ValueError,
     r"constrain: mesh axis 'model' is not in the mesh mesh\(dp=2, tp=4\)"),
    ("constrain-length", lambda x: jshard.constrain(x, [Shard(0)]), ValueError,
     r"constrain: 1 placements for the 2 axes of mesh\(dp=2, tp=4\)"),
    ("constrain-bad-dim", lambda x: jshard.constrain(x, [Shard(5), None]), ValueError, r"Shard\(5\)|dim 5|S\(5\)"),
    ("constrain-pin-gradient", lambda x: jshard.constrain(x, [None, None], pin_gradient="yes"), TypeError,
     r"pin_gradient must be True or False"),
    ("constrain-inside-jit", lambda x: jshard.jit(lambda a: jshard.constrain(a * 2, [R]))(x), ValueError,
     r"constrain: 1 placements for the 2 axes"),
]

OTHER_MESH = ("other-mesh", None, ValueError,
              r"live on different meshes, mesh\(dp=2, tp=4\) of devices .* and mesh\(x=8\)")


def _other(x):
    return jshard.distribute(np.ones(4, np.float32), make_mesh((8,)), (Shard(0),))


APPLY_CASES = [
    ("jit-two-meshes", lambda x: jshard.jit(lambda a, b: a.sum() + b.sum())(x, _other(x))) + OTHER_MESH[2:],
    ("operator-two-meshes", lambda x: x[0] + _other(x)) + OTHER_MESH[2:],
    ("apply-unhashable-static", lambda x: jshard.apply(lambda a, s: a, x, s={1, 2}), TypeError,
     r"apply\(.*\): static argument \{1, 2\} of type set is not hashable"),
    ("operator-string", lambda x: x + "a", TypeError, r"unsupported operand type\(s\) for \+: 'DArray' and 'str'"),
    ("getitem-string", lambda x: x["a"], (TypeError, IndexError), r"index|str"),
    ("reshape-wrong-size", lambda x: x.reshape(5, 5), TypeError, r"reshape|size"),
    ("matmul-shapes", lambda x: x @ x, TypeError, r"dot_general|matmul|shape"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in JIT_CASES + CONSTRAIN_CASES + APPLY_CASES],
                         ids=[c[0] for c in JIT_CASES + CONSTRAIN_CASES + APPLY_CASES])
def test_engine_entry_points_refuse_bad_input_clearly(x, call, error, match):
    with pytest.raises(error, match=match):
        call(x)


# ---------------------------------------------------------------------------------------------------
# silent wrong results and lost data that once were (regressions)


def test_argnums_count_from_the_end_and_never_wrap():
    x = jshard.distribute(X, make_mesh((2, 4)), (Shard(0), R))
    power = jshard.jit(lambda a, n: a ** n, static_argnums=-1)  # the last argument, as in jax.jit
    np.testing.assert_array_equal(np.asarray(power(x, 2).full()), X ** 2)
    f = jshard.jit(two, donate_argnums=-1)
    y = jshard.distribute(X, x.mesh, (Shard(0), R))
    out = f(x, y)
    np.testing.assert_array_equal(np.asarray(out.full()), 2 * X)
    assert y.block.is_deleted() and not x.block.is_deleted()  # argument 1 went, argument 0 stays
    # donate_argnums=2 with two arguments once deleted argument 0 (2 % 2): now refused, nothing deleted
    g = jshard.jit(_star, donate_argnums=2)
    with pytest.raises(ValueError, match="donate_argnums 2 is out of range"):
        g(x, x)
    assert not x.block.is_deleted()


def test_apply_keys_static_arrays_by_content():
    # two 2,000-element index arrays that differ at position 1,000 once shared one program (keyed by repr)
    mesh = make_mesh((8,))
    v = np.arange(4000.0, dtype=np.float32)
    x = jshard.distribute(v, mesh, (Shard(0),))
    a = np.zeros(2000, np.int32)
    b = a.copy()
    b[1000] = 3999
    assert repr(a) == repr(b)
    for idx in (a, b, jnp.asarray(b)):
        np.testing.assert_array_equal(np.asarray(x[idx].full()), v[np.asarray(idx)])
    mask = np.arange(4000) % 3 == 0  # a boolean mask decides the result's shape: static, by content
    np.testing.assert_array_equal(np.asarray(x[mask].full()), v[mask])
    np.testing.assert_array_equal(np.asarray(x[~mask].full()), v[~mask])


def test_donated_darrays_are_refused_before_xla_sees_them():
    mesh = make_mesh((2, 4))
    x = jshard.distribute(X, mesh, (Shard(0), R))
    x.full()  # full()'s program is cached: using a deleted block with it once killed the process
    f = jshard.jit(lambda a: a + 1, donate_argnums=0)
    y = f(x)
    for use in (x.full, lambda: f(x), lambda: x.redistribute((R, R)), lambda: x + 1, x.to_local):
        with pytest.raises(jshard.DeletedArrayError, match=r"donated to argument 0 of .*<lambda>"):
            use()
    np.testing.assert_array_equal(np.asarray(y.full()), X + 1)


@pytest.mark.parametrize("donate,args", [((0, 1), "xx"), (0, "xx"), (1, "xx"), (0, "x{x}")],
                         ids=["both-donated", "first-donated", "second-donated", "donated-and-in-a-tree"])
def test_one_array_donated_and_passed_twice_is_refused(donate, args):
    mesh = make_mesh((2, 4))
    x = jshard.distribute(X, mesh, (Shard(0), R))
    f = jshard.jit(lambda a, b: a + (b["w"] if isinstance(b, dict) else b), donate_argnums=donate)
    second = {"w": x} if args == "x{x}" else x
    for _ in range(2):  # the first call traces; the second takes the steady-state path
        with pytest.raises(ValueError, match=r"are the same array, and (both are|one is) donated"):
            f(x, second)
    assert not x.block.is_deleted()
    np.testing.assert_array_equal(np.asarray(x.full()), X)


def test_constrain_outside_jit_redistributes_a_darray_and_leaves_arrays_alone():
    x = jshard.distribute(X, make_mesh((2, 4)), (Shard(0), R))
    y = jshard.constrain(x, {"tp": Shard(1)})
    assert y.placements == (Shard(0), Shard(1)) and x.placements == (Shard(0), R)
    np.testing.assert_array_equal(np.asarray(y.full()), X)
    np.testing.assert_array_equal(np.asarray(jshard.constrain(X, [Shard(0), None])), X)  # not a DArray: as it is


def test_caches_are_bounded_keyed_by_value_and_cleared_in_one_place():
    from jshard.caches import Cache
    from jshard.propagate import params_key

    class Opaque:  # no hash, no content: keyed by the object itself (held, so its id is never recycled)
        __hash__ = None

    a, b = Opaque(), Opaque()
    assert params_key({"p": a}) == params_key({"p": a}) != params_key({"p": b})
    cache = Cache(2)
    for k in "xyz":
        cache.put(k, k.upper())
    assert len(cache) == 2 and cache.get("x") is None and cache.get("z") == "Z"  # the oldest went
    traces = []
    f = jshard.jit(lambda v: traces.append(1) or v * 2)
    x = jshard.distribute(np.ones(8, np.float32), make_mesh((8,)), (Shard(0),))
    f(x), f(x)
    assert len(traces) == 1
    jshard.clear_caches()  # every memo, a jitted function's programs included
    assert len(cache) == 0
    np.testing.assert_array_equal(np.asarray(f(x).full()), np.full(8, 2.0))
    assert len(traces) == 2  # traced again: its program was forgotten


def test_a_loop_prices_the_move_of_its_initial_carry_once():
    # a Partial carry is reduced once before the loop and the body keeps it as it settled, so the loop costs that
    # one move; the estimate once counted it twice, steering the choices of enclosing loops
    from jshard.engine import replicated
    from jshard.engine.control import plan_scan, plan_while

    mesh = make_mesh((8,))
    w = jshard.distribute(np.eye(8, dtype=np.float32), mesh, (R,))
    h = jshard.from_local([np.ones((16, 8), np.float32) / 8] * 8, mesh, (Partial(),))
    loops = {plan_scan: lambda h, w: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=6)[0],
             plan_while: lambda h, w: jax.lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                                                     (0, h))[1]}
    by_shape = {h.shape: h.spec, w.shape: w.spec}  # everything else (the counter) is replicated
    for walk, f in loops.items():
        (eqn,) = [e for e in jax.make_jaxpr(f)(np.ones((16, 8), np.float32), np.eye(8, dtype=np.float32)).eqns
                  if e.primitive.name in ("scan", "while")]
        specs = [by_shape.get(tuple(v.aval.shape)) or replicated(mesh, v.aval.shape, v.aval.dtype) for v in eqn.invars]
        choice = walk(eqn, specs, mesh)[0]
        (carry,) = [s for s in choice.outs if s.shape == h.shape]
        move = jshard.plan_redistribute(h.spec, carry.placements).cost
        assert move > 0 and choice.cost == pytest.approx(move), (walk.__name__, choice.cost, move)
