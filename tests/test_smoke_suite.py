"""The regression suite that ships: the repository's notebooks, headless, against the committed CPU baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO

from workbench.hardware import detect
from workbench.regress.runner import run as run_suite

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
