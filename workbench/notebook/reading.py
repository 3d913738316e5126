"""Live numbers of a run, read from its run directory: what one poll found (`Reading`, taken by
`take_reading`), and the lines derived from the run's events (torch.compile, an idle GPU).

`RowTail` reads metrics.jsonl a poll at a time, parsing only what was appended: a poll of a long run
costs what its new rows cost, not the whole file; its first poll of a long run reads the newest rows
and an even sample of the ones before (what the figure draws), so the first view costs what it
shows. What the dashboard derives from a Reading is in pace.py (throughput over the session, the
window a row covers, ETA) and reading_view.py (the numbers table).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from workbench.rundir.metrics_row import MetricsRow
from workbench.utils.jsonl import count_lines, sample_jsonl, sample_lines

if TYPE_CHECKING:
    from workbench.rundir import RunDir

log = logging.getLogger("workbench")


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
                    self._start_over((st.st_dev, st.st_ino))
                if st.st_size == self._offset:
                    return self._rows
                if self._offset == 0:
                    return self._first_read(f)
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            self._start_over(None)
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

    def _start_over(self, file_id: tuple[int, int] | None) -> None:
        """Forget the rows read: the file is a new one, shorter than what was read, or gone."""
        self._rows, self._offset, self._lines, self.sampled = [], 0, 0, False
        self._file_id = file_id

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
    from workbench.training.compiling import compile_line

    mine = {
        e.get("event"): e
        for e in events
        if e.get("event") in ("compiling", "compiled", "compile_report")
        and (e.get("step") or 0) >= session_step
    }
    if "compile_report" in mine:
        return compile_line(mine["compile_report"])
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
    """The latest 'gpu_idle' events of this session as one line each (training/observe/monitor.py
    writes them)."""
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


def take_reading(run_dir: RunDir, tail: RowTail) -> Reading:
    """What `run_dir` shows now: the rows `tail` (of its metrics.jsonl) has read so far, the
    summary, the observed status, and this session's start, warnings, compile line and profile
    traces."""
    events = run_dir.events()
    session_step = session_start(events)
    return Reading(
        rows=tail.read(),
        summary=run_dir.summary().to_dict(),
        observed=tuple(str(x) for x in run_dir.observed_status()),
        session_step=session_step,
        warnings=idle_warnings(events, session_step),
        compile=compile_line(events, session_step),
        profiles=tuple(str(p) for p in run_dir.profile_traces()),
    )


def fmt_num(value: float | None, spec: str = ".4g") -> str:
    return "–" if value is None else format(value, spec)
