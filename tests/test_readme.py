"""The README's Python snippets run as written, one after another, in a fresh process (which must set up its
own 8 CPU devices, as the README tells a newcomer to)."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_readme_snippets_run_as_written():
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 4
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the README's first lines set it
    run = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "jshard plan on mesh(dp=2, tp=4)" in run.stdout  # explain printed its table
