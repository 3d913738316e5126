"""`RayRun`: the handle of a run on Ray, with the local `Run`'s surface (status, done(), wait(),
stop(), kill(), result(), resume(); the live line and the dashboard read its directory) and what
only a run on Ray has: its driver actor, and where Ray placed each rank.

Everything comes back through the run directory and the driver actor's name (ray.json), so
`wb.attach(run_dir)` builds the same handle from a new kernel."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.launcher.phases import STARTING_RAY
from workbench.launcher.result import RunResult
from workbench.launcher.run import raise_for_ending, waiting_interruptibly
from workbench.rundir import RunDir, RunFiles, Status, lock

POLL_S = 0.5
"""How often wait() asks Ray and the run directory."""
ALIVE, GONE, UNKNOWN = "ALIVE", "GONE", "UNKNOWN"

log = logging.getLogger("workbench")


@dataclass(repr=False)  # RunFiles' one-line repr
class RayRun(RunFiles):
    """A run on Ray (`wb.start(cfg, cluster=wb.Ray(...))` or `wb.attach(run_dir)`)."""

    run_dir: Path
    config: RunConfig
    job: dict[str, Any]
    """ray.json: the cluster's address, the driver actor's name and namespace, the workers."""
    _token: str | None = field(default=None, repr=False)
    _result: RunResult | None = field(default=None, repr=False)
    _unasked_since: float | None = field(default=None, repr=False)

    @property
    def start_method(self) -> str:
        return "ray"

    # ---- Ray's side ------------------------------------------------------------------------------
    def _live_actor(self) -> Any:
        """The driver actor's handle, found by name (from a new kernel too); None once it has
        ended. Raises where the cluster can't be asked (driver() says UNKNOWN)."""
        from workbench.cluster.raytrain.session import connect

        namespace = self.job.get("namespace", "workbench")
        ray = connect(self.job.get("address"), namespace, self.dir.ray_log_path)
        try:
            return ray.get_actor(self.job["actor"], namespace=namespace)
        except ValueError:  # no live actor of that name: it ended
            return None

    def driver(self) -> tuple[str, str]:
        """(state, why) of the run's driver actor: ALIVE, GONE (it ended, or was killed), UNKNOWN
        (Ray can't be asked from here: the cluster is down or unreachable)."""
        try:
            if self._live_actor() is None:
                return GONE, f"no actor {self.job['actor']} on the cluster"
            return ALIVE, "running"
        except Exception as e:  # the cluster can't be asked: nothing is concluded from it
            return UNKNOWN, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def workers(self) -> list[dict[str, Any]]:
        """Where Ray placed each rank last (node address, node_rank, local_rank, pids, attempt)."""
        return self.dir.ray_workers()

    def launch_phase(self) -> tuple[str, str]:
        """('starting Ray workers', what of them is there) until the ranks report."""
        attempt = self.dir.ray_attempt()
        placed = [
            w
            for w in self.workers()
            if attempt is not None
            and attempt[0] == self.job.get("submission")
            and w.get("attempt") == attempt[1]
        ]
        if placed:
            nodes = len({w.get("node_id") for w in placed})
            return STARTING_RAY, (
                f"{len(placed)}/{self.job['workers']} rank(s) started on {nodes} node(s)"
            )
        return STARTING_RAY, f"Ray places {self.job['workers']} worker(s)"

    def describe(self) -> str:
        """One line: the run's status and its driver's."""
        state, why = self.driver()
        return f"{self.run_dir.name}: {self.status.value}; Ray driver {state.lower()}" + (
            f" ({why})" if state == UNKNOWN else ""
        )

    # ---- the handle ------------------------------------------------------------------------------
    def done(self) -> bool:
        """The driver has ended (it records the run's ending first); where Ray can't be asked, the
        run recorded an ending."""
        state = self.driver()[0]
        if state == UNKNOWN:
            return self.dir.summary().status.ended
        return state == GONE

    def stop(self) -> None:
        """Graceful stop: the ranks agree on a step, save a checkpoint and end 'stopped'; Ray then
        sees the workers return and the driver ends."""
        if not self.done():
            self.dir.request_stop()

    def kill(self) -> None:
        """Hard stop: kill the driver actor, which takes Ray Train's controller, the workers and
        their ranks with it; returns once it is gone. The last complete checkpoint stays; the run
        ends 'failed', killed."""
        handle = self._live_actor()
        if handle is None:
            return
        import ray

        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + 30
        while self.driver()[0] == ALIVE and time.monotonic() < deadline:
            time.sleep(0.2)
        if not self.dir.summary().status.ended:
            message = f"killed: the Ray driver actor {self.job['actor']} was killed (kill())"
            self.dir.set_status(Status.FAILED, error={"type": "Killed", "message": message})
            self.dir.event("failed", type="Killed", message=message)

    cancel = kill
    """As SlurmRun's cancel()."""

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the driver has ended and the run recorded why. Ctrl-C (a kernel interrupt)
        stops the run gracefully, a second one kills it. While Ray can't be asked nothing is
        concluded: wait() goes on waiting (and logs so) unless the ranks record an ending. Raises
        as a local run does (RunFailedError, ...), or TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting_interruptibly(
            lambda: self._wait_until_done(deadline, timeout),
            self.stop,
            self.kill,
            self.run_dir.name,
        )
        self._record_an_ending()
        self._result = RunResult(self.run_dir, self.config)
        lock.release(self.dir, self._token)
        raise_for_ending(self.dir)
        return self._result

    def _wait_until_done(self, deadline: float | None, timeout: float | None) -> None:
        while not self._ended():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {self.run_dir.name} (Ray driver {self.job['actor']}) still "
                    f"{self.status.value} after {timeout}s; call wait() again, stop() or kill()"
                )
            time.sleep(POLL_S)

    def _ended(self) -> bool:
        state, why = self.driver()
        if state == UNKNOWN:
            if self._unasked_since is None:
                self._unasked_since = time.monotonic()
                log.warning(
                    "%s: the Ray cluster can't be asked (%s); still waiting (the run is not taken "
                    "for ended until Ray answers, or its ranks record an ending)",
                    self.run_dir.name,
                    why,
                )
            return self.dir.summary().status.ended
        self._unasked_since = None
        return state == GONE

    def _record_an_ending(self) -> None:
        """The driver records how the run ended; a driver gone without that (killed with its node)
        leaves the run 'failed', saying so, never 'running'."""
        if self.dir.summary().status.ended:
            return
        from workbench.cluster.raytrain.driver import log_tail

        message = (
            f"the Ray driver actor {self.job['actor']} ended before the run recorded an ending "
            "(killed, or its node was lost)"
        )
        self.dir.set_status(
            Status.FAILED,
            error={
                "type": "RayDriverEnded",
                "message": message,
                "traceback": log_tail(self.run_dir),
            },
        )
        self.dir.event("failed", type="RayDriverEnded", message=message)

    def result(self) -> RunResult:
        return self._result or self.wait()

    def resume(self, **changes: Any) -> RayRun:
        """Continue this run on the same Ray cluster from its newest checkpoint, with `changes` to
        the config (e.g. max_steps=2000); returns the new handle at once."""
        # Through the public wb.start (resolved on first use): submit.py imports this module
        import workbench
        from workbench.cluster.raytrain.spec import Ray
        from workbench.rundir.run_files import resume_config

        if not self.done():
            raise RuntimeError(
                f"resume(): {self.run_dir.name} is still running on Ray; stop() or wait() first"
            )
        spec = Ray(**self.job.get("spec", {}))
        return workbench.start(resume_config(self.config, self.run_dir, changes), cluster=spec)


def attach(run_dir: str | Path) -> RayRun:
    """The handle of a run on Ray, from its directory (a new kernel, another machine that sees the
    shared storage). ValueError when the directory holds no run on Ray."""
    run = RunDir(run_dir)
    job = run.ray_job()
    if job is None or not job.get("actor"):
        raise ValueError(
            f"{run.path}: no ray.json naming a driver actor; attach() follows runs on Ray started "
            "with wb.start(cfg, cluster=wb.Ray(...))"
        )
    cfg = run.config()
    if cfg is None:
        raise ValueError(f"{run.config_path}: no such file; {run.path} is not a run directory")
    held = run.lock_owner() or {}
    return RayRun(run.path, cfg, job, held.get("token"))
