"""Executing a notebook headless with papermill, and why it could not run to its end."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KERNEL = "python3"
_SOCKET_PATH_MAX = (
    90  # AF_UNIX paths: 104 bytes on macOS, 108 on Linux, with room for ipykernel's '-<n>'
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


@dataclass
class CaseError:
    """Why a case could not run to its end, and the failing cell when there is one."""

    kind: str  # exception | timeout | dead kernel | could not run | bad baseline
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


def _kernel_manager(deadline: _Deadline, socket_dir: str | None) -> type:
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
    """
    from jupyter_client.manager import AsyncKernelManager

    class CaseKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            if socket_dir is not None:
                kwargs = {"transport": "ipc", "ip": os.path.join(socket_dir, "kernel"), **kwargs}
            super().__init__(**kwargs)

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


def _running_cell(notebook: Path) -> str:
    """Source of the last cell papermill started: the one running when the kernel timed out or
    died."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except Exception:  # noqa: BLE001  (the notebook may not have been written at all)
        return ""
    started = [
        c
        for c in nb.cells
        if c.cell_type == "code" and c.metadata.get("papermill", {}).get("start_time")
    ]
    return started[-1].source if started else ""


def execute(
    notebook: Path, output: Path, cwd: Path, parameters: Mapping[str, Any], timeout_s: float
) -> CaseError | None:
    """Run `notebook` with papermill into `output` (kept whatever happens); None on success."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    deadline, socket_dir = _Deadline(timeout_s), _socket_dir()
    try:
        pm.execute_notebook(
            str(notebook),
            str(output),
            parameters=dict(parameters),
            kernel_name=KERNEL,
            cwd=str(cwd),
            progress_bar=False,
            timeout_func=deadline,
            kernel_manager_class=_kernel_manager(deadline, socket_dir),
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
    except CellTimeoutError:
        return CaseError(
            "timeout",
            f"timed out: the notebook ran longer than timeout_s={timeout_s:g} s; raise "
            "timeout_s or make it faster",
            cell_source=_running_cell(output),
        )
    except DeadKernelError as e:
        return CaseError(
            "dead kernel",
            f"the kernel died ({e}): out of memory, a crash in native code, or os._exit()",
            cell_source=_running_cell(output),
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
