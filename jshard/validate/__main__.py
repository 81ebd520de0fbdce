"""``python -m jshard.validate [--prim add,mul | --all] [--incorrect-only] [--show-repro]``.

Prints one row per primitive (correct / incorrect / missing placement combinations, seconds) and a total;
exits non-zero when any rule is incorrect. Runs on 8 emulated CPU devices unless JAX already has devices.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jshard.validate", description=__doc__.splitlines()[0])
    ap.add_argument("--prim", help="comma-separated primitive names (default with --all: every registered rule)")
    ap.add_argument("--all", action="store_true", help="every primitive that has a rule and samples")
    ap.add_argument("--incorrect-only", action="store_true", help="print only primitives with incorrect rules")
    ap.add_argument("--show-repro", action="store_true", help="print a reproduction for each incorrect/missing case")
    ap.add_argument("--show-missing", action="store_true", help="list the missing combinations")
    ap.add_argument("--sizes", default="2,3,4", help="1-D mesh sizes (default 2,3,4)")
    ap.add_argument("--max-combos", type=int, default=None, help="sample at most this many input combinations")
    ap.add_argument("--json", help="write the report as JSON to this file")
    args = ap.parse_args(argv)
    if not args.prim and not args.all:
        ap.error("give --prim NAMES or --all")

    import jax

    from .core import NOT_SAMPLED, collect, registered_with_samples, validate, without_samples

    if len(jax.devices()) < 4:
        jax.config.update("jax_platforms", "cpu")
    names = args.prim.split(",") if args.prim else None
    samples = collect(names)
    todo = names or registered_with_samples(samples)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rows, total = [], [0, 0, 0, 0.0]
    print(f"{'primitive':28} {'correct':>8} {'incorrect':>9} {'missing':>8} {'time':>8}")
    print("-" * 65)
    bad = 0
    for name in todo:
        if name not in samples:
            print(f"{name:28} (no samples)")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = validate(name, samples[name], sizes=sizes, max_combos=args.max_combos)
        bad += r.incorrect
        total = [total[0] + r.correct, total[1] + r.incorrect, total[2] + r.missing, total[3] + r.seconds]
        rows.append(dict(primitive=name, correct=r.correct, incorrect=r.incorrect, missing=r.missing,
                         seconds=round(r.seconds, 2), errors=r.errors,
                         incorrect_cases=[k for k, _ in r.incorrect_cases],
                         missing_cases=[k for k, _ in r.missing_cases]))
        if args.incorrect_only and not r.incorrect:
            continue
        print(f"{name:28} {r.correct:8d} {r.incorrect:9d} {r.missing:8d} {r.seconds:7.1f}s")
        for e in r.errors[:3]:
            print(f"    error: {e}")
        for key, repro in r.incorrect_cases:
            print(f"    INCORRECT {key[0]} -> {key[1]}")
            if args.show_repro:
                print("      " + repro.replace("\n", "\n      "))
        if args.show_missing or args.show_repro:
            for key, repro in r.missing_cases:
                print(f"    missing {key[0]} -> {key[1]}")
                if args.show_repro:
                    print("      " + repro.replace("\n", "\n      "))
    print("-" * 65)
    if not names:  # the rules --all leaves out, and why
        for name in sorted(NOT_SAMPLED):
            print(f"{name:28} (not sampled: {NOT_SAMPLED[name]})")
        for name in without_samples(samples):
            print(f"{name:28} (no samples: add a program to jshard/validate/samples)")
    print(f"{'total':28} {total[0]:8d} {total[1]:9d} {total[2]:8d} {total[3]:7.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(sizes=sizes, rows=rows, total=dict(correct=total[0], incorrect=total[1], missing=total[2],
                                                              seconds=total[3])), f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
