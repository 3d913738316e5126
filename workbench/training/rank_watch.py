"""A rank's watch: the preemption flag, the heartbeat, and the watchdog that names a hung rank.

- SIGTERM, SIGHUP and the configured preempt_signal (utils/preemption.py) only set a flag here; the
  loop's stop vote (stop_vote.py) makes every rank stop on the same step, checkpoint and exit
  ('preempted').
- Before the watch exists, utils/preemption.py keeps such a signal (`early`). The watch takes it
  over, and the ranks agree as it starts: if any got one, every rank leaves before training with
  nothing to checkpoint (PreemptedBeforeTraining), and rank 0 records 'preempted'.
- A background thread rewrites ranks/rank_<r>.json every few seconds (pid, host, step, phase), so
  readers can tell a live run from one whose processes are gone.
- After a signal, a rank that doesn't finish within preempt_grace_s is stuck (in user code, or in a
  collective whose peer is stuck): it dumps every thread's Python stack to stacks/rank_<r>.txt,
  records a 'Hung' error naming where it was, and ends. That is how a hang is told from the timeouts
  it causes.
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
from workbench.utils import preemption

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir import RunDir

log = logging.getLogger("workbench")
EXIT_HUNG = 3


class PreemptedBeforeTraining(Exception):
    """Every rank leaves before training: a preemption signal reached a rank before its watch
    started."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} before training started")

    def record(self, run: RunDir) -> None:
        """Rank 0: the run ends 'preempted', resumable from its newest checkpoint (none of this
        session)."""
        run.end_preempted(
            signal.Signals(self.signum).name,
            "before training started: the ranks exited with nothing to save",
        )


def _stacks() -> str:
    """Every thread's Python stack, the main thread (where the training step runs) first."""
    frames = sys._current_frames()
    main = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted(frames, key=lambda ident: ident != main)
    return "\n".join(
        f"Thread {names.get(ident, ident)} (most recent call last):\n"
        + "".join(traceback.format_stack(frames[ident]))
        for ident in order
    )


AFTER_STEP = ("checkpoint", "evaluation", "finishing", "ended")
"""Phases the loop enters once a step is counted (its `at` then names that step, not the next)."""


def where(phase: str, step: int) -> str:
    """The step a phase belongs to, in words: the step in progress, or the one just done."""
    return f"after step {step}" if phase in AFTER_STEP else f"of step {step + 1}"


class RankWatch:
    """Start on every rank before training; `close()` when the rank is done (normally or not)."""

    def __init__(self, run: RunDir, rank: int, cfg: RunConfig) -> None:
        self.run, self.rank, self.cfg = run, rank, cfg
        self.signal: int = 0
        """The preemption signal this rank received (0: none)."""
        self.step, self.phase = 0, "starting"
        self.identity = this_process()
        self._done = threading.Event()
        self._previous: dict[int, Any] = {}
        self._write_failed = False

    def start(self) -> RankWatch:
        """Collective (every rank, as it starts): raises PreemptedBeforeTraining on every rank if
        any got a preemption signal before its watch was there."""
        self._previous = preemption.install(self._on_signal, self.cfg, leave_ignored=False)
        kept = preemption.early.take()
        if kept:
            self._on_signal(kept, None)
        self.beat()
        threading.Thread(
            target=self._beat_forever, name=f"wb-heartbeat-{self.rank}", daemon=True
        ).start()
        agreed = self._any_rank_signalled()
        if agreed:
            self.signal = self.signal or agreed
            self.close()
            raise PreemptedBeforeTraining(agreed)
        return self

    def _any_rank_signalled(self) -> int:
        """The largest preemption signal any rank has got so far (0: none), over the process group
        if there is one: every rank starts its watch at the same point, so this is where they can
        all agree to leave."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signal
        import torch

        device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in str(dist.get_backend())
            else "cpu"
        )
        flag = torch.tensor([float(self.signal)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def current_step(self) -> int:
        """The step the rank is in (the device monitor's gpu_idle events name it)."""
        return self.step

    def at(self, step: int, phase: str) -> None:
        """Where the rank is: shown in its heartbeat, and in the report if it hangs."""
        self.step, self.phase = step, phase

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.signal:
            self.signal = signum
            threading.Thread(
                target=self._watch, name=f"wb-watchdog-{self.rank}", daemon=True
            ).start()

    def beat(self) -> None:
        try:
            self.run.write_heartbeat(
                self.rank,
                {
                    **self.identity,
                    "step": self.step,
                    "phase": self.phase,
                    "signal": signal.Signals(self.signal).name if self.signal else None,
                },
            )
        except OSError as e:
            # a full disk must not kill the rank from a side thread; the loop reports it
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
        phase, step = self.phase, self.step
        stack = _stacks()
        path = self.run.write_stacks(self.rank, stack)
        self.run.write_rank_error(
            self.rank,
            {
                "type": "Hung",
                "pid": os.getpid(),
                "traceback": stack,
                "message": f"rank {self.rank} hung: still in {phase!r} {where(phase, step)} "
                f"{time.time() - started:.0f} s after {name} "
                f"(preempt_grace_s={self.cfg.preempt_grace_s:g}); its stack is in "
                f"{path}{self._abandoned(phase, step)}",
            },
        )
        os._exit(EXIT_HUNG)

    def _abandoned(self, phase: str, step: int) -> str:
        """A checkpoint the rank was writing when the grace ran out is abandoned, not sealed: said,
        with what a resume does with it."""
        tmp = self.run.checkpoints_path / f".tmp-step_{step}"
        if phase != "checkpoint" or not tmp.exists():
            return ""
        return (
            f"; the checkpoint of step {step} was abandoned half written ({tmp}: a resume skips "
            "it and starts from the newest complete checkpoint). A checkpoint and a step must fit "
            "preempt_grace_s: raise it, or make checkpoints faster (checkpoint_async)"
        )

    def close(self) -> None:
        self._done.set()
        preemption.restore(self._previous)
        self.at(self.step, "ended")
        self.beat()
