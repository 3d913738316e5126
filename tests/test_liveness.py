"""A live run is judged by what can be known: a Slurm controller that can't be reached says nothing of the job
(UNKNOWN, never GONE), and a heartbeat is stale only once it has stopped changing on the reader's own clock, not
because the writer's clock differs. Slurm stands in here as commands on PATH that answer as Slurm 22.05 does
(the texts are what the real squeue/scontrol print); tests/test_slurm.py does the same against a real cluster."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time as real_time
from collections.abc import Iterator
from pathlib import Path

import pytest

import workbench as wb
from workbench.cluster.slurm_run import SlurmRun
from workbench.commands.status import describe_run
from workbench.rundir import RunDir, RunDirLocked, Status, liveness, prepare, scheduler

UNREACHABLE = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
"""What squeue and scontrol print (exit 1) when the controller is down or its port unreachable."""
NO_SUCH_JOB = "slurm_load_jobs error: Invalid job id specified"
"""What they print (exit 1) for a job id the controller doesn't know."""


def _cfg(runs_dir: Path, **fields: object) -> wb.RunConfig:
    base = {
        "task": "tiny-regression",
        "num_processes": 1,
        "device": "cpu",
        "micro_batch_size": 16,
        "max_steps": 10,
        "runs_dir": str(runs_dir),
        "run_name": "live",
    }
    return wb.RunConfig(**{**base, **fields})


def _running(runs_dir: Path, name: str = "live") -> RunDir:
    """A run directory whose summary says running, as a launch on another host left it."""
    run = RunDir(runs_dir / name)
    run.path.mkdir(parents=True)
    _cfg(runs_dir, run_name=name).to_yaml(run.config_path)
    run.set_status(Status.RUNNING, run_name=name, world_size=1)
    return run


def _slurm_stand_in(folder: Path, squeue: str, scontrol: str) -> dict[str, str]:
    """squeue and scontrol on PATH that print `squeue`/`scontrol` to stderr and exit 1; the environment to use."""
    folder.mkdir(exist_ok=True)
    for name, said in (("squeue", squeue), ("scontrol", scontrol)):
        path = folder / name
        path.write_text(f"#!/bin/sh\necho '{said}' >&2\nexit 1\n")
        path.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


# ---- the scheduler: only a definite answer is GONE -----------------------------------------------
@pytest.mark.parametrize(
    ("said", "state"),
    [
        (UNREACHABLE, "UNKNOWN"),
        ("slurm_load_jobs error: Socket timed out on send/recv operation", "UNKNOWN"),
        ("squeue: fatal: Could not establish a configuration source", "UNKNOWN"),
        (NO_SUCH_JOB, "GONE"),
    ],
    ids=["unreachable", "timed-out", "no-configuration", "no-such-job"],
)
def test_only_the_controller_saying_it_doesnt_know_a_job_makes_it_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: str, state: str
) -> None:
    for key, value in _slurm_stand_in(tmp_path / "bin", said, said).items():
        monkeypatch.setenv(key, value)
    answer = scheduler.query("42")
    assert answer is not None and answer.state == state and not answer.foreign
    if state == "UNKNOWN":
        assert answer.reason == f"the Slurm controller can't be asked (squeue: {said})"
    assert liveness.is_alive({"slurm_job_id": "42"}) is (None if state == "UNKNOWN" else False)


def test_wait_keeps_waiting_through_a_controller_outage_and_finalizes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = _running(tmp_path / "runs")
    token = "t0k3n"
    run.lock_path.write_text(
        json.dumps(
            {
                "host": "login-node",
                "pid": 1,
                "token": token,
                "time": real_time.time(),
                "runner": {"slurm_job_id": "11"},
            }
        )
    )
    (run.path / scheduler.JOB_FILE).write_text(json.dumps({"job_id": "11"}))
    for key, value in _slurm_stand_in(tmp_path / "bin", UNREACHABLE, UNREACHABLE).items():
        monkeypatch.setenv(key, value)
    handle = SlurmRun(run.path, _cfg(tmp_path / "runs"), "11", token)
    with (
        caplog.at_level(logging.INFO, logger="workbench"),
        pytest.raises(
            TimeoutError,
            match=r"\(Slurm job 11\) still unknown \(the Slurm controller can't be asked \(squeue: "
            r"slurm_load_jobs error: Unable to contact slurm controller \(connect failure\)\)\) "
            r"after 1.5s",
        ),
    ):
        handle.wait(timeout=1.5)
    said = [r.getMessage() for r in caplog.records if "state is unknown" in r.getMessage()]
    assert len(said) == 1 and "still waiting" in said[0], caplog.text
    assert run.summary().status is Status.RUNNING and run.lock_path.exists(), (
        "nothing finalized, the lock kept"
    )
    assert run.observed_status()[0] is Status.RUNNING
    with pytest.raises(
        RuntimeError,
        match=r"cancel\(\): Slurm job 11 was not cancelled: the Slurm controller "
        r"can't be asked .* once `scontrol ping` says the controller is UP",
    ):
        handle.cancel()
    # the ranks record an ending while the controller is still away: that is an ending wait() can go by
    run.set_status(Status.COMPLETED, steps=10)
    assert handle.wait(timeout=10).status is Status.COMPLETED
    assert not run.lock_path.exists()


