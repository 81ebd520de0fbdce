"""The eager DArray surface against jax.Array's: operators, comparisons, ``bool``, ``len``, iteration, numpy
operands and ``np.asarray`` give what the same expression gives on one device, or raise JAX's own error.

Every check runs on meshes (8,), (2, 4), (1, 8) (a size-1 axis) and (1,) (one device), with each operand
Shard(0) (even, and 6 rows over 8 devices), Replicate, Partial(sum) or Partial(max) on every mesh axis.
"""

import itertools
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jshard
from conftest import make_mesh, mesh_params
from jshard import DArray, Partial, Replicate, Shard

# name -> (placement on every mesh axis, rows): 6 rows over 8 devices leave trailing shards short or empty
KINDS = {"S(0)": (Shard(0), 8), "R": (Replicate(), 8), "P(sum)": (Partial("sum"), 8), "P(max)": (Partial("max"), 8),
         "S(0) uneven": (Shard(0), 6)}
RNG = np.random.default_rng(37)


# a 2-D mesh, a size-1 axis beside 8 devices and one device by default; the 1-D mesh of 8 under -m slow
@pytest.fixture(scope="module", params=mesh_params(((2, 4), (1, 8), (1,), (8,)), default=((2, 4), (1, 8), (1,))))
def mesh(request):
    return make_mesh(request.param)


def on(mesh, value, kind: str) -> DArray:
    return jshard.distribute(value, mesh, (KINDS[kind][0],) * mesh.devices.ndim)


def values(kind: str, dtype=np.float32, low=-4, high=5) -> np.ndarray:
    return RNG.integers(low, high, size=(KINDS[kind][1], 3)).astype(dtype)


def check(got, want) -> None:
    """``got`` is a DArray holding exactly JAX's single-device result ``want``."""
    assert isinstance(got, DArray), f"got {type(got).__name__} {got!r:.80}, not a DArray"
    want = jnp.asarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(np.asarray(got.full()), np.asarray(want))


def jax_error(f, value) -> Exception:
    try:
        f(value)
    except Exception as e:  # whatever JAX raises is the oracle
        return e
    raise AssertionError("JAX raised nothing")


def raises_as_jax(f, x: DArray, value) -> None:
    """``f(x)`` raises JAX's exception type and message for ``f(jnp.asarray(value))``."""
    want = jax_error(f, jnp.asarray(value))
    with pytest.raises(type(want)) as got:
        f(x)
    assert message(got.value) == message(want)


def message(e: Exception) -> str:
    """An error's message, without the note on filtered frames that JAX appends to errors raised inside its
    calls, and with JAX's array type named as the DArray (``unhashable type: 'ArrayImpl'``)."""
    return re.sub(r"'[\w.]*ArrayImpl'", "'DArray'", str(e).split("\n-----")[0])


@pytest.mark.parametrize("kind", list(KINDS))
def test_comparisons_are_elementwise(mesh, kind):
    v = values(kind)
    other_kind = {"S(0) uneven": "S(0) uneven", "R": "P(max)"}.get(kind, "R")
    w = values(other_kind)
    x, y, a, b = on(mesh, v, kind), on(mesh, w, other_kind), jnp.asarray(v), jnp.asarray(w)
    check(x == 3, a == 3)
    check(x != y, a != b)
    check(x < w, a < w)  # a numpy operand
    check(x <= np.float32(1), a <= np.float32(1))
    check(x > y, a > b)
    check(x >= 0, a >= 0)
    check(2 < x, 2 < a)  # reflected by Python as x > 2


def test_comparisons_take_what_jax_takes_and_darrays_are_unhashable(mesh):
    x, a = on(mesh, values("S(0)"), "S(0)"), jnp.asarray(values("S(0)"))
    assert (x == None) is (a == None) is False and (x != None) is (a != None) is True  # noqa: E711
    raises_as_jax(lambda t: t == [1, 2], x, a)
    # JAX's message says == here too; the DArray's names the operator it ran
    with pytest.raises(type(jax_error(lambda t: t != (1,), a)), match=r"for !=: 'DArray' and 'tuple'"):
        x != (1,)
    raises_as_jax(hash, x, a)
    with pytest.raises(TypeError, match=r"for \+: 'DArray' and 'str'"):
        x + "1"
    with pytest.raises(TypeError, match=r"for -: 'list' and 'DArray'"):
        [1.0] - x


@pytest.mark.parametrize("kind", ["R", "P(sum)", "P(max)", "S(0)"])
def test_bool_of_one_element(mesh, kind):
    shapes = [(), (1,), (1, 1)] if kind != "S(0)" else [(1,), (1, 1)]  # a 0-d value has no dim to shard
    for shape, v in itertools.product(shapes, [0.0, -2.5]):
        value = np.full(shape, v, np.float32)
        assert bool(on(mesh, value, kind)) is bool(jnp.asarray(value))
    assert bool(on(mesh, np.array([0], np.int32), kind)) is False


def test_bool_of_partial_is_the_reduced_values(mesh):
    n = mesh.devices.size
    parts = {"sum": [1.0, -1.0] + [0.0] * (n - 2) if n > 1 else [0.0],  # device 0 holds 1, the sum is 0
             "max": [-1.0] + [0.0] * (n - 1)}  # device 0 holds -1, the max is 0 (one device: -1)
    for op, locals_ in parts.items():
        x = jshard.from_local([np.float32(p) for p in locals_], mesh, [Partial(op)] * mesh.devices.ndim)
        want = sum(locals_) if op == "sum" else max(locals_)
        assert bool(x) is bool(want)
        assert bool(x.reshape(1, 1)) is bool(want)


