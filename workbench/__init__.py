"""workbench: train PyTorch models on many processes from a notebook cell or the shell."""

from __future__ import annotations

from typing import Any

from workbench import data
from workbench.config import RunConfig
from workbench.estimate import estimate
from workbench.launch import Run, launch, start
from workbench.recording import record
from workbench.rundir import RunDirLocked, RunDivergedError, RunFailedError, RunPreemptedError, RunResult, Status
from workbench.tasks import Task, register_task
from workbench.version import __version__

__all__ = ["RunConfig", "Run", "RunDirLocked", "RunDivergedError", "RunFailedError", "RunPreemptedError", "RunResult",
           "Status", "Task", "Panel", "__version__", "data",
           "estimate", "launch", "record", "register_task", "start"]


def __getattr__(name: str) -> Any:
    # ipywidgets loads only when a panel is wanted.
    if name == "Panel":
        from workbench.panel import Panel

        return Panel
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
