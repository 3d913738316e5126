"""Ending an estimate in flight: a launch (whose ranks must not be forked while an estimate forks
or builds batches) or the interpreter's exit (a thread still inside torch's C++ when finalization
begins aborts the process) asks the estimate to stop. The children an estimate forks (a trace's,
the machine measurement's) are killed at once, and nothing new is forked, until allowed again.

One flag for the whole process: the estimator runs one trace at a time and measures one machine
profile at a time, and whoever cancels (the panel) waits for its estimate thread afterwards.

A Scope ends one estimate only: the panel gives each request its own, and a newer request ends the
superseded one's (its trace child killed at once) instead of queueing behind its trace.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "CANCELLED",
    "Cancelled",
    "Scope",
    "allow",
    "cancel",
    "check",
    "is_cancelled",
    "scope",
    "started",
]

CANCELLED = threading.Event()
"""Set by cancel(): traces and measurements raise Cancelled instead of starting, until allow()."""
_RUNNING: list[Any] = []
"""The children (multiprocessing.Process) of the estimates in flight: cancel() kills them all,
Scope.end() its own."""
_OWNERS: dict[int, Scope] = {}
"""id() of a child in _RUNNING -> the Scope it was started in (absent: started outside any)."""
_LOCK = threading.Lock()
_LOCAL = threading.local()


class Scope:
    """One estimate's own cancellation (the panel's request): ended, its children are killed and
    its thread raises Cancelled at its next check, while other estimates go on."""

    def __init__(self, name: str = "an estimate") -> None:
        self.name = name
        self.ended = threading.Event()

    def end(self) -> None:
        """Kill this scope's children now; its thread stops at its next check."""
        self.ended.set()
        with _LOCK:  # as in cancel(): a started() under the lock registers before this reads
            for child in _RUNNING:
                if _OWNERS.get(id(child)) is self:
                    with contextlib.suppress(ProcessLookupError):
                        child.kill()


@contextlib.contextmanager
def scope(owner: Scope) -> Iterator[Scope]:
    """Within it (this thread), children started belong to `owner`, and check() raises once
    `owner` has ended."""
    before = getattr(_LOCAL, "scope", None)
    _LOCAL.scope = owner
    try:
        yield owner
    finally:
        _LOCAL.scope = before


def _current() -> Scope | None:
    return getattr(_LOCAL, "scope", None)


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
    """The process-wide flag is set, or this thread's Scope has ended."""
    owner = _current()
    return CANCELLED.is_set() or (owner is not None and owner.ended.is_set())


def check(what: str) -> None:
    """Raise Cancelled (naming what was about to start) when the estimate was cancelled."""
    if CANCELLED.is_set():
        raise Cancelled(
            f"the estimate was cancelled before {what} (a run is launching, or Python is exiting)"
        )
    owner = _current()
    if owner is not None and owner.ended.is_set():
        raise Cancelled(f"{owner.name} was superseded before {what}")


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
            owner = _current()
            for proc in procs:
                if proc.pid is not None:
                    _RUNNING.append(proc)
                    if owner is not None:
                        _OWNERS[id(proc)] = owner
    try:
        yield
    finally:
        with _LOCK:
            for proc in procs:
                _OWNERS.pop(id(proc), None)
                with contextlib.suppress(ValueError):
                    _RUNNING.remove(proc)
