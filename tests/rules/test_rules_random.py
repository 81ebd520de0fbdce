"""Random rules (jshard.rules.random): the validator on the key primitives, random_bits' local function on
sharded outputs (uneven, strided, several axes on one dim, every bit width) against the single-device
draw, batched keys sharded together with their draws, and what select picks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import primitives as prims

import jshard.validate.samples
from conftest import make_mesh
from jshard import Partial, Replicate, Shard, Spec, StridedShard, distribute
from jshard.darray import DArray
from jshard.engine import local_equation
from jshard.propagate import select
from jshard.spec import block_of, block_sharding, local_of
from jshard.validate.core import collect, validate
from oracle import check_darray

R = Replicate()
KEY_PRIMS = ["random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_bits"]


def _report(name, samples, sizes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return validate(name, samples, sizes=sizes)


@pytest.fixture(scope="module")
def samples():
    """The samples of this family's programs only (collecting every family's would take a while)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jshard.validate.samples, "MODULES", (jshard.validate.samples.random,))
        return collect(KEY_PRIMS)


def _batched(found):
    """Samples whose key input is a batch of keys (the only ones with a dim to shard)."""
    return [s for s in found if any(getattr(v, "shape", ()) for v in s.values)]


@pytest.mark.parametrize("name", KEY_PRIMS)
def test_validator(name, samples):
    found = samples[name]
    if name == "random_bits":  # draws from one key have no input to shard (tested below); one batch, 2 devices
        found = _batched(found)[:1]
    r = _report(name, found, (2,) if name == "random_bits" else (2, 3, 4))
    assert (r.incorrect, r.missing, r.errors) == (0, 0, []), (r.incorrect_cases, r.missing_cases, r.errors)
    assert r.correct > 0


@pytest.mark.slow
def test_validator_random_bits_all_samples(samples):
    r = _report("random_bits", samples["random_bits"], (2, 3, 4))
    assert (r.incorrect, r.missing, r.errors) == (0, 0, []), (r.incorrect_cases, r.missing_cases, r.errors)


# -- random_bits, drawn shard by shard -----------------------------------------------------------------


def key_spec(mesh, placements, shape=()):
    key = jax.random.key(0)
    return Spec(mesh, tuple(placements), tuple(shape), key.dtype)


def draw(mesh, key_data, key_placements, out_placements, shape, dtype=jnp.uint32):
    """Run random_bits' local function in shard_map: key data as blocks (wrapped on each device), output
    blocks under ``out_placements``. Returns the output DArray."""
    key_data = np.asarray(key_data)
    kshape = key_data.shape[:-1]
    keys = jax.random.wrap_key_data(key_data)
    eqn = jax.make_jaxpr(lambda kk: jax.random.bits(kk, shape, dtype) if not kshape
                         else jax.vmap(lambda one: jax.random.bits(one, shape, dtype))(kk))(keys).jaxpr.eqns[-1]
    assert eqn.primitive is prims.random_bits_p
    out_aval = eqn.outvars[0].aval
    out_spec = Spec.create(mesh, out_placements, out_aval.shape, out_aval.dtype)
    fn = local_equation(eqn.primitive, eqn.params, [key_spec(mesh, key_placements, kshape)], [out_spec])
    data = distribute(key_data, mesh, key_placements)

    def body(block):
        return block_of(fn(jax.random.wrap_key_data(local_of(block, data.spec)))[0])

    block = block_sharding(mesh).spec
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(block,), out_specs=block, check_vma=False))
    return DArray(run(data.block), out_spec), eqn


def truth(key_data, shape, dtype=jnp.uint32):
    keys = jax.random.wrap_key_data(np.asarray(key_data))
    if keys.shape:
        return np.asarray(jax.vmap(lambda one: jax.random.bits(one, shape, dtype))(keys))
    return np.asarray(jax.random.bits(keys, shape, dtype))


KEY = np.asarray(jax.random.key_data(jax.random.key(1234)))

CASES = [
    ((8,), (Shard(0),), (5, 3)),  # uneven: 5 rows over 8 devices, three of them empty
    ((8,), (Shard(1),), (4, 13)),
    ((2, 4), (Shard(0), Shard(1)), (5, 7)),
    ((2, 4), (Shard(1), Shard(1)), (3, 10)),  # two axes on one dim, uneven
    ((2, 4), (StridedShard(0, 2), Shard(0)), (9, 2)),
    ((2, 4), (Shard(1), StridedShard(1, 3)), (2, 11)),
    ((2, 2, 2), (Shard(2), Replicate(), Shard(0)), (3, 4, 5)),
    ((2, 2, 2), (Shard(0), Shard(0), Shard(0)), (7,)),
    ((2, 4), (R, R), (5, 3)),  # replicated: every device draws the whole shape, hashing as the sharded draws do
]


@pytest.mark.parametrize("mesh_shape, placements, shape", CASES)
def test_bits_local_equals_single_device_draw(mesh_shape, placements, shape):
    mesh = make_mesh(mesh_shape)
    out, _ = draw(mesh, KEY, (R,) * len(mesh_shape), placements, shape)
    check_darray(out, truth(KEY, shape))


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16])
def test_bits_narrow_widths(dtype):
    mesh = make_mesh((2, 4))
    out, eqn = draw(mesh, KEY, (R, R), (Shard(1), Shard(0)), (6, 5), dtype)
    assert eqn.params["bit_width"] == np.dtype(dtype).itemsize * 8
    check_darray(out, truth(KEY, (6, 5), dtype))


