"""The quickstart notebook runs top to bottom."""

import os

import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}}).execute()
    outputs = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "matches the uncached forward" in outputs
