"""Random programs: seeding, wrapping, splitting, folding in, and drawing bits from single and batched keys.

Programs take key data (uint32) and wrap it, so key arrays reach the sampled equations as values. Batched
keys (``vmap`` over split keys) are the only key inputs with a dim to shard; draws from one key are
checked for sharded outputs by the tests, which call the local function directly.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

_DATA = np.array([12345, 678], np.uint32)
_BATCH = np.array(jax.random.key_data(jax.random.split(jax.random.key(3), 5)))  # 5 keys: uneven on 2, 3, 4
_BATCH4 = _BATCH[:4]


def _key(d):
    return jax.random.wrap_key_data(d)


PROGRAMS = [
    (lambda s: jax.random.key_data(jax.random.key(s)), (np.uint32(42),)),
    (lambda s: jax.random.key_data(jax.random.PRNGKey(s)), (np.uint32(7),)),
    (lambda s: jax.random.key_data(jax.vmap(jax.random.key)(s)), (np.arange(5, dtype=np.uint32),)),
    (lambda d: jax.random.key_data(jax.random.split(_key(d), 3)), (_DATA,)),
    (lambda d: jax.random.key_data(jax.random.split(_key(d), (2, 3))), (_DATA,)),
    (lambda d: jax.random.key_data(jax.random.fold_in(_key(d), 3)), (_DATA,)),
    (lambda d, m: jax.random.key_data(jax.random.fold_in(_key(d), m)), (_DATA, np.uint32(9))),
    (lambda d: jax.random.key_data(jax.random.clone(_key(d))), (_DATA,)),
    (lambda d: jax.random.key_data(_key(d)), (_BATCH,)),
    (lambda d: jax.random.key_data(jax.vmap(lambda k: jax.random.split(k, 2))(_key(d))), (_BATCH,)),
    (lambda d, m: jax.random.key_data(jax.vmap(jax.random.fold_in)(_key(d), m)), (_BATCH, np.arange(5, dtype="u4"))),
    (lambda d, m: jax.random.key_data(jax.vmap(jax.random.fold_in)(_key(d), m)), (_BATCH4, np.arange(4, dtype="u4"))),
    (lambda d: jax.random.bits(_key(d), (5, 3)), (_DATA,)),
    (lambda d: jax.random.bits(_key(d), (4, 6), jnp.uint8), (_DATA,)),
    (lambda d: jax.random.bits(_key(d), (7,), jnp.uint16), (_DATA,)),
    (lambda d: jax.random.uniform(_key(d), (5, 3)), (_DATA,)),
    (lambda d: jax.random.normal(jax.random.fold_in(_key(d), 1), (4, 6)), (_DATA,)),
    (lambda d: jax.vmap(lambda k: jax.random.bits(k, (3,)))(_key(d)), (_BATCH,)),
    (lambda d: jax.vmap(lambda k: jax.random.bits(k, (2, 5), jnp.uint8))(_key(d)), (_BATCH4,)),
    (lambda d: jax.vmap(lambda k: jax.random.bernoulli(k, 0.3, (6,)))(_key(d)), (_BATCH,)),
    # the hash primitive itself, as a user may bind it: one key, the counters split in halves
    (lambda c: threefry_2x32((np.uint32(7), np.uint32(9)), c), (np.arange(10, dtype=np.uint32) * 3 + 1,)),
]
