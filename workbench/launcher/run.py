"""Run: the handle of a launched run, live or ended: its status, wait(), stop() and the result."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import psutil

from workbench.config import RunConfig
from workbench.launcher.postmortem import KILLED_EVENT, finalize
from workbench.launcher.preempted import record_preemption
from workbench.launcher.process_tree import end_tree
from workbench.launcher.processes import start_processes
from workbench.launcher.result import RunResult
from workbench.launcher.spawn import StartPlan
from workbench.rundir import (
    RunDir,
    RunDivergedError,
    RunFailedError,
    RunFiles,
    RunPreemptedError,
    Status,
    lock,
    prepare,
)
from workbench.rundir.liveness import heartbeats, is_alive
from workbench.tasks import Task
from workbench.utils import preemption

log = logging.getLogger("workbench")


def waiting_interruptibly(
    wait: Callable[[], None], stop: Callable[[], None], kill: Callable[[], None], name: str
) -> None:
    """wait(), where a first Ctrl-C (a kernel interrupt) stops the run gracefully (the ranks
    checkpoint) and waits on, and a second one kills it."""
    try:
        wait()
    except KeyboardInterrupt:
        stop()
        log.warning(
            "stopping %s: ranks save a checkpoint and exit; interrupt again to kill them", name
        )
        try:
            wait()
        except KeyboardInterrupt:
            kill()
            raise


@dataclass(repr=False)  # RunFiles' one-line repr, not every field's
class Run(RunFiles):
    """A launched run. `stop()` asks ranks to checkpoint and exit; `wait()` returns the RunResult.

    While `wait()` blocks in the main thread, SIGTERM, SIGHUP and cfg.preempt_signal sent to this
    process are forwarded to the ranks (they checkpoint and exit: 'preempted'), then delivered again
    to this process once the ranks are gone, so the launcher neither outlives nor underlives them.
    Whenever such a signal lands, the run ends 'preempted', never restarted: before the ranks train,
    while they start, in a restart's back-off. A failed or preempted run is restarted from its
    newest checkpoint up to cfg.max_restarts times.
    """

    config: RunConfig
    run_dir: Path
    _process: Any = field(repr=False)
    _task: Task | None = field(default=None, repr=False)
    _progress: bool = False
    _token: str | None = field(default=None, repr=False)
    restarts: int = 0
    _plan: StartPlan = field(default=StartPlan("fork", "", device="cpu"), repr=False)
    _result: RunResult | None = field(default=None, repr=False)
    _signalled: int = 0
    _signalled_between: bool = False
    """The signal came when the last attempt's processes were gone (before a restart): it ends the
    run."""
    _kill_at: float | None = None
    _unrecorded: dict[str, Any] | None = field(default=None, repr=False)
    """A failure finalize could not write into the run directory (a full disk): wait() still raises
    it."""
    # wait() in one thread and stop()/done() in another (the panel does this) must not race on the
    # process.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def start_method(self) -> str:
        """How the ranks were started: 'fork', 'spawn' (fresh interpreters) or 'subprocess' (the
        shell's way)."""
        return self._plan.method

    @property
    def start_reason(self) -> str:
        """Why that start method (e.g. CUDA was already initialised in this process, so not
        fork)."""
        return self._plan.reason

    def done(self) -> bool:
        return self._exitcode() is not None

    def _exitcode(self) -> int | None:
        with self._lock:
            return self._process.exitcode if self.start_method == "fork" else self._process.poll()

    def _close_output(self) -> None:
        """Spawned ranks: their output is copied until they are gone; no copying thread outlives the
        run."""
        close = getattr(self._process, "close_output", None)
        if close is not None:
            close()

    def stop(self) -> None:
        """Graceful stop: ranks agree on a step, save a checkpoint and exit."""
        if not self.done():
            self.dir.request_stop()

    def kill(self) -> None:
        """Hard stop: end the supervisor (or torchrun) and every rank now, the ranks' own process
        groups included, and return once they are gone. The last complete checkpoint stays."""
        runner = self._runner()
        if runner is not None:
            with contextlib.suppress(OSError):  # before any signal: whoever records the ending
                self.dir.event(
                    KILLED_EVENT, by="Run.kill()", pid=os.getpid(), host=socket.gethostname()
                )
            end_tree(runner, timeout=30, reap_root=False)  # our child: reaped by _join
        self._join(timeout=30)
        self._close_output()
        finalize(self.dir, RuntimeError("killed by Run.kill()"))

    def _join(self, timeout: float | None) -> None:
        """Wait for the launcher process, in slices, so a preemption deadline can end it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._exitcode() is None:
            if self._kill_at is not None and time.monotonic() > self._kill_at:
                log.warning(
                    "%s: the ranks did not exit within preempt_grace_s; killing them",
                    self.run_dir.name,
                )
                self._kill_at = None
                runner = self._runner()
                if runner is not None:  # the ranks in groups of their own (torchrun's) too
                    end_tree(runner, timeout=0, reap_root=False)
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                return
            if self.start_method != "fork":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(left)
            elif self._process.sentinel in multiprocessing.connection.wait(
                self._process.waitables(), left
            ):
                # The sentinel fires when the process closes its files, a moment before it can be
                # reaped; join() then returns at once with the exit code. The lock keeps two threads
                # from reaping at once.
                with self._lock:
                    self._process.join()

    def _join_interruptibly(self, timeout: float | None) -> None:
        waiting_interruptibly(lambda: self._join(timeout), self.stop, self.kill, self.run_dir.name)

    def _forward(self, signum: int, frame: Any) -> None:
        """A preemption signal for the launcher: the ranks get it, checkpoint and exit within the
        grace period."""
        if self._signalled:
            return
        self._signalled = signum
        self._kill_at = time.monotonic() + self.config.preempt_grace_s + 15
        log.warning(
            "%s: %s received; the ranks save a checkpoint and exit",
            self.run_dir.name,
            signal.Signals(signum).name,
        )
        # Straight to the ranks (a signal through torch elastic would be followed by its SIGKILL 30
        # s later, and a traceback), started ones too (they keep it until they can act on it, see
        # utils/preemption.py); before any rank exists, to the launcher process.
        runner = self._runner()
        ranks = {b["pid"] for b in heartbeats(self.dir) if is_alive(b)}
        if runner is not None:
            # torchrun's and the supervisor's children are the ranks, heartbeat or not
            with contextlib.suppress(psutil.Error):
                ranks.update(c.pid for c in runner.children())
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if ranks:
                for pid in sorted(ranks):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)
            elif runner is None:  # between attempts (a restart's back-off): no restart follows
                self._signalled_between = True
            elif self.start_method == "fork":
                os.killpg(self._process.pid, signum)  # the supervisor and its ranks
            else:
                self._process.send_signal(signum)  # torchrun forwards it to its ranks

    def _runner(self) -> psutil.Process | None:
        """The launcher process while it runs. Not through _exitcode(): a signal handler calling
        this may have interrupted this very thread holding self._lock."""
        with contextlib.suppress(psutil.Error):
            runner = psutil.Process(self._process.pid)
            # Still our child: once reaped, its pid may be another process's.
            if runner.ppid() == os.getpid() and runner.status() != psutil.STATUS_ZOMBIE:
                return runner
        return None

    @contextlib.contextmanager
    def _forwarding_signals(self) -> Iterator[None]:
        # nohup: an ignored SIGHUP was meant to be ignored
        with preemption.handling(self._forward, self.config, leave_ignored=True) as installed:
            # came while the launch was starting the ranks (`workbench train`)
            early = preemption.before_launch.take() if installed else 0
            if early:
                self._forward(early, None)
            yield

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends. Raises RunFailedError naming the failing rank
        (RunPreemptedError, RunDivergedError for those endings), or TimeoutError."""
        if self._result is None:
            with self._forwarding_signals():
                while True:
                    self._join_interruptibly(timeout)
                    code = self._exitcode()
                    if code is None:
                        raise TimeoutError(
                            f"run {self.run_dir.name} still running after {timeout}s; call wait() "
                            "again, stop() or kill()"
                        )
                    self._close_output()
                    if not (
                        self._signalled
                        and record_preemption(
                            self.dir,
                            self._signalled,
                            "reached the launcher before the ranks recorded an ending "
                            "(they had not started training, or were ended by it)",
                        )
                    ):
                        self._unrecorded = finalize(self.dir, exitcode=code)
                    if not self._restart_if_due():
                        break
            self._result = RunResult(self.run_dir, self.config, self._task)
            lock.release(self.dir, self._token)
            if self._result.status in (Status.COMPLETED, Status.STOPPED):
                from workbench.regress.recording import record_run

                # in a notebook: the regression suite reads these back (no-op elsewhere)
                record_run(self._result)
            if self._signalled:
                # the launcher's own fate, now that the ranks are safe
                os.kill(os.getpid(), self._signalled)
        raise_for_ending(self.dir, self._unrecorded)
        return self._result

    def _restart_if_due(self) -> bool:
        cfg, status = self.config, self.dir.observed_status()[0]
        if status not in (Status.FAILED, Status.PREEMPTED) or self.restarts >= cfg.max_restarts:
            return False
        if self._signalled and not self._signalled_between:
            return False  # the attempt took the signal and ended as it did: nothing to restart
        if not self._signalled:
            # Doubled each time, up to a day: 2**restarts soon overflows what time.sleep takes.
            backoff = min(cfg.restart_backoff_s * 2.0 ** min(self.restarts, 64), 86400.0)
            error = self.dir.summary().error or {}
            self.restarts += 1
            self.dir.event(
                "restarting",
                attempt=self.restarts,
                of=cfg.max_restarts,
                after=status.value,
                error=error.get("message"),
                backoff_s=backoff,
            )
            log.warning(
                "%s %s; restart %d of %d in %.0f s",
                self.run_dir.name,
                status.value,
                self.restarts,
                cfg.max_restarts,
                backoff,
            )
            if self._back_off(backoff):
                cfg, run_dir, token = prepare(cfg.replace(resume="auto"), token=self._token)
                self.config, self._token = cfg, token
                self._process = start_processes(
                    cfg, self._task, run_dir, token, self._plan, self._progress
                )
                return True
        # A preemption signal came once the run had ended and before a due restart started: it ends
        # preempted.
        record_preemption(
            self.dir,
            self._signalled,
            f"came after the run ended {status.value}, before its due "
            f"restart (max_restarts={cfg.max_restarts}): not restarted",
            after_failure=True,
        )
        return False

    def _back_off(self, seconds: float) -> bool:
        """Sleep before a restart; False when a preemption signal came meanwhile (it ends the run
        instead). A plain sleep would resume after the signal's handler and restart the run
        regardless."""
        until = time.monotonic() + seconds
        while not self._signalled and (left := until - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
        return not self._signalled

    @cached_property
    def result(self) -> RunResult:
        return self.wait()


def raise_for_ending(run: RunDir, unrecorded: dict[str, Any] | None = None) -> None:
    """The exception for a run that didn't end well: failed, diverged or preempted. `unrecorded`:
    the failure finalize could not write (a full disk), which is still the one to report."""
    if unrecorded is not None:
        raise RunFailedError(run.path, unrecorded)
    summary = run.summary()
    status = run.observed_status()[0]
    if summary.status is Status.UNKNOWN:
        raise RunFailedError(
            run.path,
            {
                "type": "UnknownStatus",
                "message": f"{run.summary_path} says status {summary.status_text!r}, which this "
                "version of workbench doesn't know (a newer one wrote it?); upgrade workbench to "
                "read how the run ended",
            },
        )
    if summary.status is Status.DIVERGED:
        raise RunDivergedError(run.path, summary.ending or {})
    if summary.status is Status.PREEMPTED:
        raise RunPreemptedError(run.path, summary.ending or {})
    if status is Status.FAILED:
        raise RunFailedError(
            run.path, summary.error or {"type": "Lost", "message": run.observed_status()[1]}
        )
