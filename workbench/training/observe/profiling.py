"""profile_steps: a torch.profiler trace of optimizer steps [first, last] on every rank, written as
a Chrome trace to <run>/profile/rank_<r>.json (chrome://tracing, ui.perfetto.dev, or TensorBoard's
profile plugin)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir import RunDir

log = logging.getLogger("workbench")

STEP_LABEL = "workbench step {}"
"""Each profiled step is one record_function range with this name, so the trace shows where steps
begin."""


class StepProfiler:
    """Starts the profiler at the first profiled step, labels each step, stops and writes the trace
    after the last (or when the run ends inside the range: a stopped or diverged run keeps what was
    recorded)."""

    def __init__(self, cfg: RunConfig, run: RunDir, rank: int, device: torch.device) -> None:
        self.first, self.last = cfg.profile_steps or (0, -1)
        self.run, self.rank = run, rank
        self.activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if device.type == "cuda" else []
        )
        self.profiler: Any = None
        self.steps: list[int] = []
        self.trace: Path | None = None

    @property
    def path(self) -> Path:
        return self.run.profile_path / f"rank_{self.rank}.json"

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around optimizer step `number` (1-based, as metrics rows count them)."""
        if not self.first <= number <= self.last:
            yield
            return
        if self.profiler is None:
            # Shapes off: recording them costs time in every op and makes the trace much larger.
            self.profiler = profile(activities=self.activities, record_shapes=False)
            self.profiler.__enter__()
        with record_function(STEP_LABEL.format(number)):
            yield
        self.steps.append(number)
        if number == self.last:
            self.close()

    def close(self) -> Path | None:
        """Stop and write the trace if one is being recorded; the trace's path once written."""
        if self.profiler is None:
            return self.trace
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(str(self.run.profile_trace_path(self.rank)))
        self.trace = self.path
        # Every rank records its own trace: the event says which steps it holds and where it is.
        self.run.event("profile_saved", rank=self.rank, path=str(self.path), steps=self.steps)
        log.info("[rank %d] profile of steps %s written to %s", self.rank, self._span(), self.path)
        return self.trace

    def _span(self) -> str:
        return f"{self.steps[0]}-{self.steps[-1]}" if self.steps else "(none)"
