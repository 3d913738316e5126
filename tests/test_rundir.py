"""The run directory as a contract: summary.json's schema, the one writer of status changes, RunResult."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from collected_ids import cases
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import (
    ENDED,
    METRICS_SCHEMA_VERSION,
    SCHEMA_VERSION,
    MetricsRow,
    RunDir,
    Status,
    Summary,
)
from workbench.utils import files


def test_status_is_a_string_and_knows_which_statuses_end_a_run() -> None:
    assert Status.COMPLETED == "completed" and str(Status.FAILED) == "failed"
    assert {s.value for s in ENDED} == {"completed", "stopped", "preempted", "diverged", "failed"}
    assert "stopped" in ENDED and Status.COMPLETED.ended and not Status.RUNNING.ended


def test_summary_round_trips_with_eval_keys_flat_and_unknown_keys_kept() -> None:
    data = {
        "status": "completed",
        "steps": 7,
        "final_loss": 0.5,
        "eval_loss": 0.4,
        "eval_accuracy": 0.9,
        "from_a_newer_version": [1, 2],
    }
    summary = Summary.from_dict(data)
    assert summary.status is Status.COMPLETED and summary.steps == 7
    assert summary.eval == {"eval_loss": 0.4, "eval_accuracy": 0.9}
    assert summary.extra == {"from_a_newer_version": [1, 2]}
    out = summary.to_dict()
    assert out["schema_version"] == SCHEMA_VERSION and out["status"] == "completed"
    assert {k: out[k] for k in data} == data
    assert Summary.from_dict(out) == summary


# ---- metrics rows --------------------------------------------------------------------------------
def test_a_metrics_row_round_trips_flat_through_metrics_jsonl(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    train = MetricsRow(
        step=4,
        loss=0.5,
        lr=1e-3,
        step_time_s=0.25,
        peak_memory_bytes_per_rank=[7, 9],
        gpu_util_pct_per_rank=[93.0, None],
        comm_measured=False,
        verdicts=["input-bound"],
    )
    evaluated = MetricsRow.for_eval(4, {"eval_loss": 0.4, "eval_accuracy": 0.9})
    run.append_metrics(train)
    run.append_metrics(evaluated)
    assert run.metrics_rows() == [train, evaluated]
    # On disk: flat, only the keys that have a value, each row versioned.
    version = METRICS_SCHEMA_VERSION
    assert run.metrics() == [
        {
            "step": 4,
            "loss": 0.5,
            "lr": 1e-3,
            "step_time_s": 0.25,
            "peak_memory_bytes_per_rank": [7, 9],
            "comm_measured": False,
            "verdicts": ["input-bound"],
            "gpu_util_pct_per_rank": [93.0, None],
            "schema_version": version,
        },
        {"step": 4, "eval_loss": 0.4, "eval_accuracy": 0.9, "schema_version": version},
    ]
    assert evaluated.eval == {"eval_accuracy": 0.9}
    assert evaluated.is_eval and not evaluated.is_train and train.is_train
    with pytest.raises(TypeError, match="takes a MetricsRow"):
        run.append_metrics({"step": 5, "loss": 0.4})  # type: ignore[arg-type]


def test_an_old_row_without_a_version_reads_as_version_0_and_keeps_shape(tmp_path: Path) -> None:
    old = {"step": 10, "epoch": 0, "loss": 1.5, "samples_per_s": 640, "elapsed_s": 2.0}
    row = MetricsRow.from_dict(old)
    assert row.schema_version == 0 and row.loss == 1.5 and row.samples_per_s == 640
    assert row.grad_norm is None and row.phases_ms() is None and row.extra == {}
    assert row.to_dict() == old  # rewritten (a resume sets rows aside), it stays as it was
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    files.write_jsonl(run.metrics_path, [old, {**old, "step": 20}])
    assert run.set_aside_metrics_after(10) is not None
    assert run.metrics() == [old]


def test_an_unknown_key_survives_in_extra() -> None:
    data = {
        "step": 3,
        "loss": 0.7,
        "from_a_newer_version": {"a": [1, 2]},
        "eval_confusion": [[1, 0]],
        "schema_version": METRICS_SCHEMA_VERSION + 1,
    }
    row = MetricsRow.from_dict(data)
    # A numeric eval_<metric> is an eval metric; anything else unknown is kept as it came.
    assert row.extra == {"from_a_newer_version": {"a": [1, 2]}, "eval_confusion": [[1, 0]]}
    assert row.eval == {} and row.schema_version == METRICS_SCHEMA_VERSION + 1
    assert row.to_dict() == data and MetricsRow.from_dict(row.to_dict()) == row
    with pytest.raises(ValueError, match=r"extra holds known keys \['loss'\]"):
        MetricsRow(step=1, extra={"loss": 1.0})


@pytest.mark.parametrize(
    "data,field",
    cases(
        [
            ({"step": 1, "loss": "0.5"}, "loss"),
            ({"step": 1, "loss": True}, "loss"),
            ({"step": "1", "loss": 0.5}, "step"),
            ({"step": 1, "peak_memory_bytes": 1.5}, "peak_memory_bytes"),
            ({"step": 1, "gpu_util_pct_per_rank": [50.0, "idle"]}, "gpu_util_pct_per_rank"),
            ({"step": 1, "verdicts": "input-bound"}, "verdicts"),
            ({"step": 1, "schema_version": "2"}, "schema_version"),
        ]
    ),
)
def test_a_field_of_the_wrong_type_is_refused_by_name(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"at step '?1'?: {field}=.* is not "):
        MetricsRow.from_dict(data)


def test_a_bad_row_in_metrics_jsonl_is_named_by_file_and_row(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    files.write_jsonl(run.metrics_path, [{"step": 1, "loss": 0.5}, {"step": 2, "loss": "nan?"}])
    with pytest.raises(ValueError, match=r"metrics.jsonl, row 2: .*loss='nan\?' is not float"):
        run.metrics_rows()
    assert len(run.metrics()) == 2  # the plain reader still reads what is there
    with pytest.raises(ValueError, match="without a step"):
        MetricsRow.from_dict({"loss": 0.5})


def test_set_status_merges_fields_times_the_run_and_clears_an_old_error(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    started = time.time() - 5
    run.set_status(Status.STARTING, run_name="r", started_at=started)
    run.set_status(Status.FAILED, error={"rank": 1, "type": "ValueError", "message": "boom"})
    failed = files.read_json(run.summary_path)
    assert (
        failed["status"] == "failed" and failed["error"]["rank"] == 1 and failed["run_name"] == "r"
    )
    assert failed["wall_time_s"] >= 5
    run.set_status(Status.RUNNING, world_size=2)  # a resumed session
    running = run.summary()
    assert running.status is Status.RUNNING and running.error is None and running.world_size == 2
    assert running.started_at == started


def test_run_and_result_read_the_same_files(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="tiny-regression",
        num_processes=1,
        device="cpu",
        max_steps=3,
        log_every=1,
        runs_dir=str(runs_dir),
        micro_batch_size=16,
    )
    run = wb.start(cfg, task=TinyRegression())
    assert isinstance(run, wb.Run)
    result = run.wait(timeout=120)
    assert isinstance(result, wb.RunResult) and result.status is Status.COMPLETED
    assert run.summary == result.summary and run.metrics == result.metrics
    # The public rows are plain dicts, each versioned; typed, they read back the same.
    assert all(type(r) is dict for r in result.metrics)
    assert {r["schema_version"] for r in result.metrics} == {METRICS_SCHEMA_VERSION}
    assert [r.to_dict() for r in result.dir.metrics_rows()] == result.metrics
    assert wb.RunResult.load(result.run_dir).config == result.config == run.config


def test_launch_with_wait_false_is_deprecated_but_still_returns_a_run(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="tiny-regression",
        num_processes=1,
        device="cpu",
        max_steps=2,
        runs_dir=str(runs_dir),
        micro_batch_size=16,
    )
    with pytest.warns(DeprecationWarning, match=r"use wb.start\(cfg\)"):
        run = wb.launch(cfg, task=TinyRegression(), wait=False)
    assert isinstance(run, wb.Run)
    assert run.wait(timeout=120).status is Status.COMPLETED
