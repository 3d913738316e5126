"""A damaged run directory: torn lines, corrupt or foreign files, a broken LOCK. Writers carry on where they can,
and readers say which file is damaged and what to do, instead of a traceback or an invented status."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest

import workbench as wb
from workbench.cli import main
from workbench.commands.status import describe_run
from workbench.rundir import MetricsRow, RunDir, RunDirLocked, Status
from workbench.rundir import lock as run_lock
from workbench.utils import files


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    return run


# ---- torn last lines -----------------------------------------------------------------------------
def test_a_row_appended_after_a_crash_mid_line_is_read_back(
    run: RunDir, caplog: pytest.LogCaptureFixture
) -> None:
    run.append_metrics(MetricsRow(step=1, loss=0.5))
    with open(run.metrics_path, "ab") as f:
        f.write(b'{"step": 2, "loss": 0.4')  # the crash: a line without its end
    resumed = MetricsRow(step=2, loss=0.45)
    with caplog.at_level(logging.WARNING, logger="workbench"):
        run.append_metrics(resumed)
        rows = run.metrics_rows()
    assert [r.step for r in rows] == [1, 2] and rows[-1] == resumed
    assert any("metrics.jsonl" in m and "torn" in m for m in caplog.messages), caplog.messages


def test_an_event_appended_after_a_torn_line_is_read_back(run: RunDir) -> None:
    run.event("started", step=0)
    with open(run.events_path, "ab") as f:
        f.write(b'{"time": 1.0, "event": "check')
    run.event("resumed", step=4)
    run.event("completed", step=8)
    assert [e["event"] for e in run.events()] == ["started", "resumed", "completed"]


def test_a_damaged_line_is_skipped_with_a_warning_naming_file_and_line(
    run: RunDir, caplog: pytest.LogCaptureFixture
) -> None:
    good = json.dumps(MetricsRow(step=1, loss=0.5).to_dict()).encode()
    run.metrics_path.write_bytes(
        good + b"\n\xff\xfe not json\n[1, 2]\n\n" + good.replace(b'"step": 1', b'"step": 2') + b"\n"
    )
    with caplog.at_level(logging.WARNING, logger="workbench"):
        assert [r.step for r in run.metrics_rows()] == [1, 2]
    assert any(f"{run.metrics_path}, line 2" in m for m in caplog.messages), caplog.messages
    assert any(
        f"{run.metrics_path}, line 3" in m and "not a JSON object" in m for m in caplog.messages
    )


# ---- summary.json --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "content,problem",
    [
        (b"[1, 2]", "holds a JSON list, not a JSON object"),
        (b'{"status": "completed", "steps": 3', "not valid JSON"),
        (b'{"status": "compl\xe9ted"}', "not UTF-8"),
        (b" \n", "empty"),
    ],
    ids=["list", "truncated", "not-utf8", "blank"],
)
def test_a_damaged_summary_is_named_by_every_reader(
    run: RunDir, content: bytes, problem: str
) -> None:
    run.summary_path.write_bytes(content)
    match = rf"{run.summary_path}: {problem}.*restore it"
    with pytest.raises(ValueError, match=match):
        run.summary()
    with pytest.raises(ValueError, match=match):
        run.observed_status()
    view = wb.RunResult.load(run.path)  # RunFiles, as a live Run reads it too
    with pytest.raises(ValueError, match=match):
        _ = view.summary
    with pytest.raises(ValueError, match=match):
        _ = view.status
    with pytest.raises(ValueError, match=match):
        describe_run(run.path)


def test_status_of_a_completed_run_with_a_corrupt_summary_says_so_and_invents_nothing(
    run: RunDir, capsys: pytest.CaptureFixture[str]
) -> None:
    run.set_status(Status.COMPLETED, steps=3)
    run.summary_path.write_bytes(run.summary_path.read_bytes()[:-10])  # damaged by something else
    assert main(["status", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{run.summary_path}: not valid JSON" in err
        and "status says" not in err
        and "failed" not in err
    )


def test_a_summary_that_is_a_directory_is_named(run: RunDir) -> None:
    run.summary_path.mkdir()
    with pytest.raises(ValueError, match=rf"{run.summary_path}: can't be read \(.*directory"):
        run.summary()


def test_damaged_heartbeats_and_rank_errors_are_passed_over(run: RunDir) -> None:
    run.set_status(Status.RUNNING)
    run.ranks_path.mkdir()
    (run.ranks_path / "rank_0.json").write_bytes(b"\xff\xfe")
    (run.ranks_path / "rank_1.json").write_text("[1]")
    run.errors_path.mkdir()
    (run.errors_path / "rank_0.json").write_text('"boom"')
    seen = run.observe()
    assert seen.alive is None and seen.last_step is None
    assert run.rank_errors() == []


# ---- status output -------------------------------------------------------------------------------
def test_status_prints_a_stopped_runs_ending_as_text(run: RunDir) -> None:
    ckpt = run.checkpoints_path / "step_12"
    run.set_status(Status.STOPPED, ending={"step": 12, "checkpoint": str(ckpt)})
    text, code = describe_run(run.path)
    assert code == 0
    assert f"  ending: stopped at step 12; checkpoint {ckpt}" in text.splitlines(), text
    assert "{" not in text


def test_status_prints_an_endings_message_and_what_it_adds(run: RunDir) -> None:
    ckpt = run.checkpoints_path / "step_5"
    run.set_status(
        Status.PREEMPTED,
        ending={
            "step": 5,
            "checkpoint": str(ckpt),
            "signal": "SIGTERM",
            "message": "SIGTERM at step 5: the ranks checkpointed and exited",
            "node": "gpu-3",
        },
    )
    text, code = describe_run(run.path)
    assert code == 75
    assert (
        f"  ending: SIGTERM at step 5: the ranks checkpointed and exited; checkpoint {ckpt}; node: gpu-3"
        in text
    )
    run.set_status(
        Status.DIVERGED,
        ending={
            "step": 9,
            "reason": "loss is nan",
            "last_checkpoint": None,
            "message": "diverged at step 9: loss is nan; no checkpoint was saved before it",
        },
    )
    text, code = describe_run(run.path)
    assert code == 1
    assert (
        "  ending: diverged at step 9: loss is nan; no checkpoint was saved before it"
        in text.splitlines()
    ), text


def test_an_ending_of_another_shape_still_prints(run: RunDir) -> None:
    run.set_status(Status.DIVERGED, ending="loss was nan")
    assert "  ending: loss was nan" in describe_run(run.path)[0]


# ---- a damaged LOCK ------------------------------------------------------------------------------
def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_lock_of_undecodable_bytes_is_left_while_fresh_and_taken_over_once_old(
    run: RunDir, caplog: pytest.LogCaptureFixture
) -> None:
    run.lock_path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(
        RunDirLocked,
        match=rf"{run.lock_path} can't be read \(not UTF-8 text.*written .* ago.*try "
        r"again.*delete",
    ):
        run_lock.acquire(run)
    assert run.lock_owner() is None
    _age(run.lock_path, 3600)
    with caplog.at_level(logging.WARNING, logger="workbench"):
        token = run_lock.acquire(run)
    assert run_lock.held_by(run, token)
    assert any(str(run.lock_path) in m and "damaged" in m for m in caplog.messages), caplog.messages


def test_an_empty_lock_being_written_is_not_taken(run: RunDir) -> None:
    run.lock_path.write_bytes(b"")  # an older launch between creating its LOCK and writing it
    with pytest.raises(RunDirLocked, match=rf"{run.lock_path} can't be read \(empty\)"):
        run_lock.acquire(run)
    assert run.lock_path.read_bytes() == b"", "another launch's fresh lock is left alone"


def test_a_lock_that_is_a_directory_says_to_remove_it(run: RunDir) -> None:
    run.lock_path.mkdir()
    with pytest.raises(
        RunDirLocked, match=rf"{run.lock_path} is a directory, not a lock file; remove it"
    ):
        run_lock.acquire(run)
    assert run.lock_owner() is None and not run_lock.held_by(run, "x")
    run_lock.release(run, "x")
    assert run.lock_path.is_dir()


def test_a_stale_lock_is_taken_over_and_a_live_one_refused(run: RunDir) -> None:
    dead = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": 1.0,
        "token": "old",
        "time": 0.0,
    }
    files.write_json(run.lock_path, dead)
    token = run_lock.acquire(run)
    assert run.lock_owner()["token"] == token and run.lock_owner()["pid"] == os.getpid()
    with pytest.raises(
        RunDirLocked, match=rf"run directory {run.path} is in use by pid {os.getpid()}"
    ):
        run_lock.acquire(run)
    assert run_lock.acquire(run, token) == token  # the holder's restart keeps it
    run_lock.release(run, token)
    assert not run.lock_path.exists()
    assert sorted(p.name for p in run.path.iterdir()) == [run_lock.LOCK_GUARD], (
        "no temp file is left behind"
    )
