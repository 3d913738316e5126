"""The caller's side of a launch: `launch()` and `start()` run a RunConfig on N ranks from a
notebook (fork, via notebook_launcher in a supervisor process, or spawn: fresh interpreters, see
spawn.py) or the shell (`accelerate launch` / torchrun), and `Run` is the handle on a run that is
going.

What notebook_launcher gets wrong is fixed around it: a free port per run, precision that reaches
the workers, CPU ranks that form one process group, an honest launch message, and each rank's
exception written to the run directory (see rank.py, supervisor.py and postmortem.py).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

from workbench.config import RunConfig
from workbench.launcher.phases import (
    CHECKING,
    LaunchPhases,
    announce,
    announcing,
    current,
    print_phases,
)

if TYPE_CHECKING:
    from workbench.cluster import Ray, Slurm
    from workbench.cluster.raytrain.run import RayRun
    from workbench.cluster.slurm_run import SlurmRun
    from workbench.launcher.result import RunResult
    from workbench.launcher.run import Run
    from workbench.notebook.live_view import LiveView
    from workbench.rundir import RunDir
    from workbench.tasks import Task
    from workbench.utils.hardware import Hardware

log = logging.getLogger("workbench")


def __getattr__(name: str) -> Any:
    # `Run` is public here (wb.Run) but lives in run.py, which loads torch: imported when asked
    # for, so that `wb.launch` can show its first line before torch loads.
    if name == "Run":
        from workbench.launcher.run import Run

        return Run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def preflight(
    cfg: RunConfig,
    task: Task | None = None,
    hardware: Hardware | None = None,
    device: str | None = None,
) -> None:
    """config.preflight's checks, imported at the first launch (they load torch)."""
    from workbench.config.preflight import preflight as checks

    checks(cfg, task=task, hardware=hardware, device=device)


def check_launch(
    cfg: RunConfig, task: Task | None, device: str | None = None
) -> tuple[RunConfig, Task]:
    """The config and task to run, every check done before anything is created or started, on the
    `device` the launch resolved (resolved here when None)."""
    from workbench.tasks import Task, get_task

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

    announce(CHECKING, "the largest micro-batch that fits")
    run.write_autobatch(microbatch.propose(cfg.replace(device=device), task))


def start(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    progress: bool | None = None,
    cluster: Slurm | Ray | None = None,
    mode: str | None = None,
) -> Run | SlurmRun | RayRun:
    """Start `cfg` on cfg.num_processes ranks and return the `Run` handle at once (see `launch` to
    block).

    How the ranks start is cfg.start_method: from Python, 'auto' forks them (tasks defined in a
    notebook cell work) or, for a CUDA run, spawns fresh interpreters with the task pickled;
    'subprocess' runs `accelerate launch` (torchrun for multi-process CPU) like `workbench train`.
    `cluster=wb.Slurm(...)` submits the run to that cluster instead (checked against the cluster
    first) and returns its SlurmRun, which has the same status, wait(), stop() and result();
    `cluster=wb.Ray(...)` runs the ranks as Ray Train workers and returns a RayRun, the same.
    Everything is validated before any process starts. A preemption signal `workbench train` caught
    while it checked and prepared ends the run 'preempted' here, before any rank starts
    (RunPreemptedError).

    `progress`: in a notebook, a line that says at once what the launch is doing (checking,
    preparing data, starting N processes, waiting for the cluster), then follows the run until it
    ends; in a terminal, those phases as lines and rank 0's progress bar. None (the default): the
    line in a notebook, nothing in a terminal; False: nothing anywhere.

    `mode=` is the older spelling of start_method ('subprocess'; 'fork' is start_method='auto'),
    deprecated.
    """
    cfg = _forward_mode(cfg, mode)
    phases, view, bar = _speaking(cfg, progress, ends_with_run=True)
    with _shown(phases, view):
        run = _start(cfg, task, bar, cluster)
    if view is not None:
        view.follow(run)
    return run


