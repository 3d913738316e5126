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
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from workbench.launcher.postmortem import KILLED_EVENT, finalize
from workbench.launcher.process_tree import end_tree
from workbench.launcher.result import RunResult, not_a_run_directory
from workbench.launcher.run import raise_for_ending
from workbench.rundir import RunDir, RunFiles, Status, lock
from workbench.rundir.liveness import heartbeats, is_alive, proven_process
from workbench.utils.files import DamagedFileError

if TYPE_CHECKING:
    from workbench.cluster.raytrain.run import RayRun
    from workbench.cluster.slurm_run import SlurmRun
    from workbench.config import RunConfig

log = logging.getLogger("workbench")

POLL_S = 0.25
"""How often wait() reads the run directory."""
EXIT_WAIT_S = 30.0
"""How long kill() waits for the processes it ended to be gone before recording the run's end."""
START_WAIT_S = 60.0
"""How long kill() waits, for a run still starting, for its launch to name the process that runs
the ranks."""
ORPHAN_WAIT_S = 10.0
"""How long kill() waits for ranks whose launcher is gone to die with it (by their parent-death
signal: within a second) before it refuses to record an ending while they run."""


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
        status = self.dir.observed_status()[0]
        if status is Status.UNKNOWN:
            # a status this version can't read: done once nothing of the run is running
            beats = heartbeats(self.dir)
            return is_alive(self._runner()) is not True and not any(is_alive(b) for b in beats)
        if not status.ended:
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
        """Hard stop: end the process that runs the ranks, everything it started and the process
        groups those lead (torchrun's ranks run in groups of their own), and return once they are
        gone; the run then ends 'failed', killed. The last complete checkpoint stays.

        Only processes proven to be the run's are signalled: the lock's runner, by pid and start
        time, running `workbench.worker` on this directory or forked from the launch that holds the
        lock, and what it started. While the run is starting and its launch has not named that
        process yet, kill() waits up to START_WAIT_S for it. RuntimeError, with nothing signalled
        and nothing recorded, when the run's processes can't be proven: its lock can't be read,
        names a process that isn't the run's or names none (a run started by hand), or they run on
        another host. stop() works in every case: it goes through the directory."""
        runner = self._proven_runner()
        if runner is not None:
            try:  # before any signal: the launching process reads it when its ranks die
                self.dir.event(
                    KILLED_EVENT,
                    by="AttachedRun.kill()",
                    pid=os.getpid(),
                    host=socket.gethostname(),
                )
            except OSError as e:
                log.warning("%s: could not record the kill (%s); killing anyway", self.run_dir, e)
            left = end_tree(runner, EXIT_WAIT_S)
            if left:
                raise RuntimeError(
                    f"kill(): {self.run_dir.name}: processes {', '.join(str(p.pid) for p in left)} "
                    f"are still there {EXIT_WAIT_S:.0f} s after SIGKILL (stuck in the kernel: a "
                    "D state in `ps`?); the run's ending is not recorded while they are"
                )
        try:
            unreadable = self.dir.summary().status is Status.UNKNOWN
        except DamagedFileError as e:
            log.warning("kill(): %s; the run's ending is not recorded over it", e)
            return
        if not unreadable:
            finalize(self.dir, RuntimeError("killed by AttachedRun.kill()"))
        else:
            finalize(self.dir)  # says why it records nothing

    def _proven_runner(self) -> psutil.Process | None:
        """The process that runs the ranks, proven to be the run's (see kill()); None when nothing
        of the run is left to end. RuntimeError when that can't be told."""
        name = self.run_dir.name
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                status: Status | None = self.dir.summary().status
            except DamagedFileError:
                status = None
            try:
                held = lock.owner_checked(self.dir)
            except DamagedFileError as e:
                if status is not None and status.ended:
                    return None
                raise RuntimeError(
                    f"kill(): {name}: its lock can't be read ({e}), so the process that runs its "
                    f"ranks can't be proven; nothing was signalled and its status is left as it "
                    f"is. {self._ranks_hint()}"
                ) from None
            runner = held.get("runner") if held else None
            if isinstance(runner, dict):
                proc = self._check_runner(runner, held or {})
                if proc is not None:
                    return proc
                return self._nothing_left()
            if held is None:
                # no launch holds the run: it has ended, or rank 0 held it and is gone
                return self._nothing_left()
            owner_alive = is_alive(held)
            if owner_alive is None:
                raise RuntimeError(
                    f"kill(): {name} was launched on {held.get('host')}, not on "
                    f"{socket.gethostname()}; kill it there, or stop() from here"
                )
            if owner_alive is False:  # a stale lock: its launch is gone, and so its processes
                return self._nothing_left()
            if status is not Status.STARTING:
                raise RuntimeError(
                    f"kill(): {name}: its lock, held by pid {held.get('pid')}, names no process "
                    "that runs the ranks (rank 0 holds it: a run started by hand, multi-node or "
                    f"--prepare-only); nothing was signalled. End it where it was started, or "
                    f"stop() it. {self._ranks_hint()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"kill(): {name} is still starting {START_WAIT_S:.0f} s on: its launch (pid "
                    f"{held.get('pid')}) has not started the process that runs the ranks; "
                    "nothing was signalled. Call kill() again, or stop() it (the ranks stop at "
                    "their first step)"
                )
            time.sleep(POLL_S)

    def _check_runner(self, runner: dict[str, Any], held: dict[str, Any]) -> psutil.Process | None:
        """The lock's runner as a process proven to be the run's; None when it is gone (its pid
        ended, or is now another process's: its start time differs). RuntimeError when it is
        there but not proven."""
        name = self.run_dir.name
        if runner.get("slurm_job_id") or runner.get("host") != socket.gethostname():
            where = runner.get("host") or f"Slurm job {runner.get('slurm_job_id')}"
            raise RuntimeError(
                f"kill(): {name}'s ranks run on {where}, not on {socket.gethostname()}; kill "
                "them there, or stop() from here"
            )
        if not isinstance(runner.get("create_time"), (int, float)):
            raise RuntimeError(
                f"kill(): {name}: its lock names pid {runner.get('pid')} without the start time "
                "its launch records, so it can't be proven to be the run's (a lock written by "
                f"hand?); nothing was signalled. {self._ranks_hint()}"
            )
        proc = proven_process(runner)
        if proc is None:
            return None
        why = _not_the_runs(proc, self.dir, held)
        if why:
            raise RuntimeError(
                f"kill(): {name}: its lock names pid {proc.pid} as the process that runs its "
                f"ranks, but {why}: not the run's (a lock copied from another run, or forged); "
                f"nothing was signalled. {self._ranks_hint()}"
            )
        return proc

    def _nothing_left(self) -> None:
        """No process runs the ranks: wait (ORPHAN_WAIT_S) for ranks that outlived it to die with
        it, and refuse while one still trains."""
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while True:
            alive = [b.get("pid") for b in heartbeats(self.dir) if is_alive(b)]
            if not alive:
                return None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"kill(): {self.run_dir.name}: no process that runs its ranks is left, but "
                    f"ranks with pids {alive} still write heartbeats; nothing was signalled and "
                    "its status is left as it is: stop() it, or end them by hand"
                )
            time.sleep(POLL_S)

    def _ranks_hint(self) -> str:
        pids = [b.get("pid") for b in heartbeats(self.dir) if is_alive(b)]
        if not pids:
            return "stop() works through the directory"
        return f"Its ranks' heartbeats name pids {pids}; stop() works through the directory"


