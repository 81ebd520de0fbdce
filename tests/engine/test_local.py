"""``jshard.local``: every device reads its own row of a static table (``PerDevice``), and opaque constants
(``opaque_ints``), inside ``shard_map``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import make_mesh
from jshard.local import PerDevice, opaque_ints

SHAPE = (2, 2, 2)
NAMES = ("x", "y", "z")
COORDS = np.indices(SHAPE).reshape(3, *SHAPE, 1)


def read(table: np.ndarray):
    """Each device's ``PerDevice(table)()``, stacked in device order, and the program's StableHLO."""
    mesh = make_mesh(SHAPE)
    per = PerDevice(table, NAMES)
    fn = jax.jit(jax.shard_map(lambda: per()[None], mesh=mesh, in_specs=(), out_specs=P(NAMES), check_vma=False))
    return np.asarray(fn()), fn.lower().as_text()


TABLES = {
    "affine in two axes": (3 * COORDS[0] + 5 * COORDS[2] + np.array([0, 1, 2])).astype(np.int32),
    "negative steps": (7 - 2 * COORDS[1] + 0 * np.arange(2)).astype(np.int32),  # -1 rows (padding) included
    "not affine": ((COORDS[0] + 1) * (COORDS[1] + 2) + np.arange(3)).astype(np.int32),
    "uint32 counters": (np.uint32(2**32 - 3) + COORDS[2].astype(np.uint32) * np.uint32(2)),  # wraps past 2**32
    "one axis, int64": (np.arange(2)[None, None, :, None] * 10 + np.zeros(SHAPE + (2,), np.int64)),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_every_device_reads_its_row(name):
    table = TABLES[name]
    got, _ = read(table)
    want = table.reshape(8, -1)
    np.testing.assert_array_equal(got.reshape(8, -1), want.astype(got.dtype))


def test_affine_tables_are_arithmetic_not_lookups():
    _, text = read(TABLES["affine in two axes"])
    assert "dynamic_slice" not in text and "gather" not in text
    _, text = read(TABLES["not affine"])
    assert text.count("dynamic_slice") == 1  # one lookup into the flattened table, whatever the axes it varies on


def test_a_table_equal_on_every_device_is_a_constant():
    table = np.broadcast_to(np.array([4, 2], np.int32), SHAPE + (2,))
    per = PerDevice(table, NAMES)
    assert per.axes == () and per().tolist() == [4, 2]


def test_opaque_offsets_stay_runtime_values():
    # pieces cut out of one buffer at opaque offsets: right on every device, and XLA keeps each a dynamic slice
    # (a folded offset would make it a static slice, and each piece's kernel its own)
    mesh = make_mesh(SHAPE)
    sizes = [3, 5, 5, 1, 5]
    starts = np.cumsum([0] + sizes[:-1])

    def cut(x):
        offsets = opaque_ints(starts.tolist(), "y")
        return [jax.lax.dynamic_slice_in_dim(x[0], o, n, allow_negative_indices=False)[None] * 2
                for o, n in zip(offsets, sizes)]

    fn = jax.jit(jax.shard_map(cut, mesh=mesh, in_specs=P(NAMES), out_specs=P(NAMES), check_vma=False))
    x = jax.device_put(jnp.arange(8 * sum(sizes), dtype=jnp.float32).reshape(8, -1), NamedSharding(mesh, P(NAMES)))
    for piece, start, n in zip(fn(x), starts, sizes):
        np.testing.assert_array_equal(piece, 2 * np.asarray(x)[:, start:start + n])
    assert fn.lower(x).compile().as_text().count("dynamic-slice(") == len(sizes)
