"""Several JAX processes on one machine: the multi-controller mode of several hosts, for the demo and the tests.

Each process runs the same program on its own devices (``devices`` CPU devices each, emulated), joined through
``jax.distributed`` on a localhost coordinator with gloo CPU collectives. ``launch`` starts them and never waits
past its timeout: when one fails or time runs out, the others are killed (a process waiting on a dead peer's
collective would wait forever). ``join`` is the first thing each process does, before JAX touches a device.

>>> import sys
>>> launch(lambda i, port: [sys.executable, "-c", "print('ok')"], processes=2, devices=1, timeout=60)
[0, 0]
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

__all__ = ["environment", "free_port", "join", "launch", "log_tail"]


def launch(command: Callable[[int, int], Sequence[str]], *, processes: int = 2, devices: int = 4,
           timeout: float = 240, logs: Sequence[tuple[str, str]] | None = None,
           cwd: str | None = None) -> list[int | None]:
    """Run ``command(process_id, port)`` as ``processes`` processes of ``devices`` CPU devices each; their exit
    codes (None: killed at the timeout, or because a peer failed). ``logs`` gives each process's (stdout,
    stderr) file paths; a None path (or no ``logs``) inherits this process's stream."""
    port = free_port()
    procs = []
    deadline = time.monotonic() + timeout
    try:
        for i in range(processes):
            out, err = (None if p is None else open(p, "w") for p in (logs[i] if logs else (None, None)))
            try:
                procs.append(subprocess.Popen(list(command(i, port)), env=environment(i, devices), stdout=out,
                                              stderr=err, stdin=subprocess.DEVNULL, cwd=cwd))
            finally:
                for f in (out, err):
                    if f is not None:
                        f.close()
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break  # all done, or one failed: the others would wait on it for their collectives
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [p.returncode if p.returncode is not None and p.returncode >= 0 else None for p in procs]


def join(process_id: int, port: int, processes: int = 2) -> None:
    """Join the other processes (call it before anything touches JAX's devices). A peer that never starts fails
    this after 60 s; one that dies later makes the coordination service end this process (heartbeats)."""
    import jax

    # gloo: the CPU cross-process collectives (without them a cross-process program fails with "Multiprocess
    # computations aren't implemented on the CPU backend")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process_id, initialization_timeout=60, heartbeat_timeout_seconds=30,
                               shutdown_timeout_seconds=60)


def environment(process_id: int, devices: int) -> dict[str, str]:
    """This process's environment for process ``process_id`` of ``devices`` CPU devices. The hash seed differs
    per process: they must agree on every program without agreeing on set and dict order."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PYTHONHASHSEED"] = str(process_id + 1)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_tail(path: str, n: int = 3000) -> str:
    """The end of a process's log without gloo's connection chatter and C++ stack frames."""
    try:
        with open(path, errors="replace") as f:
            lines = [line for line in f if not line.startswith(("[Gloo]", "    @ "))]
    except OSError as e:
        return f"<{e}>"
    return "".join(lines)[-n:]


def free_port() -> int:
    """A TCP port free on localhost now (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