def _not_the_runs(proc: psutil.Process, run: RunDir, held: dict[str, Any]) -> str:
    """Why `proc` is not the run's process that runs its ranks; '' when it is: it runs
    `workbench.worker` on this very directory (torchrun, accelerate launch), or it is a fork of the
    live launch that holds the lock, running that launch's command line (the fork-mode
    supervisor)."""
    try:
        command = proc.cmdline()
        if "workbench.worker" in command[:-1]:
            target = Path(command[command.index("workbench.worker") + 1])
            with contextlib.suppress(OSError, psutil.Error):
                if os.path.samefile(Path(proc.cwd()) / target, run.path):
                    return ""
            return f"it runs workbench.worker on {target}, not on {run.path}"
        launch = proven_process(held)
        if launch is not None and proc.ppid() == launch.pid and command == launch.cmdline():
            return ""
    except psutil.Error as e:
        return f"it can't be inspected ({e})"
    shown = " ".join(command)
    return (
        f"it runs {shown[:80]!r}{'...' if len(shown) > 80 else ''}, neither workbench.worker on "
        f"this directory nor a fork of the launch that holds the lock (pid {held.get('pid')})"
    )


def attach(run_dir: str | os.PathLike[str]) -> AttachedRun | SlurmRun | RayRun:
    """The handle of a run started elsewhere, from its directory: a `SlurmRun` for a run submitted
    to Slurm, a `RayRun` for one on Ray, an `AttachedRun` for a local one (running or ended).
    ValueError when `run_dir` is not a run directory."""
    run = RunDir(Path(run_dir).expanduser())
    if run.ray_job() is not None:
        from workbench.cluster.raytrain.run import attach as attach_ray

        return attach_ray(run.path)
    if run.job_path.exists():
        from workbench.cluster.slurm_run import attach as attach_slurm

        return attach_slurm(run.path)
    cfg = run.config()
    if cfg is None and run.summary_path.is_file():
        raise ValueError(
            f"attach: {run.path} has a summary.json but no config.yaml, the config the run was "
            "launched with (deleted or moved?); put it back (a copy of the YAML it ran with) to "
            "follow or resume the run, or read its summary with wb.runs("
            f"{str(run.path.parent)!r})"
        )
    if cfg is None:
        raise ValueError(not_a_run_directory(run.path, call="attach"))
    return AttachedRun(run.path, cfg)
