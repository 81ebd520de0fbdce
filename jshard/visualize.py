"""``visualize``: which device holds which global indices, as a text table, for any rank."""

from __future__ import annotations

import numpy as np

from .darray import DArray, index_runs
from .spec import Spec

__all__ = ["visualize"]


class _Text(str):
    """A str that shows itself as text in a REPL or notebook (no quotes, real newlines)."""

    def __repr__(self) -> str:
        return str(self)


def visualize(x) -> str:
    """A table of every device's coordinates, local shape and global index ranges per dim.

    Works for any rank and any placements (a strided shard shows several ranges); a Partial axis is
    named in the last column.

    >>> import jax, numpy as np; from jshard import distribute, Shard, Partial
    >>> x = distribute(np.zeros((10, 4)), jax.make_mesh((2, 4), ("dp", "tp")), [Shard(0), Partial()])
    >>> print(visualize(x).splitlines()[0])
    f32[10,4] (S(0), P(sum)) on mesh(dp=2, tp=4)
    """
    if isinstance(x, DArray):
        x._check_live("visualize")
        spec = x.spec
    elif isinstance(x, Spec):
        spec = x
    else:
        raise TypeError(f"visualize: takes a DArray (or a Spec), got {type(x).__name__}; build a DArray with "
                        "jshard.distribute(value, mesh, placements)")
    names = spec.mesh.axis_names
    partial = ", ".join(f"{p.op} over {n}" for n, p in zip(names, spec.placements, strict=True) if p.is_partial)
    header = ["device", *names, "local shape", *(f"dim {d}" for d in range(spec.rank))]
    rows = []
    for coords in np.ndindex(*spec.mesh_shape):
        device = spec.mesh.devices[coords]
        rows.append([str(device.id), *map(str, coords), str(spec.local_shape(coords)),
                     *map(_ranges, spec.global_indices(coords))])
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
    text = [str(spec), line(header), line(["-" * w for w in widths]), *map(line, rows)]
    if partial:
        text.append(f"pending reduction: {partial} (each device holds a part)")
    return _Text("\n".join(text))


def _ranges(idx: np.ndarray) -> str:
    """``0:3 8:11`` for the indices 0,1,2,8,9,10; ``-`` for none."""
    return " ".join(f"{a}:{b}" for a, b in index_runs(idx)) or "-"
