"""Is a run still going? Heartbeats of the ranks, and the process ids the run directory records.

Each rank writes ranks/rank_<r>.json every few seconds from a background thread (pid, host, step,
phase). A reader that finds the status 'starting' or 'running' asks `observe()`: on this host the
recorded processes are checked directly (pid and start time, so a reused pid doesn't count); a Slurm
job is asked of its controller (scheduler.py: a controller that can't be reached tells nothing); a
run on another host is taken for gone once its heartbeats stop changing. A status can then never
claim 'running' for a run whose processes are all gone, nor 'failed' for one that can't be seen from
here.

Whether a heartbeat changes is timed on the reader's own clock (time.monotonic), never by comparing
the writer's timestamp with the reader's clock alone: the hosts' clocks may differ by minutes. A
heartbeat seen unchanged for STALE_AFTER_S is stale; one seen changing is fresh. A reader that has
just come (a first look) goes by the writer's timestamp only while it agrees with the reader's
clock; one that looks old (or from the future) by it is watched for CONFIRM_S, a few heartbeat
periods, before it is judged: `observe(settle=True)` (`workbench status`, a launch judging a lock)
re-reads it meanwhile; other readers (a repr, wb.runs) say they can't tell yet, and a reader that
looks again (wait(), the dashboard) judges it on a later look.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from workbench.rundir.scheduler import ACTIVE, JOB_FILE, UNKNOWN, identity_of, query
from workbench.utils.files import read_json

if TYPE_CHECKING:
    from workbench.rundir.run_dir import RunDir

HEARTBEAT_EVERY_S = 2.0
STALE_AFTER_S = 60.0
"""A heartbeat seen unchanged this long, on the reader's clock, is stale: its rank is gone (or
hung)."""
CONFIRM_S = 4 * HEARTBEAT_EVERY_S
"""How long a heartbeat that looks old by the writer's clock is watched before it is judged: a live
rank rewrites it every HEARTBEAT_EVERY_S, so one unchanged over this is more than a clock that
differs."""
_RE_READ_S = 0.25
_REMEMBERED = 4096
"""Heartbeats whose changes a process keeps track of; the ones looked at least recently are
forgotten first."""


def this_process() -> dict[str, Any]:
    """Who we are, in a form another process can check: host, pid and the process's start time."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),
    }


def is_alive(identity: dict[str, Any] | None) -> bool | None:
    """True/False for a process of this host (a reused pid counts as gone), or a Slurm job
    ({'slurm_job_id'} and who the job is, scheduler.IDENTITY: queued or running counts as alive,
    another's job of that id as gone); None when it can't be told (another host, a controller that
    can't be asked)."""
    if identity and identity.get("slurm_job_id"):
        answer = query(str(identity["slurm_job_id"]), identity_of(identity))
        return (
            None if answer is None or answer.state == UNKNOWN else answer.state.split()[0] in ACTIVE
        )
    if not identity or identity.get("host") != socket.gethostname() or not identity.get("pid"):
        return None
    try:
        proc = psutil.Process(int(identity["pid"]))
        started = identity.get("create_time")
        return proc.status() != psutil.STATUS_ZOMBIE and (
            started is None or abs(proc.create_time() - started) < 1.0
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def proven_process(identity: dict[str, Any] | None) -> psutil.Process | None:
    """The live process of this host that `identity` names by pid AND start time; None when there is
    none (gone, a zombie, another host, a record without a start time, or a reused pid: a process
    that started at another time). What a process may signal on a record's word: a pid alone
    proves nothing."""
    if not identity or identity.get("host") != socket.gethostname():
        return None
    pid, started = identity.get("pid"), identity.get("create_time")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    if isinstance(started, bool) or not isinstance(started, (int, float)):
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) >= 1.0 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except (psutil.Error, OverflowError):
        return None
    return proc


@dataclass(frozen=True)
class Observation:
    """What a reader can tell about a run that says it is starting or running."""

    alive: bool | None
    """True: a process of the run is running; False: all are gone; None: can't tell (another host,
    fresh)."""
    reason: str
    last_step: int | None = None
    doubt: str = ""
    """What a status shown for a run that isn't gone should say with it: its Slurm job's state can't
    be asked (the controller is unreachable), or its heartbeats can't be judged yet; '' when nothing
    is in doubt."""


def heartbeats(run: RunDir) -> list[dict[str, Any]]:
    return [beat for _, beat in _read_beats(run)]


def _read_beats(run: RunDir) -> list[tuple[Path, dict[str, Any]]]:
    return [
        (p, b)
        for p in sorted(run.ranks_path.glob("rank_*.json"))
        if isinstance(b := read_json(p), dict) and b
    ]


# ---- heartbeats, timed on this reader's clock ----------------------------------------------------
@dataclass
class _Seen:
    signature: Any
    since: float
    """When this process first read the heartbeat as it is now (time.monotonic)."""
    before: float | None
    """When it last read it as it was before (it changed between then and `since`); None: never saw
    it change."""
    looked: float


_seen: dict[str, _Seen] = {}
_seen_lock = threading.Lock()


def _look(path: Path, beat: dict[str, Any], now: float) -> _Seen:
    """Note this read of a heartbeat, and return what this process has seen of it."""
    signature = (beat.get("time"), beat.get("pid"), beat.get("step"), beat.get("phase"))
    key = str(path)
    with _seen_lock:
        seen = _seen.get(key)
        if seen is None or seen.signature != signature:
            seen = _seen[key] = _Seen(signature, now, None if seen is None else seen.looked, now)
        seen.looked = now
        if len(_seen) > _REMEMBERED:  # down to three quarters, so that this runs once in a while
            for old in sorted(_seen, key=lambda k: _seen[k].looked)[
                : len(_seen) - _REMEMBERED * 3 // 4
            ]:
                del _seen[old]
        return seen


