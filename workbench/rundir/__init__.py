"""The run directory: the only channel from ranks back to the user (forked, subprocess or remote ranks alike).

`RunDir` (layout.py) names the files and is the only code that writes them (`set_status` is the one writer
of summary.json); `Summary` (summary.py) is summary.json's schema and `Status` the statuses a run goes
through; prepare.py creates or reopens a run directory for a launch under its lock (lock.py); liveness.py
tells whether a run's processes are still there; `RunResult` (result.py) is a run that has ended.
"""

from __future__ import annotations

from workbench.rundir.layout import (CHECKPOINTS, COMPLETE_MARKER, CONFIG, ERRORS, EVENTS, METRICS, STOP_REQUEST, SUMMARY, TIMINGS,
                     RunDir, RunDirWriteError, is_fallout, new_run_name)
from workbench.rundir.lock import RunDirLocked
from workbench.rundir.prepare import prepare
from workbench.rundir.result import RunDivergedError, RunFailedError, RunFiles, RunPreemptedError, RunResult
from workbench.rundir.summary import ENDED, RESUMABLE, SCHEMA_VERSION, Status, Summary

__all__ = ["CHECKPOINTS", "COMPLETE_MARKER", "CONFIG", "ENDED", "ERRORS", "EVENTS", "METRICS", "RESUMABLE",
           "SCHEMA_VERSION", "STOP_REQUEST", "SUMMARY", "TIMINGS", "RunDir", "RunDirLocked", "RunDirWriteError",
           "RunDivergedError", "RunFailedError", "RunFiles", "RunPreemptedError", "RunResult", "Status", "Summary",
           "is_fallout", "new_run_name", "prepare"]
