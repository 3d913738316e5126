"""`wb.attach(run_dir)`: the handle of a run some other process started, built from its run
directory alone (a new kernel after a restart, a notebook following `workbench train` from the
shell, another machine on a shared filesystem).

A run submitted to Slurm comes back as a `SlurmRun` (it has a job to follow); a local run as an
`AttachedRun`, with the local `Run`'s surface: status, done(), wait(), stop(), kill(), result().
Everything it knows it reads from the directory: the status and heartbeats the ranks write, and the
lock, which names the process that runs the ranks (the supervisor, or `accelerate launch`) with its
start time, so that a reused pid is never taken for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.launcher.postmortem import finalize
from workbench.launcher.result import RunResult, not_a_run_directory
from workbench.launcher.run import raise_for_ending
from workbench.rundir import RunDir, RunFiles
from workbench.rundir.liveness import is_alive

if TYPE_CHECKING:
    from workbench.cluster.slurm_run import SlurmRun
    from workbench.config import RunConfig

POLL_S = 0.25
"""How often wait() reads the run directory."""
EXIT_WAIT_S = 30.0
"""How long kill() waits for the processes it ended to be gone before recording the run's end."""


@dataclass(repr=False)  # RunFiles' one-line repr, not every field's
class AttachedRun(RunFiles):
    """A local run followed from its directory (`wb.attach(run_dir)`), not from the process that
    started it."""

    run_dir: Path
    config: RunConfig
    _result: RunResult | None = field(default=None, repr=False)

    @property
    def start_method(self) -> str:
        return "attached"

    def _runner(self) -> dict[str, Any] | None:
        """The process that runs the ranks, as the lock names it (host, pid, start time); None when
        no lock names one (the run has ended and its launcher gave the lock back, or rank 0 holds
        it: a run started by hand)."""
        owner = self.dir.lock_owner() or {}
        runner = owner.get("runner")
        return runner if isinstance(runner, dict) and runner.get("pid") else None

    def done(self) -> bool:
        """The run recorded an ending (or its processes are all gone without one: 'failed'), and the
        process that ran its ranks has exited: a resume from here finds the directory free."""
        if not self.dir.observed_status()[0].ended:
            return False
        return is_alive(self._runner()) is not True

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends. Raises as the local Run's wait() does (RunFailedError naming
        the rank, RunPreemptedError, RunDivergedError), or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {self.run_dir.name} still {self.status.value} after {timeout}s; call "
                    "wait() again, stop() or kill()"
                )
            time.sleep(POLL_S)
        self._result = RunResult(self.run_dir, self.config)
        raise_for_ending(self.dir)
        return self._result

    def result(self) -> RunResult:
        return self._result or self.wait()

    def stop(self) -> None:
        """Graceful stop: the ranks agree on a step, save a checkpoint and end 'stopped'."""
        if not self.done():
            self.dir.request_stop()

    def kill(self) -> None:
        """Hard stop: end the process that runs the ranks, and the ranks with it (one process
        group). The last complete checkpoint stays; the run ends 'failed'. RuntimeError when they
        run on another host, where this process can't signal them (stop() works from anywhere: it
        goes through the directory)."""
        runner = self._runner()
        alive = is_alive(runner)
        if alive is None and runner is not None:
            raise RuntimeError(
                f"kill(): {self.run_dir.name}'s ranks run on {runner.get('host')}, not on "
                f"{socket.gethostname()}; kill them there, or stop() from here"
            )
        if alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # the supervisor leads its ranks' group
                os.killpg(int(runner["pid"]), signal.SIGKILL)
            deadline = time.monotonic() + EXIT_WAIT_S
            while is_alive(runner) and time.monotonic() < deadline:
                time.sleep(0.1)
        finalize(self.dir, RuntimeError("killed by AttachedRun.kill()"))


def attach(run_dir: str | os.PathLike[str]) -> AttachedRun | SlurmRun:
    """The handle of a run started elsewhere, from its directory: a `SlurmRun` for a run submitted
    to a cluster, an `AttachedRun` for a local one (running or ended). ValueError when `run_dir` is
    not a run directory."""
    run = RunDir(Path(run_dir).expanduser())
    if run.job_path.exists():
        from workbench.cluster.slurm_run import attach as attach_slurm

        return attach_slurm(run.path)
    cfg = run.config()
    if cfg is None:
        raise ValueError(not_a_run_directory(run.path, call="attach"))
    return AttachedRun(run.path, cfg)
