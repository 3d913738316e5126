"""A live view of a run, read from its run directory: progress with ETA, the latest numbers, and figures.

The run directory is the only thing watched, so a dashboard works the same for runs launched from a panel,
from `wb.start(cfg)` or from the shell. A daemon thread polls it into the `reading` trait; one observer
re-derives every widget from the traits. The kernel stays free to run cells (widget updates from a thread
reach the browser without the kernel's help).
"""

from __future__ import annotations

import base64
import html
import io
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import traitlets

from workbench.notebook.breakdown_bars import breakdown_html
from workbench.notebook.reading import (
    Reading,
    eta_s,
    idle_warnings,
    monitor_items,
    run_average,
    session_start,
    window_steps,
)
from workbench.notebook.snapshot import dashboard_html, table
from workbench.rundir import ENDED, MetricsRow, RunDir, Status
from workbench.utils.kernel import in_kernel
from workbench.utils.units import fmt_bytes, fmt_duration

log = logging.getLogger("workbench")

BAR_STYLES = {Status.COMPLETED: "success", Status.FAILED: "danger", Status.DIVERGED: "danger",
              Status.STOPPED: "warning", Status.PREEMPTED: "warning"}


def _num(value: float | None, spec: str = ".4g") -> str:
    return "–" if value is None else format(value, spec)


