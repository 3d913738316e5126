"""`workbench bench launch`: wb.launch against accelerate.notebook_launcher running the equivalent function, both
measured in one run, and the verdict on the ratio of their medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.commands.bench.launch_latency import BUDGET, LaunchReport, launch_latency


def test_the_verdict_is_the_ratio_of_the_medians_against_ten_percent() -> None:
    report = LaunchReport(workbench_s=[1.0, 1.2, 1.1], notebook_launcher_s=[1.0, 1.05, 0.9])
    assert report.ratio == pytest.approx(1.1 / 1.0) and BUDGET == 1.10
    assert report.passed is (report.ratio <= 1.10)
    assert not LaunchReport(workbench_s=[1.3], notebook_launcher_s=[1.0]).passed
    assert "FAIL" in LaunchReport(workbench_s=[1.3], notebook_launcher_s=[1.0]).table()


@pytest.mark.slow
def test_both_sides_launch_two_ranks_and_are_timed_in_one_run(tmp_path: Path) -> None:
    report = launch_latency(pairs=2, cold_pairs=0, json_path=tmp_path / "launch.json")
    assert len(report.workbench_s) == len(report.notebook_launcher_s) == 2
    assert all(0 < t < 60 for t in report.workbench_s + report.notebook_launcher_s)
    saved = json.loads((tmp_path / "launch.json").read_text())
    assert saved["ratio"] == pytest.approx(report.ratio) and "notebook_launcher" in report.table()
