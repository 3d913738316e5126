"""The pace of a run's session, from a `Reading`: samples/s over the session, the window a row
covers, the smoothed step time and the ETA, and the progress line that shows them.

The numbers follow summary.json's definitions, so the dashboard and the summary never disagree about
what "samples/s" means.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from workbench.notebook.reading import Reading
from workbench.rundir.metrics_row import MetricsRow
from workbench.utils.units import fmt_duration

ETA_HORIZON_S = (30.0, 600.0)
"""The ETA's pace is the mean over roughly the last `horizon` seconds of training: a fifth of the
session so far, kept between these bounds. Long enough that what recurs (evals, checkpoints, a
neighbour's bursts, the dashboard's own drawing) is averaged in rather than skipped, so a slow
window moves the ETA by its share of the horizon; short enough that a lasting change of pace shows
within minutes."""
ETA_HORIZON_SHARE = 0.2


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


def _windows(rows: Sequence[MetricsRow]) -> Iterator[tuple[float, int]]:
    """(seconds, steps) of each logged window between consecutive rows, newest first: the training
    clock (`elapsed_s`) where the rows have it, else the window's own step time."""
    for i in range(len(rows) - 1, 0, -1):
        before, row = rows[i - 1], rows[i]
        steps = row.step - before.step
        if row.elapsed_s is not None and before.elapsed_s is not None:
            seconds = row.elapsed_s - before.elapsed_s
        elif row.step_time_s is not None:
            seconds = row.step_time_s * steps
        else:
            continue
        if steps > 0 and seconds >= 0:
            yield seconds, steps


def smoothed_step_time(rows: Sequence[MetricsRow], session_step: int = 0) -> float | None:
    """Seconds per step: the training rows of this session (after `session_step`) as an
    exponentially time-weighted mean pace, sum(w * seconds) / sum(w * steps) with w = exp(-age /
    horizon), age the training time since the window ended (ETA_HORIZON_S says which horizon, and
    why).

    A ratio of sums, not a median of windows: steps slowed now and then (an eval, the dashboard
    drawing, a neighbour) are counted at their real share of the time, where a median of short
    windows skips them and promises too soon. The first logged window, warm-up included, counts only
    while it is the only one.
    """
    train = [r for r in rows if r.is_train and r.step > session_step]
    first, last = (train[0], train[-1]) if train else (None, None)
    if (
        first is not None
        and last is not None
        and first.elapsed_s is not None
        and last.elapsed_s is not None
    ):
        session_s = last.elapsed_s - first.elapsed_s
    else:
        session_s = sum(seconds for seconds, _ in _windows(train))
    horizon = min(max(ETA_HORIZON_SHARE * session_s, ETA_HORIZON_S[0]), ETA_HORIZON_S[1])
    time_sum = step_sum = age = 0.0
    # newest first, until what is older no longer moves the pace
    for seconds, steps in _windows(train):
        weight = math.exp(-age / horizon)
        if weight < 1e-3:
            break
        time_sum += weight * seconds
        step_sum += weight * steps
        age += seconds
    if step_sum == 0:
        # one window so far: the first, warm-up in it
        return first.step_time_s if first is not None else None
    return time_sum / step_sum


def eta_s(reading: Reading, max_steps: int | None, step: int) -> float | None:
    """Seconds left to max_steps at the smoothed pace; the latest row's own ETA without one. It runs
    to the last step: the final evaluation and checkpoint after it are not in it (nothing tells
    their cost in advance)."""
    per_step = smoothed_step_time(reading.rows, reading.session_step)
    if per_step is not None and max_steps:
        return per_step * max(0, max_steps - step)
    train = reading.train_rows
    return train[-1].eta_s if train else None


def progress_line(reading: Reading, max_steps: int | None, step: int, ended: str | None) -> str:
    """'step 40/100 (40%) · ETA 1m 10s'; while compiling, what compiles; `ended`: the status a run
    ended with."""
    total = f"/{max_steps}" if max_steps else ""
    pct = f" ({100 * step / max_steps:.0f}%)" if max_steps else ""
    if ended:
        wall = reading.summary.get("wall_time_s")
        tail = ended + (f" in {fmt_duration(wall)}" if wall else "")
    elif reading.compile.startswith("compiling"):
        tail = reading.compile
    elif max_steps and step >= max_steps:
        # not 'ETA 0 s' while the final evaluation and checkpoint run
        tail = "finishing: the final evaluation and checkpoint…"
    elif reading.train_rows:
        tail = f"ETA {fmt_duration(eta_s(reading, max_steps, step))}"
    elif reading.observed[0] == "starting":
        tail = "starting the ranks…"
    else:  # the ranks reported: the first steps run until the first logged one
        tail = "starting the first steps…"
    return f"step {step}{total}{pct} · {tail}"
