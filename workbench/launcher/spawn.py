"""How a launch from a Python process starts its ranks: forked (the default) or as fresh
interpreters (spawn).

Forked ranks can't use CUDA once the caller has initialised it (the CUDA runtime does not survive
fork), or even only asked torch.cuda.is_available(): the most reported notebook-launcher failure. So
with start_method='auto' a CUDA run starts its ranks through the shell launcher (torchrun /
`accelerate launch`, as `workbench train` does) on `python -m workbench.worker`, and the task
object, which may be a class defined in a notebook cell, travels pickled with cloudpickle. What
can't be pickled is refused before anything starts, saying what initialised CUDA and how to avoid
it. The spawned ranks' output is copied to the caller's sys.stdout/sys.stderr: in a notebook, their
file descriptors lead to the kernel's log, not to the cell.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import torch

from workbench.launcher.scratch import ScratchProcess
from workbench.rundir import RunDir
from workbench.utils.hardware import resolve_device
from workbench.utils.lifecycle import ending_with_parent

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

Method = Literal["fork", "spawn", "subprocess"]

_first_cuda_init: list[str] = []
"""Where CUDA was first initialised in this process, as far as workbench saw it (torch keeps no
record)."""


@dataclass(frozen=True)
class StartPlan:
    """How the ranks of one launch start, why, on which device, and (spawn) the pickled task they
    load."""

    method: Method
    reason: str
    payload: bytes | None = None
    level: int = logging.INFO
    """How loudly to log the choice: a warning when CUDA initialised in this process forced
    spawn."""
    device: str = field(kw_only=True)
    """'cpu' or 'cuda': the launch's device, resolved once by its caller (launch.start) and read
    from here by the launch line, the shell launcher's command and the supervisor."""


def watch_cuda_init() -> None:
    """Record the caller's stack when CUDA gets initialised, to name it if a launch must refuse
    later.

    torch.cuda._lazy_init is what .cuda(), torch.cuda.* calls and tensors created on a GPU go
    through (the C++ side looks it up on the module each time). Wrapped once, while CUDA is not yet
    initialised; after the first initialisation torch's own function is put back, so nothing is left
    in the way.
    """
    original = getattr(torch.cuda, "_lazy_init", None)
    if (
        original is None
        or getattr(original, "_workbench_watch", False)
        or torch.cuda.is_initialized()
    ):
        return

    def _lazy_init() -> None:
        try:
            original()
        finally:
            if torch.cuda.is_initialized() and torch.cuda._lazy_init is _lazy_init:
                torch.cuda._lazy_init = original
                _first_cuda_init[:] = _user_frames(traceback.extract_stack()[:-1])

    _lazy_init._workbench_watch = True  # type: ignore[attr-defined]
    torch.cuda._lazy_init = _lazy_init


def _user_frames(stack: traceback.StackSummary) -> list[str]:
    """The innermost calls outside torch, up to the cell or script that made them (not IPython's
    machinery)."""
    torch_dir = os.path.dirname(torch.__file__)
    picked: list[traceback.FrameSummary] = []
    for f in reversed([f for f in stack if not f.filename.startswith(torch_dir)]):
        picked.append(f)
        if f.name == "<module>" or len(picked) == 3:
            break
    return [
        f"`{f.line}` ({f.filename}, line {f.lineno}, in {f.name})"
        if f.line
        else f"{f.filename}, line {f.lineno}, in {f.name}"
        for f in picked
    ]


def cuda_initialised_by() -> str | None:
    """None while CUDA is not initialised in this process; else what is known of who initialised
    it."""
    if not torch.cuda.is_initialized():
        return None
    if _first_cuda_init:
        return (
            "torch.cuda.is_initialized() is True; it was first initialised by "
            + _first_cuda_init[0]
            + "".join(f", called from {f}" for f in _first_cuda_init[1:])
        )
    return (
        "torch.cuda.is_initialized() is True; which call initialised it is unknown (before "
        "`import workbench`, or through a path workbench doesn't watch)"
    )


def run_uses_cuda(device: str) -> bool:
    """Whether ranks on `device` use CUDA, so that forking them is unsafe: the one question the
    start plan asks of the device (the tests answer it to plan a CUDA start for CPU ranks)."""
    return device == "cuda"


def plan_start(cfg: RunConfig, task: Task, device: str | None = None) -> StartPlan:
    """Fork, spawn or subprocess, and why; raises before anything is created when none can work.
    `device`: the launch's, as its caller resolved it (None: resolved here from cfg)."""
    device = device or resolve_device(cfg)
    if cfg.start_method == "subprocess":
        return StartPlan(
            "subprocess",
            "start_method='subprocess': accelerate launch / torchrun starts fresh "
            "interpreters, the task by name",
            device=device,
        )
    cuda_run = run_uses_cuda(device)
    cuda = cuda_initialised_by() if cuda_run else None
    if cfg.start_method == "fork":
        if cuda:
            raise RuntimeError(
                f"start_method='fork', but CUDA is already initialised in this process ({cuda}), "
                "and forked ranks cannot use it. Set start_method='auto' or 'spawn' (ranks start "
                "as fresh interpreters), or restart the kernel and keep CUDA work inside your "
                "Task"
            )
        return StartPlan("fork", "start_method='fork'", device=device)
    if cfg.start_method == "auto" and not cuda_run:
        return StartPlan(
            "fork",
            "start_method='auto': a CPU run, so the ranks fork",
            level=logging.DEBUG,
            device=device,
        )
    if cfg.start_method == "auto" and not cuda:
        return _fresh_for_cuda(task, device)
    if cuda:
        reason = (
            f"start_method={cfg.start_method!r}: CUDA is already initialised in this process "
            f"({cuda}), and forked ranks can't use it, so the ranks start as fresh interpreters"
        )
    else:
        reason = "start_method='spawn': the ranks start as fresh interpreters"
    return StartPlan(
        "spawn",
        reason,
        pickle_task(task, cuda),
        logging.WARNING if cuda else logging.INFO,
        device=device,
    )


