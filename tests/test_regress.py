"""workbench regress: recording metrics, comparison rules, suites, papermill execution, reports, JUnit, CLI.

Notebook-executing tests start a real python3 kernel (2-3 s each), so they share few, tiny fixture notebooks
from tests/fixtures/notebooks/, named after what they do; none of them trains.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import nbformat
import pytest
import yaml
from collected_ids import cases

import workbench
import workbench.regress.recording as rec
import workbench.utils.kernel
from workbench.launcher.result import RunResult
from workbench.regress.baselines import baseline_path, load_baseline
from workbench.regress.judging import compare
from workbench.regress.rules import DEFAULT_REL, Rule, median, parse_rule
from workbench.regress.runner import run as run_suite
from workbench.regress.suite import Case, load_targets, parse_parameters, select_profile
from workbench.utils.hardware import Hardware

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "notebooks"


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> Hardware:
    """The same device class ('cpu') on every machine, so baselines written by tests are found by them."""
    hw = Hardware(cpu_count=2)
    monkeypatch.setattr("workbench.utils.hardware.detect", lambda: hw)
    return hw


def write_suite(directory: Path, cases: list[dict[str, Any]], **top: Any) -> Path:
    path = directory / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "t", **top, "cases": cases}, sort_keys=False))
    return path


def fixture(name: str, relative_to: Path) -> str:
    """A fixture notebook's path relative to the suite file, as suites are written."""
    return os.path.relpath(FIXTURES / f"{name}.ipynb", relative_to)


def write_baseline(baselines: Path, case_id: str, metrics: dict[str, float]) -> Path:
    path = baselines / "cpu" / f"{case_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metrics": {k: {"value": v} for k, v in metrics.items()}}))
    return path


def junit_cases(path: Path) -> dict[str, ET.Element]:
    return {tc.get("name"): tc for tc in ET.parse(path).getroot().iter("testcase")}


# ---- comparison rules ----------------------------------------------------------------------------
def test_throughput_fails_only_on_a_drop_beyond_tolerance() -> None:
    rule = Rule("higher_is_better", rel=0.5)
    assert rule.check(40.0, 100.0) == ("fail", "drop 60 (-60.0%) > allowed 50")
    assert rule.check(55.0, 100.0)[0] == "pass"
    verdict, reason = rule.check(300.0, 100.0)  # faster never fails, however much
    assert verdict == "pass" and "better" in reason


def test_memory_fails_only_on_a_rise_beyond_tolerance() -> None:
    rule = Rule("lower_is_better", rel=0.5)
    assert rule.check(160.0, 100.0) == ("fail", "rise 60 (+60.0%) > allowed 50")
    assert rule.check(140.0, 100.0)[0] == "pass"
    assert rule.check(10.0, 100.0)[0] == "pass"


def test_two_sided_exact_and_info_rules() -> None:
    # on the boundary, despite 1.1 - 1.0 > 0.1 in floats
    assert Rule("abs", abs=0.1).check(1.1, 1.0)[0] == "pass"
    assert Rule("abs", abs=0.1).check(0.85, 1.0) == ("fail", "changed 0.15 (-15.0%) > allowed 0.1")
    assert Rule("rel", rel=0.05).check(1.06, 1.0)[0] == "fail"
    assert Rule("rel", rel=0.05).check(0.96, 1.0)[0] == "pass"
    assert Rule("exact").check(10, 10) == ("pass", "equal")
    assert Rule("exact").check(11, 10) == ("fail", "11 != 10")
    assert Rule("info").check(1e9, 1.0) == ("info", "reported only")
    # directional: the larger allowance
    assert Rule("lower_is_better", abs=0.01, rel=0.1).allowance(1.0) == 0.1


def test_a_diverged_value_fails_every_rule_but_info() -> None:
    for rule in (
        Rule("abs", abs=10.0),
        Rule("lower_is_better", rel=1.0),
        Rule("higher_is_better", rel=1.0),
    ):
        verdict, reason = rule.check(math.nan, 1.0)
        assert verdict == "fail" and "diverged" in reason
    assert Rule("info").check(math.nan, 1.0)[0] == "info"


