"""The run's driver on the cluster: a detached Ray actor that runs the TorchTrainer and records how
the run ended. Detached, so the run outlives the kernel that submitted it (a restart, a closed
laptop): `wb.attach(run_dir)` finds the actor by the name ray.json gives.

The actor owns Ray Train's controller, which owns the worker group: killing the actor
(RayRun.kill) takes the whole run down, ranks included (they die with their workers).
"""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

from workbench.rundir import RunDir, Status, lock

log = logging.getLogger("workbench")


class RunDriver:
    """What the detached actor runs (`ray.remote(RunDriver)`: Ray is imported lazily)."""

    def __init__(self, run_dir: str, token: str, job: dict[str, Any]) -> None:
        self.run = RunDir(run_dir)
        self.token = token
        self.job = job
        self.driving = False

    def started(self) -> bool:
        """Whether drive() has begun. The actor runs two calls at once (max_concurrency=2), so the
        submitter can ask while drive() runs: it returns only once drive() is known to have
        arrived, since a call sent by a process that exits right after (a kernel that dies) may
        never leave it."""
        return self.driving

    def where(self) -> dict[str, Any]:
        """The actor's process: the run's lock is handed to it (liveness follows it)."""
        from workbench.rundir.liveness import this_process

        return this_process()

    def drive(self) -> str:
        """Run the TorchTrainer to its end; record the ending the ranks could not (Ray gave up
        after max_failures, a node was lost, the group never started). Returns the run's status."""
        from workbench.cluster.raytrain.session import quiet

        self.driving = True
        with quiet(self.run.ray_log_path):
            error: BaseException | None = None
            started = time.time()
            try:
                self._trainer().fit()
            except BaseException as e:  # recorded below, then the actor ends
                error = e
            status = self._record(error, time.time() - started)
            lock.release(self.run, self.token)
        self._exit_later()
        return status

    def _trainer(self) -> Any:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from workbench.cluster.raytrain.rank import train_rank

        job = self.job
        return TorchTrainer(
            train_rank,
            train_loop_config={
                "run_dir": str(self.run.path),
                "token": self.token,
                "submission": job["submission"],
                "env": job.get("env", {}),
                "threads": job.get("threads", 1),
            },
            # the worker group's own process group only carries the rendezvous: on CPU (gloo) even
            # for a GPU run, so the workers hold no CUDA context beside their ranks'
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=job["workers"],
                use_gpu=job["use_gpu"],
                resources_per_worker=job["per_worker"],
                placement_strategy=job["placement_strategy"],
            ),
            run_config=RunConfig(
                name="ray",
                storage_path=str(self.run.path),
                failure_config=FailureConfig(
                    max_failures=job["max_failures"],
                    # a lost node is a failure to count, not a preemption to wait out forever
                    max_preemption_failures=job["max_failures"],
                ),
                worker_runtime_env=job.get("runtime_env") or None,
            ),
        )

    def _record(self, error: BaseException | None, seconds: float) -> str:
        """The run's ending when the ranks recorded none, from what Ray said."""
        from workbench.launcher.postmortem import finalize

        summary = self.run.summary()
        if error is None and summary.status.ended:
            self.run.event("ray_finished", seconds=round(seconds, 1))
            return summary.status.value
        if error is not None:
            cause = _cause(error, self.run, self.job["max_failures"])
            self.run.event("ray_failed", message=cause, seconds=round(seconds, 1))
            if summary.status.ended and summary.status is not Status.FAILED:
                return summary.status.value  # the ranks ended it (stopped, diverged, ...) first
            # Ray's reason is the run's: what a surviving rank recorded (it lost a peer) is how
            # the failure showed, not why it happened
            said = summary.error or {}
            if said:
                cause += (
                    f"; before that, rank {said.get('rank')} recorded {said.get('type')}: "
                    f"{str(said.get('message', ''))[:300]}"
                )
            self.run.set_status(
                Status.FAILED,
                error={
                    "type": "RayTrainFailed",
                    "message": cause,
                    "traceback": said.get("traceback")
                    or "".join(traceback.format_exception(error))[-4000:],
                },
            )
            self.run.event("failed", type="RayTrainFailed", message=cause)
        elif not summary.status.ended:
            finalize(self.run, exitcode=1)
        return self.run.summary().status.value

    def _exit_later(self) -> None:
        """End the actor once this call's reply is out (a detached actor lives until told)."""
        import threading

        import ray

        def leave() -> None:
            time.sleep(0.5)
            ray.actor.exit_actor()

        threading.Thread(target=lambda: _quietly(leave), daemon=True).start()


def _quietly(fn: Any) -> None:
    try:
        fn()
    except BaseException:  # exit_actor raises to end the actor: nothing to report
        os._exit(0)


def _cause(error: BaseException, run: RunDir, max_failures: int) -> str:
    """Why Ray gave up, in a line: the failures allowed, and each worker's error (a lost node named
    by its address)."""
    text = " ".join(str(error).split())
    # a worker that stopped answering may be on a node that is gone; one that raised is not
    unreachable = any(s in text for s in _UNREACHABLE)
    lost = _lost_nodes(run, _failed_ranks(text), NODE_DEATH_S if unreachable else 0.0)
    if max_failures < 0:
        limit = ""
    elif max_failures:
        limit = f" after max_failures={max_failures} restart(s)"
    else:
        limit = " (max_failures=0: no restart)"
    head = f"Ray Train gave up on the worker group{limit}"
    if lost:
        head += f"; node(s) lost: {', '.join(lost)}"
    return f"{head}: {type(error).__name__}: {text[:800]}"


_RANK_SNIPPET = re.compile(r"\[Rank (\d+) Error Snippet\]")
NODE_DEATH_S = 30.0
"""How long the driver waits for Ray to tell whether a failed worker's node is gone: Ray marks a
node dead once its raylet stops answering the GCS's health checks, seconds after the worker's own
health check failed."""


_UNREACHABLE = ("health check failed", "is unavailable", "failed to connect", "ActorDiedError")


def _failed_ranks(text: str) -> set[int]:
    """The ranks whose workers Ray names in its error (its '[Rank N Error Snippet]' parts)."""
    return {int(n) for n in _RANK_SNIPPET.findall(text)}


def _lost_nodes(run: RunDir, ranks: set[int], wait_s: float) -> list[str]:
    """The nodes (addresses) of the failed ranks' workers that Ray no longer has alive, waiting up
    to `wait_s` for Ray to decide; [] when none is lost, or Ray can't be asked."""
    nodes = {
        str(w["node_id"]): f"{w.get('node_ip')} (rank {w.get('rank')})"
        for w in run.ray_workers()
        if w.get("node_id") and (not ranks or w.get("rank") in ranks)
    }
    deadline = time.monotonic() + wait_s
    while nodes:
        try:
            import ray

            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        except Exception:
            return []
        lost = sorted(where for node, where in nodes.items() if node not in alive)
        if lost or time.monotonic() > deadline:
            return lost
        time.sleep(1.0)
    return []


def log_tail(run_dir: Path, limit: int = 2000) -> str:
    """The end of the run's ray.log ('' when there is none)."""
    try:
        return RunDir(run_dir).ray_log_path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""