def test_bits_64_bit_width():
    with jax.enable_x64(True):
        mesh = make_mesh((8,))
        out, eqn = draw(mesh, KEY, (R,), (Shard(0),), (11, 2), jnp.uint64)
        assert eqn.params["bit_width"] == 64
        check_darray(out, truth(KEY, (11, 2), jnp.uint64))


def test_linear_index_beyond_32_bits():
    # a draw with more than 2**32 elements: each dim's share g_j * stride_j is split into 32-bit limbs and
    # summed with carries; compare with numpy's uint64 sums (no need to draw 2**33 numbers)
    from jshard.rules.random import linear_index

    rng = np.random.default_rng(0)
    shares = [rng.integers(2**31, 2**34, size=n, dtype=np.uint64) for n in (3, 4, 2)]
    shares[1][0] = 2**32 - 1  # low limbs that wrap when added
    shares[2][1] = 2**32 + 2**32 - 1
    limbs = [(jnp.asarray((s >> np.uint64(32)).astype(np.uint32)), jnp.asarray(s.astype(np.uint32)))  # (hi, lo)
             for s in shares]
    hi, lo = linear_index(limbs, (3, 4, 2))
    want = shares[0][:, None, None] + shares[1][None, :, None] + shares[2][None, None, :]
    got = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
    assert np.array_equal(got, want)



def test_threefry_written_out_equals_jax_hash():
    # jshard's elementwise hash against JAX's primitive: one key (scalar words) and a key per element
    from jax.extend.random import threefry2x32_p

    from jshard.rules.random import threefry2x32

    rng = np.random.default_rng(0)
    x0, x1, k0, k1 = (rng.integers(0, 2**32, (3, 7), dtype=np.uint64).astype(np.uint32) for _ in range(4))
    for keys in [(np.uint32(0), np.uint32(2**32 - 1)), (k0, k1)]:
        want = threefry2x32_p.bind(*keys, x0, x1)
        got = jax.jit(threefry2x32)(*keys, x0, x1)
        assert all(np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))

def test_batched_keys_sharded_with_their_draws():
    # 5 keys sharded on dp, each key's draw sharded on tp: both at once
    mesh = make_mesh((2, 4))
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5), 5)))
    out, _ = draw(mesh, keys, (Shard(0), R), (Shard(0), Shard(1)), (6,))
    check_darray(out, truth(keys, (6,)))


# -- selection ------------------------------------------------------------------------------------------


def test_select_keeps_a_replicated_key_replicated():
    mesh = make_mesh((2, 4))
    eqn = jax.make_jaxpr(lambda k: jax.random.bits(k, (8, 4)))(jax.random.key(0)).jaxpr.eqns[-1]
    c = select(eqn.primitive, eqn.params, [key_spec(mesh, (R, R))], [eqn.outvars[0].aval])
    assert c.outs[0].placements == (R, R) and c.cost == 0


def test_select_batched_keys_stay_sharded():
    mesh = make_mesh((2, 4))
    keys = jax.random.split(jax.random.key(0), 6)
    ks = key_spec(mesh, (Shard(0), R), (6,))
    fold = jax.make_jaxpr(jax.vmap(jax.random.fold_in))(keys, jnp.arange(6, dtype=jnp.uint32)).jaxpr.eqns[-1]
    msg = Spec.create(mesh, (Shard(0), R), (6,), np.uint32)
    c = select(fold.primitive, fold.params, [ks, msg], [fold.outvars[0].aval])
    assert c.cost == 0 and c.outs[0].placements == (Shard(0), R)
    bits = jax.make_jaxpr(jax.vmap(lambda k: jax.random.bits(k, (4,))))(keys).jaxpr.eqns[-1]
    c = select(bits.primitive, bits.params, [ks], [bits.outvars[0].aval])
    # the keys stay put; each key's draws stay whole over tp, where its keys are whole: a split made from whole
    # inputs is made where the consumers ask for it (a dropout mask on tp-replicated activations must not be
    # gathered back)
    assert c.cost == 0 and c.ins[0].placements == (Shard(0), R) and c.outs[0].placements == (Shard(0), R)
    # asked for, they split over tp at no cost: each device draws a quarter (test_batched_keys_sharded_with_their_draws
    # runs exactly this layout)
    split = Spec.create(mesh, (Shard(0), Shard(1)), (6, 4), np.uint32)
    c = select(bits.primitive, bits.params, [ks], [bits.outvars[0].aval], want=[split])
    assert c.cost == 0 and c.ins[0].placements == (Shard(0), R) and c.outs[0].placements == (Shard(0), Shard(1))


def test_key_primitives_never_take_partials():
    mesh = make_mesh((8,))
    keys = jax.random.split(jax.random.key(0), 8)
    eqn = jax.make_jaxpr(lambda k: jax.random.key_data(k))(keys).jaxpr.eqns[-1]
    c = select(eqn.primitive, eqn.params, [key_spec(mesh, (Shard(0),), (8,))], [eqn.outvars[0].aval])
    assert c.outs[0].placements == (Shard(0),) and c.cost == 0
    assert not any(isinstance(p, Partial) for p in c.outs[0].placements)
