"""The caller's side of a launch: `launch()` and `start()` run a RunConfig on N ranks from a
notebook (fork, via notebook_launcher in a supervisor process, or spawn: fresh interpreters, see
spawn.py) or the shell (`accelerate launch` / torchrun), and `Run` is the handle on a run that is
going.

What notebook_launcher gets wrong is fixed around it: a free port per run, precision that reaches
the workers, CPU ranks that form one process group, an honest launch message, and each rank's
exception written to the run directory (see rank.py, supervisor.py and postmortem.py).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Literal, overload

from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.preempted import record_preemption
from workbench.launcher.processes import start_processes
from workbench.launcher.result import RunResult
from workbench.launcher.run import Run, raise_for_ending
from workbench.launcher.spawn import plan_start
from workbench.rundir import RunDir, lock, prepare
from workbench.tasks import Task, get_task
from workbench.utils.hardware import resolve_device
from workbench.utils.preemption import before_launch

if TYPE_CHECKING:
    from workbench.cluster import Slurm
    from workbench.cluster.slurm_run import SlurmRun

log = logging.getLogger("workbench")


def check_launch(
    cfg: RunConfig, task: Task | None, device: str | None = None
) -> tuple[RunConfig, Task]:
    """The config and task to run, every check done before anything is created or started, on the
    `device` the launch resolved (resolved here when None)."""
    if task is not None:
        if not isinstance(task, Task):
            raise TypeError(
                f"task={task!r}: pass an instance of a workbench.Task subclass, e.g. task=MyTask()"
            )
        if cfg.task != task.name:
            cfg = cfg.replace(task=task.name)
        if cfg.start_method == "subprocess":
            raise ValueError(
                "start_method='subprocess' starts fresh interpreters that can't see a task object: "
                "register the task in an importable module (or name it 'module:Class' in cfg.task) "
                "and pass no task=, or use start_method='auto' for tasks defined in a notebook"
            )
    # hardware, precision, task and its options: all before anything starts
    preflight(cfg, task=task, device=device)
    return cfg, task or get_task(cfg.task)


def propose_micro_batch(run: RunDir, cfg: RunConfig, task: Task, device: str) -> None:
    """micro_batch_size='auto', the caller's half: the largest micro-batch the estimate says fits a
    rank on `device` here, written to autobatch.json for the ranks, which confirm it on their
    devices (the rank side's half)."""
    from workbench.estimator import microbatch

    run.write_autobatch(microbatch.propose(cfg.replace(device=device), task))


def start(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    progress: bool = False,
    cluster: Slurm | None = None,
    mode: str | None = None,
) -> Run | SlurmRun:
    """Start `cfg` on cfg.num_processes ranks and return the `Run` handle at once (see `launch` to
    block).

    How the ranks start is cfg.start_method: from Python, 'auto' forks them (tasks defined in a
    notebook cell work) or, for a CUDA run, spawns fresh interpreters with the task pickled;
    'subprocess' runs `accelerate launch` (torchrun for multi-process CPU) like `workbench train`.
    `cluster=wb.Slurm(...)` submits the run to that cluster instead (checked against the cluster
    first) and returns its SlurmRun, which has the same status, wait(), stop() and result().
    Everything is validated before any process starts. A preemption signal `workbench train` caught
    while it checked and prepared ends the run 'preempted' here, before any rank starts
    (RunPreemptedError).

    `mode=` is the older spelling of start_method ('subprocess'; 'fork' is start_method='auto'),
    deprecated.
    """
    cfg = _forward_mode(cfg, mode)
    if cluster is not None:
        from workbench.cluster.submit import submit

        return submit(cfg, cluster, task)
    # 'cpu' or 'cuda', decided once for the launch: its checks, start plan, the micro-batch
    # proposal and its processes (the launch line, the shell launcher, the supervisor, a restart)
    # take it from here; each rank resolves its own (training/accelerator.py)
    device = resolve_device(cfg)
    cfg, task = check_launch(cfg, task, device)
    plan = plan_start(cfg, task, device)  # may refuse: still nothing created
    cfg, run_dir, token = prepare(cfg)
    try:
        if cfg.micro_batch_size == "auto":
            propose_micro_batch(run_dir, cfg, task, device)
        # `workbench train` was sent a preemption signal while it checked and prepared
        early = before_launch.take()
        if early:
            record_preemption(run_dir, early, "came before the ranks were started, so none was")
            raise_for_ending(run_dir)
        process = start_processes(cfg, task, run_dir, token, plan, progress)
    except BaseException:
        lock.release(run_dir, token)
        raise
    return Run(
        cfg,
        run_dir.path,
        process,
        task if plan.method == "fork" else None,
        progress,
        token,
        _plan=plan,
    )


def _forward_mode(cfg: RunConfig, mode: str | None) -> RunConfig:
    """The config that `mode=` (deprecated) meant: 'subprocess' is start_method='subprocess', 'fork'
    the default way from Python."""
    if mode is None:
        return cfg
    if mode not in ("fork", "subprocess"):
        raise ValueError(
            f"mode={mode!r}: choose 'fork' or 'subprocess' (deprecated: set "
            "RunConfig.start_method='auto' | 'fork' | 'spawn' | 'subprocess' instead)"
        )
    if mode == "subprocess":
        method = "subprocess"
    else:  # fork: the ways from Python, which a config saying 'subprocess' had overridden
        method = "auto" if cfg.start_method == "subprocess" else cfg.start_method
    warnings.warn(
        f"mode={mode!r} is deprecated: set RunConfig.start_method={method!r} instead "
        "(cfg.replace(start_method=...))",
        DeprecationWarning,
        stacklevel=3,
    )
    return cfg.replace(start_method=method)


@overload
def launch(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    wait: Literal[True] = True,
    progress: bool | None = None,
    cluster: Slurm | None = None,
    mode: str | None = None,
) -> RunResult: ...


@overload
def launch(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    wait: Literal[False],
    progress: bool | None = None,
    cluster: Slurm | None = None,
    mode: str | None = None,
) -> Run | SlurmRun: ...


def launch(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    wait: bool = True,
    progress: bool | None = None,
    cluster: Slurm | None = None,
    mode: str | None = None,
) -> RunResult | Run | SlurmRun:
    """Run `cfg` on cfg.num_processes ranks and block until it ends: returns the RunResult, or
    raises RunFailedError naming the failing rank. `start()` is the same without blocking;
    `cluster=` as there.

    `progress`: in a notebook, a line that follows the run (progress, loss, step time, ETA) and
    becomes its summary when it ends; in a terminal, rank 0's progress bar. None (the default): the
    line in a notebook, nothing in a terminal; False: nothing anywhere.

    `wait=False` is the older spelling of `start()` and `mode=` of cfg.start_method; both are
    deprecated.
    """
    from workbench.utils.kernel import in_kernel

    live = progress is not False and in_kernel()
    # in a kernel the ranks' bar would go to the kernel's own stdout
    bar = bool(progress) and not live
    cfg = _forward_mode(cfg, mode)
    if not wait:
        warnings.warn(
            "launch(cfg, wait=False) is deprecated: use wb.start(cfg), which returns the Run "
            "handle",
            DeprecationWarning,
            stacklevel=2,
        )
        return start(cfg, task, progress=bar, cluster=cluster)
    run = start(cfg, task, progress=bar, cluster=cluster)
    view = None
    if live:
        from workbench.notebook.live_view import LiveView

        view = LiveView(run)
    try:
        return run.wait()
    except BaseException:
        # wait() itself stops the run on an interrupt; any other exception that ends the blocking
        # call while the run is still going (a caller's deadline, say) would otherwise leave its
        # ranks running unseen.
        if not run.done():
            run.kill()
        raise
    finally:
        if view is not None:
            view.close()
