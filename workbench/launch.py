"""The caller's side of a launch: `launch()` and `start()` run a RunConfig on N ranks from a notebook (fork,
via notebook_launcher in a supervisor process) or the shell (`accelerate launch` / torchrun), and `Run` is
the handle on a run that is going.

What notebook_launcher gets wrong is fixed around it: a free port per run, precision that reaches the
workers, CPU ranks that form one process group, an honest launch message, and each rank's exception
written to the run directory (see rank.py, supervisor.py and postmortem.py).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

from .config import PARALLELISM_MODES, RunConfig
from .hardware import detect
from .postmortem import finalize
from .precision import accelerate_mixed_precision
from .rundir import RunFailedError, RunFiles, RunResult, Status, prepare
from .tasks import Task, get_task

log = logging.getLogger("workbench")

Mode = Literal["fork", "subprocess"]


def free_port() -> int:
    """A TCP port nobody listens on now (notebook_launcher's fixed 29500 collides across runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_launch(cfg: RunConfig) -> str:
    hw = detect()
    device = cfg.resolved_device(hw)
    if cfg.num_processes == 1:
        how = f"1 process on {hw.describe(device)}"
    else:
        backend = "NCCL" if device == "cuda" else "gloo"
        what = "GPUs" if device == "cuda" else "CPU processes"
        mode = "DDP" if cfg.parallelism == "ddp" else f"{cfg.parallelism} ({PARALLELISM_MODES[cfg.parallelism]})"
        how = f"{cfg.num_processes} {what}, {mode} over {backend}"
    extras = [f"activation checkpointing {cfg.activation_checkpointing}"] * (cfg.activation_checkpointing != "none")
    extras += [f"{cfg.grad_compression} gradient compression"] * (cfg.grad_compression != "none")
    extras += ["parameters offloaded to CPU"] * cfg.cpu_offload
    return ", ".join([f"launching {cfg.task}: {how}", cfg.precision, f"global batch {cfg.global_batch_size}", *extras])


@dataclass
class Run(RunFiles):
    """A launched run. `stop()` asks ranks to checkpoint and exit; `wait()` returns the RunResult."""

    config: RunConfig
    run_dir: Path
    _process: Any = field(repr=False)
    _mode: Mode = "fork"
    _result: RunResult | None = field(default=None, repr=False)
    # wait() in one thread and stop()/done() in another (the panel does this) must not race on the process.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def done(self) -> bool:
        return self._exitcode() is not None

    def _exitcode(self) -> int | None:
        with self._lock:
            return self._process.poll() if self._mode == "subprocess" else self._process.exitcode

    def stop(self) -> None:
        """Graceful stop: ranks agree on a step (within a few steps), save a checkpoint and exit."""
        if not self.done():
            self.dir.request_stop()

    def kill(self) -> None:
        """Hard stop: end the supervisor and every rank now. The last complete checkpoint stays."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._join(timeout=30)
        finalize(self.dir, RuntimeError("killed by Run.kill()"))

    def _join(self, timeout: float | None) -> None:
        if self._mode == "subprocess":
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout)
        elif multiprocessing.connection.wait([self._process.sentinel], timeout):
            # The sentinel fires when the process closes its files, a moment before it can be reaped;
            # join() then returns at once with the exit code. The lock keeps two threads from reaping at once.
            with self._lock:
                self._process.join()

    def _join_interruptibly(self, timeout: float | None) -> None:
        try:
            self._join(timeout)
        except KeyboardInterrupt:
            # First Ctrl-C / kernel interrupt: stop gracefully (the ranks checkpoint); a second one kills.
            self.stop()
            log.warning("stopping %s: ranks save a checkpoint and exit; interrupt again to kill them",
                        self.run_dir.name)
            try:
                self._join(timeout)
            except KeyboardInterrupt:
                self.kill()
                raise

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends. Raises RunFailedError naming the failing rank, or TimeoutError."""
        if self._result is None:
            self._join_interruptibly(timeout)
            code = self._exitcode()
            if code is None:
                raise TimeoutError(f"run {self.run_dir.name} still running after {timeout}s; call wait() again, "
                                   "stop() or kill()")
            finalize(self.dir, exitcode=code)
            self._result = RunResult(self.run_dir, self.config)
            if self._result.status in (Status.COMPLETED, Status.STOPPED):
                from .recording import record_run

                record_run(self._result)  # in a notebook: the regression suite reads these back (no-op elsewhere)
        summary = self.dir.summary()
        if summary.status is Status.FAILED:
            raise RunFailedError(self.run_dir, summary.error or {})
        return self._result

    @cached_property
    def result(self) -> RunResult:
        return self.wait()


def _launch_command(cfg: RunConfig, run_dir: Path, port: int) -> list[str]:
    """The shell launcher for one machine: `accelerate launch`, except for multi-process CPU runs.

    `accelerate launch --cpu` starts a single process unless MPI is configured, so N CPU ranks are started
    with torchrun (the elastic launcher accelerate's multi-GPU mode uses too); the worker then builds its
    Accelerator with cpu=True and the ranks form one gloo group.
    """
    worker = ["-m", "workbench.worker", str(run_dir)]
    if cfg.resolved_device() == "cpu" and cfg.num_processes > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.num_processes),
                "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), *worker]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(cfg.num_processes),
           "--num_machines", "1", "--main_process_port", str(port), "--dynamo_backend", "no",
           "--mixed_precision", accelerate_mixed_precision(cfg.precision)]
    if cfg.resolved_device() == "cpu":
        cmd.append("--cpu")
    elif cfg.num_processes > 1:
        cmd.append("--multi_gpu")
    return [*cmd, *worker]


