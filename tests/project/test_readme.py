"""The README's Python snippets run as written, in fresh processes: the one-GPU example first, alone, on the devices
there are (one CPU device where there is no accelerator: no XLA flag), then the rest one after another, in a
process that sets up its own 8 CPU devices, as the README tells a newcomer to."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the README's own lines set it, where they do


def snippets() -> tuple[list[str], list[str]]:
    """The snippets before the first that emulates 8 devices (the one-GPU example), and that one with the rest."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    first = next(i for i, b in enumerate(blocks) if "xla_force_host_platform_device_count" in b)
    return blocks[:first], blocks[first:]


def run(blocks: list[str]) -> str:
    done = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_one_gpu_example_trains_on_the_devices_there_are():
    one_device, _ = snippets()
    assert len(one_device) == 1
    losses = [float(line.split()[-1]) for line in run(one_device).splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_readme_snippets_run_as_written():
    _, eight_devices = snippets()
    assert len(eight_devices) >= 4
    assert "jshard plan on mesh(dp=2, tp=4)" in run(eight_devices)  # explain printed its table
