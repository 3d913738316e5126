"""The regression suite that ships: the repository's notebooks, headless, against the committed CPU baselines.

One test per case, each notebook executed once. The shipped suite asks for `repeats: 3` (and notebook 03 times
every configuration `repeats` times itself) so that `workbench regress regress/smoke.yaml`, the scheduled run,
judges throughput on medians; repeating them here made one test take over 300 s on a busy 2-core machine.
These tests override both explicitly, to 1, and apply the suite's rules, throughput included, to that single
run: on CPU the suite fails throughput only on a collapse (below 15% of the baseline), which a busy machine
does not cause.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import nbformat
import pytest
from conftest import REPO

from workbench.regress.case_run import run_case
from workbench.regress.judging import PASSED
from workbench.regress.report import write_junit, write_report
from workbench.regress.suite import load_targets
from workbench.utils.hardware import detect

pytestmark = pytest.mark.slow

CASES = {case.name: case for case in load_targets([REPO / "regress" / "smoke.yaml"])}
RUN_ONCE = {"precision_and_batch_size": {"repeats": 1}}
"""Papermill parameters of the cases whose notebook repeats runs itself (its `repeats` parameter)."""


@pytest.mark.parametrize("name", sorted(CASES))
def test_shipped_smoke_case_passes_against_its_committed_baseline(
    tmp_path: Path, name: str
) -> None:
    if detect().device_class != "cpu":
        pytest.skip("the committed baselines are for the 'cpu' device class")
    case = dataclasses.replace(CASES[name], repeats=1)
    result = run_case(
        case,
        RUN_ONCE.get(name, {}),
        tmp_path,
        device_class="cpu",
        has_cuda=False,
        update_baselines=False,
    )
    write_report([result], tmp_path, device_class="cpu")
    write_junit([result], tmp_path / "junit.xml")
    [judged] = json.loads((tmp_path / "results.json").read_text())["cases"]
    assert result.status == PASSED, json.dumps(judged, indent=1)[:4000]
    assert any(m.name.endswith(".samples_per_s") and m.verdict == "pass" for m in result.metrics), (
        "the suite's throughput rule was applied"
    )
    assert (tmp_path / "report.html").stat().st_size > 10_000
    assert "<failure" not in (tmp_path / "junit.xml").read_text()
    [path] = result.notebooks  # ran headless (papermill), once, and kept what a reader needs
    outputs = [
        o
        for cell in nbformat.read(path, as_version=4).cells
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
    ]
    assert not [o for o in outputs if o.output_type == "error"], path
    assert any("image/png" in o.get("data", {}) for o in outputs), (
        f"{path}: the final figure is missing"
    )
    if name == "quickstart":  # opened later without a kernel: the panel as it ended
        panels = [
            o["data"]["text/html"]
            for o in outputs
            if "wb-snapshot-panel" in o.get("data", {}).get("text/html", "")
        ]
        assert len(panels) == 1 and "data-status='completed'" in panels[0], path
        # executed headless, the panel waited for its estimate: the saved snapshot has it, not "estimating..."
        shown = re.sub(r"<[^>]+>", "", panels[0])
        assert "estimating" not in shown and "Estimate on this machine" in shown, path
