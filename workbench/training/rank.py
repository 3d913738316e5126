"""The rank side of a launch: what runs inside every launched process, and nothing of the caller's
side.

`rank_main` is the entry point whichever launcher started the process (notebook_launcher's fork,
torchrun, `accelerate launch`, srun): it runs the trainer and, on any exception, writes it to the
run directory where the caller will find it (torch elastic keeps tracebacks only of @record
functions).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from workbench.rundir import RunDir
from workbench.training.rank_watch import PreemptedBeforeTraining
from workbench.utils.lifecycle import ending_with_parent
from workbench.utils.preemption import catch_early

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies, so no rank is ever
    orphaned. A process that has such a signal already keeps it (the fork-mode supervisor running a
    single rank itself has SIGTERM). `parent`: the pid the parent must have (default: the parent
    now); if it died before the kernel could be asked, this process is an orphan already and
    exits."""
    arrange = ending_with_parent(
        sig, os.getppid() if parent is None else parent, keep_existing=True
    )
    if arrange is not None:
        arrange()


_forked_siblings: Any = None
"""A barrier for the ranks the fork-mode supervisor is about to fork (expect_forked_ranks), None
elsewhere."""
SIBLINGS_TIMEOUT_S = 60.0


def expect_forked_ranks(n: int) -> None:
    """In the fork-mode supervisor, before it forks `n` ranks: none of them talks to the
    process-group store until all `n` exist (wait_for_forked_siblings). torch elastic serves that
    store from a libuv thread of the supervisor (pt_tcpstore_uv); a rank forked while that thread
    serves an earlier rank's requests inherits whatever lock the thread held at that instant, and
    can block for good before it joins the group. Seen in CI twice on 4 ranks over 2 cores: rank 3
    never set its store key, the others timed out waiting for it."""
    global _forked_siblings
    _forked_siblings = multiprocessing.get_context("fork").Barrier(n) if n > 1 else None


def wait_for_forked_siblings(timeout_s: float = SIBLINGS_TIMEOUT_S) -> None:
    """In a forked rank: return once every rank of the launch has been forked (at most
    `timeout_s`)."""
    if _forked_siblings is None:
        return
    with contextlib.suppress(threading.BrokenBarrierError):
        # one never came: the process group says which
        _forked_siblings.wait(timeout_s)


RETURNED_FD = "WORKBENCH_RETURNED_FD"
"""Names, in the fork-mode supervisor and its ranks, the write end of the pipe the launcher counts
returned ranks on (launcher/forked.py)."""


def tell_launcher_returned() -> None:
    """In a forked rank whose training returned, everything written: one byte to the launcher."""
    fd = os.environ.pop(RETURNED_FD, None)
    if fd is not None:
        with contextlib.suppress(OSError, ValueError):
            os.write(int(fd), b"r")
            os.close(int(fd))


def record_exception(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Write this rank's exception where the caller finds it; an exception without a message is
    named by its repr (EOFError() would otherwise read as 'EOFError: ')."""
    error = {
        "type": type(exc).__name__,
        "message": str(exc) or repr(exc),
        "traceback": traceback.format_exc(),
        "pid": os.getpid(),
    }
    run = RunDir(run_dir)
    for attempt in range(3):
        try:
            run.write_rank_error(rank, error)
            return
        except OSError as e:
            failed = e
        # A full disk: the failed checkpoint's partial files hold the room. Each rank removes its
        # own, but another rank may still be writing into the directory as this one clears it; the
        # checkpoint failed as a whole, so any rank may sweep them all (a run has one writer: no
        # other run's files are here).
        for partial in run.checkpoints_path.glob(".tmp-step_*"):
            shutil.rmtree(partial, ignore_errors=True)
        time.sleep(0.1 * attempt)
    # the disk that failed the run refuses this too: the launcher's log still has it
    print(
        f"[rank {rank}] could not record its error in {run_dir} ({failed}): {error['type']}: "
        f"{error['message']}",
        file=sys.stderr,
    )


class LinePrefixer(io.TextIOBase):
    """A text stream that prefixes every whole line it passes on (`print` from a rank: '[rank 1]
    ...'); a partial line waits for its end, or for close."""

    def __init__(self, target: TextIO, prefix: str) -> None:
        super().__init__()
        self.target, self.prefix, self._partial = target, prefix, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self.target.write("".join(f"{self.prefix}{line}\n" for line in lines))
            self.target.flush()  # a rank can end by os._exit, which flushes nothing
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        if self._partial:
            self.target.write(f"{self.prefix}{self._partial}\n")
            self._partial = ""
        self.flush()
        super().close()


@contextlib.contextmanager
def rank_stdout(rank: int) -> Iterator[None]:
    """The rank's print() output, prefixed with its rank, to the stdout it was started with."""
    original = sys.stdout
    if original is None or isinstance(original, LinePrefixer):
        yield
        return
    sys.stdout = prefixed = LinePrefixer(original, f"[rank {rank}] ")
    try:
        yield
    finally:
        sys.stdout = original
        prefixed.close()


def rank_main(cfg: RunConfig, task: Task, run_dir: str, progress: bool) -> None:
    """Entry point of every rank: run the trainer; on any exception, write it where the caller will
    find it. A preemption signal before training starts ends the run 'preempted' (rank_watch.py),
    whatever started the rank."""
    catch_early(cfg)
    die_with_parent()
    wait_for_forked_siblings()
    rank = int(os.environ.get("RANK", "0"))
    # torch: after the signals are caught
    from workbench.utils.distributed import FORKED_RANKS, bind_rank_store

    bind_rank_store()  # a store this rank hosts (no agent's: Slurm) listens where the nodes meet
    if os.environ.get(FORKED_RANKS):
        import torch

        # GNU OpenMP's thread pool does not survive fork: once the launching process (a notebook
        # kernel that did any sizeable CPU math) has used it, a forked rank's first parallel region
        # waits forever for threads that exist only in the parent. One thread never enters the pool
        # (PyTorch's DataLoader workers do the same); set before any CPU math.
        torch.set_num_threads(1)
    with rank_stdout(rank):
        try:
            from workbench.training.loop import train

            train(cfg, task, Path(run_dir), progress=progress)
        except PreemptedBeforeTraining as preempted:
            if rank == 0:
                preempted.record(RunDir(run_dir))
        except BaseException as exc:
            record_exception(Path(run_dir), rank, exc)
            raise
    tell_launcher_returned()
