"""`workbench bench dashboard`: both arms run the same config side by side, pairs are matched however their order
alternated, and the cost is 1 - the median pair ratio (the speed target itself lives in the benchmark, not here)."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from workbench.cli import main
from workbench.commands.bench.dashboard_cost import BUDGET, ArmRun, DashboardReport, dashboard_cost
from workbench.utils.hardware import detect


def _report(rates: list[tuple[float, float]]) -> DashboardReport:
    """A report of (headless, dashboard) samples/s per pair, run in alternating order as the benchmark does."""
    report = DashboardReport(
        device="CPU (2 cores)", cores=2, steps=100, pairs=len(rates), interval_s=1.0
    )
    for i, (headless, dashboard) in enumerate(rates):
        arms = [("headless", headless), ("dashboard", dashboard)]
        for arm, rate in arms if i % 2 == 0 else arms[::-1]:
            report.runs.append(
                ArmRun(
                    i,
                    arm,
                    rate,
                    wall_s=10.0,
                    cpu_s=1.0 if arm == "dashboard" else 0.2,
                    figures=5 if arm == "dashboard" else 0,
                )
            )
    return report


def test_the_cost_is_one_minus_the_median_ratio_of_back_to_back_pairs() -> None:
    report = _report([(100.0, 99.0), (200.0, 150.0), (100.0, 98.0)])
    assert report.ratios == pytest.approx([0.99, 0.75, 0.98])  # matched by pair, B A order included
    assert report.cost == pytest.approx(0.02) and report.passed
    assert report.dashboard_cpu_s == pytest.approx(0.8)
    table = report.table()
    assert (
        "0.990, 0.750, 0.980" in table and "cost: 2.0% of throughput" in table and "PASS" in table
    )
    slow = _report([(100.0, 90.0), (100.0, 92.0)])
    assert (
        slow.cost == pytest.approx(0.09)
        and slow.cost > BUDGET
        and not slow.passed
        and "FAIL" in slow.table()
    )


def test_the_benchmark_runs_both_arms_of_one_config(tmp_path: Path) -> None:
    report = dashboard_cost(steps=40, pairs=1, json_path=tmp_path / "cost.json")
    assert [r.arm for r in report.runs] == ["headless", "dashboard"]
    assert all(r.samples_per_s > 0 for r in report.runs) and report.runs[0].figures == 0
    saved = json.loads((tmp_path / "cost.json").read_text())
    assert saved["ratios"] == pytest.approx(report.ratios) and saved["steps"] == 40
    stamp = saved["measured_on"]  # a result says where and when it was measured (bench/results.py)
    assert (
        stamp["cores"] == str(detect().cpu_count)
        and stamp["torch"] == torch.__version__
        and stamp["cpu"]
    )
    assert abs(datetime.datetime.fromisoformat(stamp["date"]).timestamp() - time.time()) < 600
    with pytest.raises(ValueError, match="pairs=0"):
        dashboard_cost(steps=40, pairs=0)


def test_the_command_line_parses_and_calls_the_benchmark(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    called: dict[str, object] = {}

    def fake(**kwargs: object) -> DashboardReport:
        called.update(kwargs)
        if kwargs["json_path"] is not None:
            Path(str(kwargs["json_path"])).parent.mkdir(parents=True, exist_ok=True)
            Path(str(kwargs["json_path"])).write_text("{}")
        return _report([(100.0, 99.0)])

    monkeypatch.setattr("workbench.commands.bench.dashboard_cost.dashboard_cost", fake)
    # no benchmarks/results here: no result file unless --json names one
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "dashboard", "--steps", "300", "--pairs", "2"]) == 0
    assert called == {"steps": 300, "pairs": 2, "json_path": None}
    assert "workbench bench dashboard" in capsys.readouterr().out


def test_a_bench_run_in_a_checkout_keeps_its_result_under_benchmarks_results(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workbench.commands.bench.results import machine_tag

    paths: list[object] = []
    monkeypatch.setattr(
        "workbench.commands.bench.dashboard_cost.dashboard_cost",
        lambda **kw: paths.append(kw["json_path"]) or _report([(100.0, 99.0)]),
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    assert main(["bench", "dashboard", "--pairs", "1"]) == 0
    today = datetime.date.today().isoformat()
    assert paths[-1] == Path("benchmarks/results/dashboard") / f"{today}-{machine_tag()}.json"
    assert machine_tag() == (f"cpu-{os.cpu_count()}cores" if not detect().gpus else machine_tag())
    assert main(["bench", "dashboard", "--pairs", "1", "--no-json"]) == 0 and paths[-1] is None
    assert main(["bench", "dashboard", "--pairs", "1", "--json", "mine.json"]) == 0 and paths[
        -1
    ] == Path("mine.json")


@pytest.mark.parametrize(
    ("argv", "folder"),
    [
        (["bench", "overhead"], "overhead"),
        (["bench", "overhead", "--mode", "zero3"], "overhead-zero3"),
        (["bench", "overhead", "--mode", "pp"], "overhead-pp"),
    ],
)
def test_each_overhead_mode_keeps_its_own_result_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str], folder: str
) -> None:
    """The four modes have budgets of their own: a zero3 run the same day doesn't replace the ddp
    result, and the benchmarks page shows each mode."""
    from workbench.commands.bench.results import machine_tag

    paths: list[object] = []
    monkeypatch.setattr(
        "workbench.commands.bench.overhead",
        lambda **kw: paths.append((kw["mode"], kw["json_path"])) or _report([(100.0, 99.0)]),
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    assert main(argv) == 0
    today = datetime.date.today().isoformat()
    mode = argv[-1] if "--mode" in argv else "ddp"
    assert paths == [(mode, Path("benchmarks/results") / folder / f"{today}-{machine_tag()}.json")]
    assert (
        f"<!-- generated: bench-results {folder} -->"
        in (REPO / "docs" / "benchmarks.md").read_text()
    )
