"""The regression suite that ships: the repository's notebooks, headless, against the committed CPU baselines."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

from workbench.regress.runner import run as run_suite
from workbench.utils.hardware import detect

pytestmark = pytest.mark.slow


def test_shipped_smoke_suite_passes_against_committed_baselines(tmp_path: Path) -> None:
    if detect().device_class != "cpu":
        pytest.skip("the committed baselines are for the 'cpu' device class")
    code = run_suite([REPO / "regress" / "smoke.yaml"], parameters={}, out=tmp_path, baselines=None,
                       update_baselines=False, junit=tmp_path / "junit.xml", profile="smoke")
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, json.dumps(results, indent=1)[:4000]
    assert (tmp_path / "report.html").stat().st_size > 10_000
    assert "<failure" not in (tmp_path / "junit.xml").read_text()
    for case in results["cases"]:  # every notebook ran headless (papermill) and kept what a reader needs
        for path in case["executed"]:
            outputs = [o for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"
                       for o in cell.get("outputs", [])]
            assert not [o for o in outputs if o.output_type == "error"], path
            assert any("image/png" in o.get("data", {}) for o in outputs), f"{path}: the final figure is missing"
            if case["case"] == "smoke.quickstart":  # opened later without a kernel: the panel as it ended
                panels = [o["data"]["text/html"] for o in outputs
                          if "wb-snapshot-panel" in o.get("data", {}).get("text/html", "")]
                assert len(panels) == 1 and "data-status='completed'" in panels[0], path
