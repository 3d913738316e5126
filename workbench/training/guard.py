"""A rank's guard: preemption signals, the heartbeat, and the watchdog that names a hung rank.

- SIGTERM, SIGHUP and the configured preempt_signal only set a flag here; the loop's per-step agreement
  makes every rank stop on the same step, checkpoint and exit ('preempted').
- A background thread rewrites ranks/rank_<r>.json every few seconds (pid, host, step, phase), so readers
  can tell a live run from one whose processes are gone.
- After a signal, a rank that doesn't finish within preempt_grace_s is stuck (in user code, or in a
  collective whose peer is stuck): it dumps every thread's Python stack to stacks/rank_<r>.txt, records a
  'Hung' error naming where it was, and ends. That is how a hang is told from the timeouts it causes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from workbench.rundir.liveness import HEARTBEAT_EVERY_S, this_process

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir import RunDir

log = logging.getLogger("workbench")
EXIT_HUNG = 3


def preempt_signals(cfg: RunConfig) -> list[signal.Signals]:
    names = ["SIGTERM", "SIGHUP", *([cfg.preempt_signal] if cfg.preempt_signal else [])]
    return [getattr(signal, n) for n in dict.fromkeys(names)]


def _stacks() -> str:
    """Every thread's Python stack, the main thread (where the training step runs) first."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted(frames, key=lambda ident: ident != main)
    return "\n".join(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frames[ident])) for ident in order)


class Guard:
    """Install on every rank before training; `close()` when the rank is done (normally or not)."""

    def __init__(self, run: RunDir, rank: int, cfg: RunConfig) -> None:
        self.run, self.rank, self.cfg = run, rank, cfg
        self.signal: int = 0
        """The preemption signal this rank received (0: none)."""
        self.step, self.phase = 0, "starting"
        self.identity = this_process()
        self._done = threading.Event()
        self._previous: dict[int, Any] = {}
        self._write_failed = False

    def start(self) -> Guard:
        if threading.current_thread() is threading.main_thread():
            for sig in preempt_signals(self.cfg):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self.beat()
        threading.Thread(target=self._beat_forever, name=f"wb-heartbeat-{self.rank}", daemon=True).start()
        return self

    def at(self, step: int, phase: str) -> None:
        """Where the rank is: shown in its heartbeat, and in the report if it hangs."""
        self.step, self.phase = step, phase

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.signal:
            self.signal = signum
            threading.Thread(target=self._watch, name=f"wb-watchdog-{self.rank}", daemon=True).start()

    def beat(self) -> None:
        try:
            self.run.write_heartbeat(self.rank, {**self.identity, "step": self.step, "phase": self.phase,
                                                 "signal": signal.Signals(self.signal).name if self.signal else None})
        except OSError as e:  # a full disk must not kill the rank from a side thread; the loop reports it
            if not self._write_failed:
                log.warning("[rank %d] heartbeat: %s", self.rank, e)
            self._write_failed = True

    def _beat_forever(self) -> None:
        while not self._done.wait(HEARTBEAT_EVERY_S):
            self.beat()

    def _watch(self) -> None:
        started = time.time()
        if self._done.wait(self.cfg.preempt_grace_s):
            return
        name = signal.Signals(self.signal).name
        self.run.stacks_path.mkdir(parents=True, exist_ok=True)
        path = self.run.stacks_path / f"rank_{self.rank}.txt"
        stack = _stacks()
        path.write_text(stack)
        self.run.write_rank_error(self.rank, {
            "type": "Hung", "pid": os.getpid(), "traceback": stack,
            "message": f"rank {self.rank} hung: still in {self.phase!r} of step {self.step + 1} "
                       f"{time.time() - started:.0f} s after {name} (preempt_grace_s={self.cfg.preempt_grace_s:g}); "
                       f"its stack is in {path}"})
        os._exit(EXIT_HUNG)

    def close(self) -> None:
        self._done.set()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self.at(self.step, "ended")
        self.beat()