def test_repeats_are_compared_by_their_median() -> None:
    assert median([100.0, 10.0, 105.0]) == 100.0
    assert math.isnan(median([1.0, math.nan, 1.0]))  # one diverged repeat is not an outlier
    case = Case(
        id="t.c",
        suite="t",
        name="c",
        notebook=FIXTURES / "records_metric.ipynb",
        baselines=Path("."),
        tolerances=({"*samples_per_s": {"mode": "higher_is_better", "rel": 0.5}},),
    )
    # one slow outlier: a single run would fail
    runs = [
        rec.Records(metrics={"samples_per_s": rec.RecordedMetric("samples_per_s", v, "higher")})
        for v in (100.0, 10.0, 105.0)
    ]
    [result] = compare(case, runs, {"metrics": {"samples_per_s": {"value": 100.0}}})
    assert (result.verdict, result.current, result.values) == ("pass", 100.0, [100.0, 10.0, 105.0])
    assert result.reason.startswith("median of 3:")
    assert result.rule_source == "suite '*samples_per_s'"


def test_missing_metric_fails_and_new_metric_does_not() -> None:
    case = Case(
        id="t.c",
        suite="t",
        name="c",
        notebook=FIXTURES / "records_metric.ipynb",
        baselines=Path("."),
    )
    runs = [rec.Records(metrics={"fresh": rec.RecordedMetric("fresh", 1.0)})]
    results = {m.name: m for m in compare(case, runs, {"metrics": {"gone": {"value": 2.0}}})}
    assert (results["fresh"].verdict, results["fresh"].failed) == ("new", False)
    assert (results["gone"].verdict, results["gone"].failed) == ("missing", True)


def test_rule_precedence_suite_then_notebook_then_default() -> None:
    case = Case(
        id="t.c",
        suite="t",
        name="c",
        notebook=FIXTURES / "records_metric.ipynb",
        baselines=Path("."),
        tolerances=(
            {"run.final_loss": {"mode": "abs", "abs": 0.01}},
            {"*.final_loss": {"rel": 0.5}},
        ),
    )
    assert case.rule_for("run.final_loss", "lower", {"abs": 1}) == (
        Rule("abs", abs=0.01),
        "suite 'run.final_loss'",
    )
    # A suite spec without a mode takes the metric's direction: one-sided.
    assert case.rule_for("run1.final_loss", "lower") == (
        Rule("lower_is_better", rel=0.5),
        "suite '*.final_loss'",
    )
    assert case.rule_for("val", None, {"abs": 0.2}) == (Rule("abs", abs=0.2), "notebook")
    assert case.rule_for("val", "higher") == (Rule("higher_is_better", rel=DEFAULT_REL), "default")


def test_device_class_tolerances_beat_the_others_on_that_class_only() -> None:
    case = Case(
        id="t.c",
        suite="t",
        name="c",
        notebook=FIXTURES / "records_metric.ipynb",
        baselines=Path("."),
        tolerances=({"*.samples_per_s": {"rel": 0.4}},),
        device_tolerances=(
            {"cuda-*": {"run.samples_per_s": {"rel": 0.1}}, "cpu": {"*_per_s": "info"}},
        ),
    )
    assert case.rule_for("run.samples_per_s", "higher", device_class="cpu") == (
        Rule("info"),
        "suite '*_per_s' on cpu",
    )
    assert case.rule_for("run.samples_per_s", "higher", device_class="cuda-H100") == (
        Rule("higher_is_better", rel=0.1),
        "suite 'run.samples_per_s' on cuda-*",
    )
    assert case.rule_for("run.samples_per_s", "higher", device_class="rocm-MI300X")[0] == Rule(
        "higher_is_better", rel=0.4
    )
    runs = [
        rec.Records(
            metrics={"run.samples_per_s": rec.RecordedMetric("run.samples_per_s", 10.0, "higher")}
        )
    ]
    [on_cpu] = compare(case, runs, {"metrics": {"run.samples_per_s": {"value": 100.0}}}, "cpu")
    [on_gpu] = compare(
        case, runs, {"metrics": {"run.samples_per_s": {"value": 100.0}}}, "cuda-A100"
    )
    assert (on_cpu.verdict, on_gpu.verdict) == ("info", "fail")


