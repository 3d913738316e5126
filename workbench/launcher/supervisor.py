"""The fork-mode supervisor: one process per run, between the caller's kernel and the ranks.

It calls accelerate's notebook_launcher and records how the run ended. Keeping the launcher out of
the caller's process is what makes a kernel able to launch again and again: torch elastic's signal
handlers, accelerate's singletons and any failure stay in the supervisor.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, TextIO

import psutil

from workbench.config.precision import accelerate_mixed_precision
from workbench.launcher.postmortem import finalize, record_signal_deaths
from workbench.launcher.scratch import remove_scratch, use_scratch
from workbench.rundir import RunDir, lock
from workbench.tasks.hf.sources import offline
from workbench.training.parallel import strategy_module
from workbench.training.rank import RETURNED_FD, die_with_parent, expect_forked_ranks, rank_main
from workbench.utils import preemption
from workbench.utils.distributed import (
    FORKED_RANKS,
    LOOPBACK,
    bind_store_servers,
    single_node_listeners,
)
from workbench.utils.hardware import detect

if TYPE_CHECKING:
    from pathlib import Path

    from workbench.config import RunConfig
    from workbench.tasks import Task


class DropLines(io.TextIOBase):
    """A text stream that passes on everything but the lines starting with one of `prefixes`.
    print() writes a line's text and its end apart: a start that may become a dropped line waits for
    its end (or for what shows it is not one), so neither half leaks (the lone newline was a blank
    line in the notebook); anything else, a progress bar's '\r' updates included, passes at once."""

    def __init__(self, target: TextIO, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.target, self.prefixes, self._held = target, prefixes, ""

    def writable(self) -> bool:
        return True

    def _may_drop(self, start: str) -> bool:
        return any(start.startswith(p) or p.startswith(start) for p in self.prefixes)

    def write(self, text: str) -> int:
        lines = (self._held + text).splitlines(keepends=True)
        self._held = ""
        if lines and not lines[-1].endswith(("\n", "\r")) and self._may_drop(lines[-1]):
            self._held = lines.pop()
        kept = "".join(line for line in lines if not line.startswith(self.prefixes))
        if kept:
            self.target.write(kept)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def _pass_to_ranks(signum: int, frame: Any) -> None:
    """A preemption signal in the supervisor: kept (ranks forked later inherit it, and
    preemption.early, as an early preemption) and sent to the ranks already forked. In a rank forked
    before its own catch_early, only kept."""
    preemption.early.keep(signum, frame)
    if os.getpid() != _supervisor_pid:
        return
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)


_supervisor_pid = 0
ELASTIC_SIGNALS = "SIGINT,SIGQUIT"
"""What elastic handles in the supervisor; the preemption signals are passed on by
_pass_to_ranks."""


def _leave_preemption_signals_to_us() -> None:
    """Elastic installs its handlers for LaunchConfig.signals_to_handle
    (TORCHELASTIC_SIGNALS_TO_HANDLE is overwritten from it), and notebook_launcher builds its
    LaunchConfig with the default, every signal: so the config is amended on its way to
    elastic_launch, which accelerate imports at each call. This process is the supervisor's own, so
    the patch ends with it."""
    from torch.distributed.launcher import api

    launch = api.elastic_launch

    def elastic_launch(config: Any, entrypoint: Any) -> Any:
        config.signals_to_handle = ELASTIC_SIGNALS
        return launch(config=config, entrypoint=entrypoint)

    api.elastic_launch = elastic_launch  # type: ignore[assignment]
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ELASTIC_SIGNALS


def load_rank_modules(cfg: RunConfig) -> None:
    """The trainer, this run's strategy, dynamo (DDP's and FSDP's constructors import it: about 1 s
    on a small CPU) and DCP's fsspec writer (every checkpoint looks for it: 20 ms), loaded before
    the fork rather than in every rank after it. The caller loads them once per session, so a
    relaunch forks ranks that have them."""
    for module in (
        strategy_module(cfg),
        "workbench.training.loop",
        "torch._dynamo",
        "torch.distributed.checkpoint._fsspec_filesystem",
    ):
        importlib.import_module(module)


