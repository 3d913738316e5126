"""`python -m workbench.worker RUN_DIR`: one rank of the run stored in RUN_DIR/config.yaml.

This is what `workbench train` hands to `accelerate launch`; torchrun, Slurm's srun or a multi-node
`accelerate launch` can start it the same way. It imports only the rank side of workbench.

Ranks spawned from a notebook (start_method 'spawn', see spawn.py) get the caller's task object
instead of a task name: pickled into RUN_DIR/task.pkl, with its sha256 in $WORKBENCH_TASK_SHA256.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.rundir import RunDir
from workbench.training.rank import die_with_parent, rank_main, record_exception
from workbench.utils.preemption import catch_early

if TYPE_CHECKING:
    from workbench.tasks import Task

_PARENT = os.getppid()
"""The launcher that started this rank, as early as it can be read: a rank re-parented before main()
ran is an orphan (its launcher died while it started). main(parent=...) names another."""
TASK_DIGEST_ENV = "WORKBENCH_TASK_SHA256"
"""The sha256 of the task file the launcher wrote; without it the worker never reads a task file."""


def load_task(run_dir: Path, digest: str) -> Task:
    """The task object the launcher pickled for this run (RunDir.task_path: the caller's sys.path
    and the cloudpickle bytes), only if the file is the one it wrote."""
    path = RunDir(run_dir).task_path
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if not hmac.compare_digest(actual, digest.strip().lower()):
        raise RuntimeError(
            f"{path}: its sha256 is {actual[:16]}..., not the {digest[:16]}... its launcher wrote "
            f"({TASK_DIGEST_ENV}); refusing to unpickle it, since unpickling runs code. Launch the "
            "run again from the caller, which writes a fresh one"
        )
    # Unpickling executes code. Only the bytes the launcher wrote for this launch get here: their
    # digest came through the environment, which only the launcher and its children see, not through
    # the run directory.
    paths, blob = pickle.loads(data)
    # The caller's import path, behind ours: a task class importable there (sys.path.append in a
    # notebook) is pickled by reference and must import here too, without shadowing what this
    # interpreter finds first.
    sys.path.extend(p for p in paths if p not in sys.path)
    task = pickle.loads(blob)
    from workbench.tasks import Task

    if not isinstance(task, Task):
        raise TypeError(f"{path} holds a {type(task).__name__}, not a workbench.Task")
    return task


def main(argv: list[str] | None = None, parent: int | None = None) -> None:
    """Run one rank of the run directory argv names. `parent`: the process the rank dies with (a
    Slurm task's step daemon, cluster/job.py); by default the one that started this interpreter."""
    # First, before torch and the task load (seconds): a preemption signal from now on is kept
    # (preemption.py) (a signal that killed the rank here would read as an out-of-memory kill), and
    # the rank dies with its launcher, or exits now if that is gone already.
    catch_early()
    die_with_parent(parent=_PARENT if parent is None else parent)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m workbench.worker RUN_DIR")
    run = RunDir(args[0])
    cfg = run.config()
    if cfg is None:
        raise SystemExit(
            f"{run.config_path}: no such file; create the run directory with "
            "`workbench train CONFIG --prepare-only`"
        )
    digest = os.environ.get(TASK_DIGEST_ENV)
    from workbench.tasks import get_task

    try:
        task = load_task(run.path, digest) if digest else get_task(cfg.task)
    except (
        BaseException
    ) as exc:  # the caller reads why this rank never started from the run directory
        record_exception(run.path, int(os.environ.get("RANK", "0")), exc)
        raise
    rank_main(cfg, task, str(run.path), progress=os.environ.get("WORKBENCH_PROGRESS") == "1")


if __name__ == "__main__":
    main()
