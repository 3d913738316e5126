"""The run directory: the only channel from ranks back to the user (forked, subprocess or remote ranks alike).

`RunDir` names the files and is the only code that writes them (`set_status` is the one writer of
summary.json); `Summary` is summary.json's schema and `Status` the statuses a run goes through;
`RunResult` is a run that has ended, read back from its directory.
"""

from __future__ import annotations

from .layout import (
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
                     is_fallout,
                     new_run_name,
                     prepare,
)
from .result import RunFailedError, RunFiles, RunResult
from .summary import ENDED, SCHEMA_VERSION, Status, Summary

__all__ = ["CHECKPOINTS", "COMPLETE_MARKER", "CONFIG", "ENDED", "ERRORS", "EVENTS", "METRICS", "SCHEMA_VERSION",
           "STOP_REQUEST", "SUMMARY", "TIMINGS", "RunDir", "RunFailedError", "RunFiles", "RunResult", "Status",
           "Summary", "is_fallout", "new_run_name", "prepare"]
