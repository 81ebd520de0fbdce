"""The notebooks run top to bottom (their cells assert their own claims against numpy / one device)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

HERE = os.path.join(os.path.dirname(__file__), "..", "notebooks")


@pytest.mark.parametrize("name", ["01_placements.ipynb", "02_flax_tensor_parallel.ipynb"])
def test_notebook_runs(name):
    nb = nbformat.read(os.path.join(HERE, name), as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Error" not in text
