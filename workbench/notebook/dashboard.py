"""A live view of a run, read from its run directory: progress with ETA, the latest numbers, and
figures.

The run directory is the only thing watched, so a dashboard works the same for runs launched from a
panel, from `wb.start(cfg)` or from the shell. A daemon thread polls it into the `reading` trait;
one observer re-derives every widget from the traits. The kernel stays free to run cells (widget
updates from a thread reach the browser without the kernel's help).

The ranks come first. On a small machine they use every core, and a synchronous step runs at the
pace of its slowest rank, so CPU the dashboard takes from one rank stalls them all. So the poll
reads only the rows appended since the last one, widgets are re-derived only when something changed,
the figure is redrawn in place only when new rows came and no more often than its CPU cost allows
(FIGURE_CPU_SHARE), and on Linux the polling thread runs at the lowest priority (nice 19), so it
takes the CPU the ranks leave rather than theirs.
"""

from __future__ import annotations

import base64
import html
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import traitlets

from workbench.notebook.breakdown_bars import breakdown_html
from workbench.notebook.reading import Reading, RowTail, lower_thread_priority, take_reading
from workbench.notebook.reading_view import ReadingView
from workbench.notebook.snapshot import dashboard_html, table
from workbench.rundir import RunDir, Status
from workbench.utils.kernel import in_kernel

log = logging.getLogger("workbench")

BAR_STYLES = {
    Status.COMPLETED: "success",
    Status.FAILED: "danger",
    Status.DIVERGED: "danger",
    Status.STOPPED: "warning",
    Status.PREEMPTED: "warning",
}
FIGURE_CPU_SHARE = 0.05
"""The live figure is redrawn at most this often: the CPU one redraw took, divided by this, must
pass before the next (and figure_interval at least). A redraw that had to wait for idle CPU waits
longer still: the interval runs from its end."""
LOSS_SCALES = {"auto": None, "linear": False, "log": True}
"""The loss axis toggle's choices and the log_loss value each stands for."""


