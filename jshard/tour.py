"""A tour of the placement algebra on 8 devices (the first main job, before the engine landed).

Run ``python -m jshard.tour``. It builds an 8-device mesh (emulating 8 CPU devices when the machine has
fewer), distributes arrays, runs redistributions that show off the algebra (uneven shards, StridedShard,
Partial max, a multi-axis merge, a reduce-scatter) and prints, for each, the plan (collectives, mesh
axes, bytes) and a check against the original values. It exits non-zero if any check fails.
"""

from __future__ import annotations

import os
import sys


def _ensure_devices(n: int = 8) -> None:
    # must run before JAX initialises its backends; accelerators are left alone
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main() -> int:
    _ensure_devices()
    import jax
    import numpy as np

    import jshard
    from jshard import Partial, Replicate, Shard, StridedShard
    from jshard.validate.tolerance import is_close

    devices = jax.devices()
    if len(devices) < 8:
        devices = jax.devices("cpu")
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices[:8])
    cube = jax.make_mesh((2, 2, 2), ("x", "y", "z"), devices=devices[:8])
    rng = np.random.default_rng(0)
    print(f"jshard demo on {len(devices[:8])} {devices[0].platform} devices\n")

    failures = 0

    def show(title, x, placements, expect, parts=None):
        nonlocal failures
        plan = jshard.plan_redistribute(x, placements)
        y = x.redistribute(placements)
        got = np.asarray(y.full())
        # sums of parts may round differently from numpy's order (within the bound their size and number
        # give); everything else is bit-exact
        ok = np.array_equal(got, expect) if parts is None else is_close(got, expect, n=len(parts),
                                                                          terms=np.abs(parts).sum(0))
        failures += not ok
        print(f"== {title}")
        print(plan)
        print(f"   collectives: {plan.collective_count}, bytes per device: {plan.bytes}, "
              f"check against the original: {'OK' if ok else 'WRONG'}\n")
        return y

    # uneven shards: 6 rows and 10 columns over (2, 4) follow torch.chunk sizes
    g = rng.standard_normal((6, 10)).astype(np.float32)
    x = jshard.distribute(g, mesh, [Shard(0), Shard(1)])
    print(jshard.visualize(x), "\n")
    show("uneven: swap the sharded dims (S(0), S(1)) -> (S(1), S(0))", x, [Shard(1), Shard(0)], g)

    # a multi-axis merge: one all_gather over the tuple (dp, tp), one psum over (x, z)
    x = jshard.distribute(g, mesh, [Shard(0), Shard(0)])
    show("multi-axis merge: (S(0), S(0)) -> (R, R) is one all_gather", x, [Replicate(), Replicate()], g)
    parts = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(4)]
    # a Partial(sum) over x and z: 4 distinct parts, each replicated over y
    locals_ = [parts[2 * xi + zi] for xi in range(2) for _ in range(2) for zi in range(2)]
    p = jshard.from_local(locals_, cube, [Partial(), Replicate(), Partial()])
    y = show("Partial(sum) over two axes -> R: one psum over (x, z)", p, [Replicate()] * 3,
             np.sum(parts, axis=0), parts=parts)
    replicas = [np.asarray(a) for a in y.to_local()]
    print(f"   replicas bitwise equal: {all(np.array_equal(replicas[0], r) for r in replicas)}\n")

    # Partial max: each device holds a part, the value is the elementwise max
    winners = rng.integers(0, 8, size=(4, 6))
    value = rng.standard_normal((4, 6)).astype(np.float32)
    locals_ = [np.where(winners == i, value, value - rng.uniform(0.5, 2.0, (4, 6)).astype(np.float32))
               for i in range(8)]
    m = jshard.from_local(locals_, mesh, [Partial("max"), Partial("max")])
    show("Partial(max) -> (S(1), R): pmax, then each device keeps its columns", m, [Shard(1), Replicate()], value)

    # StridedShard: the layout FSDP gets when it shards inside tensor-parallel blocks
    w = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    s = jshard.distribute(w, mesh, [StridedShard(0, 4), Shard(0)])
    print(jshard.visualize(s), "\n")
    show("StridedShard(0, 4), Shard(0) -> R: one all_gather over (tp, dp), no reshuffle", s,
         [Replicate(), Replicate()], w)

    # Partial(sum) landing sharded: a reduce-scatter, never an all-reduce and a slice
    parts = [rng.standard_normal((8, 6)).astype(np.float32) for _ in range(8)]
    q = jshard.from_local(parts, mesh, [Partial(), Partial()])
    show("(P(sum), P(sum)) -> (S(0), S(0)): one psum_scatter over (dp, tp)", q, [Shard(0), Shard(0)],
         np.sum(parts, axis=0), parts=parts)

    print("all checks passed" if not failures else f"{failures} checks FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
