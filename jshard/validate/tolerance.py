"""How close a distributed float result must be to the single-device one: a bound that follows from the computation.

A sharded program adds in another order than one device (partial sums per shard, then a collective; and XLA:CPU's
own order depends on the CPU's vector width), so float results differ by rounding. How much depends on the
computation, not on a fixed ``rtol``: a sum of ``n`` terms rounds each partial sum, so two orders of it can
land apart by about ``eps * sqrt(n) * sum|terms|`` (the rounding errors add like a random walk; ``n * eps``
is the worst case, never seen in practice). A sum that cancels (72 terms of size 1 adding to 0.2) loses
relative precision that no ``rtol`` on the result can describe; the magnitude of its terms does.

``rounding_bound(want, n=, terms=)`` is that bound (times a small safety factor), and ``assert_close`` /
``is_close`` compare against it. Exact dtypes (integers, bools) compare exactly; so do non-finite values
(inf stays inf with its sign, NaN stays NaN).

>>> import numpy as np
>>> terms = np.sin(np.arange(72.0, dtype=np.float32))
>>> want = terms.sum()                             # 72 terms of size ~1 adding up to ~0.2
>>> got = np.float32(np.sort(terms)[::-1].sum())   # another order
>>> is_close(got, want, n=72, terms=np.abs(terms).sum())
True
>>> is_close(np.int32(3), np.int32(4))
False
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ELEMENTWISE_ULPS", "SLACK", "assert_close", "assert_within_ulps", "curve_ratio", "is_close",
           "rounding_bound"]

# two results each within ~eps*sqrt(n)*terms of the exact value, and a few elementwise roundings around the
# sums (scaling, bias, activation): a factor of 4 over eps*sqrt(n)*terms, never a tuned number
SLACK = 4.0

# one elementwise float transform evaluated in two programs: XLA:CPU's vectorised and scalar forms of a
# transcendental function may round apart by an ulp (erf_inv on jaxlib 0.12 with AVX-512, for a block 4 wide
# and not for one 16 wide), and each of the few roundings after it (a truncated normal's sqrt(2), the
# initialiser's scale) can carry that one step further: 1 + 3, never a tuned number
ELEMENTWISE_ULPS = 4


def _eps(*dtypes) -> float:
    """The unit roundoff of the least precise float dtype among ``dtypes`` (bfloat16 included)."""
    import jax.numpy as jnp  # knows bfloat16 and the float8s, which numpy stores as kind "V"

    return max(float(jnp.finfo(d).eps) for d in dtypes if np.dtype(d).kind in "fcV")


def rounding_bound(want, *, n: int = 1, terms=None, dtype=None) -> np.ndarray:
    """The largest difference from ``want`` that reordering a float computation explains, per element.

    ``n``: the number of terms summed into each element along the computation (a reduction's length, a
    matmul's contraction; for a chain, their total). ``terms``: the size of what was summed, per element or
    as one number: ``sum |term|`` for a reduction that may cancel, else the default, the result's own scale
    ``max |want|`` (the rounding of a network's intermediates is relative to their scale, not to each
    element). ``dtype``: the computation's dtype (default: ``want``'s).

    >>> float(rounding_bound(np.float32(1.0), n=16) / np.finfo(np.float32).eps)  # SLACK * sqrt(16)
    16.0
    """
    want = np.asarray(want)
    eps = _eps(dtype or want.dtype)
    if terms is None:
        finite = np.abs(want[np.isfinite(want)].astype(np.complex128 if want.dtype.kind == "c" else np.float64))
        terms = finite.max() if finite.size else 0.0
    terms = np.abs(np.asarray(terms, dtype=np.float64))
    return SLACK * eps * math.sqrt(max(n, 1)) * np.broadcast_to(terms, want.shape)


def _diff(got, want, n, terms, dtype) -> tuple[str | None, np.ndarray, np.ndarray]:
    """(why they differ or None, |got - want|, bound) with exact comparison where the result is exact."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shapes differ: {got.shape} vs {want.shape}", np.zeros(()), np.zeros(())
    kinds = {np.dtype(got.dtype).kind, np.dtype(want.dtype).kind}
    if kinds <= set("biu"):
        bad = got != want
        return (f"{int(bad.sum())} of {bad.size} exact elements differ" if bad.any() else None,
                bad.astype(np.float64), np.zeros(want.shape))
    dtype = dtype or max((got.dtype, want.dtype), key=lambda d: _eps(d) if d.kind in "fcV" else 0.0)
    wide = np.complex128 if "c" in kinds else np.float64
    g, w = got.astype(wide), want.astype(wide)
    finite = np.isfinite(w)
    same_special = np.where(np.isnan(w), np.isnan(g), g == w)
    if not np.all(same_special[~finite]):
        return f"{int((~same_special[~finite]).sum())} inf/NaN elements differ", np.zeros(()), np.zeros(())
    err = np.where(finite, np.abs(g - np.where(finite, w, 0.0)), 0.0)
    bound = rounding_bound(want, n=n, terms=terms, dtype=dtype)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape) if err.ndim else ()
        return (f"{int(bad.sum())} of {bad.size} elements differ by more than the rounding bound (n={n}); worst at "
                f"{tuple(map(int, i))}: got {g[i]!r}, want {w[i]!r}, |diff| {err[i]:.3e} > bound {bound[i]:.3e}",
                err, bound)
    return None, err, bound


