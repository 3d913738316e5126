"""What the caller holds of a run: RunResult (ended) and the read side shared with the live Run handle."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from workbench.rundir.layout import RunDir
from workbench.rundir.summary import Status

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


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


def resume_config(cfg: RunConfig, run_dir: Path, changes: dict[str, Any]) -> RunConfig:
    """The config that continues the run in `run_dir` with `changes`: the changes are allowed by name."""
    allowed = sorted(set(cfg.resume_allow) | set(changes) - {"resume", "resume_allow"})
    return cfg.replace(**{"runs_dir": str(Path(run_dir).parent), "run_name": Path(run_dir).name, **changes,
                          "resume": True, "resume_allow": allowed})


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
    task: Task | None = field(default=None, repr=False)
    """The task object the run was launched with (a notebook's own); else the one cfg.task names."""

    def _task(self) -> Task:
        from workbench.tasks import get_task

        return self.task if self.task is not None else get_task(self._config().task)

    def _config(self) -> RunConfig:
        cfg = self.config or self.dir.config()
        if cfg is None:
            raise FileNotFoundError(f"{self.dir.config_path}: no such file; is {self.run_dir} a run directory?")
        return cfg

    def load_model(self, step: int | None = None, device: str | Any = "cpu") -> Any:
        """The task's model with this run's final weights (or those of the checkpoint at `step`), on
        `device`, in eval mode, whatever parallelism trained it."""
        from workbench.weights import load_model

        return load_model(self.dir, self._config(), self._task(), step=step, device=device)

    @property
    def rank_values(self) -> list[Any]:
        """What Task.rank_value returned on every rank at the end of the run, in rank order."""
        from workbench.weights import rank_values

        return rank_values(self.dir)

    launcher: ClassVar[Callable[..., RunResult] | None] = None
    """wb.launch, registered by workbench.launch when it is imported: the run directory's code stays free of
    the caller's launcher (and the ranks of it)."""

    def resume(self, **changes: Any) -> RunResult:
        """Continue this run from its newest checkpoint, with `changes` to the config (e.g. max_steps=2000);
        blocks like wb.launch. Changes you name are allowed even where they alter the trajectory."""
        if RunResult.launcher is None:
            raise RuntimeError("resume() needs the launcher: import workbench (or workbench.launch) first")
        return RunResult.launcher(resume_config(self._config(), self.run_dir, changes), self.task)

    def plot(self, *others: RunResult, **kwargs: Any) -> Any:
        """Loss, throughput and memory; pass other results to overlay them (e.g. fp32 against bf16)."""
        from workbench.plots import plot_runs

        return plot_runs([self, *others], **kwargs)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunResult:
        run = RunDir(run_dir)
        return cls(run.path, run.config())

    def _repr_html_(self) -> str:
        s = self.summary
        return (f"<b>{self.run_dir.name}</b>: {s.get('status')} after {s.get('steps')} steps, "
                f"loss {s.get('final_loss')}, {s.get('samples_per_s', 0) or 0:.0f} samples/s")
