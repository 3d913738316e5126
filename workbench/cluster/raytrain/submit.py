"""Submitting a run to Ray: every check first (the config, the task, the storage, what the
cluster's nodes can place), then the run directory, then the detached driver actor that runs the
TorchTrainer. A submission that fails leaves the run directory saying so, never 'starting'."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.cluster.raytrain.driver import RunDriver
from workbench.cluster.raytrain.run import RayRun
from workbench.cluster.raytrain.session import connect, head_node_id, quiet, resolve_address
from workbench.cluster.raytrain.spec import Ray, check_placement, check_run
from workbench.launcher.phases import STARTING_RAY, announce
from workbench.rundir import Status, lock, prepare

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir import RunDir
    from workbench.tasks import Task

log = logging.getLogger("workbench")
ACTOR_READY_S = 120.0
"""How long the driver actor may take to start (Ray starts a fresh worker process for it, with its
runtime_env: pip installs take longer, and are refused past this)."""


def submit(cfg: RunConfig, spec: Ray, task: Task | None = None) -> RayRun:
    """Check `cfg` against the cluster, prepare its run directory, start the driver actor and
    return the handle; the ranks start as Ray places the worker group."""
    from workbench.cluster.slurm import check_shared_folder
    from workbench.config.preflight import check_checkpoint_store

    check_run(cfg, spec)
    # the driver and the ranks run in Ray's own working directories (and Ray Train's storage_path
    # must be absolute): a relative runs_dir means the caller's folder
    cfg = cfg.replace(runs_dir=str(cfg.runs_dir_path.resolve()))
    payload = _task_payload(cfg, task)
    check_checkpoint_store(cfg)
    check_shared_folder(cfg.runs_dir)
    announce(STARTING_RAY, f"connecting to {resolve_address(spec.address)}")
    with tempfile.TemporaryDirectory(prefix="wb-ray-") as scratch:
        early_log = Path(scratch) / "ray.log"
        ray = connect(spec.address, spec.namespace, early_log)
        with quiet(early_log, keep=False):
            nodes = ray.nodes()
        plan = check_placement(cfg, spec, nodes)
        cfg, run, token = prepare(cfg)
        run.append_ray_log(early_log.read_bytes())
    try:
        job = _job(cfg, spec, plan, run, payload)
        run.write_ray_job(_public(job))
        announce(STARTING_RAY, "starting the run's driver on the cluster")
        _start_driver(ray, spec, job, run, token, head_node_id(nodes))
    except BaseException as e:
        _refused(run, token, e)
        raise ValueError(f"Ray: the run was not started: {e}") from e
    run.event(
        "submitted",
        engine="ray",
        address=job["address"],
        workers=job["workers"],
        actor=job["actor"],
    )
    announce(STARTING_RAY, f"{job['workers']} worker(s) asked of Ray")
    log.info(
        "submitted %s to Ray at %s: %d worker(s) of %s -> %s",
        cfg.run_name,
        job["address"],
        job["workers"],
        job["per_worker"],
        run.path,
    )
    return RayRun(run.path, cfg, job, token)


def _task_payload(cfg: RunConfig, task: Task | None) -> bytes | None:
    """A task object travels pickled through the run directory (the ranks start in fresh
    interpreters, on other nodes); a task name must be one the nodes can import."""
    from workbench.tasks import get_task

    if task is None:
        get_task(cfg.task)  # an unknown task is refused here, not on the nodes
        return None
    from workbench.launcher.spawn import pickle_task

    return pickle_task(task, None)


def _job(
    cfg: RunConfig, spec: Ray, plan: dict[str, Any], run: RunDir, payload: bytes | None
) -> dict[str, Any]:
    """What the driver actor needs, and ray.json records."""
    submission = secrets.token_hex(6)
    env = dict(spec.env)
    if payload is not None:
        from workbench.launcher.spawn import write_task

        env.update(write_task(run, payload))
    return {
        "address": _address_of_cluster(spec),
        "namespace": spec.namespace,
        "actor": f"workbench-{cfg.run_name}-{submission}",
        "submission": submission,
        "workers": plan["world"],
        "use_gpu": plan["use_gpu"],
        "per_worker": plan["per_worker"],
        "placement_strategy": spec.placement_strategy,
        "max_failures": spec.max_failures,
        "runtime_env": spec.runtime_env or {},
        "env": env,
        "threads": max(1, int(plan["per_worker"].get("CPU", 1))),
        "submitted_at": time.time(),
        "spec": dataclasses.asdict(spec),
    }


def _public(job: dict[str, Any]) -> dict[str, Any]:
    """ray.json: the job without the task's digest (the digest travels to the ranks through Ray,
    never through the run directory, as for spawned ranks)."""
    from workbench.worker import TASK_DIGEST_ENV

    return {**job, "env": {k: v for k, v in job["env"].items() if k != TASK_DIGEST_ENV}}


def _address_of_cluster(spec: Ray) -> str:
    """The head's address as this connection found it ('auto' resolved), for attach()."""
    try:
        import ray

        found = ray.get_runtime_context().gcs_address
        return str(found) if found else (spec.address or "auto")
    except Exception:
        return spec.address or "auto"


def _start_driver(
    ray: Any, spec: Ray, job: dict[str, Any], run: RunDir, token: str, head: str | None
) -> None:
    """The detached driver actor, pinned to the head node (the node least likely to go),
    holding the run's lock from now on; then its drive() call, waited for until it has begun."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {
        "name": job["actor"],
        "namespace": spec.namespace,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_restarts": 0,
        "max_concurrency": 2,  # drive() and started()
    }
    if head is not None:
        # Hard: a soft affinity spills to another node whenever the head is busy starting worker
        # processes, and the driver then dies with that node. The head is the one node a cluster
        # can't lose anyway.
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    if spec.runtime_env:
        options["runtime_env"] = spec.runtime_env
    actor = ray.remote(RunDriver).options(**options).remote(str(run.path), token, job)
    try:
        where = ray.get(actor.where.remote(), timeout=ACTOR_READY_S)
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    lock.hand_over(run, token, {**where, "ray_actor": job["actor"]})
    actor.drive.remote()
    deadline = time.monotonic() + ACTOR_READY_S
    while not ray.get(actor.started.remote(), timeout=ACTOR_READY_S):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the driver actor did not begin the run within {ACTOR_READY_S:.0f} s"
            )
        time.sleep(0.05)


def _refused(run: RunDir, token: str, error: BaseException) -> None:
    message = f"the Ray driver was not started: {type(error).__name__}: {error}"
    run.set_status(Status.FAILED, error={"type": type(error).__name__, "message": message})
    run.event("failed", type=type(error).__name__, message=message)
    lock.release(run, token)