class Dashboard(widgets.VBox):
    """Live progress, numbers and figures of the run in `run_dir` (a path, a Run or a RunResult).

    `start()` polls in a background thread until the run ends; `refresh()` does one poll by hand.
    Displayed, it is a live widget, with a static HTML snapshot in its display bundle for notebooks opened
    without a kernel; `show_final()` adds the final numbers and figure as a static output.
    """

    log_loss = traitlets.Bool(False, help="Draw the loss on a log scale.")
    show_error = traitlets.Bool(True, help="List the run's error with the numbers (off where a Panel shows it).")
    final_shown = traitlets.Bool(False, help="show_final() displayed the figure as an output: the live view "
                                             "points there instead of showing it twice.")
    reading = traitlets.Instance(Reading, args=(), help="What the latest poll of the run directory found.")

    def __init__(self, run_dir: str | os.PathLike[str] | Any, *, interval: float = 1.0,
                 figure_interval: float = 2.0, max_steps: int | None = None, log_loss: bool = False,
                 show_error: bool = True) -> None:
        super().__init__(log_loss=log_loss, show_error=show_error)
        self.run_dir = Path(getattr(run_dir, "run_dir", run_dir))
        self.dir = RunDir(self.run_dir)
        self.interval = interval
        # Rendering the figure costs a few tenths of a second of CPU that the ranks would rather have.
        self.figure_interval = max(interval, figure_interval)
        self._max_steps = max_steps
        self._png = b""
        self._drawn_key: tuple[int, bool] | None = None
        self._drawn_at = 0.0
        self._force_figure = self._hold_figure = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._figure: Any = None
        self._build()
        self.observe(self._render, names=["reading", "log_loss", "show_error", "final_shown"])
        self.refresh()

    def _build(self) -> None:
        def html_box(css_class: str) -> widgets.HTML:
            box = widgets.HTML(layout=widgets.Layout(margin="0"))
            box.add_class(css_class)
            return box

        self.title, self.progress_text, self.stats, self.breakdown = (
            html_box(c) for c in ("wb-dash-title", "wb-progress-text", "wb-stats", "wb-breakdown-box"))
        self.placeholder = html_box("wb-figure-placeholder")
        self.progress = widgets.IntProgress(value=0, min=0, max=max(1, self._max_steps or 1), bar_style="info",
                                            layout=widgets.Layout(width="320px"))
        self.progress.add_class("wb-progress")
        # Hidden until there is a figure: an empty Image shows the browser's broken-image icon.
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="900px", display="none"))
        self.image.add_class("wb-figure")
        self.children = [self.title, widgets.HBox([self.progress, self.progress_text]), self.stats,
                         self.breakdown, self.placeholder, self.image]
        self.add_class("wb-dashboard")

    @property
    def widget(self) -> Dashboard:
        """The widget to put in a layout: the dashboard itself (kept for code that embeds `.widget`)."""
        return self

    # ---- reading the run directory ------------------------------------------------------------------
    @property
    def max_steps(self) -> int | None:
        if self._max_steps is None:
            try:
                cfg = self.dir.config()
            except (OSError, ValueError):
                return None  # half written, or not a RunConfig: ask again next poll
            if cfg is None:
                return None  # not written yet
            self._max_steps = cfg.max_steps
        return self._max_steps

    @property
    def rows(self) -> list[MetricsRow]:
        return self.reading.rows

    @property
    def summary(self) -> dict[str, Any]:
        return self.reading.summary

    @property
    def status(self) -> str:
        """The run's status; 'failed' once a run that says it runs has lost all its processes."""
        return str(self.reading.observed[0])

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def train_rows(self) -> list[MetricsRow]:
        return self.reading.train_rows

    @property
    def eval_rows(self) -> list[MetricsRow]:
        return self.reading.eval_rows

    @property
    def last_train_row(self) -> MetricsRow | None:
        train = self.train_rows
        return train[-1] if train else None

    @property
    def step(self) -> int:
        """The latest step the run directory reports."""
        last = self.last_train_row
        step = int(self.summary.get("steps") or 0) if self.ended else 0
        return max(step, last.step if last else 0)

    @property
    def run_average(self) -> float | None:
        """samples/s over this session of the run, as summary.json's samples_per_s defines it."""
        return run_average(self.reading, self.ended)

    def refresh(self, draw: bool = True, force_draw: bool = False) -> bool:
        """Read the run directory into `reading` (the observer updates the widgets); True once the run has ended.

        draw=False leaves the figure as it is; force_draw=True draws it now, whatever figure_interval says.
        """
        with self._lock:
            events = self.dir.events()
            session_step = session_start(events)
            reading = Reading(rows=self.dir.metrics_rows(), summary=self.dir.summary().to_dict(),
                              observed=tuple(str(x) for x in self.dir.observed_status()),
                              session_step=session_step, warnings=idle_warnings(events, session_step),
                              profiles=tuple(str(p) for p in self.dir.profile_traces()))
            self._force_figure = force_draw
            self._hold_figure = not draw
            try:
                if reading != self.reading:
                    self.reading = reading
                else:
                    self._render()  # nothing new, but a figure held back by figure_interval may be due
            finally:
                self._force_figure = self._hold_figure = False
            return self.ended

    # ---- the one view of the state ------------------------------------------------------------------
    def _render(self, change: Any = None) -> None:
        with self._lock:
            max_steps = self.max_steps
            if max_steps:
                self.progress.max = max_steps
                self.progress.value = min(self.step, max_steps)
            self.progress.bar_style = BAR_STYLES.get(self.status, "info")
            self.title.value = (f"<b>{html.escape(self.run_dir.name)}</b> &nbsp; "
                                f"<span class='wb-run-status'>{html.escape(self.status)}</span>")
            self.progress_text.value = html.escape(self.progress_line())
            self.stats.value = table(self.stat_items(), "wb-stat-")
            self.breakdown.value = breakdown_html(self.last_train_row)
            redraw = self._force_figure or (change is not None and change["name"] == "log_loss")
            if self.rows and not self._hold_figure and (redraw or self._figure_due()):
                png = self.figure_png()
                if png != bytes(self.image.value):
                    self.image.value = png
            live = bool(self._png) and not self.final_shown
            self.image.layout.display = None if live else "none"
            self.placeholder.layout.display = "none" if live else None
            self.placeholder.value = "" if live else f"<i>{html.escape(self.placeholder_text())}</i>"

    def _figure_due(self) -> bool:
        if self._drawn_key == (len(self.rows), self.log_loss):
            return False
        return self.ended or time.monotonic() - self._drawn_at >= self.figure_interval - 0.05

    def placeholder_text(self) -> str:
        """What stands where the figure will be, while there is none to show."""
        if self.final_shown:
            return "the final figure is shown below the cell that waited for the run"
        if not self.train_rows:
            return "no step was logged" if self.ended else "waiting for the first logged step…"
        return "drawing the figure…"

    def progress_line(self) -> str:
        max_steps, step = self.max_steps, self.step
        total = f"/{max_steps}" if max_steps else ""
        pct = f" ({100 * step / max_steps:.0f}%)" if max_steps else ""
        if self.ended:
            wall = self.summary.get("wall_time_s")
            tail = self.status + (f" in {fmt_duration(wall)}" if wall else "")
        elif self.train_rows:
            tail = f"ETA {fmt_duration(eta_s(self.reading, max_steps, step))}"
        else:
            tail = "starting the ranks…"
        return f"step {step}{total}{pct} · {tail}"

    def stat_items(self, show_error: bool | None = None) -> list[tuple[str, str]]:
        """The numbers as (label, value): loss, eval, throughput (window and run average), memory, lr, the device
        monitor's latest window, warnings (idle GPUs), profile traces, error."""
        last, evals = self.last_train_row, self.eval_rows
        items: list[tuple[str, str]] = [("loss", _num(last.loss if last else None))]
        if evals:
            last_eval = evals[-1]
            items.append(("eval loss", f"{_num(last_eval.eval_loss)} (step {last_eval.step})"))
            items += [(key.replace("_", " "), _num(value)) for key, value in last_eval.eval.items()]
        items += self._throughput_items(last)
        per_rank = (last.peak_memory_bytes_per_rank if last else None) or []
        if per_rank:
            items.append(("peak memory", ", ".join(f"rank {i}: {fmt_bytes(b)}"
                                                   for i, b in enumerate(per_rank))))
        elif last and last.peak_memory_bytes is not None:
            items.append(("peak memory", f"{fmt_bytes(last.peak_memory_bytes)} (max over ranks)"))
        items.append(("learning rate", _num(last.lr if last else None, ".3g")))
        items += monitor_items(last)
        items += [("warning", line) for line in self.reading.warnings]
        if self.reading.profiles:
            items.append(("profile", ", ".join(self.reading.profiles) + " (Chrome traces: open in ui.perfetto.dev "
                                                                        "or chrome://tracing)"))
        if (self.show_error if show_error is None else show_error):
            items += self._ending_items()
        return items

    def _throughput_items(self, last: MetricsRow | None) -> list[tuple[str, str]]:
        """The last window's figures labelled with their window, the run average beside them."""
        if last is None:
            return [("samples/s", "–")]
        n = window_steps(self.reading)
        window = f"last {n} step{'s' if n != 1 else ''}"
        avg, window_rate = self.run_average, last.samples_per_s
        items = [("samples/s", f"{_num(window_rate, ',.0f')} ({window}) · {_num(avg, ',.0f')} (run average)")]
        if last.tokens_per_s is not None:
            tokens_avg = (avg * last.tokens_per_s / window_rate
                          if avg is not None and window_rate else None)
            items.append(("tokens/s", f"{_num(last.tokens_per_s, ',.0f')} ({window}) · "
                                      f"{_num(tokens_avg, ',.0f')} (run average)"))
        if last.step_time_s is not None:
            items.append(("step time", f"{1000 * last.step_time_s:.1f} ms ({window})"))
        return items

    def _ending_items(self) -> list[tuple[str, str]]:
        if self.status == Status.FAILED:
            error = self.summary.get("error") or {"type": "Lost", "message": self.reading.observed[1]}
            where = f"rank {error['rank']}" if error.get("rank") is not None else "the launcher"
            return [("error", f"{where}: {error.get('type', 'Error')}: {error.get('message', '')}")]
        if (self.summary.get("ending") or {}).get("message"):
            return [("ending", self.summary["ending"]["message"])]
        return []

    # ---- figures ------------------------------------------------------------------------------------
    def figure_png(self) -> bytes:
        """The figure of the rows read so far, as PNG bytes (empty before the first metrics row)."""
        with self._lock:
            rows = self.rows
            if not rows:
                return b""
            key = (len(rows), self.log_loss)
            if key == self._drawn_key and self._png:
                return self._png
            from matplotlib.figure import Figure

            from workbench.notebook.plots import draw, monitor_kind

            started = time.monotonic()
            if self._figure is None:
                self._figure = Figure(figsize=(9, 5.5), dpi=80)
            self._figure.set_size_inches(9, 8 if monitor_kind(rows) else 5.5)  # a third row: the device monitor
            s = self.summary
            label = f"x{s.get('world_size', '?')} {s.get('precision', '')}".strip()
            draw(self._figure, [(label, rows)], title=self.run_dir.name, log_loss=self.log_loss,
                 drawn_at=self.step)
            buf = io.BytesIO()
            self._figure.savefig(buf, format="png")
            self._png, self._drawn_key, self._drawn_at = buf.getvalue(), key, started
            return self._png

    def snapshot_html(self, *, show_error: bool = True, figure: bool = True) -> str:
        """The dashboard as static HTML: run, status, progress, numbers, breakdown and the latest
        figure (or why there is none); figure=False points to the output holding the final one."""
        png = self.figure_png()
        shown: bytes | str = png or self.placeholder_text()
        if not figure:
            shown = "the final figure is in the output of the cell that waited for the run"
        return dashboard_html(self.run_dir.name, self.status, self.progress_line(),
                              self.stat_items(show_error=show_error),
                              breakdown_html(self.last_train_row), shown)

    def show_final(self) -> None:
        """Show the final numbers and figure as a static output, so a saved or papermill-executed notebook
        keeps them; the live view then points to it instead of showing the figure twice."""
        if self.final_shown or not self.figure_png() or not in_kernel():
            return  # shown once: a second wait() must not add a second copy
        from IPython.display import display

        # One output, two forms of it: frontends render the HTML (numbers and figure) and fall back to the PNG.
        display({"text/html": self.snapshot_html(show_error=self.show_error),
                 "text/plain": repr(self),
                 "image/png": base64.b64encode(self.figure_png()).decode("ascii")}, raw=True)
        self.final_shown = True

    # ---- polling ------------------------------------------------------------------------------------
    def start(self) -> Dashboard:
        """Poll the run directory every `interval` seconds in a daemon thread, until the run ends."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, name=f"wb-dashboard-{self.run_dir.name}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop polling, then read the run directory one last time (final numbers and figure)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.refresh(force_draw=True)

    @property
    def polling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _poll(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self.refresh():
                    break
            except Exception:  # noqa: BLE001  (a display glitch must never kill the watcher)
                log.exception("dashboard of %s: refresh failed", self.run_dir)
            # A steady beat: drawing the figure takes part of the interval, not extra time on top of it.
            self._stop.wait(max(0.05, self.interval - (time.monotonic() - started)))

    # ---- display ------------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The live widget, plus a static snapshot for frontends without a kernel (papermill output, nbconvert)."""
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = self.snapshot_html(show_error=self.show_error)
        return bundle

    def __repr__(self) -> str:
        if not hasattr(self, "dir"):
            return "<workbench.Dashboard (being built)>"
        return f"<workbench.Dashboard {self.run_dir.name}: {self.status}, {self.progress_line()}>"