@pytest.mark.parametrize(
    ("spec", "direction", "message"),
    cases(
        [
            ({"tol": 0.1}, None, r"unknown key 'tol'; allowed: mode, abs, rel"),
            ({"mode": "absolute", "abs": 0.1}, None, r"mode='absolute' \(did you mean 'abs'\?\)"),
            ({"abs": 0.1, "rel": 0.1}, None, r"both abs and rel but no mode"),
            ({"mode": "higher_is_better"}, None, r"mode='higher_is_better' needs abs and/or rel"),
            ({"mode": "abs", "rel": 0.1}, None, r"mode='abs' takes exactly 'abs'"),
            ({"rel": -0.1}, "lower", r"rel=-0.1: must be a number >= 0"),
            ({"mode": "info", "abs": 1}, None, r"mode='info' takes no abs/rel"),
            ([0.1], None, r"use a mapping such as"),
        ]
    ),
)
def test_invalid_tolerances_are_rejected(spec: Any, direction: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rule(spec, direction)


# ---- suites and parameters -----------------------------------------------------------------------
def test_suite_cases_merge_defaults_and_resolve_paths(tmp_path: Path) -> None:
    suite = write_suite(
        tmp_path,
        [
            {
                "notebook": fixture("records_metric", tmp_path),
                "parameters": {"value": 2.0},
                "repeats": 3,
            },
            {
                "notebook": fixture("raises_error", tmp_path),
                "name": "boom",
                "profile": ["smoke", "full"],
            },
        ],
        defaults={
            "profile": "full",
            "timeout_s": 60,
            "parameters": {"value": 1.0, "other": 1},
            "tolerances": {"*": "info"},
        },
    )
    first, second = load_targets([suite])
    assert (first.id, first.notebook, first.parameters) == (
        "t.records_metric",
        FIXTURES / "records_metric.ipynb",
        {"value": 2.0, "other": 1},
    )
    assert (first.repeats, first.timeout_s, first.profiles, first.baselines) == (
        3,
        60.0,
        ("full",),
        tmp_path / "baselines",
    )
    assert (second.id, second.profiles) == ("t.boom", ("smoke", "full"))
    assert [c.id for c in select_profile([first, second], "smoke")] == ["t.boom"]
    with pytest.raises(
        ValueError,
        match=r"--profile 'nightly': no case has it; profiles in these suites: full, "
        r"smoke",
    ):
        select_profile([first, second], "nightly")


@pytest.mark.parametrize(
    ("case", "top", "message"),
    [
        (
            {"notebook": "NB", "timout_s": 5},
            {},
            r"cases\[0\]: unknown key 'timout_s' \(did you mean 'timeout_s'\?\)",
        ),
        (
            {"notebook": "missing.ipynb"},
            {},
            r"cases\[0\]: notebook 'missing.ipynb' not found \(looked for .*missing",
        ),
        ({"name": "x"}, {}, r"cases\[0\]: missing 'notebook'"),
        ({"notebook": "NB", "repeats": 0}, {}, r"repeats=0: use a whole number >= 1"),
        ({"notebook": "NB", "needs_gpu": "yes"}, {}, r"needs_gpu='yes': use true or false"),
        (
            {"notebook": "NB", "tolerances": {"x": {"mode": "rell"}}},
            {},
            r"tolerances\['x'\]: mode='rell'",
        ),
        (
            {"notebook": "NB", "device_tolerances": {"cpu": {"x": {"abs": "1"}}}},
            {},
            r"device_tolerances\['cpu'\]\['x'\]",
        ),
        (
            {"notebook": "NB", "device_tolerances": ["cpu"]},
            {},
            r"device_tolerances=\['cpu'\]: use a mapping of device class",
        ),
        (
            {"notebook": "NB"},
            {"baseline": "b"},
            r"unknown key 'baseline' \(did you mean 'baselines'\?\)",
        ),
        ({"notebook": "NB"}, {"defaults": {"notebook": "x"}}, r"defaults: unknown key 'notebook'"),
    ],
    ids=[
        "typo-in-case",
        "missing-notebook",
        "no-notebook-key",
        "zero-repeats",
        "needs_gpu-not-bool",
        "bad-tolerance-mode",
        "bad-device-tolerance",
        "device_tolerances-a-list",
        "typo-in-suite",
        "notebook-in-defaults",
    ],
)
def test_invalid_suites_fail_before_anything_runs(
    tmp_path: Path, case: dict[str, Any], top: dict[str, Any], message: str
) -> None:
    if case.get("notebook") == "NB":
        case["notebook"] = fixture("records_metric", tmp_path)
    suite = write_suite(tmp_path, [case], **top)
    out = tmp_path / "report"
    with pytest.raises(ValueError, match=message):
        run_suite(
            [suite],
            parameters={},
            out=out,
            baselines=None,
            update_baselines=False,
            junit=None,
            profile=None,
        )
    assert not out.exists()


def test_targets_must_exist_and_ids_be_unique(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope.ipynb: no such file"):
        load_targets([tmp_path / "nope.ipynb"])
    nb = FIXTURES / "records_metric.ipynb"
    with pytest.raises(ValueError, match=r"case id 'records_metric' appears twice"):
        load_targets([nb, nb])


def test_cli_parameters_are_read_like_papermill() -> None:
    got = parse_parameters(
        {
            "value": "1.5",
            "lr": "1e-3",
            "steps": "20",
            "name": "abc",
            "flag": "true",
            "sizes": "[1, 2]",
        }
    )
    assert got == {
        "value": 1.5,
        "lr": 0.001,
        "steps": 20,
        "name": "abc",
        "flag": True,
        "sizes": [1, 2],
    }
    with pytest.raises(ValueError, match=r"-p max-steps 5: parameter names are Python identifiers"):
        parse_parameters({"max-steps": "5"})


def test_shipped_smoke_suite_is_valid() -> None:
    suite = REPO / "regress" / "smoke.yaml"
    cases = load_targets([suite])  # raises if a notebook is missing
    # CI runs it as its own step (.ci/run)
    gallery = load_targets([REPO / "regress" / "gallery.yaml"])
    # every notebook is in one suite or the other, with its committed CPU baseline
    assert sorted(c.notebook.name for c in [*cases, *gallery]) == sorted(
        p.name for p in (REPO / "notebooks").glob("*.ipynb")
    )
    for case in gallery:
        assert load_baseline(baseline_path(case, "cpu")) is not None, case.id
    assert "regress/gallery.yaml" in (REPO / ".ci" / "run").read_text()
    assert {c.profiles for c in cases} == {("smoke",)}
    rule, _ = cases[0].rule_for("run.samples_per_s", "higher")
    assert rule == Rule("higher_is_better", rel=0.6)
    assert cases[0].rule_for("run.samples_per_s", "higher", device_class="cuda-H100")[0] == rule
    assert cases[0].rule_for("run.samples_per_s", "higher", device_class="cpu") == (
        Rule("higher_is_better", rel=0.85),
        "suite '*.samples_per_s' on cpu",
    )
    assert cases[0].rule_for("run.final_loss", "lower", device_class="cpu")[0] == Rule(
        "abs", abs=0.05
    )
    for case in cases:  # CPU baselines are committed for every case, and readable
        baseline = load_baseline(baseline_path(case, "cpu"))
        assert baseline is not None and any(
            k.endswith(".final_loss") for k in baseline["metrics"]
        ), case.id


# ---- recording -----------------------------------------------------------------------------------
class _FakeKernelShell:
    kernel = object()


@pytest.fixture
def fake_kernel(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Pretend to be inside a Jupyter kernel; collect what would be displayed."""
    shown: list[dict[str, Any]] = []
    monkeypatch.setattr(workbench.utils.kernel, "kernel_shell", lambda: _FakeKernelShell())
    monkeypatch.setattr(rec, "_display", shown.append)
    monkeypatch.setattr(rec, "_prefix_counts", {})
    monkeypatch.setattr(rec, "_run_names", {})
    return shown


def fake_result(run_dir: Path, loss: float) -> RunResult:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "status": "completed",
                "final_loss": loss,
                "samples_per_s": 50.0,
                "tokens_per_s": None,
                "peak_memory_bytes": 2**20,
                "wall_time_s": 1.0,
                "eval_accuracy": 0.5,
                "eval_perplexity": 3.0,
            }
        )
    )
    (run_dir / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 1, "eval_loss": 1.9}\n'
        f'{{"step": 2, "loss": {loss}}}\n'
    )
    return RunResult(run_dir)


def test_record_run_names_runs_in_launch_order_and_reads_back(
    tmp_path: Path, fake_kernel: list[dict[str, Any]]
) -> None:
    first, second = fake_result(tmp_path / "a", 1.0), fake_result(tmp_path / "b", math.nan)
    assert rec.record_run(first) == "run"
    assert rec.record_run(second) == "run1"
    assert rec.record_run(first) == "run"  # a second wait() on the same run records nothing new
    assert rec.record_run(first, prefix="fp32") == "fp32"
    metrics = [
        m["name"]
        for b in fake_kernel
        if rec.METRIC_MIME in b
        for m in b[rec.METRIC_MIME].get("metrics", [b[rec.METRIC_MIME]])
    ]
    # tokens_per_s is None: left out
    assert metrics[:6] == [
        "run.final_loss",
        "run.eval_accuracy",
        "run.samples_per_s",
        "run.peak_memory_bytes",
        "run.wall_time_s",
        "run.eval_perplexity",
    ]
    assert len(metrics) == 18
    assert not any("text/plain" in b for b in fake_kernel), (
        "a saved notebook prints no raw record lines"
    )
    summaries = [b for b in fake_kernel if rec.METRIC_MIME in b]
    assert len(summaries) == 3, "one output per recorded run, not one per metric"
    assert summaries[0][rec.METRIC_MIME]["text"].startswith("recorded run: final_loss = 1")
    # Read back from a notebook holding these outputs, as an executed notebook would.
    outputs = [nbformat.v4.new_output("display_data", data=b) for b in fake_kernel]
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("wb.launch(cfg)", outputs=outputs)]
    )
    found = rec.read_records(nbformat.reads(nbformat.writes(nb), as_version=4))
    assert found.metrics["run.final_loss"] == rec.RecordedMetric(
        "run.final_loss", 1.0, "lower", {"mode": "abs", "abs": 0.05}, None
    )
    assert math.isnan(found.metrics["run1.final_loss"].value)  # NaN survives JSON as a string
    assert found.metrics["run.peak_memory_bytes"].unit == "bytes"
    # eval rows are not part of the train curve
    assert found.curves["run.loss"] == [[1, 2.0], [2, 1.0]]


def test_record_outside_a_kernel_is_a_quiet_no_op(tmp_path: Path) -> None:
    assert rec.record_run(fake_result(tmp_path / "a", 1.0)) is None
    workbench.record("val_loss", 1.0, direction="lower")
    # still the function after workbench.regress.recording was imported
    workbench.record("val_loss", 2.0)
    rec.record_curve("loss", [[1, 2.0]])


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("val_loss", "1.0"), {}, r"record\('val_loss', '1.0'\): value must be a number"),
        (("val loss", 1.0), {}, r"name='val loss': use letters, digits"),
        (("val_loss", 1.0), {"direction": "up"}, r"direction='up': use 'higher', 'lower' or None"),
        (
            ("val_loss", 1.0),
            {"tolerance": {"absolute": 0.1}},
            r"record\('val_loss'\) tolerance: unknown key 'absolute'",
        ),
    ],
    ids=["value-a-string", "name-with-space", "bad-direction", "bad-tolerance-key"],
)
def test_record_rejects_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        workbench.record(*args, **kwargs)


# ---- executing notebooks (a real kernel each) ----------------------------------------------------
@pytest.mark.slow
def test_metric_past_tolerance_fails_the_suite_and_one_inside_passes(tmp_path: Path) -> None:
    nb = fixture("records_metric", tmp_path)
    suite = write_suite(
        tmp_path,
        [
            {"notebook": nb, "name": "inside", "parameters": {"value": 1.05}},
            {"notebook": nb, "name": "outside", "parameters": {"value": 1.5}},
            {"notebook": nb, "name": "gpu_only", "needs_gpu": True},
        ],
    )
    for case in ("t.inside", "t.outside"):
        write_baseline(tmp_path / "baselines", case, {"val_loss": 1.0, "steps": 10})
    out, junit = tmp_path / "report", tmp_path / "junit.xml"
    code = run_suite(
        [suite],
        parameters={},
        out=out,
        baselines=None,
        update_baselines=False,
        junit=junit,
        profile=None,
    )
    assert code == 1
    cases = junit_cases(junit)
    assert cases["inside"].find("failure") is None and cases["inside"].find("error") is None
    failure = cases["outside"].find("failure")
    assert failure is not None and failure.get("message") == "1 metric(s) regressed: val_loss"
    assert "rise 0.5 (+50.0%) > allowed 0.1" in failure.text
    assert cases["gpu_only"].find("skipped").get("message").startswith("skipped: needs_gpu")
    page = (out / "report.html").read_text()
    assert "<td>val_loss</td>" in page and "<td>steps</td>" in page
    assert (
        "lower_is_better (notebook)" in page
        and 'href="cases/t.outside/records_metric.ipynb"' in page
    )
    results = {c["case"]: c for c in json.loads((out / "results.json").read_text())["cases"]}
    assert {k: v["status"] for k, v in results.items()} == {
        "t.inside": "passed",
        "t.outside": "failed",
        "t.gpu_only": "skipped",
    }
    assert (out / "cases" / "t.inside" / "records_metric.ipynb").is_file()


@pytest.mark.slow
def test_errors_and_timeouts_are_reported_and_the_suite_goes_on(tmp_path: Path) -> None:
    suite = write_suite(
        tmp_path,
        [
            {"notebook": fixture("raises_error", tmp_path)},
            {"notebook": fixture("sleeps_past_timeout", tmp_path), "timeout_s": 2},
            {"notebook": fixture("kills_kernel", tmp_path)},
            {"notebook": fixture("records_metric", tmp_path)},
        ],
    )
    out, junit = tmp_path / "report", tmp_path / "junit.xml"
    code = run_suite(
        [suite],
        parameters={},
        out=out,
        baselines=None,
        update_baselines=False,
        junit=junit,
        profile=None,
    )
    assert code == 2
    results = {c["case"]: c for c in json.loads((out / "results.json").read_text())["cases"]}
    error = results["t.raises_error"]["error"]
    assert (error["kind"], error["ename"], error["evalue"]) == (
        "exception",
        "ValueError",
        "deliberate failure, x=1",
    )
    assert "raise ValueError" in error["cell_source"] and "check(x)" in error["traceback"]
    assert "\x1b[" not in error["traceback"]
    timeout = results["t.sleeps_past_timeout"]["error"]
    assert timeout["kind"] == "timeout" and "timeout_s=2 s" in timeout["message"]
    assert timeout["cell_source"] == "import time\n\ntime.sleep(seconds)"
    assert results["t.kills_kernel"]["error"]["kind"] == "dead kernel"
    # ran after the failures; no baseline is not a failure
    assert results["t.records_metric"]["status"] == "new"
    assert any("--update-baselines" in n for n in results["t.records_metric"]["notes"])
    for case in results.values():
        assert all(Path(p).is_file() for p in case["executed"])  # every executed notebook is kept
    page = (out / "report.html").read_text()
    assert (
        "deliberate failure, x=1" in page and "time.sleep(seconds)" in page and "\x1b" not in page
    )
    cases = junit_cases(junit)
    assert [n for n, tc in cases.items() if tc.find("error") is not None] == [
        "raises_error",
        "sleeps_past_timeout",
        "kills_kernel",
    ]
    assert cases["raises_error"].find("error").get("type") == "ValueError"


@pytest.mark.slow
def test_the_kernel_prints_no_warning_or_zmq_traceback_and_case_errors_still_show(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel's stderr is this process's: ipykernel's TCP warning came at every kernel start, and a kernel
    asked to shut down while still inside a timed-out cell logged a ZMQError traceback."""
    from workbench.cli import main

    suite = write_suite(
        tmp_path,
        [
            {"notebook": fixture("sleeps_past_timeout", tmp_path), "timeout_s": 2},
            {"notebook": fixture("raises_error", tmp_path)},
        ],
    )
    caplog.set_level(logging.INFO, logger="workbench")
    code = main(["regress", str(suite), "--out", str(tmp_path / "report")])
    output = capfd.readouterr()
    assert code == 2
    # This process's stderr also carries whatever an earlier test left running writes there, so it is searched
    # for the two texts themselves; the suite's own log must hold no traceback at all.
    for text in (output.err, output.out, caplog.text):
        assert "without encryption" not in text and "ZMQError" not in text, text
    assert "Traceback" not in caplog.text, caplog.text
    assert (
        "t.sleeps_past_timeout: ERROR (timeout) timed out: the notebook ran longer than timeout_s=2 s"
        in caplog.text
    )
    assert "t.raises_error: ERROR (exception) ValueError: deliberate failure, x=1" in caplog.text


@pytest.mark.slow
def test_update_baselines_then_rerun_passes_with_curves_in_the_report(tmp_path: Path) -> None:
    nb, baselines = FIXTURES / "records_run_summary.ipynb", tmp_path / "baselines"
    first = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "regress",
            str(nb),
            "--out",
            str(tmp_path / "r1"),
            "--baselines",
            str(baselines),
            "--update-baselines",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    [written] = baselines.glob("*/records_run_summary.json")
    stored = json.loads(written.read_text())
    assert stored["metrics"]["run1.final_loss"] == {
        "value": 0.1,
        "direction": "lower",
        "unit": None,
    }
    assert stored["curves"]["run.loss"][:2] == [[1, 2.0], [2, 1.0]]
    assert "[1, 2.0]" in written.read_text()  # one curve point per line: reviewable diffs
    from workbench.cli import main

    out = tmp_path / "r2"
    args = [
        "regress",
        str(nb),
        "--out",
        str(out),
        "--baselines",
        str(baselines),
        "--junit",
        str(out / "j.xml"),
    ]
    assert main(args) == 0
    page = (out / "report.html").read_text()
    assert "<td>run.final_loss</td>" in page and "<td>run1.samples_per_s</td>" in page
    assert '<img alt="loss curves of records_run_summary" src="data:image/png;base64,' in page
    assert (out / "cases" / "records_run_summary" / "curves.png").is_file()
    assert "![loss curves](cases/records_run_summary/curves.png)" in (out / "report.md").read_text()


@pytest.mark.slow
def test_command_line_parameter_overrides_and_fails_the_run(tmp_path: Path) -> None:
    from workbench.cli import main

    write_baseline(tmp_path / "baselines", "records_metric", {"val_loss": 1.0, "steps": 10})
    out = tmp_path / "report"
    code = main(
        [
            "regress",
            str(FIXTURES / "records_metric.ipynb"),
            "-p",
            "value",
            "1.25",
            "--out",
            str(out),
            "--baselines",
            str(tmp_path / "baselines"),
        ]
    )
    assert code == 1
    [case] = json.loads((out / "results.json").read_text())["cases"]
    assert case["parameters"] == {"value": 1.25}
    assert {m["name"]: m["current"] for m in case["metrics"]} == {"steps": 10, "val_loss": 1.25}


MALFORMED_BASELINES = [  # (file text, what the error must say is wrong)
    ("null", r"holds JSON null, not a JSON object"),
    ('"val_loss: 1.0"', r"holds a JSON string, not a JSON object"),
    ('[{"metrics": {"val_loss": {"value": 1.0}}}]', r"holds a JSON list, not a JSON object"),
    ("{}", r"no 'metrics' \(its keys: none\)"),
    ('{"case": "t.c", "curves": {}}', r"no 'metrics' \(its keys: case, curves\)"),
    ("{'metrics': {}}", r"not valid JSON \(line 1, column 2"),
    ("", r"empty; expected \{'metrics'"),
    ('{"metrics": [1.0]}', r"'metrics' is \[1.0\], not a mapping"),
    ('{"metrics": {"val_loss": 1.0}}', r"metrics\['val_loss'\] is 1.0, not \{'value'"),
    (
        '{"metrics": {"val_loss": {"value": null}}}',
        r"metrics\['val_loss'\].value=None: must be a number",
    ),
    (
        '{"metrics": {"steps": {"value": 10}}, "curves": {"loss": [[1, "low"]]}}',
        r"curves\['loss'\] is \[\[1, \"low\"\]\]: use a list of",
    ),
    ('{"metrics": {}}', r"'metrics' is empty: a baseline compares at least one metric"),
    (
        '{"metrics": {"val_loss": {"value": 1.0, "value": 50.0}}}',
        (
            r"key 'value' is written twice in metrics\['val_loss'\] \(first 1.0, then 50.0\); JSON would silently keep "
            r"the last, so write each key once"
        ),
    ),
    (
        '{"metrics": {"val_loss": {"value": 1.0}}, "metrics": {"val_loss": {"value": 50.0}}}',
        r"key 'metrics' is written twice in the top-level object \(first",
    ),
]


@pytest.mark.parametrize(
    ("text", "problem"),
    MALFORMED_BASELINES,
    ids=[
        "null",
        "string",
        "list",
        "empty-mapping",
        "no-metrics",
        "not-json",
        "empty-file",
        "metrics-list",
        "metric-no-value",
        "value-null",
        "curve-text",
        "metrics-empty",
        "duplicate-value",
        "duplicate-metrics",
    ],
)
def test_a_malformed_baseline_is_a_value_error_naming_the_file_and_the_problem(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "cpu" / "t.c.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(
        ValueError, match=rf"^baseline {re.escape(str(path))}: .*{problem}.*--update-baselines"
    ):
        load_baseline(path)


@pytest.mark.slow
def test_malformed_baselines_are_their_cases_errors_and_the_other_cases_run(tmp_path: Path) -> None:
    nb = fixture("records_metric", tmp_path)
    bad = {f"bad{i}": text for i, (text, _) in enumerate(MALFORMED_BASELINES)}
    suite = write_suite(
        tmp_path,
        [{"notebook": nb, "name": name} for name in bad] + [{"notebook": nb, "name": "good"}],
    )
    paths = {}
    for name, text in bad.items():
        paths[name] = write_baseline(tmp_path / "baselines", f"t.{name}", {})
        paths[name].write_text(text)
    write_baseline(tmp_path / "baselines", "t.good", {"val_loss": 1.0, "steps": 10})
    out, junit = tmp_path / "report", tmp_path / "junit.xml"
    code = run_suite(
        [suite],
        parameters={},
        out=out,
        baselines=None,
        update_baselines=False,
        junit=junit,
        profile=None,
    )
    assert code == 2, "a baseline that can't be used means 'could not run', not 'regression'"
    results = {c["case"]: c for c in json.loads((out / "results.json").read_text())["cases"]}
    assert results["t.good"]["status"] == "passed" and results["t.good"]["executed"]
    cases = junit_cases(junit)
    assert cases["good"].find("error") is None and cases["good"].find("failure") is None
    page = (out / "report.md").read_text()
    for (name, path), (_, problem) in zip(paths.items(), MALFORMED_BASELINES):
        error = results[f"t.{name}"]["error"]
        assert results[f"t.{name}"]["status"] == "error" and error["kind"] == "bad baseline", name
        assert re.search(rf"^baseline {re.escape(str(path))}: .*{problem}", error["message"]), (
            error["message"]
        )
        assert results[f"t.{name}"]["executed"] == [] and not (out / "cases" / f"t.{name}").exists()
        xml_error = cases[name].find("error")
        assert xml_error is not None and xml_error.get("type") == "bad baseline", name
        assert xml_error.get("message").startswith(f"bad baseline: baseline {path}: "), name
        assert f"**bad baseline**: baseline {path}: " in page
    assert ET.parse(junit).getroot().get("errors") == str(len(bad))


@pytest.mark.slow
def test_update_baselines_rewrites_a_malformed_baseline(tmp_path: Path) -> None:
    suite = write_suite(tmp_path, [{"notebook": fixture("records_metric", tmp_path)}])
    path = write_baseline(tmp_path / "baselines", "t.records_metric", {})
    path.write_text("null")
    code = run_suite(
        [suite],
        parameters={},
        out=tmp_path / "report",
        baselines=None,
        update_baselines=True,
        junit=None,
        profile=None,
    )
    assert code == 0
    assert load_baseline(path)["metrics"]["val_loss"]["value"] == 1.0
    [case] = json.loads((tmp_path / "report" / "results.json").read_text())["cases"]
    assert case["status"] == "updated" and any("holds JSON null" in n for n in case["notes"])


@pytest.mark.slow
def test_update_baselines_of_a_notebook_that_records_nothing_writes_no_empty_baseline(
    tmp_path: Path,
) -> None:
    nb = nbformat.read(FIXTURES / "records_metric.ipynb", as_version=4)
    # runs, records nothing
    nb.cells = [cell for cell in nb.cells if "wb.record" not in cell.source]
    nbformat.write(nb, tmp_path / "records_nothing.ipynb")
    suite = write_suite(tmp_path, [{"notebook": "records_nothing.ipynb"}])
    code = run_suite(
        [suite],
        parameters={},
        out=tmp_path / "report",
        baselines=None,
        update_baselines=True,
        junit=None,
        profile=None,
    )
    path = tmp_path / "baselines" / "cpu" / "t.records_nothing.json"
    assert code == 2 and not path.exists(), (
        "a baseline comparing nothing would pass every later run"
    )
    [case] = json.loads((tmp_path / "report" / "results.json").read_text())["cases"]
    assert case["status"] == "error" and case["error"]["kind"] == "no metrics"
    assert case["error"]["message"] == (
        f"baseline {path}: not written: the notebook of t.records_nothing recorded "
        "no metrics, and a baseline compares at least one; call wb.record(name, "
        "value) in it, or launch a run there"
    )


def test_a_broken_baseline_is_reported_before_any_notebook_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from workbench.cli import main

    path = write_baseline(tmp_path / "baselines", "records_metric", {"val_loss": 1.0})
    path.write_text(json.dumps({"metrics": {"val_loss": {"value": None}}}))
    out = tmp_path / "report"
    caplog.set_level(logging.INFO, logger="workbench")
    code = main(
        [
            "regress",
            str(FIXTURES / "records_metric.ipynb"),
            "--out",
            str(out),
            "--baselines",
            str(tmp_path / "baselines"),
            "--junit",
            str(tmp_path / "junit.xml"),
        ]
    )
    assert code == 2
    message = f"baseline {path}: metrics['val_loss'].value=None: must be a number"
    lines = [r.getMessage() for r in caplog.records]
    first = next(i for i, line in enumerate(lines) if message in line)
    assert first < lines.index(f"[1/1] records_metric: {FIXTURES / 'records_metric.ipynb'}")
    assert "Traceback" not in caplog.text and not (out / "cases").exists(), (
        "the case's notebook did not run"
    )
    assert (out / "report.html").is_file()
    assert junit_cases(tmp_path / "junit.xml")["records_metric"].find("error") is not None


def test_an_unwritable_junit_path_is_an_error_line_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workbench.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = main(
        [
            "regress",
            str(FIXTURES / "records_metric.ipynb"),
            "--out",
            str(tmp_path / "report"),
            "--junit",
            str(blocker / "junit.xml"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --junit ") and "can't write there" in err
    assert "Traceback" not in err and not (tmp_path / "report" / "cases").exists()
