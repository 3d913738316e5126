"""Submitting a run to Slurm: every check first (the config, the task, the cluster), then the run
directory, then one sbatch through submitit. A submission that fails leaves the run directory saying
so, never 'starting', and no job behind."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from workbench.cluster.job import WARNING_SIGNAL, run_rank
from workbench.cluster.slurm import Slurm, check, executor_parameters, python_for_jobs
from workbench.cluster.slurm_run import SlurmRun
from workbench.launcher.phases import WAITING_FOR_CLUSTER, announce
from workbench.rundir import Status, lock, prepare
from workbench.rundir.scheduler import UNKNOWN, query

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir import RunDir
    from workbench.tasks import Task

log = logging.getLogger("workbench")


def submit(cfg: RunConfig, slurm: Slurm, task: Task | None = None) -> SlurmRun:
    """Check `cfg` against the cluster, prepare its run directory (on the shared filesystem), submit
    one job of nodes x ranks-per-node Slurm tasks, each a rank, and return the handle."""
    cfg = _checked(cfg, slurm, task)
    partition = check(cfg, slurm)
    cfg, run, token = prepare(cfg)
    announce(WAITING_FOR_CLUSTER, "submitting the job")
    job_id = _sbatch(cfg, slurm, partition, run, token)
    _record_job(job_id, cfg, slurm, partition, run, token)
    # the live line asks Slurm from here on (SlurmRun.launch_phase)
    announce(WAITING_FOR_CLUSTER, f"Slurm job {job_id} submitted")
    log.info(
        "submitted %s to Slurm: job %s on partition %s, %d node(s) x %d rank(s) -> %s",
        cfg.run_name,
        job_id,
        partition,
        slurm.nodes,
        slurm.per_node(cfg),
        run.path,
    )
    return SlurmRun(run.path, cfg, job_id, token)


def _checked(cfg: RunConfig, slurm: Slurm, task: Task | None) -> RunConfig:
    """`cfg` with Slurm's warning signal as its preempt_signal, once its task and signal suit a
    cluster run."""
    from workbench.tasks import get_task

    if task is not None:
        raise ValueError(
            "a cluster run can't take a task object from this process: its ranks start in fresh "
            "interpreters on the nodes. Register the task in an importable module (or name it "
            "'module:Class' in cfg.task) and pass no task="
        )
    get_task(cfg.task)  # an unknown task is refused here, not on the nodes
    from workbench.config.preflight import check_checkpoint_store

    check_checkpoint_store(cfg)  # wrong keys or a missing bucket: refused here, not on the nodes
    if cfg.preempt_signal not in (None, WARNING_SIGNAL):
        raise ValueError(
            f"preempt_signal={cfg.preempt_signal!r}: Slurm warns a run with {WARNING_SIGNAL} "
            f"grace_s={slurm.grace_s} s before its time limit; leave preempt_signal unset or set "
            f"it to {WARNING_SIGNAL!r}"
        )
    return cfg.replace(preempt_signal=WARNING_SIGNAL)


def _sbatch(cfg: RunConfig, slurm: Slurm, partition: str, run: RunDir, token: str) -> str:
    """Submit the run's job through submitit and return its id. A refusal leaves the run directory
    failed and its lock released."""
    import submitit

    try:
        executor = submitit.SlurmExecutor(folder=run.slurm_path, python=python_for_jobs())
        executor.update_parameters(
            **executor_parameters(
                slurm,
                partition,
                job_name=f"workbench-{cfg.run_name}",
                nodes=slurm.nodes,
                tasks_per_node=slurm.per_node(cfg),
                requeue=cfg.max_restarts > 0,
            ),
            stderr_to_stdout=False,
            signal_delay_s=slurm.grace_s,
        )
        job = executor.submit(run_rank, str(run.path), token)
    except Exception as e:
        run.set_status(
            Status.FAILED,
            error={"type": type(e).__name__, "message": f"sbatch refused the job: {e}"},
        )
        run.event("failed", type=type(e).__name__, message=f"sbatch refused the job: {e}")
        lock.release(run, token)
        raise ValueError(f"Slurm: the job was not submitted: {e}") from e
    return job.job_id


def _record_job(
    job_id: str, cfg: RunConfig, slurm: Slurm, partition: str, run: RunDir, token: str
) -> None:
    """The job in the run directory: slurm.json names it (with its identity), an event says it was
    submitted, and the lock's runner is the job."""
    identity = job_identity(job_id, slurm.job_name or f"workbench-{cfg.run_name}")
    run.write_job(
        {
            "job_id": job_id,
            **identity,
            "folder": str(run.slurm_path),
            "partition": partition,
            "nodes": slurm.nodes,
            "ranks_per_node": slurm.per_node(cfg),
            "submitted_at": time.time(),
        }
    )
    run.event("submitted", job_id=job_id, partition=partition, nodes=slurm.nodes)
    lock.set_runner(run, token, {"slurm_job_id": job_id, **identity})


def job_identity(job_id: str, job_name: str) -> dict[str, str]:
    """Who the job just submitted is, as Slurm prints it (scheduler.IDENTITY): its name, submit time
    and cluster. A job id alone is not enough: ids start over when a cluster's state is reset, and a
    dead run must not take another's job of its id for its own. What the controller can't say right
    now is left out (not checked)."""
    answer = query(job_id)
    if answer is None or answer.state == UNKNOWN:
        log.warning(
            "Slurm job %s: its submit time and cluster could not be read (%s); slurm.json names "
            "it by id and name only",
            job_id,
            "no squeue here" if answer is None else answer.reason,
        )
        return {"job_name": job_name}
    found = {
        "job_name": answer.name or job_name,
        "submit_time": answer.submit_time,
        "cluster": answer.cluster,
    }
    return {k: v for k, v in found.items() if v}
