"""Where each rank's step time goes, measured: waiting for data, forward+backward compute, exposed communication,
the optimizer, and the rest of the loop (logging, the per-step agreement, progress).

The trainer marks phase changes (the same points it reports to the hang watchdog); every instant of a training
step belongs to exactly one phase, so the phases add up to the step. Eval and checkpoints are not step time and
are not counted (the metrics window leaves them out too). On CPU a mark is one perf_counter() call; on a GPU it
also records a CUDA event on the current stream, so the phases are GPU time, read once per logging window.

Exposed communication is the part of the gradient all-reduce that compute did not hide: DDP calls a comm hook
as each bucket's gradients are ready, and the hook notes the time. After the last bucket, backward only waits
for the all-reduces to finish (and copies their result into the gradients), so the time from the last hook call
to the end of backward is time the rank sat idle in communication; it is carved out of the compute phase.
Modes whose collectives run inside forward/backward without a hook (FSDP2, tensor and pipeline parallel)
report them as compute (`comm_measured` False).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from ..verdicts import PHASES

NOT_STEP_TIME = ("evaluation", "checkpoint", "finishing")


def phase_of(where: str) -> str | None:
    """The breakdown phase of a point the trainer reports to its watchdog (`at(...)`): 'data', 'forward/backward
    ...', 'pipeline schedule ...', 'optimizer'; None for what is not step time (eval, checkpoints)."""
    if where.startswith(NOT_STEP_TIME):
        return None
    if where.startswith("data"):
        return "data"
    if where.startswith("optimizer"):
        return "optimizer"
    return "compute"


class CommTimer:
    """Wraps a DDP comm hook to note when it was last called: the moment the last bucket's gradients were
    ready, after which backward only waits for the all-reduces (and copies their result into the gradients).
    A time stamp per bucket and no completion callback: a Python callback per bucket costs more than the
    measurement is worth."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.calls = 0
        """Gradient all-reduces started (one per bucket on each step's last micro-batch)."""
        self._called: Any = None

    def wrap(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        @functools.wraps(hook)  # DDP reports the hook by its qualified name, and checks its annotations
        def timed(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            self.calls += 1
            self._called = stamp(self.cuda)
            return hook(state, bucket)

        return timed

    def exposed_until(self, end: Any) -> float:
        """Seconds from the last bucket's hook call to `end` (a stamp taken after backward), then forgets it."""
        called, self._called = self._called, None
        return 0.0 if called is None else max(0.0, elapsed(called, end, self.cuda))


def stamp(cuda: bool) -> Any:
    """Now: a CUDA event recorded on the current stream (GPU time), or perf_counter() on CPU."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed(start: Any, end: Any, cuda: bool) -> float:
    if cuda:
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return end - start


class StepBreakdown:
    """Per-phase time of this rank over the current logging window."""

    def __init__(self, device: torch.device, comm: CommTimer | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.comm = comm
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.phase: str | None = None
        self.since: Any = None
        self.steps = 0

    @property
    def comm_measured(self) -> bool:
        return self.comm is not None

    def mark(self, phase: str | None) -> None:
        """From now on the rank is in `phase` (None: not step time, e.g. eval or a checkpoint)."""
        now = stamp(self.cuda)
        if self.phase is not None:
            spent = elapsed(self.since, now, self.cuda)
            if self.phase == "compute" and self.comm is not None:
                exposed = min(spent, self.comm.exposed_until(now))
                spent -= exposed
                self.totals["comm"] += exposed
            self.totals[self.phase] += spent
        self.phase, self.since = phase, now

    def step_done(self) -> None:
        self.steps += 1
        self.mark("other")

    def restart(self) -> None:
        """The window starts now: time since the last mark (logging, eval, a checkpoint) is dropped, as the metrics
        window drops it."""
        self.phase, self.since = "other", stamp(self.cuda)  # the loop is back in step time
        if self.comm is not None:
            self.comm.exposed_until(self.since)

    def window(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the last window; starts the next window."""
        self.mark(self.phase)
        steps = max(1, self.steps)
        means = {name: total / steps for name, total in self.totals.items()}
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        return means
