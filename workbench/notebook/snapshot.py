"""Live numbers of a run read from its metrics rows, and static HTML snapshots of the panel and dashboard.

The numbers follow summary.json's definitions, so the dashboard and the summary never disagree about what
"samples/s" means. The snapshots are the `text/html` half of the widgets' display bundles: what a notebook
executed headless (papermill) and opened without a kernel shows instead of `VBox(children=...)`.
"""

from __future__ import annotations

import base64
import html
import re
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from workbench.notebook.breakdown_bars import breakdown_html
from workbench.utils.units import fmt_bytes

if TYPE_CHECKING:
    from workbench.notebook.dashboard import Dashboard
    from workbench.notebook.panel import Panel

ETA_WINDOWS = 5
"""The ETA uses the median step time of this many recent logged windows: one slow window (an eval, a
checkpoint, a neighbour's burst) doesn't swing it."""


@dataclass(frozen=True)
class Reading:
    """What one poll of a run directory found: the dashboard's state, compared by value."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    observed: tuple[str, str] = ("starting", "")
    session_step: int = 0
    """The step this session of the run started from (0, or the checkpoint a resume loaded)."""
    warnings: tuple[str, ...] = ()
    """Warning lines from events.jsonl for the numbers table (a GPU left idle)."""
    profiles: tuple[str, ...] = ()
    """Profile traces written so far (profile_steps), in rank order."""


def session_start(events: Sequence[dict[str, Any]]) -> int:
    """The step the latest session started at: its 'started' or 'resumed' event."""
    starts = [e for e in events if e.get("event") in ("started", "resumed")]
    return int(starts[-1].get("step") or 0) if starts else 0


def idle_warnings(events: Sequence[dict[str, Any]], session_step: int = 0, limit: int = 3) -> tuple[str, ...]:
    """The latest 'gpu_idle' events of this session as one line each (monitor.py writes them)."""
    idle = [e for e in events if e.get("event") == "gpu_idle" and (e.get("step") or 0) >= session_step]
    return tuple(f"rank {e.get('rank', '?')}: GPU at {e.get('util_pct', '?')}% for {e.get('seconds', '?')} s "
                 f"(under {e.get('threshold_pct', '?')}%)" + (f" near step {e['step']}" if e.get("step") else "")
                 + f": {e.get('advice', '')}" for e in idle[-limit:])


def monitor_items(row: dict[str, Any]) -> list[tuple[str, str]]:
    """The device monitor's latest window per rank, for the numbers table (absent fields: no line)."""
    def per_rank(key: str, fmt: Any) -> str | None:
        values = row.get(key)
        if not isinstance(values, list) or all(v is None for v in values):
            return None
        return ", ".join(f"rank {i}: {'–' if v is None else fmt(v)}" for i, v in enumerate(values))

    lines = [("GPU utilisation", per_rank("gpu_util_pct_per_rank", lambda v: f"{v:.0f}%")),
             ("GPU memory used", per_rank("gpu_mem_used_bytes_per_rank", fmt_bytes)),
             ("GPU power", per_rank("gpu_power_w_per_rank", lambda v: f"{v:.0f} W")),
             ("GPU temperature", per_rank("gpu_temp_c_per_rank", lambda v: f"{v:.0f} °C")),
             ("process CPU", per_rank("cpu_pct_per_rank", lambda v: f"{v:.0f}%")),
             ("process RSS", per_rank("rss_bytes_per_rank", fmt_bytes))]
    return [(label, text) for label, text in lines if text is not None]


def global_batch(summary: dict[str, Any], row: dict[str, Any]) -> float | None:
    if summary.get("global_batch_size"):
        return float(summary["global_batch_size"])
    if row.get("samples_per_s") and row.get("step_time_s"):
        return round(row["samples_per_s"] * row["step_time_s"])  # the row's own definition, undone
    return None


def run_average(reading: Reading, ended: bool) -> float | None:
    """samples/s over this session, as summary.json defines it: samples trained / time in training steps
    (eval and checkpoints included). Once the run has ended, the summary's own figure.

    A row's `elapsed_s` is taken before its own step's time is added, so a row at step k times the steps
    before it: the average is over those, not over k steps in the time of k-1.
    """
    if ended and reading.summary.get("samples_per_s") is not None:
        return float(reading.summary["samples_per_s"])
    rows = [r for r in reading.rows if r.get("loss") is not None and r.get("step", 0) > reading.session_step
            and r.get("elapsed_s") is not None]
    if not rows:
        return None
    last, s0 = rows[-1], reading.session_step
    at_start = [r for r in reading.rows if r.get("step") == s0 and r.get("elapsed_s") is not None]
    if s0 == 0:
        start_step, start_time = 1, 0.0
    elif at_start:  # a resumed session: the checkpoint's training time is the row's at that step
        start_step, start_time = s0 + 1, at_start[0]["elapsed_s"]
    else:
        start_step, start_time = rows[0]["step"], rows[0]["elapsed_s"]
    batch, seconds = global_batch(reading.summary, last), last["elapsed_s"] - start_time
    steps = last["step"] - start_step
    if batch is None or steps <= 0 or seconds <= 0:
        return None
    return steps * batch / seconds


