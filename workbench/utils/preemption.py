"""The signals a run reacts to, and the one place their handlers are installed: on the caller's side
(`workbench train`, Run.wait, the fork-mode supervisor) and on the rank side (rank_main, the worker,
the trainer's RankWatch) alike. Both sides may import it: it needs nothing but the standard library.

SIGTERM (schedulers, Kubernetes, cloud preemption), SIGHUP and cfg.preempt_signal (e.g. Slurm's
USR1) mean "preempted: checkpoint and exit now". The path of one such signal:

- caller side: `workbench train` keeps it while it checks and prepares (`before_launch`), so the
  launch ends preempted without starting ranks, or forwards it once they are there; Run.wait
  forwards it to the ranks and delivers it to its own process again once they are gone; the
  fork-mode supervisor passes it to its ranks and keeps it (`early`) for the ones it forks later. A
  signal the process ignores (nohup's SIGHUP) stays ignored.
- rank side: kept (`early`) from the rank's first instruction until the trainer's RankWatch takes it
  over; the RankWatch raises the flag the ranks vote on (training/stop_vote.py), so every rank stops
  on the same step, checkpoints and exits: the run ends 'preempted' (exit code 75 from `workbench
  train`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.config import RunConfig

Handler = Callable[[int, Any], None]


def preempt_signals(cfg: RunConfig | None) -> list[signal.Signals]:
    """SIGTERM (schedulers, Kubernetes, cloud preemption), SIGHUP, and cfg.preempt_signal (e.g.
    Slurm's USR1)."""
    names = [
        "SIGTERM",
        "SIGHUP",
        *([cfg.preempt_signal] if cfg is not None and cfg.preempt_signal else []),
    ]
    return [getattr(signal, n) for n in dict.fromkeys(names)]


def elastic_signals(cfg: RunConfig) -> str:
    """The signals torch elastic (torchrun, notebook_launcher) handles and forwards to the ranks:
    its defaults and the configured preemption signal, which would otherwise end elastic itself."""
    names = [
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        *([cfg.preempt_signal] if cfg.preempt_signal else []),
    ]
    return ",".join(dict.fromkeys(names))


class KeptSignal:
    """The first preemption signal a process got while nothing could act on it yet, kept until
    taken."""

    def __init__(self) -> None:
        # a list: a handler appends without a lock (at most one: the first)
        self._kept: list[int] = []

    def keep(self, signum: int, frame: Any = None) -> None:
        """A signal handler: keep the first signal."""
        if not self._kept:
            self._kept.append(signum)

    def take(self) -> int:
        """The kept signal (0: none), forgotten once taken."""
        return self._kept.pop() if self._kept else 0


early = KeptSignal()
"""Rank side: a signal that came before the rank's RankWatch started (torch importing, the task
built, the process group forming), which would otherwise kill the rank and read as an out-of-memory
kill. Ranks the fork-mode supervisor forks inherit what it kept."""
before_launch = KeptSignal()
"""Caller side: a signal `workbench train` got while it checked and prepared, before it had ranks to
forward to; the launch takes it (launcher/launch.py, Run.wait)."""


def on_main_thread() -> bool:
    """Python runs signal handlers in the main thread only, and installs them only from there."""
    return threading.current_thread() is threading.main_thread()


def install(handler: Handler, cfg: RunConfig | None, *, leave_ignored: bool) -> dict[int, Any]:
    """`handler` for each of the run's preemption signals (nothing off the main thread); returns the
    handlers it replaced, for `restore`. `leave_ignored`: a signal this process ignores (nohup's
    SIGHUP) stays ignored."""
    previous: dict[int, Any] = {}
    if not on_main_thread():
        return previous
    for sig in preempt_signals(cfg):
        if leave_ignored and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        previous[sig] = signal.signal(sig, _plain(handler))
    return previous


def _plain(handler: Handler) -> Handler:
    """`handler` inside a plain function. signal.signal answers the handler it replaces as an enum
    when it is one, and finds out by formatting a ValueError with the handler's repr: a bound
    method's repr is its object's, and a Run's reads its run directory (11 ms; twice per launch, as
    `restore` puts the defaults back). A function's repr costs nothing, whatever it wraps."""

    def on_signal(signum: int, frame: Any) -> Any:
        return handler(signum, frame)

    return on_signal


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers `install` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextmanager
def handling(handler: Handler, cfg: RunConfig | None, *, leave_ignored: bool) -> Iterator[bool]:
    """`install` for the block, `restore` after it; yields whether the handlers are in (the main
    thread)."""
    previous = install(handler, cfg, leave_ignored=leave_ignored) if on_main_thread() else None
    try:
        yield previous is not None
    finally:
        if previous:
            restore(previous)


def catch_early(cfg: RunConfig | None = None) -> None:
    """Rank side, first thing in a rank (again once its config is read, for cfg.preempt_signal):
    keep a preemption signal for the RankWatch rather than die of it, whatever the rank inherited
    for it."""
    install(early.keep, cfg, leave_ignored=False)


def launcher_takes_signals(cfg: RunConfig | None) -> None:
    """Caller side, `workbench train`: handle, not inherit. Ctrl-C stops gracefully whatever the
    shell left SIGINT as (a background job ignores it); a preemption signal is kept for the launch
    (`before_launch`), and one the launch has forwarded doesn't end this process before the ranks
    have checkpointed (the launch delivers it here again when they are done)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install(before_launch.keep, cfg, leave_ignored=True)
