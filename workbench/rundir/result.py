"""What the caller holds of a run: RunResult (ended) and the read side shared with the live Run handle."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .layout import RunDir
from .summary import Status

if TYPE_CHECKING:
    from ..config import RunConfig


class RunFailedError(RuntimeError):
    """A rank raised. Carries which rank, the exception type, its message and the rank's traceback."""

    def __init__(self, run_dir: Path, error: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.rank = error.get("rank")
        self.exc_type = error.get("type") or "Error"
        # An exception without a message (EOFError(), a bare assert) still says what it was.
        self.exc_message = error.get("message") or f"{self.exc_type} with no message (see the traceback below)"
        self.rank_traceback = error.get("traceback", "")
        where = f"rank {self.rank}" if self.rank is not None else "the launcher"
        super().__init__(f"{where} failed with {self.exc_type}: {self.exc_message}\n"
                         f"run directory: {run_dir}\n--- traceback from {where} ---\n{self.rank_traceback}")


class RunDivergedError(RunFailedError):
    """The loss or gradient norm became NaN or inf: the run stopped at that step, without checkpointing it."""

    def __init__(self, run_dir: Path, ending: dict[str, Any]) -> None:
        self.step = ending.get("step")
        self.last_checkpoint = ending.get("last_checkpoint")
        super().__init__(run_dir, {"type": "Diverged", "message": ending.get("message", "the run diverged"),
                                   "traceback": ""})


class RunPreemptedError(RunFailedError):
    """A signal (SIGTERM, SIGHUP, preempt_signal) made the ranks checkpoint and exit: resume the run later."""

    def __init__(self, run_dir: Path, ending: dict[str, Any]) -> None:
        self.step = ending.get("step")
        self.signal = ending.get("signal")
        super().__init__(run_dir, {"type": "Preempted", "message": ending.get("message", "the run was preempted"),
                                   "traceback": ""})


class RunFiles:
    """Read access to a run's directory: what a running `Run` and an ended `RunResult` both show."""

    run_dir: Path

    @property
    def dir(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def summary(self) -> dict[str, Any]:
        """The content of summary.json."""
        return self.dir.summary().to_dict()

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl."""
        return self.dir.metrics()

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.dir.events()

    @property
    def status(self) -> Status:
        """The summary's status; 'failed' for a run that says it runs but whose processes are all gone."""
        return self.dir.observed_status()[0]


@dataclass
class RunResult(RunFiles):
    """A run that has ended, read back from its run directory."""

    run_dir: Path
    config: RunConfig | None = None

    def plot(self, *others: RunResult, **kwargs: Any) -> Any:
        """Loss, throughput and memory; pass other results to overlay them (e.g. fp32 against bf16)."""
        from ..plots import plot_runs

        return plot_runs([self, *others], **kwargs)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunResult:
        run = RunDir(run_dir)
        return cls(run.path, run.config())

    def _repr_html_(self) -> str:
        s = self.summary
        return (f"<b>{self.run_dir.name}</b>: {s.get('status')} after {s.get('steps')} steps, "
                f"loss {s.get('final_loss')}, {s.get('samples_per_s', 0) or 0:.0f} samples/s")
