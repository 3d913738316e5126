"""A cap on how much output one notebook execution keeps: papermill's nbclient engine with the
output counted as it arrives.

Without it, a notebook that prints hundreds of MB is kept whole in memory, saved again and again
into the executed notebook, and ends as nbclient's 'Timeout waiting for IOPub output' (its output
could not be read within iopub_timeout after the cell finished), which read as the case's timeout.
With it, output past the cap is dropped, a line in the notebook says so, and the kernel is killed:
a notebook that floods its output would not stop by itself, and the case ends at once as an
'output limit' error that names the cap and the size reached.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from papermill.clientwrap import PapermillNotebookClient
from papermill.engines import NBClientEngine, papermill_engines
from papermill.log import logger as papermill_log
from papermill.utils import merge_kwargs, remove_args

from workbench.regress.suite import DEFAULT_OUTPUT_LIMIT_MB
from workbench.utils.units import MiB, fmt_bytes

log = logging.getLogger("workbench")

ENGINE = "workbench-regress"
IOPUB_TIMEOUT_S = 30
"""nbclient waits this long for a finished cell's last output (its default, 4 s, is too short
for a cell that printed a lot just before it ended, within the cap)."""


class OutputCap:
    """How much output an execution kept, against its limit; where it was stopped, if it was."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.kept_bytes = 0
        self.stopped_in_cell: int | None = None
        self.notebook: Any = None  # the notebook being executed, once papermill has it

    @property
    def limit_text(self) -> str:
        return f"output_limit_mb={self.limit_bytes / MiB:g}"


def output_size(msg: dict[str, Any]) -> int:
    """Characters an output message adds to the notebook (its text, its data)."""
    content = msg.get("content", {})
    if msg.get("msg_type") == "stream":
        return len(content.get("text", ""))
    if msg.get("msg_type") == "error":
        return sum(len(line) for line in content.get("traceback", []))
    return sum(
        len(v) if isinstance(v, str) else len(json.dumps(v, default=str))
        for v in content.get("data", {}).values()
    )


class _CappedClient(PapermillNotebookClient):
    """papermill's client, keeping outputs until `cap` is reached and killing the kernel there."""

    def __init__(self, nb_man: Any, cap: OutputCap, **kw: Any) -> None:
        super().__init__(nb_man, **kw)
        self._cap = cap
        self._kill: asyncio.Future[Any] | None = None
        cap.notebook = nb_man.nb

    def output(
        self, outs: list[Any], msg: dict[str, Any], display_id: str | None, cell_index: int
    ) -> Any:
        cap = self._cap
        if cap.stopped_in_cell is not None:
            return None  # what was still on its way when the kernel was killed
        size = output_size(msg)
        if cap.kept_bytes + size <= cap.limit_bytes:
            cap.kept_bytes += size
            return super().output(outs, msg, display_id, cell_index)
        cap.stopped_in_cell = cell_index
        if msg.get("msg_type") == "stream":  # the head of the last text, up to the cap
            room = cap.limit_bytes - cap.kept_bytes
            head = {**msg, "content": {**msg["content"], "text": msg["content"]["text"][:room]}}
            super().output(outs, head, display_id, cell_index)
            cap.kept_bytes += room
        from nbformat.v4 import new_output

        outs.append(
            new_output(
                "stream",
                name="stderr",
                text=f"\n[workbench regress: the output reached {cap.limit_text} "
                f"({fmt_bytes(cap.kept_bytes)}); the rest was dropped and the kernel stopped]\n",
            )
        )
        self._kill_kernel()
        return None

    def _kill_kernel(self) -> None:
        """Kill the kernel now: output() runs inside nbclient's event loop, so the kill is
        scheduled on it; nbclient then finds the kernel dead within a second."""
        if self.km is None:
            return
        process = getattr(self.km.provisioner, "process", None)
        if process is not None:  # a local kernel: its Popen
            process.kill()
        else:
            self._kill = asyncio.ensure_future(self.km.shutdown_kernel(now=True))


class CappedEngine(NBClientEngine):
    """papermill's nbclient engine with an OutputCap (`output_cap=`) on the execution."""

    @classmethod
    def execute_managed_notebook(
        cls,
        nb_man: Any,
        kernel_name: str,
        log_output: bool = False,
        stdout_file: Any = None,
        stderr_file: Any = None,
        start_timeout: int = 60,
        execution_timeout: int | None = None,
        output_cap: OutputCap | None = None,
        **kwargs: Any,
    ) -> Any:
        # as NBClientEngine.execute_managed_notebook, with the capped client
        kwargs = remove_args(["input_path"], **kwargs)
        safe_kwargs = remove_args(["timeout", "startup_timeout"], **kwargs)
        final_kwargs = merge_kwargs(
            safe_kwargs,
            timeout=execution_timeout if execution_timeout else kwargs.get("timeout"),
            startup_timeout=start_timeout,
            kernel_name=kernel_name,
            log=papermill_log,
            log_output=log_output,
            stdout_file=stdout_file,
            stderr_file=stderr_file,
        )
        cap = (
            output_cap if output_cap is not None else OutputCap(int(DEFAULT_OUTPUT_LIMIT_MB * MiB))
        )
        return _CappedClient(nb_man, cap, **final_kwargs).execute()


papermill_engines.register(ENGINE, CappedEngine)