def test_a_run_whose_job_cant_be_asked_keeps_its_lock_while_its_heartbeats_are_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    run = _running(runs)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    # the submitting kernel has exited (its pid is gone); the job's ranks beat on the nodes
    run.lock_path.write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": gone.pid,
                "create_time": 0.0,
                "token": "old",
                "time": real_time.time() - 3600,
                "runner": {"slurm_job_id": "11", "job_name": "workbench-live"},
            }
        )
    )
    run.write_heartbeat(0, {"host": "node7", "pid": 4242, "step": 800})
    for key, value in _slurm_stand_in(tmp_path / "bin", UNREACHABLE, UNREACHABLE).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        RunDirLocked,
        match=r"in use by pid .*; its ranks' heartbeats are fresh .*, and its Slurm "
        r"job 11's state is unknown",
    ):
        prepare(_cfg(runs, resume="auto"))
    status, why = run.observed_status()
    assert status is Status.RUNNING and why.startswith(
        "unknown: its Slurm job 11's state is unknown: the Slurm controller can't be asked"
    ), why
    text, code = describe_run(run.path)
    assert code == 0 and text.splitlines()[0].startswith(
        "live: running (unknown: its Slurm job 11"
    ), text


# ---- heartbeats, on the reader's own clock -------------------------------------------------------
class ReaderClock:
    """The reader's clocks: its wall clock `ahead_s` ahead of the writer's, and a stopwatch the test can move on."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead_s, self.moved = ahead_s, 0.0

    def time(self) -> float:
        return real_time.time() + self.ahead_s

    def monotonic(self) -> float:
        return real_time.monotonic() + self.moved

    def sleep(self, seconds: float) -> None:
        real_time.sleep(seconds)


@pytest.fixture
def reader_5_min_ahead(monkeypatch: pytest.MonkeyPatch) -> ReaderClock:
    clock = ReaderClock(300.0)
    monkeypatch.setattr(liveness, "time", clock)
    monkeypatch.setattr(liveness, "_seen", {})  # a reader that has seen nothing yet
    return clock


WRITER = """
import sys, time
from workbench.rundir import RunDir
run, step = RunDir(sys.argv[1]), 0
while True:
    step += 1
    run.write_heartbeat(0, {"host": "node7", "pid": 4242, "step": step})
    time.sleep(0.2)
"""


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[tuple[RunDir, subprocess.Popen[bytes]]]:
    """A run on another host ('node7') whose rank 0 rewrites its heartbeat every 0.2 s, from a real process."""
    run = _running(tmp_path / "runs")
    run.lock_path.write_text(
        json.dumps({"host": "login-node", "pid": 4242, "token": "t", "time": real_time.time()})
    )
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run.path)])
    try:
        deadline = real_time.monotonic() + 60
        while not (run.ranks_path / "rank_0.json").exists():
            assert proc.poll() is None and real_time.monotonic() < deadline, (
                "the writer wrote no heartbeat"
            )
            real_time.sleep(0.05)
        yield run, proc
    finally:
        proc.kill()
        proc.wait(30)


def test_a_live_run_is_not_declared_dead_by_a_reader_whose_clock_is_ahead_and_is_once_it_stops(
    writer: tuple[RunDir, subprocess.Popen[bytes]], reader_5_min_ahead: ReaderClock
) -> None:
    run, proc = writer
    # a one-shot reader: it re-reads the heartbeat and sees it change
    text, code = describe_run(run.path)
    assert code == 0 and text.splitlines()[0] == "live: running", text
    deadline = real_time.monotonic() + 2.0
    while real_time.monotonic() < deadline:  # a reader that keeps looking (wait(), the dashboard)
        assert run.observed_status() == (Status.RUNNING, ""), run.observe().reason
        real_time.sleep(0.1)
    with pytest.raises(
        RunDirLocked, match=r"its ranks' heartbeats are fresh \(rank_0.json changed while watched"
    ):
        prepare(_cfg(run.path.parent, resume="auto"))
    proc.kill()
    proc.wait(30)
    assert run.observed_status()[0] is Status.RUNNING, (
        "just stopped: not yet seen unchanged for long"
    )
    # the reader's own clock goes past the threshold
    reader_5_min_ahead.moved += liveness.STALE_AFTER_S + 1
    status, why = run.observed_status()
    assert (
        status is Status.FAILED
        and "no heartbeat changes: rank_0.json unchanged for the 61 s watched from here" in why
    ), why


def test_a_one_shot_reader_rereads_a_heartbeat_that_looks_old_by_the_clocks_difference_before_judging(
    tmp_path: Path, reader_5_min_ahead: ReaderClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _running(tmp_path / "runs")
    run.write_heartbeat(0, {"host": "node7", "pid": 4242, "step": 800})  # and its writer stopped
    monkeypatch.setattr(liveness, "CONFIRM_S", 1.0)  # a few heartbeat periods, shortened
    # one quick look: old by the clocks' difference, or dead? not told yet
    status, why = run.observed_status()
    assert status is Status.RUNNING, why
    assert re.match(
        r"unknown: can't tell yet: rank_0.json 30[01] s old by the writer's clock \(the hosts' clocks "
        r"may differ\), watched for 0 s$",
        why,
    ), why
    liveness._seen.clear()
    text, code = describe_run(run.path)  # re-read for CONFIRM_S: it doesn't change
    assert code == 1, text
    assert re.match(
        r"live: failed \(status says running, but no heartbeat changes: rank_0.json 30[01] s old by the "
        r"writer's clock and unchanged for the 1 s watched from here \(last heartbeat at step 800\)",
        text,
    ), text
