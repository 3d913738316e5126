"""Starting the process that runs a launch's ranks: a forked supervisor, or a shell launcher
(torchrun or `accelerate launch`) on `python -m workbench.worker`; and the line that says what runs
where."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import psutil

from workbench.config import PARALLELISM_MODES, RunConfig
from workbench.config.mesh import virtual_stages
from workbench.config.precision import accelerate_mixed_precision
from workbench.launcher.forked import ForkedSupervisor
from workbench.launcher.phases import announce, starting
from workbench.launcher.scratch import ScratchProcess, make_scratch, remove_scratch
from workbench.launcher.spawn import SpawnedRanks, StartPlan, die_with_caller, write_task
from workbench.rundir import RunDir, lock
from workbench.rundir.liveness import this_process
from workbench.tasks import Task
from workbench.tasks.hf.sources import HUB_OFFLINE
from workbench.utils.distributed import LOOPBACK, single_node_listeners
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.preemption import elastic_signals

log = logging.getLogger("workbench")

T = TypeVar("T")
_starter: list[ThreadPoolExecutor] = []
"""The thread that forks the launcher processes of launches from other threads than the main one."""
_starter_lock = threading.Lock()


def free_port() -> int:
    """A TCP port nobody listens on now (notebook_launcher's fixed 29500 collides across runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def describe_launch(cfg: RunConfig, device: str | None = None) -> str:
    """What a launch of `cfg` starts on this machine, in one line: the processes, their device and
    what they run (the panel's launch line, the CLI's `--prepare-only` answer, the launch log).
    `device`: the launch's, as its caller resolved it (None: resolved here from cfg)."""
    hw = detect()
    device = device or resolve_device(cfg, hw)
    if cfg.num_processes == 1:
        how = f"1 process on {hw.device_line(device)}"
    else:
        backend = "NCCL" if device == "cuda" else "gloo"
        what = "GPUs" if device == "cuda" else "CPU processes"
        mode = (
            "DDP"
            if cfg.parallelism == "ddp"
            else f"{cfg.parallelism} ({PARALLELISM_MODES[cfg.parallelism]})"
        )
        if cfg.tp > 1:
            data_parallel = (
                f" x {cfg.parallelism} (data-parallel {cfg.dp_size})" if cfg.dp_size > 1 else ""
            )
            mode = f"tensor parallel tp={cfg.tp}{data_parallel}"
        if cfg.pp > 1:
            chunks = virtual_stages(cfg)
            inside = [f"{cfg.parallelism} (data-parallel {cfg.dp_size})"] * (cfg.dp_size > 1) + [
                f"tp={cfg.tp}"
            ] * (cfg.tp > 1)
            mode = (
                f"pipeline parallel pp={cfg.pp} ({cfg.pp_schedule}, {cfg.grad_accum_steps} "
                "micro-batches a step"
                + f", {chunks} chunks per rank" * (chunks > 1)
                + ")"
                + "".join(f" x {d}" for d in inside)
            )
        how = f"{cfg.num_processes} {what}, {mode} over {backend}"
    extras = [f"activation checkpointing {cfg.activation_checkpointing}"] * (
        cfg.activation_checkpointing != "none"
    )
    extras += [f"{cfg.grad_compression} gradient compression"] * (cfg.grad_compression != "none")
    extras += ["parameters offloaded to CPU"] * cfg.cpu_offload
    extras += ["DDP finds unused parameters"] * cfg.find_unused_parameters
    batch = f"global batch {cfg.global_batch_size or 'chosen by the ranks'}"
    if cfg.micro_batch_size == "auto":
        batch += " (micro-batch: the largest that fits)"
    return ", ".join([f"launching {cfg.task}: {how}", cfg.precision, batch, *extras])


def launch_command(cfg: RunConfig, run_dir: Path, port: int, device: str) -> list[str]:
    """The shell launcher for one machine: `accelerate launch`, except for multi-process CPU runs.

    `accelerate launch --cpu` starts a single process unless MPI is configured, so N CPU ranks are
    started with torchrun (the elastic launcher accelerate's multi-GPU mode uses too); the worker
    then builds its Accelerator with cpu=True and the ranks form one gloo group.
    """
    worker = ["-m", "workbench.worker", str(run_dir)]
    # One machine: the launcher's rendezvous store listens on loopback only (launcher/loopback.py).
    bound = [sys.executable, "-m", "workbench.launcher.loopback"]
    if device == "cpu" and cfg.num_processes > 1:
        return [
            *bound,
            "torch.distributed.run",
            "--nproc_per_node",
            str(cfg.num_processes),
            "--nnodes",
            "1",
            "--master_addr",
            LOOPBACK,
            "--master_port",
            str(port),
            *worker,
        ]
    cmd = [
        *bound,
        "accelerate.commands.launch",
        "--num_processes",
        str(cfg.num_processes),
        "--num_machines",
        "1",
        "--main_process_ip",
        LOOPBACK,
        "--main_process_port",
        str(port),
        "--dynamo_backend",
        "no",
        "--mixed_precision",
        accelerate_mixed_precision(cfg.precision),
    ]
    if device == "cpu":
        cmd.append("--cpu")
    elif cfg.num_processes > 1:
        cmd.append("--multi_gpu")
    return [*cmd, *worker]


def start_processes(
    cfg: RunConfig, task: Task | None, run: RunDir, token: str, plan: StartPlan, progress: bool
) -> Any:
    """Start the process that runs the ranks: a forked supervisor, or `accelerate launch`/torchrun
    (for the shell, or for ranks spawned from here, whose output is then copied to this process's
    sys.stdout/stderr)."""
    # until the ranks report (the live line follows the run directory from here)
    announce(starting(cfg.num_processes))
    port = free_port()
    log.info("%s -> %s", describe_launch(cfg, plan.device), run.path)
    if plan.method != "subprocess":
        log.log(plan.level, "%s: ranks start by %s (%s)", run.path.name, plan.method, plan.reason)
    # the launch's TMPDIR, removed once its processes are gone (scratch.py)
    scratch = make_scratch(cfg.run_name)
    try:
        process = _start(cfg, task, run, token, plan, progress, port, scratch)
    except BaseException:
        remove_scratch(scratch)
        raise
    lock.set_runner(
        run,
        token,
        {
            **this_process(),
            "pid": process.pid,
            "create_time": psutil.Process(process.pid).create_time(),
        },
    )
    return process


def _start(
    cfg: RunConfig,
    task: Task | None,
    run: RunDir,
    token: str,
    plan: StartPlan,
    progress: bool,
    port: int,
    scratch: Path | None,
) -> Any:
    if plan.method == "fork":
        from workbench.launcher.supervisor import load_rank_modules, supervise

        load_rank_modules(cfg)

        read_fd, write_fd = os.pipe()
        ctx = multiprocessing.get_context("fork")
        forked = ctx.Process(
            target=supervise,
            args=(
                cfg,
                task,
                str(run.path),
                progress,
                port,
                token,
                os.getpid(),
                write_fd,
                plan.device,
                scratch,
            ),
            name=f"workbench-{cfg.run_name}",
        )
        in_a_lasting_thread(forked.start)  # the supervisor dies with this process (supervise)
        return ForkedSupervisor(forked, write_fd, read_fd, cfg.num_processes, run, scratch)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(detect().threads_per_rank(cfg.num_processes)),
        "WORKBENCH_PROGRESS": "1" if progress else "0",
        "PYTHONUNBUFFERED": "1",
        "WORKBENCH_LOCK_TOKEN": token,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": elastic_signals(cfg),
        **HUB_OFFLINE,  # nothing is fetched from the Hugging Face Hub in a rank
    }
    # gloo's and NCCL's listeners in the ranks on loopback too: every launch here is one machine's
    env.update(single_node_listeners(env))
    command = launch_command(cfg, run.path, port, plan.device)
    if plan.method == "spawn":
        assert plan.payload is not None
        env.update(write_task(run, plan.payload))
        return in_a_lasting_thread(
            lambda: SpawnedRanks(command, env, f"workbench-{cfg.run_name}", scratch)
        )
    # The preexec_fn only makes two system calls (prctl, getppid): safe beside other threads.
    return in_a_lasting_thread(
        lambda: ScratchProcess(
            command, scratch=scratch, env=env, start_new_session=True, preexec_fn=die_with_caller()
        )
    )


def in_a_lasting_thread(start: Callable[[], T]) -> T:
    """Run `start` (which forks a launcher process) in the main thread or in one kept for the life
    of this process. The launcher dies with its parent by PR_SET_PDEATHSIG, which the kernel sends
    when the *thread* that forked it ends: a launch from a short-lived thread (a callback's, a
    pool's) would die with that thread."""
    if threading.current_thread() is threading.main_thread():
        return start()
    with _starter_lock:
        if not _starter:
            _starter.append(
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-starter")
            )
    return _starter[0].submit(start).result()
