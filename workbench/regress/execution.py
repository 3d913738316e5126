"""Executing a notebook headless with papermill, and why it could not run to its end."""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KERNEL = "python3"
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


def _running_cell(notebook: Path) -> str:
    """Source of the last cell papermill started: the one running when the kernel timed out or died."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except Exception:  # noqa: BLE001  (the notebook may not have been written at all)
        return ""
    started = [c for c in nb.cells if c.cell_type == "code" and c.metadata.get("papermill", {}).get("start_time")]
    return started[-1].source if started else ""


def execute(notebook: Path, output: Path, cwd: Path, parameters: Mapping[str, Any],
            timeout_s: float) -> CaseError | None:
    """Run `notebook` with papermill into `output` (kept whatever happens); None on success."""
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    try:
        pm.execute_notebook(str(notebook), str(output), parameters=dict(parameters), kernel_name=KERNEL,
                            cwd=str(cwd), progress_bar=False, timeout_func=_Deadline(timeout_s))
    except pm.PapermillExecutionError as e:
        return CaseError("exception", f"{e.ename}: {e.evalue}", e.ename, e.evalue,
                         strip_ansi("\n".join(e.traceback)), e.source)
    except CellTimeoutError:
        return CaseError("timeout", f"timed out: the notebook ran longer than timeout_s={timeout_s:g} s; raise "
                         "timeout_s or make it faster", cell_source=_running_cell(output))
    except DeadKernelError as e:
        return CaseError("dead kernel", f"the kernel died ({e}): out of memory, a crash in native code, or "
                         "os._exit()", cell_source=_running_cell(output))
    except Exception as e:  # noqa: BLE001  (a kernel that won't start, an unreadable notebook: this case fails)
        return CaseError("could not run", f"{type(e).__name__}: {e}", type(e).__name__, str(e),
                         traceback.format_exc())
    return None
