"""Live numbers of a run, read from its run directory: what one poll found (`Reading`), and the
figures the dashboard derives from it (throughput over the session, the window a row covers, ETA).

The numbers follow summary.json's definitions, so the dashboard and the summary never disagree about
what "samples/s" means. `RowTail` reads metrics.jsonl a poll at a time, parsing only what was
appended: a poll of a long run costs what its new rows cost, not the whole file; its first poll of a
long run reads the newest rows and an even sample of the ones before (what the figure draws), so the
first view costs what it shows.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

from workbench.rundir.metrics_row import MetricsRow
from workbench.utils.jsonl import count_lines, sample_jsonl, sample_lines
from workbench.utils.units import fmt_bytes, fmt_duration

log = logging.getLogger("workbench")

ETA_HORIZON_S = (30.0, 600.0)
"""The ETA's pace is the mean over roughly the last `horizon` seconds of training: a fifth of the
session so far, kept between these bounds. Long enough that what recurs (evals, checkpoints, a
neighbour's bursts, the dashboard's own drawing) is averaged in rather than skipped, so a slow
window moves the ETA by its share of the horizon; short enough that a lasting change of pace shows
within minutes."""
ETA_HORIZON_SHARE = 0.2


@dataclass(frozen=True)
class Reading:
    """What one poll of a run directory found: the dashboard's state, compared by value."""

    rows: list[MetricsRow] = field(default_factory=list)
    """The rows of metrics.jsonl, training and eval rows as they came; of a long run watched from
    late on, a sample of the rows before the newest (RowTail): the figure's points, and coarser
    windows for the ETA's pace."""
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
    compile: str = ""
    """torch.compile in this session: 'compiling … for 12 s', then what it cost and found ('' when
    off)."""

    # Cached: a render asks for them a dozen times, and a Reading never changes (frozen; equality
    # and hashing look at the fields only).
    @cached_property
    def train_rows(self) -> list[MetricsRow]:
        return [r for r in self.rows if r.is_train]

    @cached_property
    def eval_rows(self) -> list[MetricsRow]:
        return [r for r in self.rows if r.is_eval]


FIRST_VIEW_ROWS = 800
"""Rows of a long run's history the first poll reads, spread evenly over metrics.jsonl (twice the
points a line of the live figure draws, plots.LIVE_POINTS, so thinning has room): the first view of
a 200,000-row run costs what it shows, not the file."""
FIRST_VIEW_TAIL_BYTES = 512 * 1024
"""The end of metrics.jsonl the first poll reads whole: the newest rows, every one, for the numbers
and the ETA's recent pace (a file no longer than this is read whole)."""
EVAL_MARK = b'"eval_loss"'
"""What an eval row holds and a training row doesn't: the first view keeps the eval rows of the
history."""
PLOT_POINTS = 2000
"""The most points a line of a figure of ended runs (RunResult.plot, wb.compare) draws, and about
the rows of a run it reads (sampled_rows): 200,000 rows drawn from an even sample look the same, for
a fraction of the time."""
PLOT_TAIL_BYTES = 64 * 1024
"""The end of metrics.jsonl a figure reads whole (its newest rows); a shorter file is read whole,
every row drawn."""


