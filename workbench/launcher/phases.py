"""What a launch is doing before its ranks train, announced by the code that does it: "checking"
(the config, the task, this machine), "preparing data" (datasets resolved, built, tokenized),
"starting N processes" (until the ranks report), "waiting for the cluster" (a Slurm job queued),
"starting Ray workers". A launch can take seconds here and minutes on a cluster before its first
step; whoever shows the launch (the notebook's live line, the panel, the terminal) listens to its
`LaunchPhases` and says which phase it is in at once, with the time since the call.

The launcher doesn't pass the phases down through every call: `announcing(phases)` makes them the
current ones for the code below it (a context variable), and `announce()` anywhere in that code
(preflight's data check, the process starter, the Slurm submitter) moves them on. Outside a launch,
`announce()` does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TextIO

from workbench.utils.units import fmt_duration

log = logging.getLogger("workbench")

CHECKING = "checking"
PREPARING_DATA = "preparing data"
WAITING_FOR_CLUSTER = "waiting for the cluster"
STARTING_RAY = "starting Ray workers"
"""A run on Ray, from connecting to the cluster until its ranks report (the driver actor, the
worker group's placement, the workers' start)."""


def starting(processes: int) -> str:
    """The phase from the start of the ranks' processes until they report: 'starting 2
    processes'."""
    return f"starting {processes} process{'es' if processes != 1 else ''}"


Listener = Callable[["LaunchPhases"], None]


class LaunchPhases:
    """The phases of one launch: which one it is in (`name`, `detail`), since when the launch
    runs, and the ones it went through (`history`: (name, seconds since the call)). Listeners are
    called at each change, from the thread that announced it; one that raises is logged and
    skipped: a view must never break the launch it shows."""

    def __init__(self, name: str = CHECKING) -> None:
        self.started = time.monotonic()
        self.name, self.detail = name, ""
        self.history: list[tuple[str, float]] = [(name, 0.0)]
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def listen(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def enter(self, name: str, detail: str = "") -> None:
        """The launch is in phase `name` now (`detail`: which job, which dataset); a repeat of the
        current phase and detail changes nothing."""
        with self._lock:
            if (name, detail) == (self.name, self.detail):
                return
            if name != self.name:
                self.history.append((name, self.elapsed()))
            self.name, self.detail = name, detail
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(self)
            except Exception:  # noqa: BLE001  (see the class docstring)
                log.debug("a launch phase listener failed", exc_info=True)

    def elapsed(self) -> float:
        """Seconds since the launch was called."""
        return time.monotonic() - self.started

    def text(self) -> str:
        """'preparing data · 1.2 s', 'waiting for the cluster (Slurm job 42 PENDING: Resources) ·
        3 min 05 s': the phase, then the time since the call."""
        with self._lock:
            name, detail = self.name, self.detail
        seconds = self.elapsed()
        # tenths while it counts up by the second, not '7 us' at the call
        since = f"{seconds:.1f} s" if seconds < 60 else fmt_duration(seconds)
        return f"{name}{f' ({detail})' if detail else ''} · {since}"


_current: ContextVar[LaunchPhases | None] = ContextVar("workbench_launch_phases", default=None)


def current() -> LaunchPhases | None:
    """The phases of the launch the calling code runs in, if any."""
    return _current.get()


@contextlib.contextmanager
def announcing(phases: LaunchPhases) -> Iterator[LaunchPhases]:
    """`phases` are the current launch's for the code in the block (announce() moves them on)."""
    token = _current.set(phases)
    try:
        yield phases
    finally:
        _current.reset(token)


def announce(name: str, detail: str = "") -> None:
    """The current launch is in phase `name` now; nothing outside a launch."""
    phases = _current.get()
    if phases is not None:
        phases.enter(name, detail)


def print_phases(phases: LaunchPhases, stream: TextIO | None = None) -> None:
    """In a terminal: each phase as a line of its own ('workbench: checking · 0.0 s'), now and at
    each change."""

    def say(p: LaunchPhases) -> None:
        print(f"workbench: {p.text()}", file=stream or sys.stderr, flush=True)

    say(phases)
    phases.listen(say)
