"""Random-number primitives: keys stay where they are, random bits are drawn shard by shard.

A key array (``key<fry>[...]``, from ``random_seed`` / ``random_wrap`` / ``random_split``) is tiny and
usually rank 0, so every key primitive is elementwise over the key array's own dims and nothing else:
a batch of keys (``jax.vmap`` over ``split`` keys) may be sharded like any array, one key at a time.
Pending reductions never apply: summing or maxing keys means nothing, and the selection drops Partials
on key dtypes anyway.

``random_bits(key, bit_width, shape)`` is the one that matters. Its output dims are the key array's dims,
then ``shape``; ``shape`` is a *global* size, so binding it on a device would give every shard the
numbers of shard 0. With the default threefry implementation and ``jax_threefry_partitionable`` (both
JAX defaults) element ``i`` (the row-major linear index inside ``shape``) of key ``k`` is

    x0, x1 = threefry2x32(k, hi32(i), lo32(i))        bits = x0 ^ x1   (8/16 bits: its low bits;
                                                                       64 bits: x0 << 32 | x1)

so a device can draw exactly its own elements from their global indices, whatever the layout (uneven,
strided, several mesh axes on one dim): the local function below does that, and the result equals the
single-device draw bit for bit. It hashes with ``threefry2x32`` below, the rounds written out as elementwise
ops, so a draw and what is made of it (a uniform, a truncated normal) fuse into one kernel that holds nothing
but its output: a parameter initialiser's peak is its parameters. An output shard on a ``shape`` dim is
offered as a placeholder, so it is taken only when the key itself is sharded (then on another mesh axis);
tests call the local function with sharded outputs directly.

>>> import jax, jax.numpy as jnp; from jax.core import ShapedArray
>>> key = jax.random.key(0)
>>> key, bits = ShapedArray((), key.dtype), ShapedArray((4, 6), jnp.uint32)
>>> _bits((key,), (bits,), {"shape": (4, 6), "bit_width": 32})
[(Φ0, R), (Φ1, R)]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..local import PerDevice
from ..spec import Spec
from .algebra import R, pointwise
from .registry import ShardPlaceholder, register

__all__: list[str] = []


def _elementwise(ins, outs, params) -> list[tuple]:
    """Shard a leading dim shared by the outputs and the inputs; scalars and size-1 (broadcast) dims of an
    input stay Replicate. Covers seed, wrap / unwrap (which add or drop the trailing key-data dim), split
    (which appends its new dims), fold_in, clone, and the threefry2x32 hash itself."""
    rank = min([len(a.shape) for a in outs] + [len(a.shape) for a in ins if a.shape or len(ins) == 1])
    return pointwise(ins, outs, rank)


def _unexported_key_primitives() -> tuple:
    """``random_wrap``, ``random_clone`` and ``random_unwrap``: JAX exports these objects nowhere (not even in
    ``jax.extend``), so they are read off the jaxpr of the public functions that bind them (tracing starts no
    backend)."""
    data = jax.ShapeDtypeStruct((2,), jnp.uint32)
    traced = jax.make_jaxpr(lambda k: jax.random.key_data(jax.random.clone(
        jax.random.wrap_key_data(k, impl="threefry2x32"))))(data)
    found = {e.primitive.name: e.primitive for e in traced.eqns}
    wanted = ("random_wrap", "random_clone", "random_unwrap")
    if not set(wanted) <= set(found):
        raise RuntimeError(f"jshard.rules.random: jax {jax.__version__} binds {sorted(found)} for wrap_key_data, "
                           f"clone and key_data, not {list(wanted)}: find the key primitives' new names in that "
                           "jaxpr and register the key rule for them")
    return tuple(found[n] for n in wanted)


register("random_seed", "random_split", "random_fold_in", "threefry2x32", *_unexported_key_primitives())(_elementwise)


def _partitionable(key_dtype) -> bool:
    """Do this key's bits depend only on the element's global index (threefry, partitionable mode)?"""
    impl = getattr(key_dtype, "_impl", None)
    return getattr(impl, "name", None) == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


def _count_tables(out_spec: Spec, first: int, shape: tuple[int, ...]) -> list[tuple[PerDevice, PerDevice]]:
    """Per ``shape`` dim ``j``: this device's ``g_j * stride_j`` along output dim ``first + j``, as (hi, lo)
    uint32 tables (the linear index may exceed 32 bits; padding counts as index 0)."""
    names = tuple(out_spec.mesh.axis_names)
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    tables = []
    for j, stride in enumerate(strides):
        part = np.maximum(out_spec.layouts[first + j], 0).astype(np.uint64) * np.uint64(stride)
        tables.append((PerDevice((part >> np.uint64(32)).astype(np.uint32), names),
                       PerDevice((part & np.uint64(0xFFFFFFFF)).astype(np.uint32), names)))
    return tables


def linear_index(parts: list[tuple], block: tuple[int, ...]) -> tuple:
    """``(hi, lo)`` uint32 arrays of ``block`` shape: the 64-bit sum over dims ``j`` of ``parts[j]``, a pair
    of (hi, lo) vectors along dim ``j`` (broadcast over the others), added limb by limb with carries."""
    hi = jnp.zeros(block, jnp.uint32)
    lo = jnp.zeros(block, jnp.uint32)
    for j, (part_hi, part_lo) in enumerate(parts):
        at = [1] * len(block)
        at[j] = -1
        new_lo = lo + jnp.reshape(part_lo, at)
        hi = hi + jnp.reshape(part_hi, at) + (new_lo < lo).astype(jnp.uint32)  # carry when lo wrapped
        lo = new_lo
    return hi, lo


# the rotation amounts of Threefry-2x32's rounds, the first four and the second four alternating
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k0, k1, x0, x1) -> tuple:
    """Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) of
    the counters ``(x0, x1)`` under the key words ``(k0, k1)``, all uint32 (scalars broadcast), as elementwise ops.

    JAX lowers its ``threefry2x32`` primitive on CPU as a loop over the rounds, whose state holds both counters
    at full size, and XLA:CPU runs every draw's loop before any draw's conversion to floats: a model's
    initialiser then holds twice its parameters in counters (1.8x the parameters in temporaries, GSPMD's program
    alike). Written out, the hash fuses with the counters before it and the conversions after it.

    >>> import jax, numpy as np
    >>> k = np.asarray(jax.random.key_data(jax.random.key(7)))
    >>> x0, x1 = threefry2x32(k[0], k[1], np.zeros(4, np.uint32), np.arange(4, dtype=np.uint32))
    >>> bool((np.asarray(x0 ^ x1) == np.asarray(jax.random.bits(jax.random.key(7), (4,)))).all())
    True
    """
    k2 = lax.bitwise_xor(lax.bitwise_xor(k0, k1), np.uint32(0x1BD11BDA))
    keys = (k0, k1, k2)
    x0, x1 = lax.add(x0, k0), lax.add(x1, k1)
    for i in range(5):  # five groups of four rounds, a key injection after each
        for r in _ROTATIONS[i % 2]:
            x0 = lax.add(x0, x1)
            x1 = lax.bitwise_or(lax.shift_left(x1, np.uint32(r)), lax.shift_right_logical(x1, np.uint32(32 - r)))
            x1 = lax.bitwise_xor(x0, x1)
        x0 = lax.add(x0, keys[(i + 1) % 3])
        x1 = lax.add(lax.add(x1, keys[(i + 2) % 3]), np.uint32(i + 1))
    return x0, x1



def _bits_local(prim, params, in_specs, out_specs):
    key_spec, out_spec = in_specs[0], out_specs[0]
    kr, shape, width = key_spec.rank, tuple(params["shape"]), params["bit_width"]
    if not _partitionable(key_spec.dtype):
        if any(out_spec.chain(kr + j) for j in range(len(shape))):  # the rule never shards these; refuse to guess
            raise ValueError(f"random_bits: {key_spec.dtype} draws cannot be split by element index")
        return lambda keys: [prim.bind(keys, **params)]  # every device draws the full shape for its own keys
    tables = _count_tables(out_spec, kr, shape)
    block = out_spec.local_block_shape
    dtype = jnp.dtype(f"uint{width}")

    def run(keys):
        hi, lo = linear_index([(thi(), tlo()) for thi, tlo in tables], block[kr:])
        data = jax.random.key_data(keys)
        # one key: its words stay scalars (threefry broadcasts them), so the hash's loop carries only the
        # counters, not two more block-sized copies of the key (a third of an initialiser's peak memory)
        k1, k2 = ((data[..., i] if kr == 0 else
                   jnp.broadcast_to(jnp.reshape(data[..., i], data.shape[:-1] + (1,) * len(shape)), block))
                  for i in (0, 1))
        x0, x1 = threefry2x32(k1, k2, jnp.broadcast_to(hi, block), jnp.broadcast_to(lo, block))
        if width == 64:
            return [(x0.astype(dtype) << dtype.type(32)) | x1.astype(dtype)]
        return [(x0 ^ x1).astype(dtype)]

    return run


@register("random_bits", local=_bits_local)
def _bits(ins, outs, params) -> list[tuple]:
    kr = len(ins[0].shape)
    t = [(ShardPlaceholder(d), ShardPlaceholder(d)) for d in range(kr)]  # a batch of keys, key by key
    if _partitionable(ins[0].dtype):
        t += [(ShardPlaceholder(d), R) for d in range(kr, len(outs[0].shape))]
    return t
