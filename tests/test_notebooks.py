"""The user-facing notebooks: stored clean, and each one runs headless under papermill and keeps its figure."""

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


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_headless(name: str, tmp_path: Path) -> None:
    papermill = pytest.importorskip("papermill")
    out = tmp_path / name
    # The shipped smoke suite runs every notebook on its own defaults; here 03 runs shorter (2 repeats).
    quick = {"repeats": 2, "max_steps": 40} if name.startswith("03_") else {}
    papermill.execute_notebook(str(NOTEBOOKS / name), str(out), parameters={"runs_dir": str(tmp_path / "runs"), **quick},
                               kernel_name="python3", cwd=str(tmp_path), progress_bar=False,
                               execution_timeout=240)
    nb = nbformat.read(out, as_version=4)
    errors = [o for o in outputs(nb) if o.output_type == "error"]
    assert not errors, "\n".join(f"{e.ename}: {e.evalue}" for e in errors)
    assert any("image/png" in o.get("data", {}) for o in outputs(nb)), "the final figure is missing"
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert runs, "the runs_dir parameter was not used"
    if name.startswith("01_"):  # opened later without a kernel: the panel as it ended, not 'VBox(children=...)'
        panels = [o["data"]["text/html"] for o in outputs(nb) if "wb-snapshot-panel" in o.get("data", {}).get("text/html", "")]
        assert len(panels) == 1 and "data-status='completed'" in panels[0], panels
