"""The notebooks as a Colab user sees them: they run top to bottom in a Jupyter kernel (their cells assert their
own claims against numpy / one device), their figures render inline, the committed notebooks hold the code
``notebooks/build.py`` writes together with its outputs, and the install cell installs jshard from where it
says it does."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HERE = os.path.join(ROOT, "notebooks")


def _build():
    spec = importlib.util.spec_from_file_location("notebook_build", os.path.join(HERE, "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build()
NAMES = list(build.NOTEBOOKS)


def _figure_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "plt.show()" in "".join(c["source"])]


def _images(cell: dict) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell["outputs"])


# the notebooks that take over a minute each on 2 cores run with -m slow (CI's budget): 04 trains context-parallel,
# pipelined and autoplanned GPTs, 05 mixtures of experts, 06 prices Llama 3 on some 25 clusters and searches two;
# 01-03 run by default, and every committed notebook is checked against build.py (with its outputs) below
SLOW = {"04_long_context_and_deep_models.ipynb", "05_mixture_of_experts.ipynb", "06_planning_a_cluster.ipynb"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in NAMES])
def test_notebook_runs_and_shows_its_figures(name, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # as in Jupyter and Colab: the kernel picks inline display
    ran = build.execute(build.notebook(build.NOTEBOOKS[name]))  # an error in any cell raises here
    text = "".join("".join(o.get("text", "")) for c in ran["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    assert "Traceback" not in text and "Error" not in text
    for cell in _figure_cells(ran):
        assert _images(cell) >= 1, f"{name}: a figure cell showed no image:\n{''.join(cell['source'])[:300]}"


def test_plots_are_where_the_notebooks_say():
    """Notebooks 02 to 06 plot (communication per style; memory and communication per plan; memory and step time
    against sequence length; routing and load per expert; predicted MFU and memory against chip count)."""
    plotted = {n for n in NAMES if _figure_cells(build.notebook(build.NOTEBOOKS[n]))}
    assert plotted == {"02_flax_tensor_parallel.ipynb", "03_large_models_and_checkpoints.ipynb",
                       "04_long_context_and_deep_models.ipynb", "05_mixture_of_experts.ipynb",
                       "06_planning_a_cluster.ipynb"}
    assert "matplotlib.use" not in open(os.path.join(HERE, "build.py")).read()  # no backend forced


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_what_build_writes_with_its_outputs(name):
    with open(os.path.join(HERE, name)) as f:
        committed = json.load(f)
    assert build.code_of(committed) == build.code_of(build.notebook(build.NOTEBOOKS[name])), \
        f"{name} differs from notebooks/build.py: run python notebooks/build.py"
    code = [c for c in committed["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), f"{name} was committed without running it"
    assert all(c["outputs"] for c in code if "print(" in "".join(c["source"])), f"{name}: a printing cell has no output"
    for cell in _figure_cells(committed):
        assert _images(cell) >= 1, f"{name}: the committed figure cell carries no image"
    assert build.main(["--check", name]) == 0


def test_every_notebook_opens_in_colab_from_the_readme_link():
    url = build.repository()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert f.read().count(url) == 1  # the one place that names the repository
    with open(os.path.join(HERE, "README.md")) as f:
        links = f.read()
    for name in NAMES:
        assert build.colab(name) in links, f"notebooks/README.md lacks the Colab link of {name}"
        nb = build.notebook(build.NOTEBOOKS[name])
        assert build.colab(name) in "".join(nb["cells"][0]["source"])  # the badge in its first cell
    assert re.fullmatch(r"https://colab\.research\.google\.com/github/[^/]+/[^/]+/blob/main/notebooks/\S+",
                        build.colab(NAMES[0]))


def _run_install_cell(monkeypatch, capsys, cwd, *, installed=False, succeeds=lambda source: True, env=None):
    """Run the install cell with pip replaced by a recorder; return (the pip requirements tried, printed text)."""
    tried = []

    def pip(cmd, **kwargs):
        assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
        tried.append(cmd[-1])
        ok = succeeds(cmd[-1])
        return types.SimpleNamespace(returncode=0 if ok else 1, stderr="" if ok else "ERROR: no such package")

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: real(n, *a) if installed or n != "jshard" else None)
    monkeypatch.setattr(subprocess, "run", pip)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("JSHARD_SOURCE", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    exec(compile(build.INSTALL, "install-cell", "exec"), {})
    return tried, capsys.readouterr().out


def test_install_cell_installs_from_the_clone_pypi_or_the_repository(monkeypatch, capsys, tmp_path):
    tried, out = _run_install_cell(monkeypatch, capsys, HERE, installed=True)
    assert tried == [] and "is installed" in out

    tried, out = _run_install_cell(monkeypatch, capsys, HERE)  # Jupyter in a clone: built from the clone
    assert tried == [ROOT] and f"pip install {ROOT}" in out

    tried, out = _run_install_cell(monkeypatch, capsys, tmp_path)  # Colab: PyPI first
    assert tried == ["jshard"] and "pip install jshard" in out

    git = f"git+{build.repository()}"  # not on PyPI: the repository named in the README
    tried, out = _run_install_cell(monkeypatch, capsys, tmp_path, succeeds=lambda s: s == git)
    assert tried == ["jshard", git] and "pip install jshard failed" in out
    assert f"installed jshard: pip install {git}" in out

    tried, _ = _run_install_cell(monkeypatch, capsys, tmp_path, env={"JSHARD_SOURCE": "/wheels/jshard.whl"})
    assert tried == ["/wheels/jshard.whl"]

    with pytest.raises(RuntimeError, match="JSHARD_SOURCE"):
        _run_install_cell(monkeypatch, capsys, tmp_path, succeeds=lambda s: False)


def test_the_package_builds_and_installs_from_the_repository(tmp_path):
    """What the install cell's clone and git sources do: pip builds jshard from this repository's files, and the
    installed package (every module, no source tree on the path) imports."""
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, "jshard"), src / "jshard", ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    modules = sorted(os.path.relpath(os.path.join(d, f), src).replace(os.sep, ".")[:-3]
                     for d, _, fs in os.walk(src / "jshard") for f in fs if f.endswith(".py"))
    installed = {os.path.relpath(os.path.join(d, f), site).replace(os.sep, ".")[:-3]
                 for d, _, fs in os.walk(site / "jshard") for f in fs if f.endswith(".py")}
    assert set(modules) <= installed, sorted(set(modules) - installed)
    check = ("import importlib, jshard, sys; assert jshard.__file__.startswith(sys.argv[1]), jshard.__file__; "
             f"[importlib.import_module(m) for m in {[m.removesuffix('.__init__') for m in modules]!r}]; print('ok')")
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", check, str(site)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
