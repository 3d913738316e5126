"""The caller's side of a launch: `launch()` and `start()` run a RunConfig on N ranks from a notebook (fork,
via notebook_launcher in a supervisor process, or spawn: fresh interpreters, see spawn.py) or the shell
(`accelerate launch` / torchrun), and `Run` is the handle on a run that is going.

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
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

import psutil

from workbench.config import PARALLELISM_MODES, RunConfig
from workbench.utils.hardware import detect
from workbench.launcher.postmortem import finalize
from workbench.config.precision import accelerate_mixed_precision
from workbench.launcher.result import RunResult
from workbench.rundir import (RunDir, RunDivergedError, RunFailedError, RunFiles, RunPreemptedError, Status, lock,
                     prepare)
from workbench.rundir.liveness import heartbeats, is_alive, this_process
from workbench.launcher.signals import elastic_signals, preempt_signals
from workbench.launcher.spawn import SpawnedRanks, StartPlan, plan_start, write_task
from workbench.tasks import Task, get_task

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
        if cfg.tp > 1:
            mode = f"tensor parallel tp={cfg.tp}" + (f" x {cfg.parallelism} (data-parallel {cfg.dp_size})" * (cfg.dp_size > 1))
        if cfg.pp > 1:
            mode = (f"pipeline parallel pp={cfg.pp} ({cfg.pp_schedule}, {cfg.grad_accum_steps} micro-batches a step)"
                    + f" x {cfg.dp_size} replicas" * (cfg.dp_size > 1))
        how = f"{cfg.num_processes} {what}, {mode} over {backend}"
    extras = [f"activation checkpointing {cfg.activation_checkpointing}"] * (cfg.activation_checkpointing != "none")
    extras += [f"{cfg.grad_compression} gradient compression"] * (cfg.grad_compression != "none")
    extras += ["parameters offloaded to CPU"] * cfg.cpu_offload
    batch = f"global batch {cfg.global_batch_size or 'chosen by the ranks'}"
    if cfg.micro_batch_size == "auto":
        batch += " (micro-batch: the largest that fits)"
    return ", ".join([f"launching {cfg.task}: {how}", cfg.precision, batch, *extras])


@dataclass
class Run(RunFiles):
    """A launched run. `stop()` asks ranks to checkpoint and exit; `wait()` returns the RunResult.

    While `wait()` blocks in the main thread, SIGTERM, SIGHUP and cfg.preempt_signal sent to this process are
    forwarded to the ranks (they checkpoint and exit: 'preempted'), then delivered again to this process once
    the ranks are gone, so the launcher neither outlives nor underlives them. A failed or preempted run is
    restarted from its newest checkpoint up to cfg.max_restarts times.
    """

    config: RunConfig
    run_dir: Path
    _process: Any = field(repr=False)
    _mode: Mode = "fork"
    _task: Task | None = field(default=None, repr=False)
    _progress: bool = False
    _token: str | None = field(default=None, repr=False)
    restarts: int = 0
    _plan: StartPlan = field(default=StartPlan("fork", ""), repr=False)
    _result: RunResult | None = field(default=None, repr=False)
    _signalled: int = 0
    _kill_at: float | None = None
    # wait() in one thread and stop()/done() in another (the panel does this) must not race on the process.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def start_method(self) -> str:
        """How the ranks were started: 'fork', 'spawn' (fresh interpreters) or 'subprocess' (the shell's way)."""
        return self._plan.method

    @property
    def start_reason(self) -> str:
        """Why that start method (e.g. CUDA was already initialised in this process, so not fork)."""
        return self._plan.reason

    def done(self) -> bool:
        return self._exitcode() is not None

    def _exitcode(self) -> int | None:
        with self._lock:
            return self._process.exitcode if self.start_method == "fork" else self._process.poll()

    def _close_output(self) -> None:
        """Spawned ranks: their output is copied until they are gone; no copying thread outlives the run."""
        close = getattr(self._process, "close_output", None)
        if close is not None:
            close()

    def stop(self) -> None:
        """Graceful stop: ranks agree on a step, save a checkpoint and exit."""
        if not self.done():
            self.dir.request_stop()

    def kill(self) -> None:
        """Hard stop: end the supervisor and every rank now. The last complete checkpoint stays."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._join(timeout=30)
        self._close_output()
        finalize(self.dir, RuntimeError("killed by Run.kill()"))

    def _join(self, timeout: float | None) -> None:
        """Wait for the launcher process, in slices, so a preemption deadline can end it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._exitcode() is None:
            if self._kill_at is not None and time.monotonic() > self._kill_at:
                log.warning("%s: the ranks did not exit within preempt_grace_s; killing them", self.run_dir.name)
                self._kill_at = None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._process.pid, signal.SIGKILL)
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                return
            if self.start_method != "fork":
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(left)
            elif multiprocessing.connection.wait([self._process.sentinel], left):
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

    def _forward(self, signum: int, frame: Any) -> None:
        """A preemption signal for the launcher: the ranks get it, checkpoint and exit within the grace period."""
        if self._signalled:
            return
        self._signalled = signum
        self._kill_at = time.monotonic() + self.config.preempt_grace_s + 15
        log.warning("%s: %s received; the ranks save a checkpoint and exit", self.run_dir.name,
                    signal.Signals(signum).name)
        # Straight to the ranks that are up (a signal through torch elastic would be followed by its SIGKILL
        # 30 s later, and a traceback); before any rank is up, to the launcher process, which forwards it.
        ranks = [b["pid"] for b in heartbeats(self.dir) if is_alive(b)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if ranks:
                for pid in ranks:
                    os.kill(pid, signum)
            elif self.start_method == "fork":
                os.killpg(self._process.pid, signum)  # the supervisor and its ranks
            else:
                self._process.send_signal(signum)  # torchrun forwards it to its ranks

    @contextlib.contextmanager
    def _forwarding_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {}
        for sig in preempt_signals(self.config):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup: SIGHUP was meant to be ignored
                previous[sig] = signal.signal(sig, self._forward)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def wait(self, timeout: float | None = None) -> RunResult:
        """Block until the run ends. Raises RunFailedError naming the failing rank (RunPreemptedError,
        RunDivergedError for those endings), or TimeoutError."""
        if self._result is None:
            with self._forwarding_signals():
                while True:
                    self._join_interruptibly(timeout)
                    code = self._exitcode()
                    if code is None:
                        raise TimeoutError(f"run {self.run_dir.name} still running after {timeout}s; call wait() "
                                           "again, stop() or kill()")
                    self._close_output()
                    finalize(self.dir, exitcode=code)
                    if not self._restart_if_due():
                        break
            self._result = RunResult(self.run_dir, self.config, self._task)
            lock.release(self.dir, self._token)
            if self._result.status in (Status.COMPLETED, Status.STOPPED):
                from workbench.regress.recording import record_run

                record_run(self._result)  # in a notebook: the regression suite reads these back (no-op elsewhere)
            if self._signalled:
                os.kill(os.getpid(), self._signalled)  # the launcher's own fate, now that the ranks are safe
        raise_for_ending(self.dir)
        return self._result

    def _restart_if_due(self) -> bool:
        cfg, status = self.config, self.dir.observed_status()[0]
        if status not in (Status.FAILED, Status.PREEMPTED) or self.restarts >= cfg.max_restarts or self._signalled:
            return False
        backoff = cfg.restart_backoff_s * 2**self.restarts
        error = self.dir.summary().error or {}
        self.restarts += 1
        self.dir.event("restarting", attempt=self.restarts, of=cfg.max_restarts, after=status.value,
                       error=error.get("message"), backoff_s=backoff)
        log.warning("%s %s; restart %d of %d in %.0f s", self.run_dir.name, status.value, self.restarts,
                    cfg.max_restarts, backoff)
        time.sleep(backoff)
        cfg, run_dir, token = prepare(cfg.replace(resume="auto"), token=self._token)
        self.config, self._token = cfg, token
        self._process = _spawn(cfg, self._task, run_dir, token, self._plan, self._progress)
        return True

    @cached_property
    def result(self) -> RunResult:
        return self.wait()


def raise_for_ending(run: RunDir) -> None:
    """The exception for a run that didn't end well: failed, diverged or preempted."""
    summary = run.summary()
    status = run.observed_status()[0]
    if summary.status is Status.DIVERGED:
        raise RunDivergedError(run.path, summary.ending or {})
    if summary.status is Status.PREEMPTED:
        raise RunPreemptedError(run.path, summary.ending or {})
    if status is Status.FAILED:
        raise RunFailedError(run.path, summary.error or {"type": "Lost", "message": run.observed_status()[1]})


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


def check_launch(cfg: RunConfig, task: Task | None, mode: Mode) -> tuple[RunConfig, Task]:
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
    return cfg, task or get_task(cfg.task)


def _spawn(cfg: RunConfig, task: Task | None, run: RunDir, token: str, plan: StartPlan, progress: bool) -> Any:
    """Start the process that runs the ranks: a forked supervisor, or `accelerate launch`/torchrun (for the
    shell, or for ranks spawned from here, whose output is then copied to this process's sys.stdout/stderr)."""
    port = free_port()
    log.info("%s -> %s", describe_launch(cfg), run.path)
    if plan.method != "subprocess":
        log.log(plan.level, "%s: ranks start by %s (%s)", run.path.name, plan.method, plan.reason)
    if plan.method == "fork":
        from workbench.launcher.supervisor import supervise

        ctx = multiprocessing.get_context("fork")
        process: Any = ctx.Process(target=supervise, args=(cfg, task, str(run.path), progress, port, token),
                                   name=f"workbench-{cfg.run_name}")
        process.start()
    else:
        env = {**os.environ, "OMP_NUM_THREADS": str(detect().threads_per_rank(cfg.num_processes)),
               "WORKBENCH_PROGRESS": "1" if progress else "0", "PYTHONUNBUFFERED": "1",
               "WORKBENCH_LOCK_TOKEN": token, "TORCHELASTIC_SIGNALS_TO_HANDLE": elastic_signals(cfg)}
        if plan.method == "spawn":
            assert plan.payload is not None
            env.update(write_task(run.path, plan.payload))
            process = SpawnedRanks(_launch_command(cfg, run.path, port), env, f"workbench-{cfg.run_name}")
        else:
            process = subprocess.Popen(_launch_command(cfg, run.path, port), env=env, start_new_session=True)
    lock.set_runner(run, token, {**this_process(), "pid": process.pid,
                                 "create_time": psutil.Process(process.pid).create_time()})
    return process


def start(cfg: RunConfig, task: Task | None = None, *, mode: Mode = "fork", progress: bool = False) -> Run:
    """Start `cfg` on cfg.num_processes ranks and return the `Run` handle at once (see `launch` to block).

    mode='fork' (notebooks, any Python process) forks ranks through accelerate.notebook_launcher, so tasks
    defined in a notebook cell work, or, per cfg.start_method (when CUDA is already initialised here), spawns
    them as fresh interpreters with the task pickled; mode='subprocess' runs `accelerate launch` (torchrun for
    multi-process CPU) like `workbench train`. Everything is validated before any process starts.
    """
    cfg, task = check_launch(cfg, task, mode)
    plan = plan_start(cfg, task, mode)  # may refuse: still nothing created
    cfg, run_dir, token = prepare(cfg)
    try:
        if cfg.micro_batch_size == "auto":
            from workbench.estimator.microbatch import propose
            from workbench.utils.files import write_json

            write_json(run_dir.path / "autobatch.json", propose(cfg, task))
        process = _spawn(cfg, task, run_dir, token, plan, progress)
    except BaseException:
        lock.release(run_dir, token)
        raise
    return Run(cfg, run_dir.path, process, mode, task if mode == "fork" else None, progress, token, _plan=plan)


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
    run = start(cfg, task, mode=mode, progress=progress)
    try:
        return run.wait()
    except BaseException:
        # wait() itself stops the run on an interrupt; any other exception that ends the blocking call while
        # the run is still going (a caller's deadline, say) would otherwise leave its ranks running unseen.
        if not run.done():
            run.kill()
        raise


RunResult.launcher = launch  # result.resume() launches through here