@pytest.mark.parametrize("kind", list(KINDS))
def test_bool_of_more_or_fewer_elements_raises_jaxs_error(mesh, kind):
    v = values(kind)
    raises_as_jax(bool, on(mesh, v, kind), v)
    raises_as_jax(bool, on(mesh, v[:, 0], kind), v[:, 0])
    raises_as_jax(bool, on(mesh, v[:0], kind), v[:0])  # empty


@pytest.mark.parametrize("kind", list(KINDS))
def test_len_iteration_and_membership(mesh, kind):
    v = values(kind)
    x, a = on(mesh, v, kind), jnp.asarray(v)
    assert len(x) == len(a) == KINDS[kind][1]
    rows = list(itertools.islice(iter(x), len(a) + 1))  # bounded: an iteration that never stops fails here
    assert len(rows) == len(a)
    for got, want in zip(rows, a):
        check(got, want)
    for got, want in zip(itertools.islice(reversed(x), len(a) + 1), reversed(list(a))):
        check(got, want)
    column, c = x[:, 1], a[:, 1]
    assert [float(r) for r in column] == [float(r) for r in c]
    for q in (float(v[2, 1]), 100.0, np.float32(v[0, 1])):
        assert (q in column) is (q in c)
    raises_as_jax(lambda t: 1.0 in t, x, a)  # JAX's `in` takes 1-D arrays only
    with pytest.raises(type(jax_error(lambda t: None in t, c)), match="__contains__: unsupported operand type"):
        None in column


def test_scalars_have_no_length_and_no_rows(mesh):
    for kind in ["R", "P(sum)"]:
        x = on(mesh, np.float32(2.0), kind)
        raises_as_jax(len, x, np.float32(2.0))
        raises_as_jax(iter, x, np.float32(2.0))
        raises_as_jax(list, x, np.float32(2.0))


def test_iteration_past_one_program_of_rows():
    mesh = make_mesh((8,))
    v = np.arange(150 * 2, dtype=np.int32).reshape(150, 2)  # 19 rows per device, the last one short
    x = jshard.distribute(v, mesh, [Shard(0)])
    assert len(x) == 150
    rows = list(itertools.islice(x, 151))
    assert [np.asarray(r.full()).tolist() for r in rows] == v.tolist()
    assert [np.asarray(r.full()).tolist() for r in itertools.islice(reversed(x), 151)] == v[::-1].tolist()


@pytest.mark.parametrize("kind", list(KINDS))
def test_numpy_operands_on_the_left_give_darrays(mesh, kind):
    v, n = values(kind), values(kind) + 5
    x, a = on(mesh, v, kind), jnp.asarray(v)
    check(n + x, n + a)
    check(n - x, n - a)
    check(n * x, n * a)
    check(n / x, n / a)
    check(n == x, n == a)
    check(n < x, n < a)
    check(np.float32(2) * x, np.float32(2) * a)
    m = values(kind)[:, :2].T  # (2, rows)
    check(m @ x, m @ a)
    assert np.asarray(x).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(x), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(x, dtype=np.float64), np.asarray(a, dtype=np.float64))


@pytest.mark.parametrize("kind", list(KINDS))
def test_power_is_jaxs(mesh, kind):
    v = RNG.normal(size=(KINDS[kind][1], 3)).astype(np.float32)
    w = np.abs(v) + 0.5
    x, a = on(mesh, v, kind), jnp.asarray(v)
    check(x ** 3, a ** 3)  # lax.integer_pow, as JAX traces a Python int exponent
    check(x ** np.int32(2), a ** np.int32(2))
    check(on(mesh, w, kind) ** 0.5, jnp.asarray(w) ** 0.5)
    check(2.0 ** x, 2.0 ** a)
    twos = np.full(v.shape, 2.0, np.float32)
    check(x ** on(mesh, twos, "R"), a ** jnp.asarray(twos))
    i = values(kind, np.int32, 0, 5)
    check(on(mesh, i, kind) ** 2, jnp.asarray(i) ** 2)
    check(2 ** on(mesh, i, kind), 2 ** jnp.asarray(i))
    raises_as_jax(lambda t: t ** -1, on(mesh, i, kind), i)


@pytest.mark.parametrize("kind", list(KINDS))
def test_arithmetic_and_reflected_operators(mesh, kind):
    v = values(kind) + 0.5  # no zeros to divide by
    x, a = on(mesh, v, kind), jnp.asarray(v)
    for f in [lambda t: t % 3, lambda t: t // 2, lambda t: 7.0 % t, lambda t: 7.0 // t, lambda t: 2.0 - t,
              lambda t: 3.0 / t, abs, lambda t: +t, lambda t: -t]:
        check(f(x), f(a))
    for got, want in zip(divmod(x, 2.0), divmod(a, 2.0)):
        check(got, want)
    for got, want in zip(divmod(5.0, x), divmod(5.0, a)):
        check(got, want)
    raises_as_jax(lambda t: ~t, x, a)  # floats have no bitwise not


@pytest.mark.parametrize("kind", ["S(0)", "P(max)", "S(0) uneven"])
def test_bitwise_and_shift_operators(mesh, kind):
    v = values(kind, np.int32, 0, 8)
    x, a = on(mesh, v, kind), jnp.asarray(v)
    for f in [lambda t: t & 6, lambda t: 5 | t, lambda t: t ^ np.int32(3), lambda t: 3 & t, lambda t: t | 8,
              lambda t: 6 ^ t, lambda t: ~t, lambda t: t << 2, lambda t: 1 << t, lambda t: t >> 1,
              lambda t: 256 >> t, lambda t: np.full(v.shape, 7, np.int32) & t]:
        check(f(x), f(a))
