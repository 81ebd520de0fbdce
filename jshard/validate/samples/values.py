"""Deterministic sample values: ``arr((5, 3))`` is a float32 array of small integers and halves in
[-6, 6]; ``positive=True`` keeps them in [0.5, 6.5]; integer and bool dtypes are supported."""

from __future__ import annotations

import zlib

import numpy as np


def arr(shape, dtype="float32", *, positive: bool = False, lo: float = -6, hi: float = 6, salt: int = 0) -> np.ndarray:
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(repr((shape, str(dtype), positive, lo, hi, salt)).encode()))
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        lo_, hi_ = (1, int(hi) + 1) if positive or dtype.kind == "u" else (int(lo), int(hi) + 1)
        return rng.integers(lo_, hi_, size=shape).astype(dtype)
    v = rng.integers(int(2 * lo), int(2 * hi) + 1, size=shape) / 2.0
    if positive:
        v = np.abs(v) + 0.5
    return v.astype(dtype)
