"""workbench: train PyTorch models on many processes from a notebook cell or the shell."""

from __future__ import annotations

from typing import Any

from . import data
from .config import RunConfig
from .estimate import estimate
from .launch import Run, launch, start
from .recording import record
from .rundir import RunDirLocked, RunDivergedError, RunFailedError, RunPreemptedError, RunResult, Status
from .tasks import Task, register_task
from .version import __version__

__all__ = ["RunConfig", "Run", "RunDirLocked", "RunDivergedError", "RunFailedError", "RunPreemptedError", "RunResult",
           "Status", "Task", "Panel", "__version__", "data",
           "estimate", "launch", "record", "register_task", "start"]


def __getattr__(name: str) -> Any:
    # ipywidgets loads only when a panel is wanted.
    if name == "Panel":
        from .panel import Panel

        return Panel
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
