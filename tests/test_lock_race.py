"""Many launches taking one run directory's lock at the same instant: exactly one wins, whether the directory is
new or holds the stale lock of a launch that died."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from workbench.rundir import RunDir
from workbench.rundir import lock as run_lock
from workbench.utils import files

RACERS = 8
TRIALS = 24
"""Half of them race for a new directory, half for one holding a dead launch's LOCK."""


def _race(base: str, start: Any, results: Any, done: Any) -> None:
    """One launch: at each trial, released with the others by the barrier, try to take that trial's lock."""
    from workbench.rundir import RunDirLocked

    for trial in range(TRIALS):
        try:
            start.wait(timeout=60)
        except threading.BrokenBarrierError:
            return
        try:
            token = run_lock.acquire(RunDir(Path(base) / f"trial-{trial}"))
            results.put((trial, os.getpid(), token))
        except RunDirLocked:
            results.put((trial, os.getpid(), None))
        except BaseException as e:  # noqa: BLE001  (reported to the test, which fails on it)
            results.put((trial, os.getpid(), repr(e)))
    # a winner's lock names this process: alive, it is no stale lock to take over
    done.wait(timeout=120)


def _stale_trial(trial: int) -> bool:
    return trial % 2 == 1


def _prepare(base: Path) -> None:
    dead = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": 1.0,
        "token": "dead",
        "time": 0.0,
    }
    for trial in range(TRIALS):
        run = RunDir(base / f"trial-{trial}")
        run.path.mkdir()
        if _stale_trial(trial):
            # this process, with another start time: a pid reused
            files.write_json(run.lock_path, dead)


def race(base: Path, deadline_s: float = 90.0) -> dict[int, list[tuple[int, str | None]]]:
    """Each trial's outcomes, (pid, token or None when refused) per racer; fails the test past the deadline."""
    _prepare(base)
    # fork, not spawn: spawn's semaphores start multiprocessing's resource tracker, a child that outlives the
    # test and that every later test checking for leftover processes would find.
    ctx = mp.get_context("fork")
    start, results, done = ctx.Barrier(RACERS), ctx.Queue(), ctx.Event()
    racers = [
        ctx.Process(target=_race, args=(str(base), start, results, done), daemon=True)
        for _ in range(RACERS)
    ]
    outcomes: dict[int, list[tuple[int, str | None]]] = {t: [] for t in range(TRIALS)}
    try:
        for p in racers:
            p.start()
        deadline = time.monotonic() + deadline_s
        received = 0
        while received < TRIALS * RACERS:
            try:
                trial, pid, token = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in racers):
                    pytest.fail(
                        f"the racers did not all report within {deadline_s:.0f} s (exit codes "
                        f"{[p.exitcode for p in racers]}): {outcomes}"
                    )
                continue
            outcomes[trial].append((pid, token))
            received += 1
    finally:
        done.set()
        start.abort()
        for p in racers:
            if p.pid is None:
                continue
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return outcomes


@pytest.mark.slow
def test_of_many_launches_started_together_exactly_one_takes_the_lock(tmp_path: Path) -> None:
    outcomes = race(tmp_path)
    for trial, got in outcomes.items():
        errors = [t for _, t in got if t is not None and not t.isalnum()]
        assert not errors, f"trial {trial}: {errors}"
        winners = [(pid, t) for pid, t in got if t is not None]
        assert len(winners) == 1, (
            f"trial {trial} ({'stale LOCK' if _stale_trial(trial) else 'new'}): {winners}"
        )
        owner = RunDir(tmp_path / f"trial-{trial}").lock_owner()
        assert owner is not None and (owner["pid"], owner["token"]) == winners[0], f"trial {trial}"
    assert not psutil.Process().children(recursive=True), (
        "the racers (and nothing they started) are gone"
    )