def _judge(beat: dict[str, Any], seen: _Seen, now: float) -> tuple[bool | None, str]:
    """One heartbeat: (True fresh / False stale / None can't tell yet, why)."""
    unchanged = now - seen.since
    if unchanged > STALE_AFTER_S:
        return False, f"unchanged for the {unchanged:.0f} s watched from here"
    if seen.before is not None and now - seen.before <= STALE_AFTER_S:
        return True, "changed while watched from here"
    stamp = beat.get("time")
    if not isinstance(stamp, (int, float)):
        return (
            (False, "unreadable and unchanged") if unchanged >= CONFIRM_S else (None, "unreadable")
        )
    age = time.time() - stamp
    if -CONFIRM_S <= age <= STALE_AFTER_S:
        return True, f"written {max(age, 0):.0f} s ago"
    said = f"{age:.0f} s old" if age > 0 else f"{-age:.0f} s in the future"
    if unchanged >= CONFIRM_S:
        return (
            False,
            f"{said} by the writer's clock and unchanged for the {unchanged:.0f} s watched from "
            "here",
        )
    return (
        None,
        f"{said} by the writer's clock (the hosts' clocks may differ), watched for {unchanged:.0f} "
        "s",
    )


def heartbeat_verdict(
    run: RunDir, settle: bool = False, also: tuple[tuple[Path, dict[str, Any]], ...] = ()
) -> tuple[bool | None, str, list[dict[str, Any]]]:
    """Whether the run's heartbeats are fresh (True: one still changes), stale (False: every one has
    stopped) or can't be told (None: none yet, or one just seen that looks old by the writer's
    clock), with why and the heartbeats read. `settle`: re-read them for up to CONFIRM_S until it
    can be told. `also`: other records judged as heartbeats, (path, record with its 'time') (a
    lock's: a launch that has just taken it)."""
    started = time.monotonic()
    while True:
        now = time.monotonic()
        beats = _read_beats(run)
        judged = [*beats, *also]
        if not judged:
            return None, "no heartbeat yet", []
        verdicts = [
            (v, f"{path.name} {why}")
            for path, beat in judged
            for v, why in [_judge(beat, _look(path, beat, now), now)]
        ]
        fresh = [why for v, why in verdicts if v is True]
        if fresh:
            return True, fresh[0], [b for _, b in beats]
        if all(v is False for v, _ in verdicts):
            return False, f"no heartbeat changes: {verdicts[0][1]}", [b for _, b in beats]
        if not settle or now - started > CONFIRM_S + 2 * _RE_READ_S:
            return (
                None,
                f"can't tell yet: {next(why for v, why in verdicts if v is None)}",
                [b for _, b in beats],
            )
        time.sleep(_RE_READ_S)


# ---- a run ---------------------------------------------------------------------------------------
def observe(run: RunDir, settle: bool = False) -> Observation:
    """Whether the processes of `run` are still there (see the module docstring). `settle`: a
    one-shot reader may re-read the heartbeats for a few heartbeat periods before it judges them
    (heartbeat_verdict)."""
    beats = heartbeats(run)
    held = run.lock_owner()
    runner = held.get("runner") if held and isinstance(held.get("runner"), dict) else None
    recorded = read_json(run.path / JOB_FILE) if runner is None else None
    if isinstance(recorded, dict) and recorded.get("job_id"):
        # a job submitted by hand (the README's sbatch recipe), or a run whose launch is over
        runner = {"slurm_job_id": recorded["job_id"], **identity_of(recorded)}
    job = runner.get("slurm_job_id") if runner is not None else None
    job_note = ""
    if job:
        # the process that submitted a Slurm job runs nothing of it: the job, and its ranks'
        # heartbeats, tell
        answer = query(str(job), identity_of(runner))
        job_verdict = (
            None if answer is None or answer.state == UNKNOWN else answer.state.split()[0] in ACTIVE
        )
        if answer is not None and answer.state == UNKNOWN:
            job_note = f"its Slurm job {job}'s state is unknown: {answer.reason}"
        elif answer is not None and answer.foreign:
            job_note = answer.reason
        verdicts = [is_alive(b) for b in beats] + [job_verdict]
    else:
        verdicts = [is_alive(o) for o in [*beats, *([held] if held else [])]]
    last_step = max((b.get("step", 0) for b in beats), default=None)

    def with_note(text: str) -> str:
        return f"{text} ({job_note})" if job_note else text

    if any(v is True for v in verdicts):
        return Observation(True, with_note("its processes are running"), last_step, job_note)
    if verdicts and all(v is False for v in verdicts):
        if job:
            return Observation(
                False,
                with_note(f"its Slurm job {job} is no longer running and no rank is alive"),
                last_step,
            )
        return Observation(
            False, f"every process of the run is gone ({len(verdicts)} checked by pid)", last_step
        )
    fresh, why, _ = heartbeat_verdict(run, settle=settle)
    if fresh is False:
        return Observation(False, with_note(why), last_step)
    if fresh is True:
        return Observation(
            None, with_note(f"running, as far as can be told from here: {why}"), last_step, job_note
        )
    if job_note:
        return Observation(None, f"{job_note}; {why}", last_step, f"{job_note}; {why}")
    return Observation(
        None,
        f"no process of the run can be checked from here yet ({why})",
        last_step,
        why if why.startswith("can't tell") else "",
    )
