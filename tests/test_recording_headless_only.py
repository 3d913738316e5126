"""Recorded metrics and curves are kept only where a notebook is executed headless (papermill, nbconvert --execute,
`workbench regress`), where the regression suite reads them back; a person's notebook gets none of them, and a
saved notebook shows none (no text/plain line: only the suite's MIME types)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import workbench as wb
import workbench.regress.recording as rec
from workbench import rundir
from workbench.utils import files


class _History:
    def __init__(self, hist_file: Any) -> None:
        self.hist_file = hist_file


class _Shell:
    """An IPython kernel shell as far as recording looks: a kernel, and its history's file."""

    kernel = object()

    def __init__(self, hist_file: Any) -> None:
        self.history_manager = _History(hist_file)


# JupyterLab's kernels keep one
INTERACTIVE = Path.home() / ".ipython" / "profile_default" / "history.sqlite"
HEADLESS = ":memory:"  # what nbclient (papermill, nbconvert, workbench regress) starts kernels with


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    monkeypatch.setattr(rec, "_display", out.append)
    monkeypatch.setattr(rec, "_prefix_counts", {})
    monkeypatch.setattr(rec, "_run_names", {})
    monkeypatch.delenv(rec.RECORD_ENV, raising=False)
    return out


def _result(run_dir: Path) -> wb.RunResult:
    run_dir.mkdir(parents=True)
    files.write_json(
        run_dir / rundir.SUMMARY, {"status": "completed", "final_loss": 0.5, "samples_per_s": 9.0}
    )
    files.append_jsonl(run_dir / rundir.METRICS, {"step": 1, "loss": 0.7})
    return wb.RunResult(run_dir)


def _record_everything(tmp_path: Path) -> str | None:
    name = rec.record_run(_result(tmp_path / "run"))
    rec.record("val_loss", 1.0, direction="lower")
    rec.record_curve("custom", [[1, 2.0]])
    return name


def test_a_persons_notebook_shows_no_recorded_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shown: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(rec.kernel, "kernel_shell", lambda: _Shell(INTERACTIVE))
    assert not rec.headless()
    assert _record_everything(tmp_path) is None
    assert shown == []


def test_a_notebook_executed_headless_records_runs_metrics_and_curves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shown: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(rec.kernel, "kernel_shell", lambda: _Shell(HEADLESS))
    assert rec.headless()
    assert _record_everything(tmp_path) == "run"
    assert [next(iter(b)) for b in shown] == [
        rec.METRIC_MIME,
        rec.CURVE_MIME,
        rec.METRIC_MIME,
        rec.CURVE_MIME,
    ]
    assert shown[0][rec.METRIC_MIME]["text"].startswith("recorded run: final_loss = 0.5")
    assert shown[1][rec.CURVE_MIME]["name"] == "run.loss" and shown[1][rec.CURVE_MIME][
        "points"
    ] == [[1, 0.7]]
    assert (
        shown[2][rec.METRIC_MIME]["name"] == "val_loss"
        and shown[3][rec.CURVE_MIME]["name"] == "custom"
    )
    # Nothing a saved notebook would print as a line of raw numbers: the suite's report shows them.
    assert all(list(b) in ([rec.METRIC_MIME], [rec.CURVE_MIME]) for b in shown)


@pytest.mark.parametrize(
    ("hist_file", "said", "records"),
    [(INTERACTIVE, "1", True), (HEADLESS, "0", False)],
    ids=["interactive", "headless"],
)
def test_workbench_record_says_it_outright(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shown: list[dict[str, Any]],
    hist_file: Any,
    said: str,
    records: bool,
) -> None:
    monkeypatch.setattr(rec.kernel, "kernel_shell", lambda: _Shell(hist_file))
    monkeypatch.setenv(rec.RECORD_ENV, said)
    assert (_record_everything(tmp_path) is not None) is records
    assert bool(shown) is records


def test_outside_a_kernel_nothing_is_recorded_even_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shown: list[dict[str, Any]]
) -> None:
    monkeypatch.setattr(rec.kernel, "kernel_shell", lambda: None)
    monkeypatch.setenv(rec.RECORD_ENV, "1")
    assert _record_everything(tmp_path) is None and shown == []
