"""One writer per run directory: an exclusive lock file from prepare to the end of the run.

The lock is created with O_EXCL (so two launches racing for one run directory can't both win) and records
its owner: host, pid, process start time, and, once started, the process that runs the ranks. A lock whose
processes are all gone (checked by pid on the same host, by heartbeat age elsewhere) is stale and taken over.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

from workbench.rundir.liveness import STALE_AFTER_S, heartbeats, is_alive, this_process
from workbench.utils.files import read_json, write_json

if TYPE_CHECKING:
    from workbench.rundir.run_dir import RunDir

LOCK = "LOCK"


class RunDirLocked(ValueError):
    """Another live launch holds the run directory."""


def _stale(run: RunDir, owner: dict[str, Any]) -> bool:
    holders = [owner] + ([owner["runner"]] if owner.get("runner") else [])
    verdicts = [is_alive(h) for h in holders]
    if any(v is True for v in verdicts):
        return False
    if verdicts and all(v is False for v in verdicts):
        return True
    newest = max([b.get("time", 0) for b in heartbeats(run)] + [owner.get("time", 0)])
    return time.time() - newest > STALE_AFTER_S


def acquire(run: RunDir, token: str | None = None) -> str:
    """Take the lock (taking over a stale one); returns its token. RunDirLocked when someone live holds it.

    With the token of a lock already held (a restart by the same launcher), the lock is kept as it is.
    """
    if token is not None and held_by(run, token):
        return token
    token = secrets.token_hex(8)
    record = {**this_process(), "token": token, "time": time.time()}
    for _ in range(3):
        try:
            fd = os.open(run.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            owner = read_json(run.lock_path)
            if owner is None or _stale(run, owner):
                run.lock_path.unlink(missing_ok=True)  # a half-written or stale lock: its owner is gone
                continue
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("time", 0)))
            raise RunDirLocked(f"run directory {run.path} is in use by pid {owner.get('pid')} on "
                               f"{owner.get('host')} (since {since}); wait for that run to end or stop it, or pick "
                               "another run_name") from None
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        return token
    raise RunDirLocked(f"run directory {run.path}: could not take its lock {run.lock_path} (another launch keeps "
                       "taking it); try again")


def set_runner(run: RunDir, token: str, runner: dict[str, Any]) -> None:
    """Record the process that runs the ranks (supervisor or launcher), so staleness follows it."""
    owner = read_json(run.lock_path)
    if owner and owner.get("token") == token:
        write_json(run.lock_path, {**owner, "runner": runner})


def release(run: RunDir, token: str | None) -> None:
    owner = read_json(run.lock_path)
    if owner and token and owner.get("token") == token:
        run.lock_path.unlink(missing_ok=True)


def held_by(run: RunDir, token: str | None) -> bool:
    owner = read_json(run.lock_path)
    return bool(owner and token and owner.get("token") == token)
