"""The work XLA's threads do during one call, from a ``jax.profiler`` trace: a step-time measure that few cores
do not blur.

On a machine with fewer cores than emulated devices, wall time mostly says how the devices' threads shared the
cores. The profiler records every thunk each XLA thread runs; summing their self times (an event's time minus
the events nested in it) by kind gives the work a step costs, whatever the scheduling: ``compute_ms`` (fusions,
dots, copies), ``collective_ms`` (the collectives' own time), ``wait_ms`` (threads blocked on a rendezvous or
on each other) and ``wall_ms`` (first to last event).

    work = xla_work(lambda: float(step(*batch)))
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from collections.abc import Callable

import jax

# thunk names of collectives: HLO op names (GSPMD's programs) and JAX primitive names (shard_map programs)
COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|psum|psum_scatter|"
                        r"reduce_scatter|all_gather|all_to_all|ppermute|pmax|pmin)\b")
WAITING = re.compile(r"^(Wait|Rendezvous|InvokeRendezvous|SlinkyThreadPool|ThunkExecutor)")


def xla_work(call: Callable[[], object]) -> dict[str, float]:
    """Run ``call`` once under the profiler; milliseconds of compute, collectives and waiting on XLA's threads,
    and the wall time they span."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            call()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    own: collections.Counter = collections.Counter()
    first, last = float("inf"), 0.0
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # XLA's compute threads (tf_XLAEigen, ...); not Python's
                continue
            stack: list[tuple[float, str]] = []  # (end, name) of the events enclosing the current one
            for start, end, name in sorted(((e.start_ns, e.end_ns, e.name) for e in line.events),
                                           key=lambda t: (t[0], -t[1])):
                first, last = min(first, start), max(last, end)
                while stack and stack[-1][0] <= start:
                    stack.pop()
                if stack:
                    own[stack[-1][1]] -= end - start
                own[name] += end - start
                stack.append((end, name))
    kinds = collections.Counter()
    for name, ns in own.items():
        kinds["collective" if COLLECTIVE.match(name) else "wait" if WAITING.match(name) else "compute"] += ns
    return {"compute_ms": kinds["compute"] / 1e6, "collective_ms": kinds["collective"] / 1e6,
            "wait_ms": kinds["wait"] / 1e6, "wall_ms": (last - first) / 1e6 if last else 0.0}
