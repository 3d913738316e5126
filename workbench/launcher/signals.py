"""Which signals mean "preempted: checkpoint and exit now", for the ranks and for the launcher alike."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.config import RunConfig

EXIT_PREEMPTED = 75
"""`workbench train`'s exit code for a preempted run (sysexits' EX_TEMPFAIL: try again, e.g. resubmit it)."""


def preempt_signals(cfg: RunConfig) -> list[signal.Signals]:
    """SIGTERM (schedulers, Kubernetes, cloud preemption), SIGHUP, and cfg.preempt_signal (e.g. Slurm's USR1)."""
    names = ["SIGTERM", "SIGHUP", *([cfg.preempt_signal] if cfg.preempt_signal else [])]
    return [getattr(signal, n) for n in dict.fromkeys(names)]


def elastic_signals(cfg: RunConfig) -> str:
    """The signals torch elastic (torchrun, notebook_launcher) handles and forwards to the ranks: its
    defaults and the configured preemption signal, which would otherwise end elastic itself."""
    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *([cfg.preempt_signal] if cfg.preempt_signal else [])]
    return ",".join(dict.fromkeys(names))
