"""Ending an estimate in flight: a launch (whose ranks must not be forked while an estimate forks
or builds batches) or the interpreter's exit (a thread still inside torch's C++ when finalization
begins aborts the process) asks the estimate to stop. The children an estimate forks (a trace's,
the machine measurement's) are killed at once, and nothing new is forked, until allowed again.

One flag for the whole process: the estimator runs one trace at a time and measures one machine
profile at a time, and whoever cancels (the panel) waits for its estimate thread afterwards.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["CANCELLED", "Cancelled", "allow", "cancel", "check", "is_cancelled", "started"]

CANCELLED = threading.Event()
"""Set by cancel(): traces and measurements raise Cancelled instead of starting, until allow()."""
_RUNNING: list[Any] = []
"""The children (multiprocessing.Process) of the estimate in flight: cancel() kills them."""
_LOCK = threading.Lock()


class Cancelled(RuntimeError):
    """The estimate was cancelled (a run is launching, or the interpreter is exiting)."""


def cancel() -> None:
    """Refuse new traces and measurements, and kill the children of those in flight: their parent
    reads an end of file and raises Cancelled."""
    CANCELLED.set()
    # after the flag: a started() that holds the lock now registers its children before this reads
    # them, and one that takes it after sees the flag and starts none
    with _LOCK:
        for child in _RUNNING:
            with contextlib.suppress(ProcessLookupError):  # it ended by itself meanwhile
                child.kill()


def allow() -> None:
    CANCELLED.clear()


def is_cancelled() -> bool:
    return CANCELLED.is_set()


def check(what: str) -> None:
    """Raise Cancelled (naming what was about to start) when the estimate was cancelled."""
    if CANCELLED.is_set():
        raise Cancelled(
            f"the estimate was cancelled before {what} (a run is launching, or Python is exiting)"
        )


@contextlib.contextmanager
def started(procs: list[Any]) -> Iterator[None]:
    """Start `procs` (multiprocessing.Process) unless the estimate was cancelled (Cancelled, none
    started); within it, cancel() kills them. The check, the starts and the registration are one
    step under the lock, so no child escapes a cancel() that races with its start."""
    with _LOCK:
        check(f"{procs[0].name if procs else 'a child'} started")
        try:
            for proc in procs:
                proc.start()
        finally:
            _RUNNING.extend(p for p in procs if p.pid is not None)
    try:
        yield
    finally:
        with _LOCK:
            for proc in procs:
                with contextlib.suppress(ValueError):
                    _RUNNING.remove(proc)
