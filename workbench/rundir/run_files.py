"""Reading a run directory: RunFiles (what a live Run and an ended RunResult both show), how a run
ended as an exception (RunFailedError and its kinds), and the config that resumes a run."""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.rundir.run_dir import RunDir
from workbench.rundir.summary import Status

if TYPE_CHECKING:
    from workbench.config import RunConfig


class RunFailedError(RuntimeError):
    """A rank raised. Carries which rank, the exception type, its message and the rank's
    traceback."""

    def __init__(self, run_dir: Path, error: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.rank = error.get("rank")
        self.exc_type = error.get("type") or "Error"
        # An exception without a message (EOFError(), a bare assert) still says what it was.
        self.exc_message = (
            error.get("message") or f"{self.exc_type} with no message (see the traceback below)"
        )
        self.rank_traceback = error.get("traceback", "")
        where = f"rank {self.rank}" if self.rank is not None else "the launcher"
        super().__init__(
            f"{where} failed with {self.exc_type}: {self.exc_message}\n"
            f"run directory: {run_dir}\n--- traceback from {where} ---\n{self.rank_traceback}"
        )


class RunDivergedError(RunFailedError):
    """The loss or gradient norm became NaN or inf: the run stopped at that step, without
    checkpointing it."""

    def __init__(self, run_dir: Path, ending: dict[str, Any]) -> None:
        self.step = ending.get("step")
        self.last_checkpoint = ending.get("last_checkpoint")
        super().__init__(
            run_dir,
            {
                "type": "Diverged",
                "message": ending.get("message", "the run diverged"),
                "traceback": "",
            },
        )


class RunPreemptedError(RunFailedError):
    """A signal (SIGTERM, SIGHUP, preempt_signal) made the ranks checkpoint and exit: resume the run
    later."""

    def __init__(self, run_dir: Path, ending: dict[str, Any]) -> None:
        self.step = ending.get("step")
        self.signal = ending.get("signal")
        super().__init__(
            run_dir,
            {
                "type": "Preempted",
                "message": ending.get("message", "the run was preempted"),
                "traceback": "",
            },
        )


def resume_config(cfg: RunConfig, run_dir: Path, changes: dict[str, Any]) -> RunConfig:
    """The config that continues the run in `run_dir` with `changes`: the changes are allowed by
    name."""
    allowed = sorted(set(cfg.resume_allow) | set(changes) - {"resume", "resume_allow"})
    return cfg.replace(
        **{
            "runs_dir": str(Path(run_dir).parent),
            "run_name": Path(run_dir).name,
            **changes,
            "resume": True,
            "resume_allow": allowed,
        }
    )


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
        """The rows of metrics.jsonl: a list of plain dicts, as written (`dir.metrics_rows()`:
        typed)."""
        return self.dir.metrics()

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.dir.events()

    def brief(self) -> str:
        """One line: name, status, step of max_steps, the latest loss ('digits-... running: step
        40/100, loss 0.6771')."""
        name, status, progress = _brief(self)
        return f"{name} {status}: {progress}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.brief()}>"

    def _repr_html_(self) -> str:
        name, status, progress = _brief(self)
        return (
            "<span class='wb-run' "
            f"title='{html.escape(str(self.run_dir), quote=True)}'><b>{html.escape(name)}</b> "
            "<span "
            f"style='color:{STATUS_COLORS.get(status, '#555')}'>{html.escape(status)}:</span> "
            f"{html.escape(progress)}</span>"
        )

    @property
    def status(self) -> Status:
        """The summary's status; 'failed' for a run that says it runs but whose processes are all
        gone."""
        return self.dir.observed_status()[0]


STATUS_COLORS: dict[str, str] = {
    "completed": "#2e7d32",
    "running": "#1565c0",
    "starting": "#1565c0",
    "failed": "#b00020",
    "diverged": "#b00020",
    "stopped": "#a15c00",
    "preempted": "#a15c00",
}
"""The colour a status is written in wherever a notebook shows runs (reprs, wb.runs, the launch's
line)."""


def _brief(run: RunFiles) -> tuple[str, str, str]:
    """A run's name, status and progress ('step 40/100, loss 0.6771'), read from its directory (the
    tail of metrics.jsonl)."""
    folder = RunDir(run.run_dir)
    try:
        status = folder.observed_status()[0].value
    except ValueError as e:  # a damaged summary.json: said, not raised from a repr
        return folder.name, "unreadable", str(e).split(":")[0]
    cfg = folder.config()
    row = folder.last_train_row()
    step = (row.get("step") if row else folder.summary().steps) or 0
    progress = f"step {step}/{cfg.max_steps}" if cfg is not None else f"step {step}"
    loss = row.get("loss") if row else None
    if isinstance(loss, (int, float)):
        progress += f", loss {loss:.4g}"
    return folder.name, status, progress
