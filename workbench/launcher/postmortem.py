"""After a run's ranks are gone: decide how it ended when the ranks couldn't say so themselves.

Rank 0 records 'completed' or 'stopped'. A failure is recorded here, by the caller's side (the
fork-mode supervisor and `Run.wait()`), because the rank that failed, or rank 0, may be dead. The
error that is reported is the likely cause: a real exception before the fallout it caused in other
ranks (a collective that lost its peer), and a rank killed by a signal is named even though it left
no exception behind.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

from workbench.rundir import RunDir, Status, is_fallout

log = logging.getLogger("workbench")


def record_signal_deaths(run: RunDir, exc: BaseException) -> None:
    """A rank killed by a signal (the OOM killer's SIGKILL, a segfault) leaves no exception behind;
    torch elastic's ChildFailedError still knows its exit code, so record it as that rank's
    error."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in failures.items():
        code = getattr(failure, "exitcode", 0)
        if code >= 0 or run.has_rank_error(rank):
            continue
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory? see `dmesg`)" if name == "SIGKILL" else ""
        run.write_rank_error(
            rank,
            {
                "type": "Killed",
                "message": f"the process was killed by {name}{hint}",
                "traceback": "",
                "time": getattr(failure, "timestamp", time.time()),
                "pid": getattr(failure, "pid", None),
            },
        )


def _silent_ranks(run: RunDir, errors: list[dict[str, Any]]) -> list[int]:
    """Ranks of a failed run that left no error record (only meaningful once some rank did)."""
    cfg = run.config() if errors else None
    if cfg is None:
        return []
    return sorted(set(range(cfg.num_processes)) - {e.get("rank") for e in errors})


KILLED_EVENT = "killed"
"""The event kill() records before it signals anything: whoever then records the ending (the killer,
or the launching process that saw its ranks die) names the kill as the cause, so both tell one
story."""


def kill_of_this_attempt(run: RunDir) -> dict[str, Any] | None:
    """The cause a kill() recorded for this attempt of the run (after its start), if one did."""
    started = run.summary().started_at or 0.0
    kills = [
        e
        for e in run.events()
        if e.get("event") == KILLED_EVENT and (e.get("time") or 0.0) >= started
    ]
    if not kills:
        return None
    kill = kills[-1]
    return {
        "rank": None,
        "type": "Killed",
        "traceback": "",
        "message": f"killed by {kill.get('by') or 'kill()'} from pid {kill.get('pid')} on "
        f"{kill.get('host')}",
    }


def _cause(
    run: RunDir,
    errors: list[dict[str, Any]],
    launcher_error: BaseException | None,
    exitcode: int | None,
) -> dict[str, Any]:
    killed = kill_of_this_attempt(run)
    if killed is not None and all(is_fallout(e) or e.get("type") == "Killed" for e in errors):
        # what a rank that lost its killed peer wrote is the kill's fallout, kept beside it
        return (
            {
                **killed,
                "other_ranks": [
                    {"rank": e.get("rank"), "type": e.get("type"), "message": e.get("message")}
                    for e in errors
                ],
            }
            if errors
            else killed
        )
    silent = _silent_ranks(run, errors)
    if silent and all(is_fallout(e) for e in errors):
        # Every recorded error is a rank losing its peer; the peer that recorded nothing died first.
        errors = [
            {
                "rank": silent[0],
                "type": "Killed",
                "traceback": "",
                "time": errors[0]["time"],
                "message": "the process ended without raising an exception (killed by a signal? "
                "out of memory? see `dmesg`); the other ranks failed because they lost "
                "it",
            },
            *errors,
        ]
    if errors:
        error = errors[0]
        if len(errors) > 1:
            error = {
                **error,
                "other_ranks": [
                    {"rank": e["rank"], "type": e["type"], "message": e["message"]}
                    for e in errors[1:]
                ],
            }
        return error
    if launcher_error is not None:
        return {
            "rank": None,
            "type": type(launcher_error).__name__,
            "message": str(launcher_error),
            "traceback": "".join(traceback.format_exception(launcher_error)),
        }
    return {
        "rank": None,
        "type": "ProcessExit",
        "traceback": "",
        "message": f"the ranks exited (code {exitcode}) without recording an ending; "
        "a rank may have been killed (out of memory?)",
    }


def finalize(
    run: RunDir, launcher_error: BaseException | None = None, exitcode: int | None = None
) -> dict[str, Any] | None:
    """After the ranks are gone: if the run didn't record an ending, record the failure (rank 0 may
    be dead). Returns the failure when it could not be written (a full disk): the caller still
    reports it, rather than the write error that hid it."""
    status = run.summary().status
    if status is Status.UNKNOWN:
        # a status this version can't read (a newer workbench's): not written over
        log.warning(
            "%s: %s says status %r, which this version of workbench doesn't know; the run's "
            "ending is not recorded over it",
            run.path,
            run.summary_path.name,
            run.summary().status_text,
        )
        return None
    errors = run.rank_errors()
    # Both the supervisor and Run.wait() call this; whoever comes second finds the ending recorded.
    # Rank 0 records the ending of a run that ends as a whole; a rank's error after that is still a
    # failure.
    if status is Status.FAILED or (status.ended and not errors):
        return None
    error = _cause(run, errors, launcher_error, exitcode)
    try:
        run.set_status(Status.FAILED, error=error)
        run.event(
            "failed",
            rank=error.get("rank"),
            type=error["type"],
            message=error["message"],
            traceback=error.get("traceback", ""),
        )
    except OSError as e:
        log.error(
            "%s: could not record the run's failure (%s); the failure was: %s",
            run.path,
            e,
            error["message"],
        )
        reason = os.strerror(e.errno) if e.errno else str(e)
        return {
            **error,
            "message": f"{error['message']} (not recorded in {run.summary_path.name}: {reason})",
        }
    return None
