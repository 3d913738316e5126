"""launch(): run a RunConfig on N ranks from a notebook (fork, via notebook_launcher) or the shell
(`accelerate launch`), and hand back a RunResult.

Fork mode starts one supervisor process per run, and the supervisor calls accelerate's notebook_launcher.
Keeping the launcher out of the caller's process is what makes a kernel able to launch again and again:
torch elastic's signal handlers, accelerate's singletons and any failure stay in the supervisor.
What notebook_launcher gets wrong is fixed around it: a free port per run, precision that reaches the
workers, CPU ranks that form one process group, an honest launch message, and each rank's exception
written to the run directory (elastic drops tracebacks of functions that aren't @record-decorated).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from . import rundir
from .config import RunConfig
from .hardware import detect
from .tasks import Task, get_task

log = logging.getLogger("workbench")


class RunFailedError(RuntimeError):
    """A rank raised. Carries which rank, the exception type, its message and the rank's traceback."""

    def __init__(self, run_dir: Path, error: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.rank = error.get("rank")
        self.exc_type = error.get("type", "Error")
        self.exc_message = error.get("message", "")
        self.rank_traceback = error.get("traceback", "")
        where = f"rank {self.rank}" if self.rank is not None else "the launcher"
        super().__init__(f"{where} failed with {self.exc_type}: {self.exc_message}\n"
                         f"run directory: {run_dir}\n--- traceback from {where} ---\n{self.rank_traceback}")


@dataclass
class RunResult:
    """A finished run, read back from its run directory."""

    run_dir: Path
    config: RunConfig | None = None

    @property
    def summary(self) -> dict[str, Any]:
        return rundir.read_json(self.run_dir / rundir.SUMMARY) or {}

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return rundir.read_jsonl(self.run_dir / rundir.METRICS)

    @property
    def events(self) -> list[dict[str, Any]]:
        return rundir.read_jsonl(self.run_dir / rundir.EVENTS)

    @property
    def status(self) -> str:
        return self.summary.get("status", "unknown")

    def plot(self, *others: RunResult, **kwargs: Any) -> Any:
        """Loss, throughput and memory; pass other results to overlay them (e.g. fp32 against bf16)."""
        from .plots import plot_runs

        return plot_runs([self, *others], **kwargs)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> RunResult:
        run_dir = Path(run_dir)
        cfg_path = run_dir / rundir.CONFIG
        return cls(run_dir, RunConfig.from_yaml(cfg_path) if cfg_path.exists() else None)

    def _repr_html_(self) -> str:
        s = self.summary
        return (f"<b>{self.run_dir.name}</b>: {s.get('status')} after {s.get('steps')} steps, "
                f"loss {s.get('final_loss')}, {s.get('samples_per_s', 0) or 0:.0f} samples/s")


def free_port() -> int:
    """A TCP port nobody listens on now (notebook_launcher's fixed 29500 collides across runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL us when our parent dies, so no rank is ever orphaned."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def rank_main(cfg: RunConfig, task: Task, run_dir: str, progress: bool) -> None:
    """Entry point of every rank: run the trainer; on any exception, write it where the caller will find it."""
    _die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    try:
        from .trainer import train

        train(cfg, task, Path(run_dir), progress=progress)
    except BaseException as exc:
        rundir.write_rank_error(Path(run_dir), rank, exc, traceback.format_exc())
        raise


def record_signal_deaths(run_dir: Path, exc: BaseException) -> None:
    """A rank killed by a signal (the OOM killer's SIGKILL, a segfault) leaves no exception behind; torch
    elastic's ChildFailedError still knows its exit code, so record it as that rank's error."""
    failures = getattr(exc, "failures", None) or {}
    for rank, failure in failures.items():
        code = getattr(failure, "exitcode", 0)
        if code >= 0 or (run_dir / rundir.ERRORS / f"rank_{rank}.json").exists():
            continue
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory? see `dmesg`)" if name == "SIGKILL" else ""
        rundir.write_json(run_dir / rundir.ERRORS / f"rank_{rank}.json", {
            "rank": rank, "type": "Killed", "message": f"the process was killed by {name}{hint}",
            "traceback": "", "time": getattr(failure, "timestamp", time.time()), "pid": getattr(failure, "pid", None),
        })


def _silent_ranks(run_dir: Path, errors: list[dict[str, Any]]) -> list[int]:
    """Ranks of a failed run that left no error record (only meaningful once some rank did)."""
    if not errors or not (run_dir / rundir.CONFIG).exists():
        return []
    world = RunConfig.from_yaml(run_dir / rundir.CONFIG).num_processes
    return sorted(set(range(world)) - {e.get("rank") for e in errors})


def finalize(run_dir: Path, launcher_error: BaseException | None = None, exitcode: int | None = None) -> None:
    """After the ranks are gone: if the run didn't record an ending, record the failure (rank 0 may be dead)."""
    summary = rundir.read_json(run_dir / rundir.SUMMARY) or {}
    errors = rundir.rank_errors(run_dir)
    # Both the supervisor and Run.wait() call this; whoever comes second finds the ending recorded.
    if summary.get("status") == "failed" or (summary.get("status") in ("completed", "stopped") and not errors):
        return
    silent = _silent_ranks(run_dir, errors)
    if silent and all(rundir.is_fallout(e) for e in errors):
        # Every recorded error is a rank losing its peer; the peer that recorded nothing died first.
        error = {"rank": silent[0], "type": "Killed", "traceback": "", "time": errors[0]["time"],
                 "message": "the process ended without raising an exception (killed by a signal? out of memory? "
                            "see `dmesg`); the other ranks failed because they lost it"}
        errors = [error, *errors]
    if errors:
        error = errors[0]
        if len(errors) > 1:
            error = {**error, "other_ranks": [{"rank": e["rank"], "type": e["type"], "message": e["message"]}
                                              for e in errors[1:]]}
    elif launcher_error is not None:
        error = {"rank": None, "type": type(launcher_error).__name__, "message": str(launcher_error),
                 "traceback": "".join(traceback.format_exception(launcher_error))}
    else:
        error = {"rank": None, "type": "ProcessExit", "traceback": "",
                 "message": f"the ranks exited (code {exitcode}) without recording an ending; "
                            "a rank may have been killed (out of memory?)"}
    started = summary.get("started_at", time.time())
    rundir.write_json(run_dir / rundir.SUMMARY, {**summary, "status": "failed", "error": error,
                                                  "wall_time_s": time.time() - started})
    rundir.event(run_dir, "failed", rank=error.get("rank"), type=error["type"], message=error["message"],
                 traceback=error.get("traceback", ""))


def describe_launch(cfg: RunConfig) -> str:
    hw = detect()
    device = cfg.resolved_device(hw)
    if cfg.num_processes == 1:
        how = f"1 process on {hw.describe(device)}"
    else:
        backend = "NCCL" if device == "cuda" else "gloo"
        what = "GPUs" if device == "cuda" else "CPU processes"
        how = f"{cfg.num_processes} {what}, DDP over {backend}"
    return f"launching {cfg.task}: {how}, {cfg.precision}, global batch {cfg.global_batch_size}"


def _supervise(cfg: RunConfig, task: Task, run_dir: str, progress: bool, port: int) -> None:
    """The supervisor process (fork mode): runs notebook_launcher and records how the run ended."""
    _die_with_parent()
    os.setpgrp()  # the parent can end the supervisor and all its ranks with one killpg
    from accelerate import notebook_launcher
    from accelerate.state import AcceleratorState, PartialState

    # An Accelerator made in the user's kernel was copied into this fork; the ranks must start clean.
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    # Elastic logs every rank failure as a wall of text; the run directory and RunFailedError carry it cleanly.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    if cfg.resolved_device() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the cores; accelerate would set 1 thread per rank and warn about it.
        os.environ["OMP_NUM_THREADS"] = str(detect().threads_per_rank(cfg.num_processes))
    error: BaseException | None = None
    try:
        # notebook_launcher prints its own "Launching training on N CUDAs/CPUs" line; ours (logged by the
        # caller) says what really runs, so accelerate's is swallowed.
        with contextlib.redirect_stdout(io.StringIO()):
            notebook_launcher(rank_main, args=(cfg, task, run_dir, progress), num_processes=cfg.num_processes,
                              mixed_precision="no" if cfg.precision == "fp32" else cfg.precision,
                              use_port=str(port), monitor_interval=0.05)
    except BaseException as exc:  # noqa: BLE001  (recorded in the run directory, then reported by exit code)
        error = exc
        record_signal_deaths(Path(run_dir), exc)
    finalize(Path(run_dir), error)
    os._exit(0 if error is None else 1)


@dataclass
class Run:
    """A launched run. `stop()` asks ranks to checkpoint and exit; `wait()` returns the RunResult."""

    config: RunConfig
    run_dir: Path
    _process: Any = field(repr=False)
    _mode: str = "fork"
    _result: RunResult | None = field(default=None, repr=False)
    # wait() in one thread and stop()/done() in another (the panel does this) must not race on the process.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return rundir.read_jsonl(self.run_dir / rundir.METRICS)

    @property
    def summary(self) -> dict[str, Any]:
        return rundir.read_json(self.run_dir / rundir.SUMMARY) or {}

    def done(self) -> bool:
        return self._exitcode() is not None

    def _exitcode(self) -> int | None:
        with self._lock:
            return self._process.poll() if self._mode == "subprocess" else self._process.exitcode

    def stop(self) -> None:
        """Graceful stop: ranks agree on a step (within a few steps), save a checkpoint and exit."""
        if not self.done():
            rundir.request_stop(self.run_dir)

    def kill(self) -> None:
        """Hard stop: end the supervisor and every rank now. The last complete checkpoint stays."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._join(timeout=30)
        finalize(self.run_dir, RuntimeError("killed by Run.kill()"))

    def _join(self, timeout: float | None) -> None:
        if self._mode == "subprocess":
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout)
        elif multiprocessing.connection.wait([self._process.sentinel], timeout):
            # The sentinel fires when the process closes its files, a moment before it can be reaped;
            # join() then returns at once with the exit code. The lock keeps two threads from reaping at once.
            with self._lock:
                self._process.join()

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends. Raises RunFailedError naming the failing rank, or TimeoutError."""
        if self._result is None:
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
            code = self._exitcode()
            if code is None:
                raise TimeoutError(f"run {self.run_dir.name} still running after {timeout}s; call wait() again, "
                                   "stop() or kill()")
            finalize(self.run_dir, exitcode=code)
            self._result = RunResult(self.run_dir, self.config)
            if self._result.status in ("completed", "stopped"):
                from .recording import record_run

                record_run(self._result)  # in a notebook: the regression suite reads these back (no-op elsewhere)
        summary = self._result.summary
        if summary.get("status") == "failed":
            raise RunFailedError(self.run_dir, summary.get("error", {}))
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
           "--mixed_precision", "no" if cfg.precision == "fp32" else cfg.precision]
    if cfg.resolved_device() == "cpu":
        cmd.append("--cpu")
    elif cfg.num_processes > 1:
        cmd.append("--multi_gpu")
    return [*cmd, *worker]


def launch(cfg: RunConfig, task: Task | None = None, *, wait: bool = True,
           mode: Literal["fork", "subprocess"] = "fork", progress: bool = False) -> RunResult | Run:
    """Run `cfg` on cfg.num_processes ranks. Blocks and returns a RunResult, or with wait=False a Run handle.

    mode='fork' (notebooks, any Python process) forks ranks through accelerate.notebook_launcher, so tasks
    defined in a notebook cell work; mode='subprocess' runs `accelerate launch` (torchrun for multi-process
    CPU) like `workbench train`.
    Everything is validated before any process starts.
    """
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
    cfg, run_dir = rundir.prepare(cfg)
    port = free_port()
    log.info("%s -> %s", describe_launch(cfg), run_dir)
    if mode == "fork":
        ctx = multiprocessing.get_context("fork")
        process = ctx.Process(target=_supervise, args=(cfg, task, str(run_dir), progress, port),
                              name=f"workbench-{cfg.run_name}")
        process.start()
    elif mode == "subprocess":
        env = {**os.environ, "OMP_NUM_THREADS": str(detect().threads_per_rank(cfg.num_processes)),
               "WORKBENCH_PROGRESS": "1" if progress else "0", "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(_launch_command(cfg, run_dir, port), env=env, start_new_session=True)
    else:
        raise ValueError(f"mode={mode!r}: choose 'fork' or 'subprocess'")
    run = Run(cfg, run_dir, process, mode)
    return run.wait() if wait else run
