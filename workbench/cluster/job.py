"""What each Slurm task of a submitted run executes: one rank. submitit pickles `run_rank` by reference, so the
job's interpreter imports workbench as the submitting one did (a shared filesystem and the same environment)."""

from __future__ import annotations

import os


def run_rank(run_dir: str, token: str) -> None:
    """Set torch.distributed's variables from the Slurm job (the first node hosts the rendezvous, at a port drawn
    from the job id), then run the worker as `torchrun` would start it."""
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    os.environ.setdefault("WORKBENCH_LOCK_TOKEN", token)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = os.environ.get("SLURM_CPUS_PER_TASK", "1")
    from workbench import worker

    # the worker watches its parent (a rank whose launcher died exits); here that is Slurm's step daemon
    worker._PARENT = os.getppid()
    print(f"[workbench] rank {env.rank} of {env.world_size} on {os.uname().nodename}, rendezvous "
          f"{env.master_addr}:{env.master_port}", flush=True)
    worker.main([run_dir])
