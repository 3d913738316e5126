"""Where each rank's step time goes, measured: waiting for data, forward+backward compute, exposed
communication, the optimizer, and the rest of the loop (logging, the per-step agreement, progress).

The trainer marks phase changes (the same points it reports to the hang watchdog); every instant of
a training step belongs to exactly one phase, so the phases add up to the step. Eval and checkpoints
are not step time and are not counted (the metrics window leaves them out too). On CPU a mark is one
perf_counter() call; on a GPU it records a CUDA event on the current stream instead, so the phases
are GPU time; the events are kept and their times read once per logging window (reading one sooner
would make the host wait for the device).

Exposed communication is the part of the gradient all-reduce that compute did not hide: the time
from the moment backward's last gradients were ready to the end of the last all-reduce, which DDP
measures in C++ (DDPCommStats); once a window it is carved out of the compute phase. Modes whose
collectives run inside forward/backward where no timer sees them (FSDP2, tensor and pipeline
parallel) report them as compute (`comm_measured` False).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from workbench.training.observe.verdicts import PHASES

NOT_STEP_TIME = ("evaluation", "checkpoint", "finishing")
FOLD_AFTER = 512
"""CUDA event pairs kept before those the device has reached are timed (a long logging window)."""


def phase_of(where: str) -> str | None:
    """The breakdown phase of a point the trainer reports to its watchdog (`at(...)`): 'data',
    'forward/backward ...', 'pipeline schedule ...', 'optimizer'; None for what is not step time
    (eval, checkpoints)."""
    if where.startswith(NOT_STEP_TIME):
        return None
    if where.startswith("data"):
        return "data"
    if where.startswith("optimizer"):
        return "optimizer"
    return "compute"


class DDPCommStats:
    """Exposed communication as DDP measures it itself: with runtime stats sampled every iteration,
    DDP's C++ reducer notes when backward's compute ended and when its last all-reduce did (CPU
    clocks, or CUDA events on GPUs) and keeps their running means. No Python runs in the backward
    for it: a Python comm hook, called once per bucket, cost more than the budget for all the
    measuring. DDP records an iteration's times when the next one starts, so a window's figures lag
    it by one step."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        self.ddp = ddp
        ddp._set_ddp_runtime_logging_sample_rate(1)
        self._seen = self._totals()

    def _totals(self) -> tuple[int, float]:
        """(iterations recorded, their exposed communication in seconds, summed)."""
        data = self.ddp._get_ddp_logging_data()
        n = int(data.get("iteration", 0))
        # Means over n iterations; exposed = all-reduce time minus its overlap with backward's
        # compute.
        exposed_ns = data.get("avg_backward_comm_time", 0) - data.get(
            "avg_backward_compute_comm_overlap_time", 0
        )
        return n, max(0.0, exposed_ns) * n / 1e9

    def exposed_s(self) -> tuple[int, float]:
        """Backward passes that all-reduced since the last call, and their exposed communication
        (seconds)."""
        now = self._totals()
        (n0, s0), self._seen = self._seen, now
        return now[0] - n0, max(0.0, now[1] - s0)

    @property
    def syncs(self) -> int:
        """Forward passes that prepared a gradient all-reduce so far (outside no_sync). DDP records
        the count at each such forward, of those before it, from its second on: one run of a single
        step reads 0."""
        n = self._totals()[0]
        return n + 1 if n else 0


def stamp(cuda: bool) -> Any:
    """Now: a CUDA event recorded on the current stream (GPU time), or perf_counter() on CPU."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed(start: Any, end: Any, cuda: bool) -> float:
    """Seconds from `start` to `end`; on CUDA it waits for `end` to be reached (read points
    only)."""
    if cuda:
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return end - start


class StepBreakdown:
    """Per-phase time of this rank over the current logging window."""

    def __init__(self, device: torch.device, comm: DDPCommStats | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.comm = comm
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.phase: str | None = None
        self.since: Any = None
        self.steps = 0
        self.pending: deque[tuple[str, Any, Any]] = deque()
        """CUDA: (phase, start event, end event) of the window, timed when it is read."""

    @property
    def comm_measured(self) -> bool:
        return self.comm is not None

    def mark(self, phase: str | None) -> None:
        """From now on the rank is in `phase` (None: not step time, e.g. eval or a checkpoint)."""
        now = stamp(self.cuda)
        if self.phase is not None:
            if self.cuda:
                self.pending.append((self.phase, self.since, now))
                if len(self.pending) > FOLD_AFTER:
                    self._fold(wait=False)
            else:
                self.totals[self.phase] += now - self.since
        self.phase, self.since = phase, now

    def step_done(self) -> None:
        self.steps += 1
        self.mark("other")

    def restart(self) -> None:
        """The window starts now: time since the last mark (logging, eval, a checkpoint) is dropped,
        as the metrics window drops it."""
        self.phase, self.since = "other", stamp(self.cuda)  # the loop is back in step time
        if self.comm is not None:
            self.comm.exposed_s()

    def _fold(self, *, wait: bool) -> None:
        """Add the kept CUDA events' times to the totals: all of them (wait), or those the device
        has already reached (a long window's, never waiting)."""
        while self.pending and (wait or self.pending[0][2].query()):
            phase, start, end = self.pending.popleft()
            self.totals[phase] += elapsed(start, end, cuda=True)

    def window(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the last window; starts the next window."""
        self.mark(self.phase)
        self._fold(wait=True)
        if self.comm is not None:
            # DDP's figures lag one step behind the window: its mean per all-reduce, times the
            # window's steps.
            syncs, seconds = self.comm.exposed_s()
            exposed = min(seconds / syncs * self.steps if syncs else 0.0, self.totals["compute"])
            self.totals["compute"] -= exposed
            self.totals["comm"] += exposed
        steps = max(1, self.steps)
        means = {name: total / steps for name, total in self.totals.items()}
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        return means