def _speaking(
    cfg: RunConfig, progress: bool | None, ends_with_run: bool
) -> tuple[LaunchPhases, LiveView | None, bool]:
    """The phases of a launch about to start and who shows them: in a kernel the live line (shown
    now, before anything heavy loads), in a terminal with progress=True a line per phase. A launch
    inside another's announcing (the panel's) reports to that one and shows nothing itself. The
    third value: whether the ranks draw their own progress bar (a terminal's progress=True)."""
    from workbench.utils.kernel import in_kernel

    live = progress is not False and in_kernel()
    # in a kernel the ranks' bar would go to the kernel's own stdout
    bar = bool(progress) and not live
    outer = current()
    if outer is not None:
        return outer, None, bar
    phases = LaunchPhases()
    view = None
    if live:
        from workbench.notebook.live_view import LiveView

        view = LiveView(phases=phases, label=cfg.run_name or cfg.task, ends_with_run=ends_with_run)
    elif bar:
        print_phases(phases)
    return phases, view, bar


@contextlib.contextmanager
def _shown(phases: LaunchPhases, view: LiveView | None) -> Iterator[None]:
    """The phases current for the block; when it raises, the live line says the launch was not
    made (the exception itself goes on to the caller)."""
    with announcing(phases):
        try:
            yield
        except BaseException as e:
            if view is not None:
                view.close(e)
            raise


def _start(
    cfg: RunConfig, task: Task | None, progress: bool, cluster: Slurm | Ray | None
) -> Run | SlurmRun | RayRun:
    """start() once its phases are shown: the checks, the run directory, the ranks."""
    announce(CHECKING)
    if cluster is not None:
        return _submit(cfg, task, cluster)
    from workbench.launcher.preempted import record_preemption
    from workbench.launcher.processes import start_processes
    from workbench.launcher.run import Run, raise_for_ending
    from workbench.launcher.spawn import plan_start
    from workbench.rundir import lock, prepare
    from workbench.utils.hardware import resolve_device
    from workbench.utils.preemption import before_launch

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


def _submit(cfg: RunConfig, task: Task | None, cluster: Any) -> SlurmRun | RayRun:
    """A run for a cluster goes to its engine: Slurm (submitit) or Ray (Ray Train)."""
    from workbench.cluster import Ray, Slurm

    if isinstance(cluster, Ray):
        from workbench.cluster.raytrain.submit import submit as submit_ray

        return submit_ray(cfg, cluster, task)
    if isinstance(cluster, Slurm):
        from workbench.cluster.submit import submit

        return submit(cfg, cluster, task)
    raise ValueError(
        f"cluster={cluster!r}: pass wb.Slurm(...) or wb.Ray(...), or None to run on this machine"
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
    cluster: Slurm | Ray | None = None,
    mode: str | None = None,
) -> RunResult: ...


@overload
def launch(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    wait: Literal[False],
    progress: bool | None = None,
    cluster: Slurm | Ray | None = None,
    mode: str | None = None,
) -> Run | SlurmRun | RayRun: ...


def launch(
    cfg: RunConfig,
    task: Task | None = None,
    *,
    wait: bool = True,
    progress: bool | None = None,
    cluster: Slurm | Ray | None = None,
    mode: str | None = None,
) -> RunResult | Run | SlurmRun | RayRun:
    """Run `cfg` on cfg.num_processes ranks and block until it ends: returns the RunResult, or
    raises RunFailedError naming the failing rank. `start()` is the same without blocking;
    `cluster=` as there.

    `progress`: in a notebook, a line that says at once what the launch is doing (checking,
    preparing data, starting N processes, waiting for the cluster), then follows the run
    (progress, loss, step time, ETA) and becomes its summary when it ends; in a terminal, those
    phases as lines and rank 0's progress bar. None (the default): the line in a notebook, nothing
    in a terminal; False: nothing anywhere.

    `wait=False` is the older spelling of `start()` and `mode=` of cfg.start_method; both are
    deprecated.
    """
    cfg = _forward_mode(cfg, mode)
    if not wait:
        warnings.warn(
            "launch(cfg, wait=False) is deprecated: use wb.start(cfg), which returns the Run "
            "handle",
            DeprecationWarning,
            stacklevel=2,
        )
        return start(cfg, task, progress=progress, cluster=cluster)
    phases, view, bar = _speaking(cfg, progress, ends_with_run=False)
    with _shown(phases, view):
        run = _start(cfg, task, bar, cluster)
    if view is not None:
        view.follow(run)
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
