"""The run directory: the only channel from ranks back to the user (forked, subprocess or remote
ranks alike), written only through this package.

`RunDir` (run_dir.py) names the files (constants, never string literals elsewhere) and is the only
code that writes them: the config, summary.json (`set_status`, its one writer), metrics and events,
timings, weights, heartbeats, stacks, rank errors and values, autobatch.json, the spawned task, the
Slurm job and attempt, the stop request; lock.py writes LOCK, prepare.py creates or reopens a run
directory for a launch under that lock. `Summary` (summary.py) is summary.json's schema and
`Status` the statuses a run goes through; `MetricsRow` (metrics_row.py) is the schema of a
metrics.jsonl row, versioned too; liveness.py tells whether a run's processes are still there and
scheduler.py what Slurm says of its job; rank_files.py reads the ranks' heartbeats and errors;
run_files.py reads a run back (`RunFiles`) and says how it ended as an exception; listing.py lists
the runs of a runs_dir. Nothing here imports matplotlib, a task or the trainer: `RunResult`, which
adds the model, the figures and resume, is the caller's (workbench.launcher.result).
"""

from __future__ import annotations

from workbench.rundir.lock import RunDirLocked
from workbench.rundir.metrics_row import METRICS_SCHEMA_VERSION, MetricsRow
from workbench.rundir.prepare import prepare
from workbench.rundir.run_dir import (
    AUTOBATCH,
    CHECKPOINTS,
    COMPLETE_MARKER,
    CONFIG,
    ERRORS,
    EVENTS,
    METRICS,
    STOP_REQUEST,
    SUMMARY,
    TASK,
    TIMINGS,
    RunDir,
    RunDirWriteError,
    is_fallout,
    new_run_name,
)
from workbench.rundir.run_files import RunDivergedError, RunFailedError, RunFiles, RunPreemptedError
from workbench.rundir.summary import ENDED, RESUMABLE, SCHEMA_VERSION, Status, Summary

__all__ = [
    "AUTOBATCH",
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
    "TASK",
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
