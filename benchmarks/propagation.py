"""Strategy selection cost per equation (``jshard.propagate.select``), uncached and cached.

For a handful of equations taken from real jaxprs (a matmul, an add after a broadcast, a sum over a
dim, a cast of a Partial, a reshape, a softmax's reduce_max, an embedding gather) and meshes from 8 to
12 axes, time one ``select`` call: *uncached* clears every jshard cache first (memoised selections,
expanded rules, shard layouts) and builds fresh specs; *cached* repeats the same call. Prints a table
with DTensor's uncached figures on (2, 4) next to ours and writes JSON.

    python benchmarks/propagation.py [--reps 200] [--out benchmarks/results/propagation.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=64")  # planning only: no programs run

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jshard import (  # noqa: E402
    Partial,
    Replicate,
    Shard,
    Spec,
    clear_caches,  # noqa: E402
)
from jshard.propagate import select  # noqa: E402
from report import write_json  # noqa: E402

R = Replicate()

# PyTorch DTensor 2.13, uncached propagation on (2, 4), µs (docs/anchors.md)
DTENSOR_2x4 = {"matmul": 6010, "add+broadcast": 6354, "reduce_sum": 297, "astype(int32) of Partial": 1824,
               "reshape": 375, "softmax reduce_max": 273, "embedding gather": 2955}

MESHES = {
    "(8,)": (8,),
    "(2,4)": (2, 4),
    "(2,2,2)": (2, 2, 2),
    "(2,)*6": (2,) * 6,
    "12 axes, 9 of size 1": (2, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1),
}


def _eqn(fn, *args, prim: str):
    closed = jax.make_jaxpr(fn)(*args)
    stack = [closed.jaxpr]
    while stack:
        jaxpr = stack.pop()
        for e in jaxpr.eqns:
            if e.primitive.name == prim:
                return e
            stack += list(jax.extend.core.jaxprs_in_params(e.params))
    raise LookupError(prim)


def _cycle(pattern, mesh_shape):
    """Placements for a mesh: the pattern's entries in turn on the axes of size > 1, R elsewhere."""
    out, k = [], 0
    for n in mesh_shape:
        if n == 1:
            out.append(R)
        else:
            out.append(pattern[k % len(pattern)])
            k += 1
    return tuple(out)


def cases():
    f32 = jnp.float32
    x = jax.ShapeDtypeStruct((64, 128), f32)
    w = jax.ShapeDtypeStruct((128, 256), f32)
    h = jax.ShapeDtypeStruct((8, 64, 128), f32)
    b = jax.ShapeDtypeStruct((128,), f32)
    ids = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    table = jax.ShapeDtypeStruct((1024, 128), f32)
    return [
        # name, equation, input placement patterns (cycled over mesh axes)
        ("matmul", _eqn(lambda a, c: a @ c, x, w, prim="dot_general"), [[Shard(0), Shard(1)], [R, Shard(0)]]),
        ("add+broadcast", _eqn(lambda a, c: a + c, h, b, prim="add"), [[Shard(0), Shard(2)], [R, Shard(2)]]),
        ("reduce_sum", _eqn(lambda a: a.sum(1), h, prim="reduce_sum"), [[Shard(0), Shard(1)]]),
        ("astype(int32) of Partial", _eqn(lambda a: a.astype(jnp.int32), h, prim="convert_element_type"),
         [[Shard(0), Partial()]]),
        ("reshape", _eqn(lambda a: a.reshape(8, 64, 4, 32), h, prim="reshape"), [[Shard(0), Shard(1)]]),
        ("softmax reduce_max", _eqn(lambda a: jax.nn.softmax(a, axis=-1), h, prim="reduce_max"),
         [[Shard(0), Shard(1)]]),
        ("embedding gather", _eqn(lambda t, i: t[i], table, ids, prim="gather"), [[R, Shard(1)], [Shard(0), R]]),
    ]


def _specs(mesh, eqn, patterns):
    return [Spec(mesh, _cycle(p, mesh.devices.shape), tuple(v.aval.shape), np.dtype(v.aval.dtype))
            for v, p in zip(eqn.invars, patterns + [[R]] * (len(eqn.invars) - len(patterns)), strict=True)]


def _time(fn, reps):
    ts = []
    for _ in range(reps):
        prep = fn()
        t0 = time.perf_counter()
        prep()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def measure(reps: int):
    rows = []
    for mname, mshape in MESHES.items():
        devices = np.array(jax.devices()[:int(np.prod(mshape))]).reshape(mshape)
        mesh = Mesh(devices, tuple(f"a{i}" for i in range(len(mshape))))
        for name, eqn, patterns in cases():
            out_avals = [v.aval for v in eqn.outvars]
            consts = [v.val if isinstance(v, jax.extend.core.Literal) else None for v in eqn.invars]
            params = eqn.params

            def uncached():
                clear_caches()
                specs = _specs(mesh, eqn, patterns)  # fresh specs: no layout cached on them
                return lambda: select(eqn.primitive, params, specs, out_avals, consts=consts)

            specs = _specs(mesh, eqn, patterns)
            choice = select(eqn.primitive, params, specs, out_avals, consts=consts)

            def cached():
                return lambda: select(eqn.primitive, params, specs, out_avals, consts=consts)

            rows.append(dict(mesh=mname, op=name, uncached_us=_time(uncached, reps), cached_us=_time(cached, reps * 5),
                             strategy=str(choice), cost_us=round(choice.cost, 2)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/propagation.json")
    args = ap.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = measure(args.reps)
    print(f"{'op':26} " + " ".join(f"{m:>22}" for m in MESHES) + f" {'DTensor (2,4)':>14} {'ratio (2,4)':>12}")
    for op in dict.fromkeys(r["op"] for r in rows):
        cells = {r["mesh"]: r for r in rows if r["op"] == op}
        line = f"{op:26} " + " ".join(f"{cells[m]['uncached_us']:9.1f} / {cells[m]['cached_us']:6.2f} µs"
                                      for m in MESHES)
        ours = cells["(2,4)"]["uncached_us"]
        print(line + f" {DTENSOR_2x4[op]:>11} µs {DTENSOR_2x4[op] / ours:>10.0f}x")
    print("(uncached / cached median; ratio = DTensor uncached / jshard uncached)")
    print("\nchosen strategies on (2,4):")
    for r in rows:
        if r["mesh"] == "(2,4)":
            print(f"  {r['op']:26} {r['strategy']}")
    write_json(args.out, rows=rows, dtensor_2x4_us=DTENSOR_2x4)


if __name__ == "__main__":
    main()
