"""What each Slurm task of a submitted run executes: one rank. submitit pickles `run_rank` by
reference, so the job's interpreter imports workbench as the submitting one did (a shared filesystem
and the same environment).

A job runs again with the same id when Slurm requeues it (its time-limit warning made the ranks
checkpoint and rank 0 asked for a requeue; a node failed; the cluster preempted it with
PreemptMode=REQUEUE): SLURM_RESTART_COUNT then says which attempt this is, rank 0 opens the next
attempt of the run directory with `resume: auto`, and the other ranks wait for it before they start.

submitit submits the job, starts one task per rank and sets torch.distributed's variables
(TorchDistributedEnvironment). Its own requeue (a `Checkpointable` callable) stays unused, for a
reason: its signal handler checkpoints and requeues from global rank 0 at once and exits that rank,
while the other ranks train on. workbench's ranks must first agree on one step and write one
checkpoint together (a collective, longer than a signal handler may take), so the worker's handler
of the warning signal only raises the preemption flag, and rank 0 requeues with `scontrol requeue`
after the ranks have checkpointed and returned.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

WARNING_SIGNAL = "SIGUSR2"
"""The signal Slurm sends `grace_s` before the time limit (sbatch --signal=USR2@grace, submitit's):
the ranks take it as a preemption (cfg.preempt_signal), checkpoint, and the job is requeued."""
ATTEMPT_WAIT_S = 300.0


def run_rank(run_dir: str, token: str) -> None:
    """Set torch.distributed's variables from the Slurm job (the first node hosts the rendezvous, at
    a port drawn from the job id), open the attempt when the job runs again, run the worker as
    `torchrun` would start it, then (rank 0) requeue a run its time-limit warning preempted while
    restarts are left."""
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ.setdefault("WORKBENCH_LOCK_TOKEN", token)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = os.environ.get("SLURM_CPUS_PER_TASK", "1")
    restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restart:
        next_attempt(Path(run_dir), token, restart, env.rank)
    from workbench import worker

    print(
        f"[workbench] rank {env.rank} of {env.world_size} on {os.uname().nodename}, rendezvous "
        f"{env.master_addr}:{env.master_port}, attempt {restart + 1}",
        flush=True,
    )
    # the worker watches its parent (a rank whose launcher died exits); here that is Slurm's step
    # daemon
    worker.main([run_dir], parent=os.getppid())
    if env.rank == 0:
        requeue_if_warned(Path(run_dir), restart)


def next_attempt(run_dir: Path, token: str, restart: int, rank: int) -> None:
    """Rank 0 stores the next attempt's config (resume: auto, from the newest checkpoint); the
    others wait for it (RunDir.open_slurm_attempt), so every rank reads the same one."""
    from workbench.rundir import RunDir, prepare

    run = RunDir(run_dir)
    if rank == 0:
        cfg = run.config()
        if cfg is None:
            raise RuntimeError(f"{run.config_path}: no config to resume from")
        prepare(cfg.replace(resume="auto"), token)
        run.event("requeue_started", job_id=os.environ.get("SLURM_JOB_ID"), attempt=restart + 1)
        run.open_slurm_attempt(restart)
        return
    deadline = time.monotonic() + ATTEMPT_WAIT_S
    while run.slurm_attempt() != restart:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank}: rank 0 did not open attempt {restart + 1} of {run.path} within "
                f"{ATTEMPT_WAIT_S:.0f} s"
            )
        time.sleep(0.2)


def requeue_if_warned(run_dir: Path, restart: int) -> None:
    """After the ranks ended: a run the time-limit warning preempted is requeued (the same job id,
    Slurm runs it again) while cfg.max_restarts allows; a SIGTERM (scancel, or preemption that Slurm
    requeues itself when so configured) is left as it ended."""
    from workbench.rundir import RunDir, Status

    run = RunDir(run_dir)
    summary, cfg = run.summary(), run.config()
    ending = summary.ending or {}
    if (
        summary.status is not Status.PREEMPTED
        or ending.get("signal") != WARNING_SIGNAL
        or cfg is None
    ):
        return
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if restart >= cfg.max_restarts:
        run.event(
            "not_requeued",
            job_id=job_id,
            reason=f"max_restarts={cfg.max_restarts} spent: resume it with "
            "resume: auto, or raise max_restarts",
        )
        return
    run.event(
        "requeued",
        job_id=job_id,
        attempt=restart + 2,
        step=ending.get("step"),
        reason="the job reached its time-limit warning; the ranks checkpointed",
    )
    subprocess.run(
        ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, check=False
    )
