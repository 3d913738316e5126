"""Live numbers of a run, read from its run directory: what one poll found (`Reading`), and the
figures the dashboard derives from it (throughput over the session, the window a row covers, ETA).

The numbers follow summary.json's definitions, so the dashboard and the summary never disagree about
what "samples/s" means.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from workbench.rundir.metrics_row import MetricsRow
from workbench.utils.units import fmt_bytes

ETA_WINDOWS = 5
"""The ETA uses the median step time of this many recent logged windows: one slow window (an eval, a
checkpoint, a neighbour's burst) doesn't swing it."""


@dataclass(frozen=True)
class Reading:
    """What one poll of a run directory found: the dashboard's state, compared by value."""

    rows: list[MetricsRow] = field(default_factory=list)
    """The rows of metrics.jsonl, training and eval rows as they came."""
    summary: dict[str, Any] = field(default_factory=dict)
    """The content of summary.json."""
    observed: tuple[str, str] = ("starting", "")
    """The status, corrected for a run whose processes are gone, and why it was corrected."""
    session_step: int = 0
    """The step this session of the run started from (0, or the checkpoint a resume loaded)."""
    warnings: tuple[str, ...] = ()
    """Warning lines from events.jsonl for the numbers table (a GPU left idle)."""
    profiles: tuple[str, ...] = ()
    """Profile traces written so far (profile_steps), in rank order."""

    @property
    def train_rows(self) -> list[MetricsRow]:
        return [r for r in self.rows if r.is_train]

    @property
    def eval_rows(self) -> list[MetricsRow]:
        return [r for r in self.rows if r.is_eval]


def session_start(events: Sequence[dict[str, Any]]) -> int:
    """The step the latest session started at: its 'started' or 'resumed' event."""
    starts = [e for e in events if e.get("event") in ("started", "resumed")]
    return int(starts[-1].get("step") or 0) if starts else 0


def idle_warnings(events: Sequence[dict[str, Any]], session_step: int = 0,
                  limit: int = 3) -> tuple[str, ...]:
    """The latest 'gpu_idle' events of this session as one line each (monitor.py writes them)."""
    idle = [e for e in events
            if e.get("event") == "gpu_idle" and (e.get("step") or 0) >= session_step]
    return tuple(f"rank {e.get('rank', '?')}: GPU at {e.get('util_pct', '?')}% for "
                 f"{e.get('seconds', '?')} s (under {e.get('threshold_pct', '?')}%)"
                 + (f" near step {e['step']}" if e.get("step") else "")
                 + f": {e.get('advice', '')}" for e in idle[-limit:])


def monitor_items(row: MetricsRow | None) -> list[tuple[str, str]]:
    """The device monitor's latest window per rank, for the numbers table (absent: no line)."""
    if row is None:
        return []

    def per_rank(values: list[Any] | None, fmt: Callable[[Any], str]) -> str | None:
        if not values or all(v is None for v in values):
            return None
        return ", ".join(f"rank {i}: {'–' if v is None else fmt(v)}" for i, v in enumerate(values))

    lines = [("GPU utilisation", per_rank(row.gpu_util_pct_per_rank, lambda v: f"{v:.0f}%")),
             ("GPU memory used", per_rank(row.gpu_mem_used_bytes_per_rank, fmt_bytes)),
             ("GPU power", per_rank(row.gpu_power_w_per_rank, lambda v: f"{v:.0f} W")),
             ("GPU temperature", per_rank(row.gpu_temp_c_per_rank, lambda v: f"{v:.0f} °C")),
             ("process CPU", per_rank(row.cpu_pct_per_rank, lambda v: f"{v:.0f}%")),
             ("process RSS", per_rank(row.rss_bytes_per_rank, fmt_bytes))]
    return [(label, text) for label, text in lines if text is not None]


def global_batch(summary: dict[str, Any], row: MetricsRow) -> float | None:
    if summary.get("global_batch_size"):
        return float(summary["global_batch_size"])
    if row.samples_per_s and row.step_time_s:
        return round(row.samples_per_s * row.step_time_s)  # the row's own definition, undone
    return None


def run_average(reading: Reading, ended: bool) -> float | None:
    """samples/s over this session, as summary.json defines it: samples trained / time in training
    steps (eval and checkpoints included). Once the run has ended, the summary's own figure.

    A row's `elapsed_s` is taken before its own step's time is added, so a row at step k times the
    steps before it: the average is over those, not over k steps in the time of k-1.
    """
    if ended and reading.summary.get("samples_per_s") is not None:
        return float(reading.summary["samples_per_s"])
    s0 = reading.session_step
    timed = [r for r in reading.rows if r.elapsed_s is not None]
    rows = [r for r in timed if r.is_train and r.step > s0]
    if not rows:
        return None
    last = rows[-1]
    at_start = [r for r in timed if r.step == s0]
    if s0 == 0:
        start_step, start_time = 1, 0.0
    elif at_start:  # a resumed session: the checkpoint's training time is the row's at that step
        start_step, start_time = s0 + 1, at_start[0].elapsed_s
    else:
        start_step, start_time = rows[0].step, rows[0].elapsed_s
    assert last.elapsed_s is not None and start_time is not None
    batch, seconds = global_batch(reading.summary, last), last.elapsed_s - start_time
    steps = last.step - start_step
    if batch is None or steps <= 0 or seconds <= 0:
        return None
    return steps * batch / seconds


def window_steps(reading: Reading) -> int | None:
    """How many steps the latest row's window (its samples/s and step time) covers."""
    rows = reading.train_rows
    if not rows:
        return None
    previous = [r.step for r in rows[:-1] if r.step >= reading.session_step]
    return rows[-1].step - (previous[-1] if previous else reading.session_step)


def smoothed_step_time(reading: Reading) -> float | None:
    """Median seconds per step over the last few windows, eval and checkpoints included."""
    rows = [r for r in reading.train_rows if r.step > reading.session_step]
    times: list[float] = []
    for before, row in itertools.pairwise(rows):
        if row.elapsed_s is not None and before.elapsed_s is not None:
            times.append((row.elapsed_s - before.elapsed_s) / (row.step - before.step))
        elif row.step_time_s is not None:
            times.append(row.step_time_s)
    if not times and rows and rows[0].step_time_s is not None:
        times.append(rows[0].step_time_s)  # one window so far: the first, warm-up included
    return statistics.median(times[-ETA_WINDOWS:]) if times else None


def eta_s(reading: Reading, max_steps: int | None, step: int) -> float | None:
    """Seconds left to max_steps at the smoothed step time; the latest row's own ETA without one."""
    per_step = smoothed_step_time(reading)
    if per_step is not None and max_steps:
        return per_step * (max_steps - step)
    train = reading.train_rows
    return train[-1].eta_s if train else None
