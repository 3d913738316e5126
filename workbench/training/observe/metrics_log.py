"""Metrics rows: the loss and throughput of each logging window, agreed over all ranks in one
collective.

Every `log_every` steps one all-gather carries each rank's window loss, peak memory, skipped steps,
the bytes it holds, its device monitor's window (monitor.py), the gradient norm and the non-finite
flags (nonfinite.py); rank 0 writes the row to metrics.jsonl and to the run's trackers (TensorBoard,
MLflow). The loss and the norm stay on the device between logging steps: the gathered tensor is the
one read of the window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from workbench.rundir.metrics_row import MetricsRow
from workbench.training.nonfinite import COLUMNS, Divergence, NonFiniteWatch, judge
from workbench.training.observe.memory import peak_memory_bytes
from workbench.training.observe.monitor import row_fields
from workbench.training.observe.verdicts import (
    PHASES,
    STRAGGLER_WINDOWS,
    diagnose,
    per_rank,
    straggler,
)

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.rundir import RunDir
    from workbench.training.batches import ShardedBatches
    from workbench.training.checkpoint import TrainerState
    from workbench.training.observe.breakdown import StepBreakdown
    from workbench.training.observe.model_flops import ModelFlops
    from workbench.training.observe.monitor import DeviceMonitor
    from workbench.training.observe.trackers import RunTrackers

HELD_KINDS = ("params", "grads", "optimizer")
"""What each rank holds, in bytes, reported per rank in every row (what sharding saved)."""
OWN_TIME = 3 + len(HELD_KINDS)
"""The gathered column of each rank's own step time; before it: loss, peak memory, skipped steps and
the bytes held of each HELD_KINDS; after it: the breakdown's phases, the device monitor's window,
then (the last 1 + COLUMNS) the gradient norm and the non-finite flags."""


class MetricsLogger:
    """Accumulates the current window's loss; writes one row per log step; tells when all ranks must
    stop."""

    def __init__(
        self,
        accelerator: Accelerator,
        run: RunDir,
        cfg: RunConfig,
        *,
        global_batch: int,
        tokens_per_sample: int | None,
        flops: ModelFlops,
        batches: ShardedBatches,
        parallel: Any,
        monitor: DeviceMonitor | None = None,
        trackers: RunTrackers | None = None,
        breakdown: StepBreakdown | None = None,
        loss_ranks: range | None = None,
        watch: NonFiniteWatch | None = None,
    ) -> None:
        self.accelerator, self.run, self.cfg = accelerator, run, cfg
        self.device = accelerator.device
        self.main = accelerator.is_main_process
        self.global_batch, self.tokens_per_sample, self.flops = (
            global_batch,
            tokens_per_sample,
            flops,
        )
        self.batches = batches
        """Which epoch a row's step is in."""
        self.parallel = parallel
        """The rank's strategy: the bytes it holds go into every row."""
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.steps = 0
        self.untimed = 0
        """Steps of this window that compiled: left out of its step time."""
        self.window_start = time.perf_counter()
        self.last_row: MetricsRow | None = None
        self.monitor = monitor
        """Its window rides in the same all-gather (a few more numbers per rank, no extra
        collective)."""
        self.trackers = trackers
        self.breakdown = breakdown
        """Each rank's step-time breakdown rides in the same all-gather; rank 0 turns it into
        verdicts."""
        self._windows: deque[dict[str, list[float]]] = deque(maxlen=STRAGGLER_WINDOWS - 1)
        """The breakdowns of this session's latest windows before the one being logged (a straggler
        must hold)."""
        self.loss_ranks = (
            slice(None) if loss_ranks is None else slice(loss_ranks.start, loss_ranks.stop)
        )
        """The ranks whose window loss the row averages: a pipeline's last stage; every rank
        otherwise."""
        self.watch = watch
        """Its flags ride in the same all-gather: a logging step is a read point (nonfinite.py)."""

    def step_done(self, step_loss: torch.Tensor) -> None:
        """A step ended with this mean loss over its micro-batches."""
        self.loss_sum += step_loss.double()
        self.steps += 1

    def restart_clock(self) -> None:
        """Time spent outside training steps (eval, checkpoints) is not step time."""
        self.window_start = time.perf_counter()
        if self.breakdown is not None:
            self.breakdown.restart()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time in the block (a checkpoint) is not step time, and the window's steps before it keep
        theirs: a row logged right after it (a run that ends on that checkpoint) times its steps
        as they ran."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.window_start += time.perf_counter() - began
            if self.breakdown is not None:
                self.breakdown.restart()

    def untime_steps_so_far(self) -> None:
        """The window's steps so far compiled: their time is compile time, not the training pace the
        row reports (they still count for the loss)."""
        self.restart_clock()
        self.untimed = self.steps

    def write(self, row: MetricsRow) -> None:
        """Rank 0: one row (training or eval) to metrics.jsonl and the trackers, so they always hold
        the same."""
        if not self.main:
            return
        self.run.append_metrics(row)
        if self.trackers is not None:
            self.trackers.log(row)

    def _breakdown(self, row: MetricsRow, columns: torch.Tensor) -> None:
        """Per phase, each rank's mean ms per step; the slowest rank; the verdicts they add up
        to."""
        assert self.breakdown is not None
        row.set_phases_ms(
            {
                name: [round(1e3 * float(v), 4) for v in columns[:, i]]
                for i, name in enumerate(PHASES)
            }
        )
        row.comm_measured = measured = self.breakdown.comm_measured
        parts = per_rank(row)
        assert parts is not None
        # one decision, by one measure, for the bars' mark and the verdict: the straggler over
        # several windows
        slow = straggler([*self._windows, parts])
        row.slowest_rank = slow[0] if slow is not None else None
        row.verdicts = diagnose(
            row, self.cfg.num_workers, self.device.type, measured, earlier=list(self._windows)
        )
        self._windows.append(parts)

    def due(self, step: int, final: bool) -> bool:
        return final or step % self.cfg.log_every == 0

    def log(
        self, state: TrainerState, grad_norm: torch.Tensor | None, elapsed_s: float, lr: float
    ) -> MetricsRow | Divergence:
        """One all-gather, one read: the window's row, written by rank 0; or, with nothing
        written, where the run diverged when the non-finite flags say it did."""
        held_bytes = self.parallel.held_bytes
        timed = max(1, self.steps - self.untimed)
        own_step_time = (time.perf_counter() - self.window_start) / timed
        parts = self.breakdown.window() if self.breakdown is not None else {}
        host = torch.tensor(
            [
                peak_memory_bytes(self.device),
                state.skipped_steps,
                *(held_bytes.get(k, 0) for k in HELD_KINDS),
                own_step_time,
                *parts.values(),
                *(self.monitor.window_vector() if self.monitor is not None else ()),
            ],
            dtype=torch.float64,
        )
        mean_loss = (self.loss_sum / self.steps).view(1)
        local = torch.cat([mean_loss, host.to(self.device), self._checks(grad_norm)])
        everyone = self.accelerator.gather(local.unsqueeze(0)).cpu()
        checks = everyone[:, -1 - COLUMNS :]
        diverged = judge(checks[:, 1:])
        if diverged is not None:
            return diverged
        step_time = (
            time.perf_counter() - self.window_start
        ) / timed  # the gather counts, as it always did
        monitored = (
            None if self.monitor is None else everyone[:, OWN_TIME + 1 + len(parts) : -1 - COLUMNS]
        )
        row = self._row(state, everyone, step_time, elapsed_s, lr, monitored)
        if parts:
            self._breakdown(row, everyone[:, OWN_TIME + 1 : OWN_TIME + 1 + len(parts)])
        if grad_norm is not None:
            row.grad_norm = float(checks[self.accelerator.process_index, 0])
        self.write(row)
        self.loss_sum.zero_()
        self.steps = self.untimed = 0
        self.restart_clock()
        self.last_row = row
        return row

    def _checks(self, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """The gradient norm (NaN: none) and the non-finite flags, on the device, float64."""
        norm = (
            grad_norm.detach().double().view(1)
            if grad_norm is not None
            else torch.full((1,), torch.nan, dtype=torch.float64, device=self.device)
        )
        flags = (
            self.watch.vector()
            if self.watch is not None
            else torch.full((COLUMNS,), torch.inf, dtype=torch.float64, device=self.device)
        )
        return torch.cat([norm, flags])

    def _row(
        self,
        state: TrainerState,
        everyone: torch.Tensor,
        step_time: float,
        elapsed_s: float,
        lr: float,
        monitored: torch.Tensor | None,
    ) -> MetricsRow:
        """The row of the gathered (ranks x values) tensor, as log() packed it; no breakdown yet."""

        def ints(column: int) -> list[int]:
            return [int(v) for v in everyone[:, column]]

        samples_per_s = self.global_batch / step_time
        return MetricsRow(
            step=state.step,
            epoch=self.batches.epoch_of(max(0, state.micro_batches - 1)),
            loss=float(everyone[self.loss_ranks, 0].mean()),
            lr=lr,
            step_time_s=step_time,
            samples_per_s=samples_per_s,
            peak_memory_bytes=int(everyone[:, 1].max()),
            peak_memory_bytes_per_rank=ints(1),
            skipped_steps=int(everyone[:, 2].max()),
            **{f"{kind}_bytes_per_rank": ints(3 + i) for i, kind in enumerate(HELD_KINDS)},
            samples=state.samples,
            elapsed_s=elapsed_s,
            eta_s=step_time * (self.cfg.max_steps - state.step),
            step_time_ms_per_rank=[1e3 * float(v) for v in everyone[:, OWN_TIME]],
            **(row_fields(monitored) if monitored is not None else {}),
            tokens_per_s=samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None,
            mfu=self.flops.mfu(samples_per_s),
        )
