"""The training function every Ray Train worker runs: one rank of the run.

The worker starts the rank as a child interpreter (`python -m workbench.worker RUN_DIR`), as
torchrun or Slurm's srun would, and waits for it. Not in the worker's own process, for reasons Ray
can't change: Train V2 calls the training function in a thread of the worker actor, and a rank needs
a main thread (the preemption signals it checkpoints on, its stack dump when it hangs); a fresh
interpreter starts each attempt with no state left from a failed one (CUDA, the process group); and
a rank dies with its parent, so Ray tearing down a worker group takes its ranks along.

The worker group's own process group (TorchTrainer sets one up) only carries the rendezvous: rank 0
picks a free port on its node, and the ranks' torch.distributed group is the children's.

When Ray restarts the group (a worker failed and max_failures allows), the training function runs
again on every worker: rank 0 sees that its submission has opened a group before, stores the next
attempt's config (resume: auto, from the newest complete checkpoint), and the others learn it
through the broadcast before their rank starts.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

from workbench.rundir import RunDir


def train_rank(config: dict[str, Any]) -> None:
    """One rank: `config` holds run_dir, token, submission, env (for the rank), threads (OMP)."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    context = ray.train.get_context()
    rank = context.get_world_rank()
    run = RunDir(config["run_dir"])
    plan = None
    if rank == 0:
        attempt = open_attempt(run, config["token"], config["submission"])
        plan = {"attempt": attempt, "master_addr": _node_address(), "master_port": _free_port()}
    plan = broadcast_from_rank_zero(plan)
    env = {
        **os.environ,
        **config.get("env", {}),
        "RANK": str(rank),
        "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "NODE_RANK": str(context.get_node_rank()),
        "GROUP_RANK": str(context.get_node_rank()),
        "MASTER_ADDR": plan["master_addr"],
        "MASTER_PORT": str(plan["master_port"]),
        "WORKBENCH_LOCK_TOKEN": config["token"],
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("OMP_NUM_THREADS", str(config.get("threads", 1)))
    log_path = run.ray_rank_log_path(rank)
    with run.ray_rank_log(rank) as log:
        log.write(
            f"--- attempt {plan['attempt'] + 1} of submission {config['submission']}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode()
        )
        log.flush()
        child = subprocess.Popen(
            [sys.executable, "-m", "workbench.worker", str(run.path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        run.write_ray_worker(
            rank,
            {
                "rank": rank,
                "node_rank": context.get_node_rank(),
                "local_rank": context.get_local_rank(),
                "node_ip": _node_address(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "host": socket.gethostname(),
                "worker_pid": os.getpid(),
                "rank_pid": child.pid,
                "attempt": plan["attempt"],
                "started_at": time.time(),
            },
        )
        code = child.wait()
    if code != 0:
        # Ray counts the failure (a restart while max_failures allows) and tears the group down
        raise RuntimeError(
            f"rank {rank} (pid {child.pid} on {_node_address()}) exited with "
            f"{_exit_words(code)}; its output is in {log_path}"
        )


def open_attempt(run: RunDir, token: str, submission: str) -> int:
    """Rank 0: the worker group this is for the submission (0 the first). A later one stores the
    next attempt's config, resuming from the newest complete checkpoint, and says so in the
    events."""
    opened = run.ray_attempt()
    attempt = opened[1] + 1 if opened is not None and opened[0] == submission else 0
    if attempt:
        from workbench.rundir import prepare

        cfg = run.config()
        if cfg is None:
            raise RuntimeError(f"{run.config_path}: no config to resume from")
        prepare(cfg.replace(resume="auto"), token)
        checkpoint = run.latest_checkpoint()
        run.event(
            "ray_restarted",
            attempt=attempt + 1,
            resume_from=getattr(checkpoint, "name", None),
            reason="Ray restarted the worker group after a failure",
        )
    run.open_ray_attempt(submission, attempt)
    return attempt


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _free_port() -> int:
    """A port free now on this node for rank 0's rendezvous (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_node_address(), 0))
        return int(sock.getsockname()[1])


def _exit_words(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