def is_close(got, want, *, n: int = 1, terms=None, dtype=None) -> bool:
    """``got`` equals ``want`` within ``rounding_bound`` (exactly, for integers, bools and inf/NaN)."""
    return _diff(got, want, n, terms, dtype)[0] is None


def assert_close(got, want, *, n: int = 1, terms=None, dtype=None, err_msg: str = "") -> None:
    """Raise ``AssertionError`` unless ``is_close(got, want, n=n, terms=terms)``; the message names the worst
    element, its difference and the bound it broke.

    >>> assert_close(np.float32(0.1) * 3, np.float32(0.3))
    """
    why = _diff(got, want, n, terms, dtype)[0]
    if why is not None:
        raise AssertionError(f"{err_msg + ': ' if err_msg else ''}{why}")


def assert_within_ulps(got, want, *, ulps: int = ELEMENTWISE_ULPS, err_msg: str = "") -> None:
    """Raise ``AssertionError`` unless ``got`` equals ``want`` to ``ulps`` units in the last place per element:
    the check for values computed elementwise (no sums) in two programs, such as parameters drawn on each
    device against the eager draw. Exact dtypes compare exactly, and so do inf and NaN.

    >>> x = np.float32([0.1, 0.3])
    >>> assert_within_ulps(np.nextafter(x, np.float32(1)), x)
    >>> assert_within_ulps(np.uint32([1, 2]), np.uint32([1, 2]))
    """
    got, want = np.asarray(got), np.asarray(want)
    prefix = f"{err_msg + ': ' if err_msg else ''}"
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{prefix}{got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}")
    if want.dtype.kind not in "fc":  # exact dtypes exactly; bfloat16 and the float8s within one rounding
        why = _diff(got, want, 1, None, None)[0]
        if why is not None:
            raise AssertionError(prefix + why)
        return
    parts = [(got.real, want.real), (got.imag, want.imag)] if want.dtype.kind == "c" else [(got, want)]
    for g, w in parts:
        special = ~np.isfinite(w)
        if not np.array_equal(g[special], w[special], equal_nan=True) or not np.isfinite(g[~special]).all():
            raise AssertionError(f"{prefix}inf/NaN elements differ")
        try:
            np.testing.assert_array_max_ulp(g[~special], w[~special], maxulp=ulps)
        except AssertionError as e:
            raise AssertionError(prefix + str(e).strip()) from None


def curve_ratio(got, want, *, n_per_step: int, dtype=np.float32) -> float:
    """How far two training runs' loss curves are apart, in units of the rounding bound: step ``k``'s loss
    carries the rounding of ``k + 1`` steps of ``n_per_step`` summed terms each (a random walk over the steps).
    At most 1 when the runs agree.

    >>> curve_ratio([2.0, 1.5000001], [2.0, 1.5], n_per_step=100) <= 1
    True
    """
    return max(float(abs(g - w) / rounding_bound(np.asarray(w, dtype), n=n_per_step * (k + 1)))
               for k, (g, w) in enumerate(zip(got, want, strict=True)))
