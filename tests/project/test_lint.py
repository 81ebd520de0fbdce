"""The code passes the linter configured in pyproject.toml (ruff: pycodestyle, pyflakes, import order)."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_ruff_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "jshard", "tests",
                          "benchmarks", "notebooks"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
