"""RunResult: a run that has ended, as the caller holds it. It composes the run directory's read side with
what the run directory itself must not import: the task's model (load_model), the figures (plot) and the
launcher (resume)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from workbench.rundir import RunDir, RunFiles
from workbench.rundir.run_files import resume_config

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


@dataclass(repr=False)  # RunFiles' one-line repr, not every field's
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
        from workbench.training.weights import load_model

        return load_model(self.dir, self._config(), self._task(), step=step, device=device)

    @property
    def rank_values(self) -> list[Any]:
        """What Task.rank_value returned on every rank at the end of the run, in rank order."""
        from workbench.training.weights import rank_values

        return rank_values(self.dir)

    launcher: ClassVar[Callable[..., RunResult] | None] = None
    """wb.launch, registered by workbench.launcher.launch when it is imported: the run directory's code stays free of
    the caller's launcher (and the ranks of it)."""

    def resume(self, **changes: Any) -> RunResult:
        """Continue this run from its newest checkpoint, with `changes` to the config (e.g. max_steps=2000);
        blocks like wb.launch. Changes you name are allowed even where they alter the trajectory."""
        if RunResult.launcher is None:
            raise RuntimeError("resume() needs the launcher: import workbench (or workbench.launcher.launch) first")
        return RunResult.launcher(resume_config(self._config(), self.run_dir, changes), self.task)

    def plot(self, *others: RunResult, **kwargs: Any) -> Any:
        """Loss, throughput and memory; pass other results to overlay them (e.g. fp32 against bf16)."""
        from workbench.notebook.plots import plot_runs

        return plot_runs([self, *others], **kwargs)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunResult:
        run = RunDir(run_dir)
        return cls(run.path, run.config())

