"""Is a run still going? Heartbeats of the ranks, and the process ids the run directory records.

Each rank writes ranks/rank_<r>.json every few seconds from a background thread (pid, host, step, phase).
A reader that finds the status 'starting' or 'running' asks `observe()`: on this host the recorded
processes are checked directly (pid and start time, so a reused pid doesn't count); a run on another host
is taken for gone once no heartbeat came for STALE_AFTER_S. A status can then never claim 'running' for a
run whose processes are all gone.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from workbench.rundir.scheduler import ACTIVE, JOB_FILE, job_state
from workbench.utils.files import read_json

if TYPE_CHECKING:
    from workbench.rundir.run_dir import RunDir

HEARTBEAT_EVERY_S = 2.0
STALE_AFTER_S = 60.0
"""A run on another host whose newest heartbeat is older than this is taken for gone."""


def this_process() -> dict[str, Any]:
    """Who we are, in a form another process can check: host, pid and the process's start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "create_time": psutil.Process().create_time()}


def is_alive(identity: dict[str, Any] | None) -> bool | None:
    """True/False for a process of this host (a reused pid counts as gone), or a Slurm job ({'slurm_job_id'}:
    queued or running counts as alive); None when it can't be told."""
    if identity and identity.get("slurm_job_id"):
        state = job_state(str(identity["slurm_job_id"]))
        return None if state is None else state[0].split()[0] in ACTIVE
    if not identity or identity.get("host") != socket.gethostname() or not identity.get("pid"):
        return None
    try:
        proc = psutil.Process(int(identity["pid"]))
        started = identity.get("create_time")
        return proc.status() != psutil.STATUS_ZOMBIE and (started is None or abs(proc.create_time() - started) < 1.0)
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


@dataclass(frozen=True)
class Observation:
    """What a reader can tell about a run that says it is starting or running."""

    alive: bool | None
    """True: a process of the run is running; False: all are gone; None: can't tell (another host, fresh)."""
    reason: str
    last_step: int | None = None


def heartbeats(run: RunDir) -> list[dict[str, Any]]:
    return [b for p in sorted(run.ranks_path.glob("rank_*.json")) if isinstance(b := read_json(p), dict) and b]


def observe(run: RunDir) -> Observation:
    """Whether the processes of `run` are still there (see the module docstring)."""
    beats = heartbeats(run)
    held = run.lock_owner()
    runner = held.get("runner") if held and isinstance(held.get("runner"), dict) else None
    recorded = read_json(run.path / JOB_FILE) if runner is None else None
    if isinstance(recorded, dict) and recorded.get("job_id"):
        runner = {"slurm_job_id": recorded["job_id"]}  # a job submitted by hand (the README's sbatch recipe)
    job = runner.get("slurm_job_id") if runner is not None else None
    # the process that submitted a Slurm job runs nothing of it: the job, and its ranks' heartbeats, tell
    owners = [*beats, runner] if job else [*beats, *([held] if held else [])]
    verdicts = [is_alive(o) for o in owners]
    last_step = max((b.get("step", 0) for b in beats), default=None)
    if any(v is True for v in verdicts):
        return Observation(True, "its processes are running", last_step)
    if verdicts and all(v is False for v in verdicts):
        if job:
            return Observation(False, f"its Slurm job {job} is no longer running and no rank is alive", last_step)
        return Observation(False, f"every process of the run is gone ({len(owners)} checked by pid)", last_step)
    newest = max((b.get("time", 0) for b in beats), default=None)
    if newest is not None and time.time() - newest > STALE_AFTER_S:
        return Observation(False, f"no heartbeat for {time.time() - newest:.0f} s", last_step)
    return Observation(None, "no process of the run can be checked from here yet", last_step)
