"""The user-facing notebooks: stored clean, with a parameters cell and what they are for first."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_your_own_model.ipynb", "03_precision_and_batch_size.ipynb"]


def outputs(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_clean_with_a_parameters_cell(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not outputs(nb) and all(c.get("execution_count") is None for c in code), "clear the outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "runs_dir = " in params[0].source
    assert nb.cells[0].cell_type == "markdown"  # what the notebook is for comes first


# Running each notebook headless (papermill) is tests/test_smoke_suite.py: the shipped suite runs all of them and
# checks their outputs, so they are not run a second time here.
