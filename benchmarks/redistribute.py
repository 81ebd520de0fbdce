"""Redistribution benchmark: every (src, dst) pair, checked against the single-device value.

Per-axis placements are {R, S(d) for each dim, P(sum), P(avg), P(max)}. Configs: mesh (2,2,2) with f32
(16,16,16) and (6,10,3); mesh (2,4) with (16,24) and (6,10). For each config it reports the pairs, the
wrong results (every pair is executed on the devices and compared with the value on the host), the
collectives and per-device input bytes of the plans by kind, and the planning time per pair (uncached).

Then, on every pair XLA can express (Shard/Replicate placements, even shapes), it compares with XLA's own
resharding (``jax.jit`` of the identity with in/out shardings): collectives and received bytes read
from both compiled HLOs with the same parser, the information lower bound (per device, the bytes of the
destination block it does not already hold), and the runtime ratio jshard / XLA on a sample of pairs.

    python benchmarks/redistribute.py            # everything (about half an hour on 2 CPU cores)
    python benchmarks/redistribute.py --quick    # a few hundred pairs per config
    python benchmarks/redistribute.py --parts plans,xla   # no execution of the pairs

Writes ``benchmarks/results/redistribute.json``.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import jshard  # noqa: E402
from jshard import Partial, PlacementError, Replicate, Shard, Spec  # noqa: E402
from jshard.lowering import compile_plan, local_program  # noqa: E402
from jshard.placements import normalize_placements  # noqa: E402
from jshard.planner import plan_uncached  # noqa: E402
from jshard.spec import block_of, block_sharding, local_of  # noqa: E402

# bandwidth only: the plan that moves the fewest bytes, whatever the number of collectives
BYTES_FIRST = jshard.CostModel(launch_us=0.0, default=jshard.AxisCost(latency_us=0.0, bandwidth_gbps=19.3))
CONFIGS = [((2, 2, 2), (16, 16, 16)), ((2, 2, 2), (6, 10, 3)), ((2, 4), (16, 24)), ((2, 4), (6, 10))]
NAMES = {3: ("x", "y", "z"), 2: ("dp", "tp")}


def placement_set(mesh_ndim: int, rank: int) -> list[tuple]:
    per_axis = [Replicate(), *map(Shard, range(rank)), Partial("sum"), Partial("avg"), Partial("max")]
    out = []
    for p in itertools.product(per_axis, repeat=mesh_ndim):
        try:
            out.append(normalize_placements(p, mesh_ndim, rank))
        except PlacementError:
            pass
    return out


# ---------------------------------------------------------------------------------------------------
# sources with unequal Partial parts, and the host-side check


def source_locals(spec: Spec, value: np.ndarray, rng) -> list[np.ndarray]:
    """Per device, its local array; Partial axes hold unequal integer parts that reduce to the value."""
    axes = [a for a, p in enumerate(spec.placements) if p.is_partial]
    keys = list(itertools.product(*[range(spec.mesh_shape[a]) for a in axes]))
    ops = {spec.placements[a].op for a in axes}
    if not axes:
        parts = {(): value}
    elif ops <= {"sum", "avg"}:
        n_avg = math.prod(spec.mesh_shape[a] for a in axes if spec.placements[a].op == "avg")
        parts = {k: rng.integers(-9, 10, value.shape).astype(value.dtype) for k in keys[1:]}
        parts[keys[0]] = value * n_avg - sum(parts.values(), np.zeros_like(value))
    else:
        winner = rng.integers(0, len(keys), value.shape)
        parts = {k: np.where(winner == i, value, value - rng.integers(1, 5, value.shape)).astype(value.dtype)
                 for i, k in enumerate(keys)}
    return [parts[tuple(c[a] for a in axes)][np.ix_(*spec.global_indices(c))]
            for c in itertools.product(*map(range, spec.mesh_shape))]


def correct(block: np.ndarray, spec: Spec, value: np.ndarray) -> bool:
    axes = [a for a, p in enumerate(spec.placements) if p.is_partial]
    groups = collections.defaultdict(list)
    for c in itertools.product(*map(range, spec.mesh_shape)):
        local = block[c][tuple(slice(0, n) for n in spec.local_shape(c))]
        groups[tuple(x for a, x in enumerate(c) if a not in axes)].append((c, local))
    for members in groups.values():
        c0 = members[0][0]
        want = value[np.ix_(*spec.global_indices(c0))]
        locals_ = [m[1] for m in members]
        if not axes:
            got = locals_[0]
            if any(not np.array_equal(x, got) for x in locals_):
                return False
        elif spec.placements[axes[0]].op == "max":
            got = np.maximum.reduce(locals_)
        else:
            n_avg = math.prod(spec.mesh_shape[a] for a in axes if spec.placements[a].op == "avg")
            got = sum(locals_[1:], locals_[0].copy()) / n_avg
        if got.shape != want.shape or not np.array_equal(got, want):
            return False
    return True


# ---------------------------------------------------------------------------------------------------
# one config: plans, planning time, execution of every pair


def dtensor_accepts(src, dst) -> bool:
    """DTensor's public redistribute refuses any new Partial target (R/S -> P, P -> P')."""
    return all(q == p for p, q in zip(src, dst, strict=True) if q.is_partial)


def run_config(mesh_shape, shape, *, quick: bool, execute: bool, rng) -> dict:
    mesh = jax.make_mesh(mesh_shape, NAMES[len(mesh_shape)], devices=jax.devices()[:8])
    placements = placement_set(len(mesh_shape), len(shape))
    pairs = list(itertools.product(placements, placements))
    if quick:
        pairs = random.Random(0).sample(pairs, min(len(pairs), 400))
    value = rng.integers(-30, 30, shape).astype(np.float32)

    plan_us, kinds, nbytes = [], collections.Counter(), collections.Counter()
    subset = {"pairs": 0, "collectives": 0, "bytes": 0}
    plans = {}
    for src, dst in pairs:
        spec = Spec.create(mesh, src, shape, np.float32)
        t = time.perf_counter()
        plan = plan_uncached(spec, dst)
        plan_us.append((time.perf_counter() - t) * 1e6)
        plans[src, dst] = plan
        for s in plan.collectives:
            kinds[s.kind] += s.count
            nbytes[s.kind] += s.bytes
        if dtensor_accepts(src, dst):
            subset["pairs"] += 1
            subset["collectives"] += plan.collective_count
            subset["bytes"] += plan.bytes

    wrong, t0 = [], time.perf_counter()
    by_src = collections.defaultdict(list)
    for src, dst in pairs if execute else ():
        by_src[src].append(dst)
    block_spec = block_sharding(mesh).spec
    for n, (src, dsts) in enumerate(by_src.items()):
        spec = Spec.create(mesh, src, shape, np.float32)
        x = jshard.from_local(source_locals(spec, value, rng), mesh, src, shape=shape)
        runs = [local_program(plans[src, d]) for d in dsts]

        def body(b, runs=runs, spec=spec):
            return tuple(block_of(r(local_of(b, spec))) for r in runs)

        prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=block_spec, out_specs=block_spec, check_vma=False))
        for d, out in zip(dsts, prog(x.block), strict=True):
            dst = plans[src, d].dst
            if not correct(np.asarray(out).reshape(dst.mesh_shape + dst.local_block_shape), dst, value):
                wrong.append(f"{jshard.placements.format_placements(src)} -> {jshard.placements.format_placements(d)}")
        if n % 25 == 0:
            print(f"  {mesh_shape} {shape}: {n + 1}/{len(by_src)} sources, {len(wrong)} wrong, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {
        "mesh": list(mesh_shape), "shape": list(shape), "pairs": len(pairs), "wrong": len(wrong) if execute else None,
        "dtensor_accepted_subset": subset,
        "wrong_examples": wrong[:20], "collectives": sum(kinds.values()), "collectives_by_kind": dict(kinds),
        "bytes": sum(nbytes.values()), "bytes_by_kind": dict(nbytes),
        "planning_us_median": statistics.median(plan_us), "planning_us_p90": sorted(plan_us)[int(0.9 * len(plan_us))],
        "execution_s": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------------------------------------------
# XLA comparison from compiled HLO

_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\((.*)$")
_BITS = {"f32": 32, "f16": 16, "bf16": 16, "f64": 64, "s32": 32, "u32": 32, "s8": 8, "u8": 8, "pred": 8, "s64": 64}


def _type_bytes(text: str) -> int:
    return sum(_BITS[t] // 8 * math.prod(int(d) for d in dims.split(",") if d) for t, dims in
               re.findall(r"\b(f32|f16|bf16|f64|s32|u32|s8|u8|pred|s64)\[([\d,]*)\]", text))


def _group_size(attrs: str, devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    # jax 0.12 names the mesh and the axes of a group: replica_groups=mesh['pp'=2,'dp'=2] {'dp'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
    return devices


def hlo_traffic(hlo: str, devices: int = 8) -> tuple[collections.Counter, float]:
    """(collectives by kind, bytes a device receives) of a compiled per-device HLO program."""
    kinds, received = collections.Counter(), 0.0
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        out, kind, attrs = _type_bytes(m.group(1)), m.group(2), m.group(3)
        kinds[kind] += 1
        if kind == "collective-permute":
            pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=")[-1])
            received += out if any(a != b for a, b in pairs) else 0
            continue
        n = _group_size(attrs, devices)
        received += {"all-gather": out * (n - 1) / n, "reduce-scatter": out * (n - 1),
                     "all-reduce": out * 2 * (n - 1) / n, "all-to-all": out * (n - 1) / n}[kind]
    return kinds, received


def lower_bound(src: Spec, dst: Spec) -> int:
    worst = 0
    for c in itertools.product(*map(range, src.mesh_shape)):
        have, need = src.global_indices(c), dst.global_indices(c)
        common = math.prod(len(np.intersect1d(a, b)) for a, b in zip(have, need, strict=True))
        worst = max(worst, (math.prod(map(len, need)) - common) * dst.itemsize)
    return worst


def _median_time(fn, x, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def xla_compare(mesh_shape, shape, *, quick: bool, timing_pairs: int, reps: int) -> dict | None:
    names = NAMES[len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:8], axis_types=(AxisType.Auto,) * len(mesh_shape))
    specs = []
    for p in placement_set(len(mesh_shape), len(shape)):
        if any(q.is_partial for q in p):
            continue
        spec = Spec.create(mesh, p, shape, np.float32)
        try:
            spec.to_partition_spec()
        except jshard.LayoutError:
            return None  # uneven: XLA rejects the layout
        specs.append(spec)
    pairs = [(a, b) for a in specs for b in specs if a != b]
    if quick:
        pairs = random.Random(1).sample(pairs, min(len(pairs), 120))
    rows = []
    t0 = time.perf_counter()
    for n, (src, dst) in enumerate(pairs):
        src_sh, dst_sh = src.to_named_sharding(), dst.to_named_sharding()
        xla = jax.jit(lambda a: a, out_shardings=dst_sh).lower(
            jax.ShapeDtypeStruct(shape, np.float32, sharding=src_sh)).compile()
        block = jax.ShapeDtypeStruct(src.block_shape, np.float32, sharding=block_sharding(mesh))
        xk, xb = hlo_traffic(xla.as_text())
        row = {"src": str(src.placements), "dst": str(dst.placements), "xla_collectives": sum(xk.values()),
               "xla_bytes": xb, "lower_bound": lower_bound(src, dst), "xla_kinds": dict(xk)}
        for tag, model in (("jshard", None), ("bytes_first", BYTES_FIRST)):
            plan = jshard.plan_redistribute(src, dst.placements, cost_model=model)
            jk, jb = hlo_traffic(compile_plan(plan).lower(block).compile().as_text())
            row.update({f"{tag}_collectives": sum(jk.values()), f"{tag}_bytes": jb, f"{tag}_kinds": dict(jk),
                        f"{tag}_plan_collectives": plan.collective_count})
        rows.append(row)
        if n % 500 == 0:
            print(f"  xla {mesh_shape} {shape}: {n + 1}/{len(pairs)} pairs, {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    # runtime on a sample: both programs on device-resident inputs, alternating, median of reps
    ratios = []
    for i in random.Random(2).sample(range(len(pairs)), min(timing_pairs, len(pairs))):
        src, dst = pairs[i]
        value = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        g = jax.device_put(value, src.to_named_sharding())
        x = jshard.distribute(value, src.mesh, src.placements)
        xla = jax.jit(lambda a: a, out_shardings=dst.to_named_sharding())
        ours = compile_plan(jshard.plan_redistribute(src, dst.placements))
        jax.block_until_ready((xla(g), ours(x.block)))
        tx, tj = [], []
        for _ in range(3):
            tx.append(_median_time(xla, g, reps))
            tj.append(_median_time(ours, x.block, reps))
        ratios.append(min(tj) / min(tx))
    total = lambda k: sum(r[k] for r in rows)
    out = {"pairs": len(rows), "xla_bytes": total("xla_bytes"), "lower_bound": total("lower_bound"),
           "xla_collectives": total("xla_collectives"),
           "pairs_xla_above_bound": sum(r["xla_bytes"] > r["lower_bound"] + 1e-6 for r in rows),
           "runtime_ratio_median": statistics.median(ratios) if ratios else None,
           "runtime_ratio_p90": sorted(ratios)[int(0.9 * len(ratios))] if ratios else None,
           "runtime_pairs": len(ratios)}
    for tag in ("jshard", "bytes_first"):
        over = [r for r in rows if r[f"{tag}_bytes"] > r["xla_bytes"] + 1e-6]
        out.update({
            f"{tag}_bytes": total(f"{tag}_bytes"), f"{tag}_collectives": total(f"{tag}_collectives"),
            f"{tag}_pairs_more_bytes_than_xla": len(over),
            f"{tag}_pairs_above_bound": sum(r[f"{tag}_bytes"] > r["lower_bound"] + 1e-6 for r in rows),
            f"{tag}_hlo_matches_plan": sum(r[f"{tag}_collectives"] == r[f"{tag}_plan_collectives"] for r in rows),
            f"{tag}_worst_over": sorted(over, key=lambda r: r["xla_bytes"] - r[f"{tag}_bytes"])[:10],
        })
    return out


def plan_speed_6d(samples: int) -> dict:
    # planning never touches devices: a 64-device mesh can reuse one device
    devices = np.array(jax.devices()[:1] * 64).reshape((2,) * 6)
    mesh = jax.sharding.Mesh(devices, tuple("abcdef"))
    placements = placement_set(6, 3)
    rnd = random.Random(3)
    times = []
    for _ in range(samples):
        src, dst = rnd.choice(placements), rnd.choice(placements)
        spec = Spec.create(mesh, src, (16, 16, 16), np.float32)
        t = time.perf_counter()
        plan_uncached(spec, dst)
        times.append((time.perf_counter() - t) * 1e6)
    return {"mesh": [2] * 6, "shape": [16, 16, 16], "pairs": samples, "planning_us_median": statistics.median(times),
            "planning_us_p90": sorted(times)[int(0.9 * samples)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sample a few hundred pairs per config")
    ap.add_argument("--timing-pairs", type=int, default=200, help="pairs timed against XLA per config")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--parts", default="pairs,xla",
                    help="comma-separated: plans (plan statistics and planning time only), pairs (plans, and every "
                         "pair executed and checked), xla (the comparison with XLA)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "redistribute.json"))
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    rng = np.random.default_rng(0)
    result = {"jax": jax.__version__, "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
              "configs": [], "xla": [], "planning_6d": plan_speed_6d(300 if not args.quick else 100)}
    for mesh_shape, shape in CONFIGS if parts & {"plans", "pairs"} else ():
        print(f"config mesh {mesh_shape} f32{list(shape)}", file=sys.stderr, flush=True)
        result["configs"].append(run_config(mesh_shape, shape, quick=args.quick, execute="pairs" in parts, rng=rng))
    for mesh_shape, shape in CONFIGS if "xla" in parts else ():
        cmp = xla_compare(mesh_shape, shape, quick=args.quick, timing_pairs=args.timing_pairs, reps=args.reps)
        if cmp is not None:
            result["xla"].append({"mesh": list(mesh_shape), "shape": list(shape), **cmp})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print_tables(result)
    print(f"\nJSON: {args.out}")
    return 0


def print_tables(result: dict) -> None:
    print(f"\njshard redistribution ({result['devices']}, jax {result['jax']})")
    head = (f"{'mesh':<9} {'shape':<12} {'pairs':>7} {'wrong':>6} {'colls':>7} {'MB/dev in':>10} "
            f"{'plan µs med':>11} {'p90':>7}")
    print(head + "\n" + "-" * len(head))
    for c in result["configs"]:
        wrong = "-" if c["wrong"] is None else c["wrong"]
        print(f"{'x'.join(map(str, c['mesh'])):<9} {'x'.join(map(str, c['shape'])):<12} {c['pairs']:>7} {wrong:>6} "
              f"{c['collectives']:>7} {c['bytes'] / 1e6:>10.1f} {c['planning_us_median']:>11.0f} "
              f"{c['planning_us_p90']:>7.0f}")
        print(f"{'':<22}by kind: " + ", ".join(f"{k} {v} ({c['bytes_by_kind'][k] / 1e6:.1f} MB)"
                                             for k, v in sorted(c["collectives_by_kind"].items())))
        sub = c["dtensor_accepted_subset"]
        print(f"{'':<22}pairs DTensor's public API accepts (no new Partial target): {sub['pairs']}, "
              f"{sub['collectives']} collectives, {sub['bytes'] / 1e6:.1f} MB")
    p = result["planning_6d"]
    print(f"planning on mesh (2,)*6, f32[16,16,16]: median {p['planning_us_median']:.0f} µs, "
          f"p90 {p['planning_us_p90']:.0f} µs")
    print("\nvs XLA resharding (jit identity with in/out shardings) on the pairs XLA can express;")
    print("received bytes per device from both compiled HLOs; 'bytes-first' = jshard with a bandwidth-only cost model")
    head = (f"{'mesh':<9} {'shape':<12} {'pairs':>6} {'model':<12} {'bytes j/XLA':>11} {'j/bound':>8} {'XLA/bound':>9} "
            f"{'pairs j>XLA':>11} {'colls j/XLA':>13} {'HLO=plan':>8}")
    print(head + "\n" + "-" * len(head))
    for c in result["xla"]:
        for tag, label in (("jshard", "default"), ("bytes_first", "bytes-first")):
            mesh, shape = "x".join(map(str, c["mesh"])), "x".join(map(str, c["shape"]))
            print(f"{mesh:<9} {shape:<12} {c['pairs']:>6} {label:<12} "
                  f"{c[tag + '_bytes'] / c['xla_bytes']:>11.3f} {c[tag + '_bytes'] / c['lower_bound']:>8.3f} "
                  f"{c['xla_bytes'] / c['lower_bound']:>9.3f} {c[tag + '_pairs_more_bytes_than_xla']:>11} "
                  f"{c[tag + '_collectives']:>6}/{c['xla_collectives']:<6} {c[tag + '_hlo_matches_plan']:>8}")
    print("\nruntime jshard/XLA (default model, median over pairs of min-of-3 medians): " + ", ".join(
        f"{'x'.join(map(str, c['mesh']))} {'x'.join(map(str, c['shape']))}: {c['runtime_ratio_median']:.3f} "
        f"(p90 {c['runtime_ratio_p90']:.3f}, {c['runtime_pairs']} pairs)" for c in result["xla"]))


if __name__ == "__main__":
    sys.exit(main())
