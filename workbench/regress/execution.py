"""Executing a notebook headless with papermill, and why it could not run to its end."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.regress.case_processes import CaseProcesses
from workbench.regress.suite import DEFAULT_OUTPUT_LIMIT_MB
from workbench.utils.units import MiB, fmt_bytes

if TYPE_CHECKING:
    from workbench.regress.output_cap import OutputCap

log = logging.getLogger("workbench")

KERNEL = "python3"
_SOCKET_PATH_MAX = (
    90  # AF_UNIX paths: 104 bytes on macOS, 108 on Linux, with room for ipykernel's '-<n>'
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@dataclass
class CaseError:
    """Why a case could not run to its end, and the failing cell when there is one."""

    kind: str  # exception | timeout | dead kernel | output limit | output timeout | folder deleted
    # | could not run | bad baseline
    message: str
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    cell_source: str = ""


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


class _Deadline:
    """nbclient timeout_func: the time left for the whole notebook, counted from its first cell."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, None

    def __call__(self, cell: Any) -> float:
        now = time.monotonic()
        if self.end is None:
            self.end = now + self.seconds
        return max(0.001, self.end - now)  # 0 would mean 'no timeout' to nbclient

    def reached(self, slack: float = 1.0) -> bool:
        """Whether the time is (all but) up: nbclient's poll may give up a hair before `end`."""
        return self.end is not None and time.monotonic() >= self.end - slack


def _kernel_manager(deadline: _Deadline, socket_dir: str | None, processes: CaseProcesses) -> type:
    """The kernel manager class nbclient instantiates for one execution.

    The kernel writes its own messages to our stderr, into the middle of the run's log. Two
    differences keep it quiet:
    - Unix sockets (ZMQ's ipc transport) in a private directory where ZMQ has them, instead of TCP
      on localhost: ipykernel warns 'Kernel is running over TCP without encryption' at every start
      otherwise.
    - After a timeout the kernel is killed, not asked to shut down: a kernel still inside the
      timed-out cell closes its sockets on shutdown_request while the interrupted cell's
      execute_reply is on its way, and logs that as a ZMQError traceback ('Socket operation on
      non-socket').
    The kernel starts with the case's marker in its environment and is watched from then on, so
    that whatever it starts can be ended with the case (case_processes.py).
    """
    from jupyter_client.manager import AsyncKernelManager

    class CaseKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            if socket_dir is not None:
                kwargs = {"transport": "ipc", "ip": os.path.join(socket_dir, "kernel"), **kwargs}
            super().__init__(**kwargs)

        async def start_kernel(self, **kw: Any) -> None:
            kw["env"] = processes.environment(kw.get("env"))
            await super().start_kernel(**kw)
            pid = getattr(self.provisioner, "pid", None)
            if isinstance(pid, int):  # a local kernel; other provisioners have no pid here
                processes.watch(pid)

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            await super().shutdown_kernel(now=now or deadline.reached(), restart=restart)

    return CaseKernelManager


def _socket_dir() -> str | None:
    """A private directory for the kernel's Unix sockets, or None where ZMQ has no ipc transport
    (Windows)."""
    import zmq

    if not zmq.has("ipc"):
        return None
    path = tempfile.mkdtemp(prefix="wb-kernel-")
    if len(os.path.join(path, "kernel-99")) > _SOCKET_PATH_MAX:
        # a long TMPDIR: TCP rather than a failed bind
        os.rmdir(path)
        return None
    return path


def _running_cell(notebook: Any) -> str:
    """Source of the last cell papermill started (`notebook`: a node, or a path to read): the one
    running when the kernel timed out or died."""
    import nbformat

    if not isinstance(notebook, nbformat.NotebookNode):
        try:
            notebook = nbformat.read(str(notebook), as_version=4)
        except Exception:  # noqa: BLE001  (the notebook may not have been written at all)
            return ""
    started = [
        c
        for c in notebook.cells
        if c.cell_type == "code" and c.metadata.get("papermill", {}).get("start_time")
    ]
    return started[-1].source if started else ""


