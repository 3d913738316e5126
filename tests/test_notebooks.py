"""The user-facing notebooks: saved with the outputs of a headless run (papermill) that read well, with a
parameters cell and what they are for first. The docs render these outputs, and a reader opening a notebook in
JupyterLab sees them before running anything."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def outputs(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]


def shown_text(nb: nbformat.NotebookNode) -> str:
    """What a reader sees: streams and the text/HTML of displays (tags stripped)."""
    parts = []
    for o in outputs(nb):
        parts.append(o.get("text", ""))
        for mime in ("text/plain", "text/html"):
            parts.append(re.sub(r"<[^>]+>", "", o.get("data", {}).get(mime, "")))
    return "\n".join(parts)


def test_the_gallery_has_at_least_eight_notebooks() -> None:
    assert len(NAMES) >= 8 and NAMES[0].startswith("01_")


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_saved_with_outputs_that_read_well(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert "papermill" not in nb.metadata, "saved without papermill's run metadata"
    code = [c for c in nb.cells if c.cell_type == "code"]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "runs_dir = " in params[0].source and code[0] is params[0]
    assert not [c for c in code if "injected-parameters" in c.metadata.get("tags", [])]
    assert nb.cells[0].cell_type == "markdown"  # what the notebook is for comes first
    # run top to bottom once: execution counts 1, 2, 3, ...
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        "save a fresh headless run"
    )
    assert outputs(nb), "saved with its outputs"
    assert not [o for o in outputs(nb) if o.output_type == "error"]
    text = shown_text(nb)
    for bad in ("Traceback", "estimating", "/tmp/", "[workbench] recorded", "[workbench metric]"):
        assert bad not in text, f"{name}: {bad!r} in its saved outputs"