def _checked(cfg: RunConfig, task: Task | None, mode: Mode) -> tuple[RunConfig, Task]:
    """The config and task to run, every check done before anything is created or started."""
    if mode not in ("fork", "subprocess"):
        raise ValueError(f"mode={mode!r}: choose 'fork' or 'subprocess'")
    if task is not None:
        if not isinstance(task, Task):
            raise TypeError(f"task={task!r}: pass an instance of a workbench.Task subclass, e.g. task=MyTask()")
        if cfg.task != task.name:
            cfg = cfg.replace(task=task.name)
        if mode == "subprocess":
            raise ValueError("mode='subprocess' starts fresh interpreters that can't see a task object: register "
                             "the task in an importable module (or name it 'module:Class' in cfg.task) and pass "
                             "no task=, or use mode='fork' for tasks defined in a notebook")
    cfg.check(task=task)  # hardware, precision, task and its options: all before anything starts
    task = task or get_task(cfg.task)
    if mode == "fork" and cfg.resolved_device() == "cuda":
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA is already initialised in this process (a .cuda() or torch.cuda call ran "
                               "here), and forked ranks cannot use it. Restart the kernel and keep GPU work "
                               "inside your Task, or launch with mode='subprocess'")
    return cfg, task


def start(cfg: RunConfig, task: Task | None = None, *, mode: Mode = "fork", progress: bool = False) -> Run:
    """Start `cfg` on cfg.num_processes ranks and return the `Run` handle at once (see `launch` to block).

    mode='fork' (notebooks, any Python process) forks ranks through accelerate.notebook_launcher, so tasks
    defined in a notebook cell work; mode='subprocess' runs `accelerate launch` (torchrun for multi-process
    CPU) like `workbench train`. Everything is validated before any process starts.
    """
    cfg, task = _checked(cfg, task, mode)
    cfg, run_dir = prepare(cfg)
    port = free_port()
    log.info("%s -> %s", describe_launch(cfg), run_dir.path)
    if mode == "fork":
        from .supervisor import supervise

        ctx = multiprocessing.get_context("fork")
        process: Any = ctx.Process(target=supervise, args=(cfg, task, str(run_dir.path), progress, port),
                                   name=f"workbench-{cfg.run_name}")
        process.start()
    else:
        env = {**os.environ, "OMP_NUM_THREADS": str(detect().threads_per_rank(cfg.num_processes)),
               "WORKBENCH_PROGRESS": "1" if progress else "0", "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(_launch_command(cfg, run_dir.path, port), env=env, start_new_session=True)
    return Run(cfg, run_dir.path, process, mode)


@overload
def launch(cfg: RunConfig, task: Task | None = None, *, wait: Literal[True] = True, mode: Mode = "fork",
           progress: bool = False) -> RunResult: ...


@overload
def launch(cfg: RunConfig, task: Task | None = None, *, wait: Literal[False], mode: Mode = "fork",
           progress: bool = False) -> Run: ...


def launch(cfg: RunConfig, task: Task | None = None, *, wait: bool = True, mode: Mode = "fork",
           progress: bool = False) -> RunResult | Run:
    """Run `cfg` on cfg.num_processes ranks and block until it ends: returns the RunResult, or raises
    RunFailedError naming the failing rank. `start()` is the same without blocking.

    `wait=False` is the older spelling of `start()` and is deprecated.
    """
    if not wait:
        warnings.warn("launch(cfg, wait=False) is deprecated: use wb.start(cfg), which returns the Run handle",
                      DeprecationWarning, stacklevel=2)
        return start(cfg, task, mode=mode, progress=progress)
    return start(cfg, task, mode=mode, progress=progress).wait()