def supervise(
    cfg: RunConfig,
    task: Task,
    run_dir: str,
    progress: bool,
    port: int,
    token: str,
    caller: int,
    returned_fd: int,
    device: str,
    scratch: Path | None = None,
) -> None:
    """Body of the supervisor process: run notebook_launcher, then record a failure the ranks
    couldn't. The ranks write to `returned_fd` once training returned (forked.py). `device`: the
    launch's, as its caller resolved it. `scratch`: the launch's TMPDIR (scratch.py)."""
    global _supervisor_pid
    _supervisor_pid = os.getpid()
    # elastic's logs and error files go there; the caller removes it once this process exited
    use_scratch(scratch)
    _take_the_signals(cfg, caller)
    _prepare_for_ranks(cfg, token, returned_fd, device)
    run = RunDir(run_dir)
    expect_forked_ranks(cfg.num_processes)
    error = _launch(cfg, task, run_dir, progress, port)
    # No error: every rank returned from rank_main, so rank 0 recorded the ending and there is
    # nothing to add. The launcher may have answered such a run without waiting for this process
    # (launcher/forked.py), and its caller may be deleting the directory by now: nothing here
    # touches it (the lock's guard file would come back into a folder being emptied). After a
    # failure the launcher waits for this exit, and a new launch may own the directory only later,
    # so the failure is recorded only while this launch holds the lock.
    if error is None:
        # the ranks are gone (elastic waited); the caller may not wait for this process
        remove_scratch(scratch)
        os._exit(0)
    with lock.holding(run, token) as ours:
        if ours:
            record_signal_deaths(run, error)
            # Preemption signals never reach elastic here (_pass_to_ranks): the ranks record that
            # ending themselves.
            finalize(run, error)
    os._exit(1)


def _take_the_signals(cfg: RunConfig, caller: int) -> None:
    """The supervisor's signals: the preemption signals passed on to the ranks, SIGTERM when the
    caller dies, a process group of its own, and elastic left only SIGINT and SIGQUIT."""
    # The preemption signals are passed on to the ranks here, not by elastic: elastic would end its
    # workers (SIGTERM, then SIGKILL 30 s on), and a rank that checkpointed and returned waits in
    # elastic's wrapper for a launcher that no longer reads its result. Not the caller's handlers
    # either (Run.wait's, on a restart).
    preemption.install(_pass_to_ranks, cfg, leave_ignored=True)
    # When the caller dies (SIGKILL, a restarted kernel): SIGTERM, passed on to the ranks, which
    # checkpoint and exit; they die with this process (rank_main).
    die_with_parent(signal.SIGTERM, parent=caller)
    os.setpgrp()  # the parent can end the supervisor and all its ranks with one killpg
    _leave_preemption_signals_to_us()


def _prepare_for_ranks(cfg: RunConfig, token: str, returned_fd: int, device: str) -> None:
    """What the forked ranks find: the run directory locked by their launcher, a clean accelerate
    state, quiet elastic and multiprocessing loggers, and the environment rank.py reads."""
    # the ranks find the run directory locked by their launcher
    os.environ["WORKBENCH_LOCK_TOKEN"] = token
    from accelerate.state import AcceleratorState, PartialState

    # An Accelerator made in the user's kernel was copied into this fork; the ranks must start
    # clean.
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    # Elastic logs every rank failure as a wall of text; the run directory and RunFailedError carry
    # it cleanly.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing").setLevel(logging.ERROR)
    os.environ[FORKED_RANKS] = "1"  # the ranks limit their OpenMP use (rank.py)
    # One machine: the rendezvous store this process hosts, and the ranks' gloo/NCCL listeners, on
    # loopback only (torch's store would listen on every interface).
    bind_store_servers(LOOPBACK)
    os.environ.update(single_node_listeners())
    offline()  # nothing is fetched from the Hugging Face Hub in a rank
    os.environ[RETURNED_FD] = str(returned_fd)
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the cores; accelerate would set 1 thread per rank and warn about it.
        os.environ["OMP_NUM_THREADS"] = str(detect().threads_per_rank(cfg.num_processes))


def _launch(
    cfg: RunConfig, task: Task, run_dir: str, progress: bool, port: int
) -> BaseException | None:
    """Fork the ranks through accelerate's notebook_launcher and wait for them; the error it
    raised, if any."""
    from accelerate import notebook_launcher

    try:
        # notebook_launcher prints its own "Launching training on N CUDAs/CPUs" line; ours (logged
        # by the caller) says what really runs, so accelerate's is dropped. Everything else, the
        # ranks' print() included (they are forked inside this redirect), passes.
        with contextlib.redirect_stdout(DropLines(sys.stdout, ("Launching training on",))):
            notebook_launcher(
                rank_main,
                args=(cfg, task, run_dir, progress),
                num_processes=cfg.num_processes,
                mixed_precision=accelerate_mixed_precision(cfg.precision),
                master_addr=LOOPBACK,
                use_port=str(port),
                monitor_interval=0.02,
            )
    except BaseException as exc:  # noqa: BLE001
        # recorded in the run directory, then reported by exit code
        return exc
    return None