def execute(
    notebook: Path,
    output: Path,
    cwd: Path,
    parameters: Mapping[str, Any],
    timeout_s: float,
    *,
    output_limit_mb: float = DEFAULT_OUTPUT_LIMIT_MB,
    notes: list[str] | None = None,
) -> CaseError | None:
    """Run `notebook` with papermill into `output` (kept whatever happens); None on success.

    Output past `output_limit_mb` stops the notebook (output_cap.py); processes it left running
    are killed when it ends, and said so in `notes` (case_processes.py)."""
    from workbench.regress.output_cap import OutputCap  # imports papermill: seconds

    cap = OutputCap(int(output_limit_mb * MiB))
    processes = CaseProcesses()
    try:
        error = _papermill(notebook, output, cwd, parameters, timeout_s, cap, processes)
    finally:
        killed = processes.end_leftovers()
    if killed:
        text = (
            f"the notebook left {len(killed)} process(es) running, killed when it ended: "
            + "; ".join(killed)
        )
        log.warning("%s: %s", notebook.name, text)
        if notes is not None:
            notes.append(text)
    if not cwd.is_dir():
        return _folder_deleted(output, cwd, cap, error)
    if cap.stopped_in_cell is not None:  # whatever nbclient made of the kernel it lost
        cell = cap.notebook.cells[cap.stopped_in_cell]
        return CaseError(
            "output limit",
            f"the notebook's output reached {cap.limit_text} in cell {cap.stopped_in_cell + 1} "
            f"({fmt_bytes(cap.kept_bytes)} kept); the kernel was stopped there. Print less (a "
            "line every N steps, or log to a file), or raise the case's output_limit_mb in its "
            f"suite (default {DEFAULT_OUTPUT_LIMIT_MB:g})",
            cell_source=cell.source,
        )
    return error


def _papermill(
    notebook: Path,
    output: Path,
    cwd: Path,
    parameters: Mapping[str, Any],
    timeout_s: float,
    cap: OutputCap,
    processes: CaseProcesses,
) -> CaseError | None:
    """The execution itself, its failure as a CaseError."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from workbench.regress.output_cap import ENGINE, IOPUB_TIMEOUT_S

    deadline, socket_dir = _Deadline(timeout_s), _socket_dir()
    try:
        pm.execute_notebook(
            str(notebook),
            str(output),
            parameters=dict(parameters),
            engine_name=ENGINE,
            kernel_name=KERNEL,
            cwd=str(cwd),
            progress_bar=False,
            timeout_func=deadline,
            kernel_manager_class=_kernel_manager(deadline, socket_dir, processes),
            output_cap=cap,
            iopub_timeout=IOPUB_TIMEOUT_S,
        )
    except pm.PapermillExecutionError as e:
        return CaseError(
            "exception",
            f"{e.ename}: {e.evalue}",
            e.ename,
            e.evalue,
            strip_ansi("\n".join(e.traceback)),
            e.source,
        )
    except CellTimeoutError as e:
        if not deadline.reached() and "IOPub" in str(e):
            # nbclient's own wait for a finished cell's output, not the case's timeout_s
            return CaseError(
                "output timeout",
                f"a cell ended, but its output ({fmt_bytes(cap.kept_bytes)} so far) did not all "
                f"arrive within {IOPUB_TIMEOUT_S} s: the notebook printed too much too fast; "
                "print less (a line every N steps, or log to a file)",
                cell_source=_running_cell(cap.notebook or output),
            )
        return CaseError(
            "timeout",
            f"timed out: the notebook ran longer than timeout_s={timeout_s:g} s; raise "
            "timeout_s or make it faster",
            cell_source=_running_cell(cap.notebook or output),
        )
    except DeadKernelError as e:
        return CaseError(
            "dead kernel",
            f"the kernel died ({e}): out of memory, a crash in native code, or os._exit()",
            cell_source=_running_cell(cap.notebook or output),
        )
    except Exception as e:  # noqa: BLE001
        # a kernel that won't start, an unreadable notebook: this case fails
        return CaseError(
            "could not run",
            f"{type(e).__name__}: {e}",
            type(e).__name__,
            str(e),
            traceback.format_exc(),
        )
    finally:
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
    return None


def _folder_deleted(output: Path, cwd: Path, cap: OutputCap, error: CaseError | None) -> CaseError:
    """The case's working directory went away while its notebook ran (papermill then fails on
    os.getcwd(), an error that names no path): the error names it, and the executed notebook as
    it was is saved in a new one, so the report's link still works."""
    import nbformat

    saved = ""
    if cap.notebook is not None:
        try:
            cwd.mkdir(parents=True, exist_ok=True)
            nbformat.write(cap.notebook, str(output))
            saved = f"; the executed notebook, as far as it ran, is saved again as {output}"
        except OSError as e:
            log.warning("%s: could not save the executed notebook again: %s", output, e)
    return CaseError(
        "folder deleted",
        f"the case's working directory {cwd} was deleted while the notebook ran (papermill keeps "
        "the executed notebook there); a notebook must leave its working directory in place: "
        "put scratch files in a subdirectory or in tempfile.mkdtemp()" + saved,
        error.ename if error is not None else "",
        error.evalue if error is not None else "",
        error.traceback if error is not None else "",
        _running_cell(cap.notebook if cap.notebook is not None else output),
    )