def window_steps(reading: Reading) -> int | None:
    """How many steps the latest row's window (its samples/s and step time) covers."""
    rows = [r for r in reading.rows if r.get("loss") is not None]
    if not rows:
        return None
    previous = [r["step"] for r in rows[:-1] if r["step"] >= reading.session_step]
    return rows[-1]["step"] - (previous[-1] if previous else reading.session_step)


def smoothed_step_time(reading: Reading) -> float | None:
    """Median seconds per step over the last few windows, eval and checkpoints included."""
    rows = [r for r in reading.rows if r.get("loss") is not None and r.get("step", 0) > reading.session_step]
    times: list[float] = []
    for before, row in zip(rows, rows[1:]):
        if row.get("elapsed_s") is not None and before.get("elapsed_s") is not None:
            times.append((row["elapsed_s"] - before["elapsed_s"]) / (row["step"] - before["step"]))
        elif row.get("step_time_s") is not None:
            times.append(row["step_time_s"])
    if not times and rows and rows[0].get("step_time_s") is not None:
        times.append(rows[0]["step_time_s"])  # one window so far: the first, warm-up included
    return statistics.median(times[-ETA_WINDOWS:]) if times else None


# ---- static HTML -----------------------------------------------------------------------------------------
def img_tag(png: bytes, css_class: str = "wb-snapshot-figure") -> str:
    data = base64.b64encode(png).decode("ascii")
    return f"<img class='{css_class}' style='max-width:900px' src='data:image/png;base64,{data}'>"


def table(items: Sequence[tuple[str, str]], css_prefix: str) -> str:
    """Label/value rows; each value cell gets a class from its label, for tests and CSS."""
    def css(label: str) -> str:
        return css_prefix + re.sub("[^a-z0-9]+", "-", label.lower()).strip("-")

    # Left-aligned by hand: a notebook's own table style (right-aligned, striped) would scatter the values.
    cells = "".join(f"<tr><td style='text-align:left;padding-right:1em;color:#666'>{html.escape(k)}</td>"
                    f"<td style='text-align:left' class='{css(k)}'>{html.escape(v)}</td></tr>" for k, v in items)
    return f"<table style='font-family:monospace'>{cells}</table>"


def dashboard_html(dash: Dashboard, *, show_error: bool = True, figure: bool = True) -> str:
    """The dashboard as it stands: run, status, progress, numbers and the latest figure (or why none yet)."""
    png = dash.figure_png()
    if not figure:
        figure_html = "<p><i>the final figure is in the output of the cell that waited for the run</i></p>"
    else:
        figure_html = img_tag(png) if png else f"<p><i>{html.escape(dash.placeholder_text())}</i></p>"
    return (f"<div class='wb-snapshot wb-snapshot-dashboard'>"
            f"<div><b>{html.escape(dash.run_dir.name)}</b> &nbsp; {html.escape(dash.status)}</div>"
            f"<div>{html.escape(dash.progress_line())}</div>"
            f"{table(dash.stat_items(show_error=show_error), 'wb-snapshot-stat-')}"
            f"{breakdown_html(dash.train_rows[-1] if dash.train_rows else None)}{figure_html}</div>")


def panel_html(panel: Panel) -> str:
    """The panel as it stands: the settings, what they imply, its status and error, and the run's dashboard."""
    settings = [(name.replace("_", " "), "" if control.value is None else str(control.value))
                for name, control in panel.controls.items()]
    parts = ["<div class='wb-snapshot wb-snapshot-panel'><h3 style='margin:0.2em 0'>workbench: run settings</h3>",
             table(settings, "wb-snapshot-setting-"),
             f"<div>{panel.batch_info.value}</div><div>{panel.launch_info.value}</div>",
             f"<div>{panel.problem_box.value}</div><div>{panel.status_box.value}</div>",
             f"<div>{panel.error_box.value}</div>"]
    if panel.dashboard is not None:
        # The panel shows the error above, and wait() the final figure: copies here would repeat them.
        parts.append(dashboard_html(panel.dashboard, show_error=False, figure=not panel.dashboard.final_shown))
    parts.append("</div>")
    return "".join(parts)
