"""A forked run is answered when its ranks have returned, everything written, not when their processes have
finished exiting; the exits are waited for in the background, and what doesn't exit in time is killed."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.launcher import forked


class SlowToExit(TinyRegression):
    """TinyRegression whose ranks take `exit_s` to exit once training returned (a finalizer at process exit,
    as a library's clean-up would)."""

    def __init__(self, exit_s: float) -> None:
        super().__init__()
        self.exit_s, self.launcher = exit_s, os.getpid()

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        if os.getpid() != self.launcher:
            multiprocessing.util.Finalize(None, time.sleep, args=(self.exit_s,), exitpriority=10)
        return super().build_model(cfg)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree(pid: int) -> list[int]:
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def wait_until_gone(pids: list[int], deadline_s: float) -> list[int]:
    deadline = time.monotonic() + deadline_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def killed_at_the_end() -> Any:
    """The pids a test started: killed if still there when it ends, whatever it asserted."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            for p in tree(pid):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(p).kill()


def test_a_run_is_answered_once_its_ranks_returned_and_what_lingers_is_killed_later(
    runs_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    killed_at_the_end: list[int],
) -> None:
    monkeypatch.setattr(forked, "REAP_AFTER_S", 3.0)
    cfg = wb.RunConfig(
        task="tiny-regression",
        num_processes=2,
        max_steps=2,
        micro_batch_size=8,
        runs_dir=str(runs_dir),
        trackers=[],
        monitor_interval_s=0.0,
    )
    run = wb.start(cfg, SlowToExit(exit_s=120.0))
    killed_at_the_end.extend(tree(run._process.pid))
    with caplog.at_level(logging.WARNING, logger="workbench"):
        result = run.wait(timeout=100)
        assert result.summary["status"] == "completed" and result.summary["steps"] == 2
        # The ranks are still in their 120-s exit, and the supervisor waits for them.
        lingering = [pid for pid in tree(run._process.pid) if alive(pid)]
        assert run._process.pid in lingering and len(lingering) == 3
        killed_at_the_end.extend(lingering)
        assert wait_until_gone(lingering, 60) == [], "killed REAP_AFTER_S after the run ended"
        deadline = time.monotonic() + 10
        while "had not exited" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert (
        f"{result.run_dir.name}: its processes had not exited 3 s after the run ended; killing them"
        in caplog.text
    )


def test_a_run_whose_ranks_exit_promptly_leaves_no_process_and_no_warning(
    runs_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = wb.RunConfig(
        task="tiny-regression",
        num_processes=2,
        max_steps=2,
        micro_batch_size=8,
        runs_dir=str(runs_dir),
        trackers=[],
        monitor_interval_s=0.0,
    )
    with caplog.at_level(logging.WARNING, logger="workbench"):
        run = wb.start(cfg, TinyRegression())
        pids = tree(run._process.pid)
        assert run.wait(timeout=100).summary["status"] == "completed"
        assert wait_until_gone(pids, 20) == []
    assert "had not exited" not in caplog.text


@pytest.mark.parametrize("removed", ["its files", "the folder"])
def test_a_run_dir_removed_once_the_run_returned_stays_removed(
    runs_dir: Path, removed: str, killed_at_the_end: list[int]
) -> None:
    """A caller may delete the run directory as soon as the run returns (a benchmark's temporary folder, a test's
    tmp_path), while the supervisor still waits for its ranks' exits. A run that recorded its ending leaves the
    supervisor nothing to write: it neither brings the lock's guard file back into the folder being deleted nor
    fails on the folder being gone. The ranks take 1 s to exit, so the deletion surely comes first."""
    import shutil
    from multiprocessing.connection import wait

    cfg = wb.RunConfig(
        task="tiny-regression",
        num_processes=2,
        max_steps=2,
        micro_batch_size=8,
        runs_dir=str(runs_dir),
        trackers=[],
        monitor_interval_s=0.0,
    )
    run = wb.start(cfg, SlowToExit(exit_s=1.0))
    killed_at_the_end.extend(tree(run._process.pid))
    result = run.wait(timeout=100)
    supervisor = run._process._process
    assert result.summary["status"] == "completed" and alive(supervisor.pid), (
        "answered before the exits"
    )
    if removed == "the folder":
        shutil.rmtree(result.run_dir)
    else:
        for path in result.run_dir.iterdir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    assert wait([supervisor.sentinel], 60), "the supervisor exits once its ranks did"
    # The launcher's reaper thread joins it too: whichever waitpid loses reads None, so the winner's code is
    # awaited rather than joined for.
    deadline = time.monotonic() + 30
    while supervisor.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervisor.exitcode == 0
    if removed == "the folder":
        assert not result.run_dir.exists()
    else:
        assert sorted(p.name for p in result.run_dir.iterdir()) == []


def test_a_supervisor_reaped_by_someone_else_is_not_taken_for_one_that_lingers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the caller's interpreter exits, multiprocessing joins its children from the main thread while the
    reaper joins them too: the waitpid that loses that race reads as 'still running' (exitcode None) for a
    process that has exited. The reaper goes by the process's sentinel, so it neither warns nor kills a process
    group whose leader is gone (the id may be someone else's by then)."""
    import signal

    from workbench.rundir import RunDir

    read_end, write_end = os.pipe()
    os.close(write_end)  # the sentinel of a process that has exited: readable at once

    class ReapedElsewhere:
        pid, sentinel, exitcode = 2**22 + 7, read_end, None

        def join(self, timeout: float | None = None) -> None:
            pass

    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: killed.append((pgid, sig)))
    pipe_r, pipe_w = os.pipe()
    supervisor = forked.ForkedSupervisor(ReapedElsewhere(), pipe_w, pipe_r, 2, RunDir(tmp_path))
    with caplog.at_level(logging.WARNING, logger="workbench"):
        supervisor._reap()
    assert killed == [] and "had not exited" not in caplog.text
    os.close(read_end)

    # one that really still runs is killed, with the warning (its sentinel never readable: a pipe kept open)
    still_r, still_w = os.pipe()

    class Lingering(ReapedElsewhere):
        sentinel = still_r

    monkeypatch.setattr(forked, "REAP_AFTER_S", 0.05)
    pipe_r, pipe_w = os.pipe()
    with caplog.at_level(logging.WARNING, logger="workbench"):
        forked.ForkedSupervisor(Lingering(), pipe_w, pipe_r, 2, RunDir(tmp_path))._reap()
    assert killed == [(Lingering.pid, signal.SIGKILL)] and "had not exited" in caplog.text
    os.close(still_r)
    os.close(still_w)
