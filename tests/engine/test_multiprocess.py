"""JAX's multi-controller mode: two processes of 4 CPU devices each on localhost, one 8-device mesh.

The test launches tests/multiprocess_worker.py twice with ``jshard.launch`` (process ids 0 and 1, a free
coordinator port, gloo CPU collectives, different hash seeds to catch set/dict-order dependence between the
processes). Each worker runs every check on meshes whose axes in turn cross the two processes: ``distribute``
(Shard, uneven Shard, Replicate, Partial), ``from_local`` and ``from_process_local`` (each process its own rows)
against independently computed local blocks, ``redistribute`` across placement kinds, sharded ``jax.Array``s
passed to and closed over by ``jshard.jit`` (on Auto and on Explicit mesh axes), DArrays read by plain JAX code
(``jax.tree``, ``jnp.sum``, ``jax.jit``; a pending sum and uneven splits among them), ``jshard.jit`` of an MLP and
its ``value_and_grad`` against float64 numpy, ``jshard.attention`` with the sequence sharded over an axis that
crosses the processes (ring, all-gather and all-to-all, causal and not, output and gradients against
``jax.nn.dot_product_attention``; and beside a batch axis that crosses them), and the demo's GPT initialised
sharded (bitwise the eager values) and trained 3 ``TrainStep``s, tensor-parallel, with scanned blocks (fsdp+tp),
as a Gemma-shaped model annotated for JAX's explicit sharding, context-parallel (the ring
crossing the processes) and pipelined (pp x dp x tp with one stage on each process: each holds only its own
stage's blocks, and the schedule's activations and input gradients pass between the processes), against one
device; checkpoints saved across the processes restore into other layouts and meshes, and the tensor-parallel and
pipelined runs resume from one under another layout (the pipelined one with its stages inside each process) with
the uninterrupted run's losses (the suite's floor share trains the autoplanned, pipelined and resumed GPTs, its
newest share the model patterns, the context-parallel one and the zero role with and without a pipeline; the
tensor-parallel GPT both). Here: both exit 0 within a hard timeout, every check passed, and the two processes
computed bitwise-equal losses, gradients and reduced values.

One launch of both workers does everything (a few seconds of compilation on each); the test never waits on a
worker past ``TIMEOUT``: when one fails or time runs out, both are killed and the failing one's stderr is shown.
"""

from __future__ import annotations

import json
import os
import sys
import time

from jshard.launch import launch, log_tail

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
TIMEOUT = 480  # seconds, for both workers together (about 60 on 2 idle cores before the pipelined checks; 280-320
# with them on 2 shared cores at a load of 11-12)
GROUPS = ("distribute", "from_local", "from_process_local", "jax_arrays_in", "jax_arrays_out", "redistribute",
          "jit_mlp", "attention", "gpt", "checkpoint")


def run_workers(tmp) -> tuple[list[int | None], list[str], list[dict | None], float]:
    """Launch both workers; return their exit codes (None: killed), stderr tails, result files and the wall time."""
    logs = [(str(tmp / f"worker{i}.out"), str(tmp / f"worker{i}.err")) for i in range(2)]
    t0 = time.monotonic()
    share = os.environ.get("JSHARD_SUITE") if os.environ.get("JSHARD_SUITE") in ("floor", "newest") else "all"
    codes = launch(lambda i, port: [sys.executable, WORKER, str(i), str(port), str(tmp / f"result{i}.json"), share],
                   processes=2, devices=4, timeout=TIMEOUT, logs=logs, cwd=ROOT)
    wall = time.monotonic() - t0
    results = []
    for i in range(2):
        try:
            with open(tmp / f"result{i}.json") as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            results.append(None)
    return codes, [log_tail(err) for _, err in logs], results, wall


def test_two_processes_of_four_cpu_devices(tmp_path):
    codes, stderr, results, wall = run_workers(tmp_path)
    problems = []
    for i, (code, err) in enumerate(zip(codes, stderr)):
        if code != 0:
            why = f"exit code {code}" if code is not None else "killed (timeout, or its peer failed)"
            done = "" if results[i] is None else f" after {len(results[i]['checks'])} checks"
            problems.append(f"worker {i}: {why}{done} ({wall:.0f} s); stderr tail:\n{err}")
    for i, r in enumerate(results):
        if r is None:
            problems.append(f"worker {i} wrote no result file")
            continue
        failed = {name: why for name, why in r["checks"].items() if why != "pass"}
        problems += [f"worker {i}: {name}: {why}" for name, why in sorted(failed.items())]
        groups = {name.split("/")[0] for name in r["checks"]}
        if r.get("done") and groups != set(GROUPS):
            problems.append(f"worker {i} ran check groups {sorted(groups)}, expected {sorted(GROUPS)}")
    if all(r is not None and r.get("done") for r in results):
        a, b = results
        if a["checks"].keys() != b["checks"].keys():
            problems.append(f"the workers ran different checks: {sorted(a['checks'].keys() ^ b['checks'].keys())}")
        for kind in ("losses", "digests"):
            for name in sorted(a[kind].keys() | b[kind].keys()):
                if a[kind].get(name) != b[kind].get(name):
                    problems.append(f"{kind} {name!r} differ between the processes: {a[kind].get(name)} vs "
                                    f"{b[kind].get(name)}")
        suite = os.environ.get("JSHARD_SUITE")  # the worker's SHARE: each GPT but one on one release
        pipelined = ("gpt_pp_across", "gpt_pp_within_resumed") if suite != "newest" else ()
        patterns = ("gpt_scanned", "gpt_explicit", "gpt_moe", "gpt_cp8_ring", "gpt_zero",
                    "gpt_zero_pp") if suite != "floor" else ()
        for name in ("mlp/2x4", "mlp/4x2", "mlp/8", "attention/cp8/ring", "attention/cp8/ring_causal", "gpt",
                     *patterns, *pipelined):
            if name not in a["losses"]:
                problems.append(f"no {name} loss recorded")
    assert not problems, "\n".join(problems)
