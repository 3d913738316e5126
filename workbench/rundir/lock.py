"""One writer per run directory: an exclusive lock file from prepare to the end of the run.

LOCK records its owner: host, pid, process start time, and, once started, the process that runs the
ranks. It is written whole to a temp file and hard-linked into place (a link fails where LOCK
exists), so no one ever reads a half-written lock and two launches racing for a new run directory
can't both win. A lock whose processes are all gone (checked by pid on the same host, by its Slurm
job's state, and elsewhere by whether the ranks' heartbeats still change, timed on this host's
clock) is stale and taken over; one whose Slurm job can't be asked (the controller is unreachable)
is not, while its heartbeats are fresh or there are none to tell. Judging a lock and taking it over
happen under an flock on LOCK_GUARD, a file that is never deleted: without it, two launches could
both judge one stale lock, and the second delete the first's new lock to put its own.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.rundir.liveness import heartbeat_verdict, is_alive, this_process
from workbench.rundir.scheduler import ACTIVE, UNKNOWN, identity_of, query
from workbench.utils.files import (
    DamagedFileError,
    mkstemp_like_open,
    parse_json,
    read_json_checked,
    write_json,
)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from workbench.rundir.run_dir import RunDir

log = logging.getLogger("workbench")

LOCK = "LOCK"
LOCK_GUARD = ".LOCK.guard"
"""flock'ed while a launch judges LOCK and takes it; never deleted, so that every launch locks the
same file."""
DAMAGED_AFTER_S = 10.0
"""A LOCK that can't be read is damaged (its writer died) once older than this; younger, a launch of
an older workbench (which created LOCK empty, then wrote it) may still be writing it."""
GUARD_WAIT_S = 30.0
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


class RunDirLocked(ValueError):
    """Another live launch holds the run directory (or its lock can't be read: the message says what
    to do)."""


def _stale(run: RunDir, owner: dict[str, Any]) -> tuple[bool, str]:
    """Whether the lock's processes are all gone, and (when not) why it is taken for held."""
    runner = owner["runner"] if isinstance(owner.get("runner"), dict) else None
    job = runner.get("slurm_job_id") if runner else None
    verdicts = [is_alive(owner)]
    unasked = ""
    if job:
        answer = query(str(job), identity_of(runner))
        if answer is not None and answer.state == UNKNOWN:
            unasked = f"its Slurm job {job}'s state is unknown ({answer.reason})"
        verdicts.append(None if answer is None or unasked else answer.state.split()[0] in ACTIVE)
    elif runner is not None:
        verdicts.append(is_alive(runner))
    if any(v is True for v in verdicts):
        return False, ""
    if verdicts and all(v is False for v in verdicts):
        return True, ""
    # Another host's processes, or a job that can't be asked: do the ranks' heartbeats still change,
    # timed on this host's clock? The lock's own record counts as one (a launch that took it has no
    # heartbeat yet).
    fresh, why, beats = heartbeat_verdict(run, settle=True, also=((run.lock_path, owner),))
    if fresh is True:
        return False, f"; its ranks' heartbeats are fresh ({why})" + (
            f", and {unasked}" if unasked else ""
        )
    if unasked and not beats:  # nothing to go by (a job still pending?): nothing says it is gone
        return (
            False,
            f"; {unasked}, and it has no heartbeat to tell by: try again once `scontrol ping` says "
            "UP",
        )
    return (True, "") if fresh is False else (False, f"; {why}")


@contextlib.contextmanager
def _guarded(run: RunDir, required: bool = True) -> Iterator[None]:
    """Hold LOCK_GUARD. Where flock isn't supported, go on without: LOCK still can't be created
    twice, only two takeovers of one stale lock could both succeed. `required=False` (releasing)
    goes on without it too when it can't be had in time or at all."""
    guard = run.path / LOCK_GUARD
    try:
        fd = _open_guard(guard)
    except OSError:
        if required:
            raise
        yield
        return
    try:
        _flock(fd, guard, run, required)
        yield
    finally:
        os.close(fd)  # releases the flock


def _open_guard(guard: Path) -> int:
    try:
        return os.open(guard, os.O_RDWR | os.O_CREAT, 0o666)  # less the umask
    except PermissionError:
        # another user's guard in a shared run directory: reading it is enough to flock it
        return os.open(guard, os.O_RDONLY)


def _flock(fd: int, guard: Path, run: RunDir, required: bool) -> None:
    deadline = time.monotonic() + GUARD_WAIT_S
    while fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                if not required:
                    log.warning(
                        "%s: held by another process for %.0f s; going on without it",
                        guard,
                        GUARD_WAIT_S,
                    )
                    return
                raise RunDirLocked(
                    f"run directory {run.path}: another process has held {guard} for "
                    f"{GUARD_WAIT_S:.0f} s while taking the run's lock; try again (if it stays so, "
                    f"`fuser {guard}` names the process, which is stuck)"
                ) from None
            time.sleep(0.002)
        except OSError as e:  # no flock on this filesystem
            log.debug("%s: flock unsupported (%s); taking the lock without the guard", guard, e)
            return


