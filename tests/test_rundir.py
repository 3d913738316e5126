"""The run directory as a contract: summary.json's schema, the one writer of status changes, RunResult."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.utils import files
from workbench.rundir import ENDED, SCHEMA_VERSION, RunDir, Status, Summary


def test_status_is_a_string_and_knows_which_statuses_end_a_run() -> None:
    assert Status.COMPLETED == "completed" and str(Status.FAILED) == "failed"
    assert {s.value for s in ENDED} == {"completed", "stopped", "preempted", "diverged", "failed"}
    assert "stopped" in ENDED and Status.COMPLETED.ended and not Status.RUNNING.ended


def test_summary_round_trips_with_eval_keys_flat_and_unknown_keys_kept() -> None:
    data = {"status": "completed", "steps": 7, "final_loss": 0.5, "eval_loss": 0.4, "eval_accuracy": 0.9,
            "from_a_newer_version": [1, 2]}
    summary = Summary.from_dict(data)
    assert summary.status is Status.COMPLETED and summary.steps == 7
    assert summary.eval == {"eval_loss": 0.4, "eval_accuracy": 0.9}
    assert summary.extra == {"from_a_newer_version": [1, 2]}
    out = summary.to_dict()
    assert out["schema_version"] == SCHEMA_VERSION and out["status"] == "completed"
    assert {k: out[k] for k in data} == data
    assert Summary.from_dict(out) == summary


def test_set_status_merges_fields_times_the_run_and_clears_an_old_error(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    started = time.time() - 5
    run.set_status(Status.STARTING, run_name="r", started_at=started)
    run.set_status(Status.FAILED, error={"rank": 1, "type": "ValueError", "message": "boom"})
    failed = files.read_json(run.summary_path)
    assert failed["status"] == "failed" and failed["error"]["rank"] == 1 and failed["run_name"] == "r"
    assert failed["wall_time_s"] >= 5
    run.set_status(Status.RUNNING, world_size=2)  # a resumed session
    running = run.summary()
    assert running.status is Status.RUNNING and running.error is None and running.world_size == 2
    assert running.started_at == started


def test_run_and_result_read_the_same_files(runs_dir: Path) -> None:
    cfg = wb.RunConfig(task="tiny-regression", num_processes=1, device="cpu", max_steps=3, log_every=1,
                       runs_dir=str(runs_dir), micro_batch_size=16)
    run = wb.start(cfg, task=TinyRegression())
    assert isinstance(run, wb.Run)
    result = run.wait(timeout=120)
    assert isinstance(result, wb.RunResult) and result.status is Status.COMPLETED
    assert run.summary == result.summary and run.metrics == result.metrics
    assert wb.RunResult.load(result.run_dir).config == result.config == run.config


def test_launch_with_wait_false_is_deprecated_but_still_returns_a_run(runs_dir: Path) -> None:
    cfg = wb.RunConfig(task="tiny-regression", num_processes=1, device="cpu", max_steps=2, runs_dir=str(runs_dir),
                       micro_batch_size=16)
    with pytest.warns(DeprecationWarning, match=r"use wb.start\(cfg\)"):
        run = wb.launch(cfg, task=TinyRegression(), wait=False)
    assert isinstance(run, wb.Run)
    assert run.wait(timeout=120).status is Status.COMPLETED
