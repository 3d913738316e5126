"""The rank side of a launch: what runs inside every launched process, and nothing of the caller's side.

`rank_main` is the entry point whichever launcher started the process (notebook_launcher's fork,
torchrun, `accelerate launch`, srun): it runs the trainer and, on any exception, writes it to the run
directory where the caller will find it (torch elastic keeps tracebacks only of @record functions).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from .rundir import RunDir

if TYPE_CHECKING:
    from .config import RunConfig
    from .tasks import Task


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL us when our parent dies, so no rank is ever orphaned."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def record_exception(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Write this rank's exception where the caller finds it; an exception without a message is named by its
    repr (EOFError() would otherwise read as 'EOFError: ')."""
    error = {"type": type(exc).__name__, "message": str(exc) or repr(exc), "traceback": traceback.format_exc(),
             "pid": os.getpid()}
    try:
        RunDir(run_dir).write_rank_error(rank, error)
    except OSError as e:  # the disk that failed the run may refuse this too: the launcher's log still has it
        print(f"[rank {rank}] could not record its error in {run_dir} ({e}): {error['type']}: {error['message']}",
              file=sys.stderr)


def rank_main(cfg: RunConfig, task: Task, run_dir: str, progress: bool) -> None:
    """Entry point of every rank: run the trainer; on any exception, write it where the caller will find it."""
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    try:
        from .training import train

        train(cfg, task, Path(run_dir), progress=progress)
    except BaseException as exc:
        record_exception(Path(run_dir), rank, exc)
        raise