def _judge(run: RunDir) -> tuple[int, str] | None:
    """None when there is no LOCK; (log level, why) when it may be taken over (stale or damaged);
    RunDirLocked when a live launch holds it, or it can't be told (a directory, unreadable, damaged
    but fresh)."""
    path = run.lock_path
    try:
        with open(path, "rb") as f:
            data, age = f.read(), time.time() - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise RunDirLocked(
            f"run directory {run.path}: {path} is a directory, not a lock file; remove it (if no "
            "launch is using this run directory) and try again"
        ) from None
    except OSError as e:
        raise RunDirLocked(
            f"run directory {run.path}: its lock file {path} can't be read ({e.strerror or e}); "
            "fix its permissions, or delete it if no launch is using this run directory"
        ) from None
    try:
        owner = parse_json(data, path)
    except DamagedFileError as e:
        if age < DAMAGED_AFTER_S:
            raise RunDirLocked(
                f"run directory {run.path}: its lock file {path} can't be read ({e.problem}) and "
                f"was written {age:.0f} s ago: another launch may be writing it; try again in a "
                f"few seconds, and if it stays so, delete {path} (if no launch is using this run "
                "directory)"
            ) from None
        return (
            logging.WARNING,
            f"{path} can't be read ({e.problem}) and is {age:.0f} s old: a damaged lock, taken "
            "over",
        )
    stale, why = _stale(run, owner)
    if not stale:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("time", 0)))
        raise RunDirLocked(
            f"run directory {run.path} is in use by pid {owner.get('pid')} on "
            f"{owner.get('host')} (since {since}){why}; wait for that run to end or stop it, or "
            "pick another run_name"
        )
    return (
        logging.INFO,
        f"the launch of {path} (pid {owner.get('pid')} on {owner.get('host')}) is gone; taken over",
    )


def _put(run: RunDir, record: dict[str, Any]) -> bool:
    """Put LOCK in place, whole; False when there is one already."""
    data = json.dumps(record).encode("utf-8")
    fd, tmp = mkstemp_like_open(run.path, prefix=f".{LOCK}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, run.lock_path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_HARD_LINKS:
                raise
        # No hard links on this filesystem: create it exclusively and write it, under the guard.
        try:
            lock_fd = os.open(run.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        try:
            with os.fdopen(lock_fd, "wb") as f:
                f.write(data)
        except BaseException:
            run.lock_path.unlink(missing_ok=True)  # not an empty lock that would hold others off
            raise
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def acquire(run: RunDir, token: str | None = None) -> str:
    """Take the lock (taking over a stale one); returns its token. RunDirLocked when someone live
    holds it.

    With the token of a lock already held (a restart by the same launcher), the lock is kept as it
    is.
    """
    if token is not None and held_by(run, token):
        return token
    token = secrets.token_hex(8)
    with run.writing(run.lock_path, "the run's lock"), _guarded(run):
        takeover = _judge(run)
        if takeover is not None:
            log.log(takeover[0], "run directory %s: %s", run.path, takeover[1])
            run.lock_path.unlink(missing_ok=True)
        if not _put(run, {**this_process(), "token": token, "time": time.time()}):
            # Only a launch that doesn't take the guard (an older workbench) gets here.
            raise RunDirLocked(
                f"run directory {run.path}: another launch took its lock {run.lock_path} just now; "
                "wait for that run to end, or pick another run_name"
            )
    return token


def owner(run: RunDir) -> dict[str, Any] | None:
    """The lock's record; None when there is no lock or it can't be read (then it names no one)."""
    try:
        return owner_checked(run)
    except DamagedFileError:
        return None


def owner_checked(run: RunDir) -> dict[str, Any] | None:
    """The lock's record; None when there is no lock; DamagedFileError (naming LOCK and what is
    wrong) when it is there but can't be read: for a reader that must not take a damaged lock for
    no lock (kill(): a run whose lock names no one may still be training)."""
    return read_json_checked(run.lock_path)


def set_runner(run: RunDir, token: str, runner: dict[str, Any]) -> None:
    """Record the process that runs the ranks (supervisor or launcher), so staleness follows it."""
    with _guarded(run, required=False):
        held = owner(run)
        if held and held.get("token") == token:
            write_json(run.lock_path, {**held, "runner": runner})


def hand_over(run: RunDir, token: str, holder: dict[str, Any]) -> None:
    """The lock, still under `token`, now held by `holder` (host, pid, create_time: another
    process, which may be on another host): a run whose submitter leaves it to a process of its own
    (a Ray run's driver actor). Staleness follows that process from then on."""
    with _guarded(run, required=False):
        held = owner(run)
        if held and held.get("token") == token:
            write_json(run.lock_path, {**held, **holder, "runner": holder})


def release(run: RunDir, token: str | None) -> None:
    with _guarded(run, required=False):
        if token and held_by(run, token):
            run.lock_path.unlink(missing_ok=True)


def held_by(run: RunDir, token: str | None) -> bool:
    held = owner(run)
    return bool(held and token and held.get("token") == token)


@contextlib.contextmanager
def holding(run: RunDir, token: str | None) -> Iterator[bool]:
    """Whether `token` still holds the lock, kept true while the block runs: no launch can take the
    directory over meanwhile. For a process that outlives its launcher's interest in the run
    (launcher/forked.py)."""
    with _guarded(run, required=False):
        yield held_by(run, token)