class RowTail:
    """The typed rows of one metrics.jsonl, read incrementally: each `read()` parses only the whole
    lines appended since the last one. The first read of a long file takes its newest
    FIRST_VIEW_TAIL_BYTES whole and FIRST_VIEW_ROWS of the rows before them, spread evenly, with
    their eval rows (sample_lines): the rows before a live run's newest are for the figure, which
    draws a sample of them anyway. A file replaced (a new inode) or shorter than what was read is
    read again from the start; a last line without its end waits for it. A row that doesn't fit the
    schema raises ValueError naming the file and row, at every read until it is fixed, as
    `RunDir.metrics_rows()` does."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._rows: list[MetricsRow] = []
        self._offset = 0
        self._lines: int | None = 0
        """Lines read so far; None after a sampled first read (counted only when a message needs a
        number)."""
        self._file_id: tuple[int, int] | None = None
        self.sampled = False
        """Whether the history before the newest rows was sampled (a long file's first read)."""

    def read(self) -> list[MetricsRow]:
        """All rows so far (a new list each time the file grew; the same one when it didn't)."""
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._file_id or st.st_size < self._offset:
                    self._rows, self._offset, self._lines, self.sampled = [], 0, 0, False
                    self._file_id = (st.st_dev, st.st_ino)
                if st.st_size == self._offset:
                    return self._rows
                if self._offset == 0:
                    return self._first_read(f)
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            self._rows, self._offset, self._lines, self._file_id, self.sampled = (
                [],
                0,
                0,
                None,
                False,
            )
            return self._rows
        whole = data[: data.rfind(b"\n") + 1]
        rows, offset, lines = list(self._rows), self._offset, self._lines
        for line in whole.split(b"\n")[:-1]:
            lines = None if lines is None else lines + 1
            row = self._parse(line, lines, offset)
            offset += len(line) + 1
            if row is not None:
                rows.append(row)
        self._rows, self._offset, self._lines = rows, offset, lines
        return rows

    def _first_read(self, f: BinaryIO) -> list[MetricsRow]:
        sampled = sample_lines(f, FIRST_VIEW_ROWS, whole_tail=FIRST_VIEW_TAIL_BYTES, keep=EVAL_MARK)
        rows = []
        for number, (offset, line) in enumerate(sampled.lines, 1):
            row = self._parse(line, number if sampled.complete else None, offset)
            if row is not None:
                rows.append(row)
        self._rows, self._offset = rows, sampled.end
        self._lines = len(sampled.lines) if sampled.complete else None
        self.sampled = not sampled.complete
        return rows

    def _parse(self, line: bytes, number: int | None, offset: int) -> MetricsRow | None:
        if not line.strip():
            return None
        try:
            data = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = None
        if not isinstance(data, dict):  # skipped, as read_jsonl does: a line torn by a crash, say
            log.warning(
                "%s, line %d: not a JSON object, skipped: %.80r",
                self.path,
                self._number(number, offset),
                line,
            )
            return None
        try:
            return MetricsRow.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{self.path}, row {self._number(number, offset)}: {e}") from None

    def _number(self, number: int | None, offset: int) -> int:
        """The line's number: counted as read, or (after a sampled first read) from the newlines
        before it."""
        return number if number is not None else count_lines(self.path, offset) + 1


def sampled_rows(path: Path, most: int) -> list[MetricsRow]:
    """The rows of the metrics.jsonl at `path` a figure needs, typed: all of a short file; of a long
    one, `most` spread evenly, the newest (its last PLOT_TAIL_BYTES) and the eval rows (thinned to
    `most`). Only those lines are parsed; a row that doesn't fit the schema raises ValueError, as
    RunDir.metrics_rows() does."""
    return [
        MetricsRow.from_dict(row)
        for row in sample_jsonl(path, most, whole_tail=PLOT_TAIL_BYTES, keep=EVAL_MARK)
    ]


def lower_thread_priority() -> bool:
    """Give the calling thread the lowest CPU priority (nice 19), on Linux where a thread has its
    own: the dashboard then draws with the CPU the ranks leave. True when it was lowered."""
    if sys.platform != "linux":
        # elsewhere setpriority(PRIO_PROCESS, ...) would take the whole process, or another one
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError as e:
        log.debug("dashboard: could not lower the polling thread's priority: %s", e)
        return False
    return True


def session_start(events: Sequence[dict[str, Any]]) -> int:
    """The step the latest session started at: its 'started' or 'resumed' event."""
    starts = [e for e in events if e.get("event") in ("started", "resumed")]
    return int(starts[-1].get("step") or 0) if starts else 0


def compile_line(
    events: Sequence[dict[str, Any]], session_step: int = 0, now: float | None = None
) -> str:
    """What torch.compile is doing or did in this session, from the ranks' events ('' when it is
    off)."""
    from workbench.training.compiling import describe

    mine = {
        e.get("event"): e
        for e in events
        if e.get("event") in ("compiling", "compiled", "compile_report")
        and (e.get("step") or 0) >= session_step
    }
    if "compile_report" in mine:
        return describe(mine["compile_report"])
    if "compiled" in mine:
        done = mine["compiled"]
        return f"compiled in {done.get('seconds', 0):.1f} s (step {done.get('step')})"
    if "compiling" in mine:
        began = mine["compiling"]
        since = max(0.0, (now or time.time()) - float(began.get("time") or 0))
        return (
            f"compiling {began.get('module', 'the model')} ({began.get('mode')}, "
            f"{began.get('backend')}): {since:.0f} s so far"
        )
    return ""


def idle_warnings(
    events: Sequence[dict[str, Any]], session_step: int = 0, limit: int = 3
) -> tuple[str, ...]:
    """The latest 'gpu_idle' events of this session as one line each (monitor.py writes them)."""
    idle = [
        e for e in events if e.get("event") == "gpu_idle" and (e.get("step") or 0) >= session_step
    ]
    return tuple(
        f"rank {e.get('rank', '?')}: GPU at {e.get('util_pct', '?')}% for "
        f"{e.get('seconds', '?')} s (under {e.get('threshold_pct', '?')}%)"
        + (f" near step {e['step']}" if e.get("step") else "")
        + f": {e.get('advice', '')}"
        for e in idle[-limit:]
    )


def monitor_items(row: MetricsRow | None) -> list[tuple[str, str]]:
    """The device monitor's latest window per rank, for the numbers table (absent: no line)."""
    if row is None:
        return []

    def per_rank(values: list[Any] | None, fmt: Callable[[Any], str]) -> str | None:
        if not values or all(v is None for v in values):
            return None
        return ", ".join(f"rank {i}: {'–' if v is None else fmt(v)}" for i, v in enumerate(values))

    lines = [
        ("GPU utilisation", per_rank(row.gpu_util_pct_per_rank, lambda v: f"{v:.0f}%")),
        ("GPU memory used", per_rank(row.gpu_mem_used_bytes_per_rank, fmt_bytes)),
        ("GPU power", per_rank(row.gpu_power_w_per_rank, lambda v: f"{v:.0f} W")),
        ("GPU temperature", per_rank(row.gpu_temp_c_per_rank, lambda v: f"{v:.0f} °C")),
        ("process CPU", per_rank(row.cpu_pct_per_rank, lambda v: f"{v:.0f}%")),
        ("process RSS", per_rank(row.rss_bytes_per_rank, fmt_bytes)),
    ]
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
    for seconds, steps in _windows(
        train
    ):  # newest first, until what is older no longer moves the pace
        weight = math.exp(-age / horizon)
        if weight < 1e-3:
            break
        time_sum += weight * seconds
        step_sum += weight * steps
        age += seconds
    if step_sum == 0:
        return (
            first.step_time_s if first is not None else None
        )  # one window so far: the first, warm-up in it
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


def fmt_num(value: float | None, spec: str = ".4g") -> str:
    return "–" if value is None else format(value, spec)


def throughput_items(reading: Reading, average: float | None) -> list[tuple[str, str]]:
    """The latest window's samples/s (tokens/s) and step time, labelled with their window, the run's
    `average` samples/s beside them, as (label, value)."""
    last = reading.train_rows[-1] if reading.train_rows else None
    if last is None:
        return [("samples/s", "–")]
    n = window_steps(reading)
    window = f"last {n} step{'s' if n != 1 else ''}"
    window_rate = last.samples_per_s
    items = [
        (
            "samples/s",
            f"{fmt_num(window_rate, ',.0f')} ({window}) · {fmt_num(average, ',.0f')} (run average)",
        )
    ]
    if last.tokens_per_s is not None:
        tokens_avg = (
            average * last.tokens_per_s / window_rate
            if average is not None and window_rate
            else None
        )
        items.append(
            (
                "tokens/s",
                (
                    f"{fmt_num(last.tokens_per_s, ',.0f')} ({window}) · "
                    f"{fmt_num(tokens_avg, ',.0f')} (run average)"
                ),
            )
        )
    if last.step_time_s is not None:
        items.append(("step time", f"{1000 * last.step_time_s:.1f} ms ({window})"))
    return items


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
    elif (
        max_steps and step >= max_steps
    ):  # not 'ETA 0 s' while the final evaluation and checkpoint run
        tail = "finishing: the final evaluation and checkpoint…"
    elif reading.train_rows:
        tail = f"ETA {fmt_duration(eta_s(reading, max_steps, step))}"
    else:
        tail = "starting the ranks…"
    return f"step {step}{total}{pct} · {tail}"
