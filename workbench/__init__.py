"""workbench: train PyTorch models on many processes from a notebook cell or the shell.

`import workbench` loads nothing but this file and the version: each public name below is imported
from where it lives on first use (PEP 562), so a rank that imports `workbench.worker` never loads
the caller's launcher or the notebook side, and `wb.Panel` alone brings in ipywidgets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from workbench.version import __version__

if TYPE_CHECKING:
    from workbench import data, tasks
    from workbench.cluster import Ray, Slurm
    from workbench.cluster.raytrain.run import RayRun
    from workbench.cluster.slurm_run import SlurmRun
    from workbench.config import RunConfig
    from workbench.estimator.estimation import estimate
    from workbench.launcher.attached import AttachedRun, attach
    from workbench.launcher.launch import Run, launch, start
    from workbench.launcher.result import RunResult
    from workbench.notebook.dashboard import Dashboard
    from workbench.notebook.panel import Panel
    from workbench.regress.recording import record
    from workbench.rundir import (
        RunDirLocked,
        RunDivergedError,
        RunFailedError,
        RunPreemptedError,
        Status,
    )
    from workbench.rundir.listing import compare, runs
    from workbench.tasks import Task, register_task

_HOMES = {
    "RunConfig": "workbench.config",
    "Slurm": "workbench.cluster",
    "Ray": "workbench.cluster",
    "RayRun": "workbench.cluster.raytrain.run",
    "SlurmRun": "workbench.cluster.slurm_run",
    "attach": "workbench.launcher.attached",
    "AttachedRun": "workbench.launcher.attached",
    "estimate": "workbench.estimator.estimation",
    "Run": "workbench.launcher.launch",
    "launch": "workbench.launcher.launch",
    "start": "workbench.launcher.launch",
    "RunResult": "workbench.launcher.result",
    "Panel": "workbench.notebook.panel",
    "Dashboard": "workbench.notebook.dashboard",
    "runs": "workbench.rundir.listing",
    "compare": "workbench.rundir.listing",
    "record": "workbench.regress.recording",
    "RunDirLocked": "workbench.rundir",
    "RunDivergedError": "workbench.rundir",
    "RunFailedError": "workbench.rundir",
    "RunPreemptedError": "workbench.rundir",
    "Status": "workbench.rundir",
    "Task": "workbench.tasks",
    "TaskOption": "workbench.tasks",
    "register_task": "workbench.tasks",
}
"""Each public name and the module it lives in."""
_PACKAGES = ("data", "tasks")
"""Subpackages that are public as they are (wb.data.resolve, wb.tasks.available)."""

__all__ = sorted([*_HOMES, *_PACKAGES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
    elif name in _PACKAGES:
        value = importlib.import_module(f"workbench.{name}")
    else:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
