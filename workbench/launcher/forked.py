"""The fork-mode supervisor as the launcher holds it: a process whose run can be over before it has
exited.

When the last rank returns from training, everything the run leaves is written; what the processes
still do takes a 1-step launch tens of milliseconds more: each rank waits for elastic's next poll of
its return value, the ranks' address spaces (copies of the caller's, with torch in them) are torn
down, then the supervisor's. Each forked rank writes a byte to a pipe once it has returned, and a
run all of whose ranks did, and that ended as a whole (completed, stopped, diverged), is answered
then; the exits go on in a thread that waits REAP_AFTER_S for them and then kills what is left.
Anything else (a failure, a preemption, a restart) waits for the supervisor's exit and its
post-mortem, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from workbench.launcher.scratch import remove_scratch
from workbench.rundir import RunDir, Status

log = logging.getLogger("workbench")

REAP_AFTER_S = 30.0
"""How long the processes of a run that ended may take to exit before they are killed."""
_ENDED_AS_A_WHOLE = (Status.COMPLETED, Status.STOPPED, Status.DIVERGED)


class ForkedSupervisor:
    """multiprocessing.Process's pid, sentinel, exitcode and join for Run, with `exitcode` 0 as soon
    as every rank returned from a run that ended as a whole. `waitables` wake a waiter on either
    event."""

    def __init__(
        self,
        process: Any,
        write_fd: int,
        read_fd: int,
        ranks: int,
        run: RunDir,
        scratch: Path | None = None,
    ) -> None:
        self._process, self._read_fd, self._ranks, self._run = process, read_fd, ranks, run
        self._scratch = scratch
        """The launch's TMPDIR (scratch.py): removed here, once the supervisor has exited (its ranks
        before it)."""
        self._returned, self._let_go = 0, False
        os.set_blocking(read_fd, False)
        os.close(write_fd)  # the supervisor and its ranks hold it now

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def sentinel(self) -> int:
        return self._process.sentinel

    def waitables(self) -> list[int]:
        return [self._process.sentinel] + [self._read_fd] * (self._read_fd >= 0)

    @property
    def exitcode(self) -> int | None:
        if self._let_go:
            return 0
        code = self._process.exitcode
        if code is not None:
            self._gone()
        elif self._all_returned() and self._run.summary().status in _ENDED_AS_A_WHOLE:
            self._let_go = True
            threading.Thread(
                target=self._reap, name=f"workbench-reap-{self.pid}", daemon=True
            ).start()
            return 0
        return code

    def join(self, timeout: float | None = None) -> None:
        if not self._let_go:
            self._process.join(timeout)

    def _all_returned(self) -> bool:
        if self._read_fd < 0:
            return False
        with contextlib.suppress(BlockingIOError):
            self._returned += len(os.read(self._read_fd, 64))
        return self._returned >= self._ranks

    def _reap(self) -> None:
        self._process.join(REAP_AFTER_S)
        # The sentinel says whether it exited, not exitcode: when the caller's interpreter exits,
        # multiprocessing joins its children from the main thread too, and the waitpid that loses
        # that race reads as running.
        if not wait([self._process.sentinel], 0):
            log.warning(
                "%s: its processes had not exited %.0f s after the run ended; killing them",
                self._run.path.name,
                REAP_AFTER_S,
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.join()
        self._gone()

    def _gone(self) -> None:
        """The supervisor has exited, so have its ranks (elastic waits for them; a killpg takes them
        all): what the launch left in its temporary folder goes, a failed run's error files
        included."""
        self._close_pipe()
        scratch, self._scratch = self._scratch, None
        remove_scratch(scratch)

    def _close_pipe(self) -> None:
        fd, self._read_fd = self._read_fd, -1
        if fd >= 0:
            os.close(fd)