class Dashboard(ReadingView, widgets.VBox):
    """Live progress, numbers and figures of the run in `run_dir` (a path, a Run or a RunResult).

    `start()` polls in a background thread until the run ends; `refresh()` does one poll by hand.
    Displayed, it is a live widget, with a static HTML snapshot in its display bundle for notebooks
    opened without a kernel; `show_final()` adds the final numbers and figure as a static output.
    What the numbers say (status, step, progress line, the numbers table) is ReadingView's.
    """

    log_loss = traitlets.Bool(
        None,
        allow_none=True,
        help="The loss axis: log (True), linear (False), or None: "
        "log once the loss spans a decade.",
    )
    show_error = traitlets.Bool(
        True, help="List the run's error with the numbers (off where a Panel shows it)."
    )
    final_shown = traitlets.Bool(
        False,
        help="show_final() displayed the figure as an output: the live view "
        "points there instead of showing it twice.",
    )
    reading = traitlets.Instance(
        Reading, args=(), help="What the latest poll of the run directory found."
    )

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | Any,
        *,
        interval: float = 1.0,
        figure_interval: float = 2.0,
        max_steps: int | None = None,
        log_loss: bool | None = None,
        show_error: bool = True,
    ) -> None:
        super().__init__(log_loss=log_loss, show_error=show_error)
        self.run_dir = Path(getattr(run_dir, "run_dir", run_dir))
        self.dir = RunDir(self.run_dir)
        self._tail = RowTail(self.dir.metrics_path)
        self.interval = interval
        self.figure_interval = max(interval, figure_interval)
        self._max_steps = max_steps
        self._png, self._drawn_key, self._next_figure_at, self._hold_figure = b"", None, 0.0, False
        self.figures_drawn = 0
        """Live figures rendered so far (each costs CPU the ranks could have used)."""
        # _lock guards the state; _figure_lock the figure, drawn without _lock (taken in that order,
        # never the other): a slow redraw by the low-priority poller then never keeps the kernel's
        # thread waiting for numbers.
        self._lock = threading.RLock()
        self._figure_lock = threading.Lock()
        self._stop, self._thread = threading.Event(), None
        # the LiveFigure, made at the first figure (matplotlib loads only then)
        self._live: Any = None
        self._figure: Any = None  # its matplotlib Figure
        self._build()
        self.observe(self._render, names=["reading", "log_loss", "show_error", "final_shown"])
        self.refresh()

    def _build(self) -> None:
        def html_box(css_class: str) -> widgets.HTML:
            box = widgets.HTML(layout=widgets.Layout(margin="0"))
            box.add_class(css_class)
            return box

        self.title, self.progress_text, self.stats, self.breakdown = (
            html_box(c)
            for c in ("wb-dash-title", "wb-progress-text", "wb-stats", "wb-breakdown-box")
        )
        self.placeholder = html_box("wb-figure-placeholder")
        self.progress = widgets.IntProgress(
            value=0,
            min=0,
            max=max(1, self._max_steps or 1),
            bar_style="info",
            layout=widgets.Layout(width="320px"),
        )
        self.progress.add_class("wb-progress")
        # Hidden until there is a figure: an empty Image shows the browser's broken-image icon.
        self.image = widgets.Image(
            format="png", layout=widgets.Layout(max_width="900px", display="none")
        )
        self.image.add_class("wb-figure")
        self.loss_scale = widgets.ToggleButtons(
            options=list(LOSS_SCALES),
            description="loss axis",
            tooltips=["log once the loss spans a decade", "linear", "log"],
            style={"button_width": "64px"},  # 'linear' whole
        )
        self.loss_scale.add_class("wb-loss-scale")
        by_value = {v: k for k, v in LOSS_SCALES.items()}
        # the link starts from the toggle: it must agree first
        self.loss_scale.value = by_value[self.log_loss]
        traitlets.link(
            (self.loss_scale, "value"),
            (self, "log_loss"),
            transform=(LOSS_SCALES.__getitem__, by_value.__getitem__),
        )
        self.children = [
            self.title,
            widgets.HBox([self.progress, self.progress_text]),
            self.stats,
            self.breakdown,
            self.loss_scale,
            self.placeholder,
            self.image,
        ]
        self.add_class("wb-dashboard")

    @property
    def widget(self) -> Dashboard:
        """The widget to put in a layout: the dashboard itself (kept for code that embeds
        `.widget`)."""
        return self

    # ---- reading the run directory (what it says: ReadingView) -----------------------------------
    def refresh(self, draw: bool = True, force_draw: bool = False) -> bool:
        """Read the run directory into `reading` (the observer updates the widgets); True once the
        run has ended.

        draw=False leaves the figure as it is; force_draw=True draws it now, whatever the cadence
        says.
        """
        with self._lock:
            reading = take_reading(self.dir, self._tail)
            # the observer re-derives the numbers; the figure follows, outside the lock
            self._hold_figure = True
            try:
                if reading != self.reading:
                    self.reading = reading
            finally:
                self._hold_figure = False
            ended = self.ended
        if draw:
            # also when nothing is new: a figure the cadence held back may be due
            self._show_figure(force_draw)
        return ended

    # ---- the one view of the state ---------------------------------------------------------------
    def _render(self, change: Any = None) -> None:
        with self._lock:
            max_steps = self.max_steps
            if max_steps:
                self.progress.max = max_steps
                self.progress.value = min(self.step, max_steps)
            self.progress.bar_style = BAR_STYLES.get(self.status, "info")
            self.title.value = (
                f"<b>{html.escape(self.run_dir.name)}</b> &nbsp; "
                f"<span class='wb-run-status'>{html.escape(self.status)}</span>"
            )
            self.progress_text.value = html.escape(self.progress_line())
            self.stats.value = table(self.stat_items(), "wb-stat-")
            self.breakdown.value = breakdown_html(self.last_train_row)
            hold = self._hold_figure
        if not hold:
            self._show_figure(change is not None and change["name"] == "log_loss")

    def _show_figure(self, force: bool) -> None:
        """Redraw the live figure when rows came since the last one and the cadence allows (or
        `force`)."""
        with self._lock:
            due = (
                bool(self.rows)
                and self._figure_key() != self._drawn_key
                and (force or self.ended or time.monotonic() >= self._next_figure_at)
            )
        if due:
            self.figure_png()
        with self._lock:
            if self._png and self._png != bytes(self.image.value):
                self.image.value = self._png
            live = bool(self._png) and not self.final_shown
            self.image.layout.display = None if live else "none"
            self.placeholder.layout.display = "none" if live else None
            self.placeholder.value = (
                "" if live else f"<i>{html.escape(self.placeholder_text())}</i>"
            )

    def _figure_key(self) -> tuple[int, int, bool | None]:
        rows = self.rows
        return len(rows), rows[-1].step if rows else 0, self.log_loss

    def placeholder_text(self) -> str:
        """What stands where the figure will be, while there is none to show."""
        if self.final_shown:
            return "the final figure is shown below the cell that waited for the run"
        if not self.train_rows:
            return "no step was logged" if self.ended else "waiting for the first logged step…"
        return "drawing the figure…"

    # ---- figures ---------------------------------------------------------------------------------
    def figure_png(self, wait: bool = True) -> bytes:
        """The figure of the rows read so far, as PNG bytes (empty before the first metrics row).
        wait=False: the figure as last drawn when another thread is drawing one now."""
        if not self._figure_lock.acquire(blocking=wait):
            return self._png
        try:
            with self._lock:
                rows, key, step = self.rows, self._figure_key(), self.step
                if not rows or (key == self._drawn_key and self._png):
                    return self._png if rows else b""
                s = self.summary
                label = f"x{s.get('world_size', '?')} {s.get('precision', '')}".strip()
            from workbench.notebook.plots import LiveFigure

            if self._live is None:
                self._live = LiveFigure()
                self._figure = self._live.figure
            cpu, builds = time.thread_time(), self._live.builds
            png = self._live.png(
                label, rows, title=self.run_dir.name, log_loss=key[2], drawn_at=step
            )
            # What a redraw costs paces the next; building the figure (and importing matplotlib) is
            # paid once.
            cost = time.thread_time() - cpu if self._live.builds == builds else 0.0
            with self._lock:
                self._png, self._drawn_key, self.figures_drawn = png, key, self.figures_drawn + 1
                self._next_figure_at = time.monotonic() + max(
                    self.figure_interval - 0.05, cost / FIGURE_CPU_SHARE
                )
            return png
        finally:
            self._figure_lock.release()

    def snapshot_html(self, *, show_error: bool = True, figure: bool = True) -> str:
        """The dashboard as static HTML: run, status, progress, numbers, breakdown and the latest
        figure (or why there is none); figure=False points to the output holding the final one.
        While the poller draws a new figure, the one before it: a snapshot never waits for a
        redraw."""
        png = self.figure_png(wait=not self.polling)
        shown: bytes | str = png or self.placeholder_text()
        if not figure:
            shown = "the final figure is in the output of the cell that waited for the run"
        return dashboard_html(
            self.run_dir.name,
            self.status,
            self.progress_line(),
            self.stat_items(show_error=show_error),
            breakdown_html(self.last_train_row),
            shown,
        )

    def show_final(self) -> None:
        """Show the final numbers and figure as a static output, so a saved or papermill-executed
        notebook keeps them; the live view then points to it instead of showing the figure twice."""
        if self.final_shown or not self.figure_png() or not in_kernel():
            return  # shown once: a second wait() must not add a second copy
        from IPython.display import display

        # One output, two forms of it: frontends render the HTML (numbers and figure) and fall back
        # to the PNG.
        display(
            {
                "text/html": self.snapshot_html(show_error=self.show_error),
                "text/plain": repr(self),
                "image/png": base64.b64encode(self.figure_png()).decode("ascii"),
            },
            raw=True,
        )
        self.final_shown = True

    # ---- polling ---------------------------------------------------------------------------------
    def start(self) -> Dashboard:
        """Poll the run directory every `interval` seconds in a daemon thread, until the run
        ends."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._poll, name=f"wb-dashboard-{self.run_dir.name}", daemon=True
            )
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
        lower_thread_priority()
        # matplotlib, loaded while the ranks start rather than train
        import workbench.notebook.plots  # noqa: F401

        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self.refresh():
                    break
            except Exception:  # noqa: BLE001  (a display glitch must never kill the watcher)
                log.exception("dashboard of %s: refresh failed", self.run_dir)
            # A steady beat: drawing the figure takes part of the interval, not extra time on top of
            # it.
            self._stop.wait(max(0.05, self.interval - (time.monotonic() - started)))

    # ---- display ---------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The live widget, plus a static snapshot for frontends without a kernel (papermill output,
        nbconvert)."""
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = self.snapshot_html(show_error=self.show_error)
        return bundle

    def __repr__(self) -> str:
        if not hasattr(self, "dir"):
            return "<workbench.Dashboard (being built)>"
        return f"<workbench.Dashboard {self.run_dir.name}: {self.status}, {self.progress_line()}>"
