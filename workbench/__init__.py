"""workbench: train PyTorch models on many processes from a notebook cell or the shell."""

from __future__ import annotations

from typing import Any

from . import data
from .config import RunConfig
from .launch import Run, RunFailedError, RunResult, launch
from .recording import record
from .tasks import Task, register_task

__all__ = ["RunConfig", "Run", "RunFailedError", "RunResult", "Task", "Panel", "data", "launch", "record",
           "register_task"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ipywidgets loads only when a panel is wanted.
    if name == "Panel":
        from .panel import Panel

        return Panel
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