def _fresh_for_cuda(task: Task, device: str) -> StartPlan:
    """A CUDA run from a process where CUDA looks untouched still starts fresh interpreters: torch's
    device queries (torch.cuda.is_available(), device_count()) leave a fork unable to use CUDA
    without initialising it, and torch.cuda.is_initialized() can't tell. Only a task that can't be
    pickled is forked, as the one way left."""
    try:
        payload = pickle_task(task, None)
    except ValueError as e:
        why = type(e.__cause__ or e).__name__
        return StartPlan(
            "fork",
            f"start_method='auto': a CUDA run would start its ranks as fresh interpreters, but "
            f"the task can't be pickled ({why}), so the ranks fork (they fail if this process "
            "queried CUDA first)",
            level=logging.WARNING,
            device=device,
        )
    return StartPlan(
        "spawn",
        "start_method='auto': a CUDA run, so the ranks start as fresh interpreters (CUDA "
        "does not survive fork)",
        payload,
        device=device,
    )


def pickle_task(task: Task, cuda: str | None) -> bytes:
    """The task for spawned ranks: cloudpickle pickles classes of __main__ (a notebook cell) by
    value and importable ones by reference; the caller's sys.path goes along so the latter import in
    the ranks too."""
    import cloudpickle

    try:
        blob = cloudpickle.dumps(task)
    except Exception as e:  # whatever pickling raised is named in the refusal
        raise _refusal(task, e, cuda) from e
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    return pickle.dumps((paths, blob))


def _refusal(task: Task, error: Exception, cuda: str | None) -> Exception:
    failed = (
        f"pickling the task ({type(task).__name__}) failed with {type(error).__name__}: {error}"
    )
    picklable = (
        "or make the task picklable: define its class in a notebook cell or an importable module, "
        "and keep locks, open files, generators and CUDA tensors out of its attributes (build "
        "them in build_model/build_datasets)"
    )
    if cuda:
        return RuntimeError(
            f"cannot start the ranks: CUDA is already initialised in this process ({cuda}), so "
            "forked ranks could not use it, and ranks started as fresh interpreters need the task "
            f"pickled: {failed}. Restart the kernel and keep CUDA work (.cuda(), .to('cuda'), "
            f"torch.cuda calls) inside your Task's methods, {picklable}"
        )
    return ValueError(
        f"start_method='spawn': {failed}. Use start_method='auto' (forked ranks take the task as "
        f"it is), {picklable}"
    )


def write_task(run_dir: RunDir | Path, payload: bytes) -> dict[str, str]:
    """Write the pickled task into the run directory (RunDir.write_task: task.pkl); returns the
    environment that lets the ranks load it."""
    # Not at the top: `python -m workbench.worker` must not find the worker imported already by the
    # package.
    from workbench.worker import TASK_DIGEST_ENV

    RunDir(run_dir).write_task(payload)
    return {TASK_DIGEST_ENV: hashlib.sha256(payload).hexdigest()}


def die_with_caller() -> Callable[[], None] | None:
    """Linux: a preexec_fn that has the kernel send SIGTERM to the child (the shell launcher:
    torchrun, `accelerate launch`) when this process dies, whatever killed it (SIGKILL, a restarted
    kernel, a signal nobody handles). The launcher passes SIGTERM on to the ranks, which checkpoint
    and exit (a preemption), and a rank dies with its launcher (rank_main). The kernel sends it when
    the *thread* that forked the child ends: children are forked by a thread that lasts
    (processes.in_a_lasting_thread). A caller that died before the child could ask for it leaves an
    orphan: the child sees that and exits before it runs anything."""
    return ending_with_parent(signal.SIGTERM, os.getpid())


class SpawnedRanks(ScratchProcess):
    """The shell launcher of spawned ranks, its stdout and stderr copied to the caller's sys.stdout
    and sys.stderr (in a notebook: the cell) by one thread each, until every process holding them
    has exited. Its temporary folder `scratch` goes once it has been waited for (ScratchProcess)."""

    def __init__(
        self, args: list[str], env: dict[str, str], name: str, scratch: Path | None = None
    ) -> None:
        super().__init__(
            args,
            scratch=scratch,
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_caller(),
        )
        assert self.stdout is not None and self.stderr is not None
        self._copiers = [
            _copier(self.stdout, sys.stdout, f"{name}-stdout"),
            _copier(self.stderr, sys.stderr, f"{name}-stderr"),
        ]

    def close_output(self, timeout: float = 10.0) -> None:
        """After the launcher exited: wait for the copiers to reach the end of the ranks' output."""
        for thread in self._copiers:
            thread.join(timeout)


def _copier(pipe: IO[bytes], target: Any, name: str) -> threading.Thread:
    def copy() -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with pipe:
            # Chunks as they come, not lines: a progress bar's '\r' updates show while they happen.
            while chunk := pipe.read1(65536):  # type: ignore[attr-defined]
                _write(target, decoder.decode(chunk))
            _write(target, decoder.decode(b"", final=True))

    thread = threading.Thread(target=copy, name=name, daemon=True)
    thread.start()
    return thread


def _write(target: Any, text: str) -> None:
    if not text or target is None:
        return
    # A stream that went away (a closed cell capture) must not stop the copy: ranks writing to a
    # full pipe would block.
    with contextlib.suppress(ValueError, OSError):
        target.write(text)
        target.flush()


watch_cuda_init()
