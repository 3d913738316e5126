"""The run directory: the only channel from ranks back to the user (forked, subprocess or remote
ranks alike).

`RunDir` (run_dir.py) names the files and is the only code that writes them (`set_status` is the
one writer of summary.json); `Summary` (summary.py) is summary.json's schema and `Status` the
statuses a run goes through; `MetricsRow` (metrics_row.py) is the schema of a metrics.jsonl row,
versioned too; prepare.py creates or reopens a run directory for a launch under its lock (lock.py);
liveness.py tells whether a run's processes are still there; rank_files.py reads the ranks'
heartbeats and errors; run_files.py reads a run back
(`RunFiles`) and says how it ended as an exception. Nothing here imports matplotlib, a task or the
trainer: `RunResult`, which adds the model, the figures and resume, is the caller's
(workbench.launcher.result).
"""

from __future__ import annotations

from workbench.rundir.lock import RunDirLocked
from workbench.rundir.metrics_row import METRICS_SCHEMA_VERSION, MetricsRow
from workbench.rundir.prepare import prepare
from workbench.rundir.run_dir import (
    CHECKPOINTS,
    COMPLETE_MARKER,
    CONFIG,
    ERRORS,
    EVENTS,
    METRICS,
    STOP_REQUEST,
    SUMMARY,
    TIMINGS,
    RunDir,
    RunDirWriteError,
    is_fallout,
    new_run_name,
)
from workbench.rundir.run_files import RunDivergedError, RunFailedError, RunFiles, RunPreemptedError
from workbench.rundir.summary import ENDED, RESUMABLE, SCHEMA_VERSION, Status, Summary

__all__ = [
    "CHECKPOINTS",
    "COMPLETE_MARKER",
    "CONFIG",
    "ENDED",
    "ERRORS",
    "EVENTS",
    "METRICS",
    "METRICS_SCHEMA_VERSION",
    "RESUMABLE",
    "SCHEMA_VERSION",
    "STOP_REQUEST",
    "SUMMARY",
    "TIMINGS",
    "MetricsRow",
    "RunDir",
    "RunDirLocked",
    "RunDirWriteError",
    "RunDivergedError",
    "RunFailedError",
    "RunFiles",
    "RunPreemptedError",
    "Status",
    "Summary",
    "is_fallout",
    "new_run_name",
    "prepare",
]
