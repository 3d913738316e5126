"""What a launch shows in a notebook from the moment it is called: one compact line that says which
phase the launch is in (checking, preparing data, starting N processes, waiting for the cluster)
and for how long, then follows the run (a progress bar, the step, ETA, loss and step time), updated
in place, and becomes the run's static summary when it ends.

`LiveView` is plain HTML updated through a display id, not a widget: it needs no widget state, so
a notebook saved by papermill or nbconvert keeps the final summary readable. `PanelLine` is the
same line as a widget, for the panel, where it stands above the run's dashboard until the ranks
report. The numbers are the dashboard's (`ReadingView`, read from the run directory without any
widget or figure).
"""

from __future__ import annotations

import html
import logging
import threading
import time
from pathlib import Path
from typing import Any

from workbench.launcher.phases import LaunchPhases
from workbench.notebook.reading import Reading, RowTail, fmt_num, take_reading
from workbench.notebook.reading_view import ReadingView
from workbench.rundir import RunDir
from workbench.rundir.run_files import STATUS_COLORS

log = logging.getLogger("workbench")

JOB_POLL_S = 2.0
"""Seconds between asking a cluster run's scheduler for its job (its phase while it waits)."""
NOT_LAUNCHED_COLOR = "#b00020"


class RunReading(ReadingView):
    """The run directory of `run_dir` as the dashboard reads it, without widgets: `refresh()`
    takes a new reading (only the metrics rows appended since the last one are parsed)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.dir = RunDir(self.run_dir)
        self._tail = RowTail(self.dir.metrics_path)
        self._max_steps: int | None = None
        self.show_error = True
        self.reading = Reading()

    def refresh(self) -> None:
        self.reading = take_reading(self.dir, self._tail)

    @property
    def reported(self) -> bool:
        """The ranks have reported: the run trains (or ended), so the training line takes over."""
        return self.status != "starting" or bool(self.train_rows)


def training_html(d: RunReading) -> str:
    """The line as the run directory stands: status, progress, loss and step time; once ended,
    the final eval and the run's samples/s."""
    status = d.status
    color = STATUS_COLORS.get(status, "#555")
    max_steps = d.max_steps or 0
    bar = (
        (
            f"<progress value='{min(d.step, max_steps)}' max='{max_steps}' style='width:10em;"
            "vertical-align:middle'></progress> "
        )
        if max_steps
        else ""
    )
    last = d.last_train_row
    parts = [d.progress_line()]
    if last is not None:
        parts.append(f"loss {fmt_num(last.loss)}")
        if last.step_time_s is not None:
            parts.append(f"{1000 * last.step_time_s:.1f} ms/step")
    if d.ended:
        evals = d.eval_rows
        if evals:
            last_eval = {"loss": evals[-1].eval_loss, **evals[-1].eval}
            parts += [
                f"eval {k.removeprefix('eval_').replace('_', ' ')} {fmt_num(v)}"
                for k, v in last_eval.items()
                if v is not None
            ]
        if d.run_average is not None:
            parts.append(f"{d.run_average:,.0f} samples/s")
    return (
        "<div class='wb-live wb-live-line' "
        f"data-status='{html.escape(status)}'><b>{html.escape(d.run_dir.name)}</b> <span "
        f"style='color:{color}'>{html.escape(status)}</span> "
        f"{bar}{html.escape(' · '.join(parts))}</div>"
    )


def phase_html(label: str, phases: LaunchPhases, error: BaseException | None = None) -> str:
    """The line while the launch is in a phase ('checking · 0.4 s'), or, when it raised `error`
    before any rank started, that it was not launched and in which phase."""
    head = f"<b>{html.escape(label)}</b> "
    if error is not None:
        return (
            f"<div class='wb-live wb-live-line' data-status='not-launched' "
            f"data-phase='{html.escape(phases.name)}'>{head}<span "
            f"style='color:{NOT_LAUNCHED_COLOR}'>not launched</span> "
            f"{html.escape(f'{type(error).__name__} while {phases.text()}')}</div>"
        )
    return (
        f"<div class='wb-live wb-live-line' data-status='starting' "
        f"data-phase='{html.escape(phases.name)}'>{head}<span class='wb-live-phase' "
        f"style='color:{STATUS_COLORS['starting']}'>{html.escape(phases.text())}</span></div>"
    )


class LiveLine:
    """The line and the thread that keeps it current: the phases of the launch until its ranks
    report, then the run as its directory stands. The thread wakes at each phase change and every
    `interval` seconds (the elapsed time moves), at the lowest CPU priority; `_put` shows a new
    content (a subclass's display)."""

    def __init__(
        self, phases: LaunchPhases | None, label: str, interval: float, ends_with_run: bool
    ) -> None:
        self.phases, self.label, self.interval = phases, label, interval
        self.run: Any = None
        self.reading: RunReading | None = None
        self.error: BaseException | None = None
        self._ends_with_run = ends_with_run
        self._trains = phases is None
        """The training line has taken over (for good: a restart's 'starting' doesn't go back)."""
        self._asked_job_at = 0.0
        self._stop, self._wake = threading.Event(), threading.Event()
        self._shown = ""
        self._put_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if phases is not None:
            phases.listen(lambda _: self._wake.set())

    def _begin(self) -> None:
        self._thread = threading.Thread(
            target=self._follow, name="workbench-live-view", daemon=True
        )
        self._thread.start()

    def follow(self, run: Any) -> None:
        """The launch returned `run` (a Run or SlurmRun): the line follows its run directory."""
        self.reading = RunReading(run.run_dir)
        self.label = run.run_dir.name
        self.run = run
        self._wake.set()

    def html(self) -> str:
        """The line as things stand (reads nothing: `show()` reads the run directory)."""
        if self.error is not None and self.phases is not None:
            return phase_html(self.label, self.phases, self.error)
        if self._trains and self.reading is not None:
            return training_html(self.reading)
        assert self.phases is not None  # no phases: the training line from the start
        return phase_html(self.label, self.phases)

    def show(self) -> None:
        """Read the run directory (once there is a run) and update the line now."""
        if self.reading is not None:
            self.reading.refresh()
            if not self._trains:
                self._ask_the_cluster()
                self._trains = self.reading.reported
        self._show_html()

    def _show_html(self) -> None:
        with self._put_lock:  # one writer at a time, in order
            shown = self.html()
            if shown != self._shown:
                self._put(shown)
                self._shown = shown

    def _put(self, content: str) -> None:
        raise NotImplementedError

    def _ask_the_cluster(self) -> None:
        """A cluster run whose ranks haven't reported: its job's phase (queued, starting), asked
        of the scheduler every JOB_POLL_S."""
        phase_of = getattr(self.run, "launch_phase", None)
        if phase_of is None or self.phases is None:
            return
        if time.monotonic() - self._asked_job_at >= JOB_POLL_S:
            self._asked_job_at = time.monotonic()
            self.phases.enter(*phase_of())

    def _follow(self) -> None:
        from workbench.notebook.reading import lower_thread_priority

        lower_thread_priority()  # the ranks' CPU first
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.show()
            except Exception:  # a view must never break the launch it shows
                log.debug("the live view could not update", exc_info=True)
            if self._ends_with_run and self.reading is not None and self.reading.ended:
                break

    def close(self, error: BaseException | None = None) -> None:
        """Stop following and leave the final line: the run's ending as its directory records it,
        or (`error`: the launch raised before it returned a run) that it was not launched."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if error is not None and self.reading is None:
            self.error = error
        self._trains = self._trains or self.reading is not None
        try:
            self.show()
        except Exception:
            log.warning("the live view could not show the run's ending", exc_info=True)


class LiveView(LiveLine):
    """The line in the cell's output: shown at once, then kept current until `close()` (or, with
    `ends_with_run`, until the run ends). `run`: a launched run to follow from the start (no
    phases); `phases`: a launch in progress, followed (`follow(run)`) once it returns its run.
    `interval`: seconds between updates."""

    def __init__(
        self,
        run: Any = None,
        interval: float = 1.0,
        *,
        phases: LaunchPhases | None = None,
        label: str = "",
        ends_with_run: bool = False,
    ) -> None:
        from IPython.display import HTML, display

        super().__init__(phases, label, interval, ends_with_run)
        self._html = HTML
        if run is not None:
            self.reading = RunReading(run.run_dir)
            self.run = run
            self.reading.refresh()
            self._trains = self._trains or self.reading.reported
        self._shown = self.html()
        self._handle = display(HTML(self._shown), display_id=True)
        self._begin()

    def _put(self, content: str) -> None:
        self._handle.update(self._html(content))


class PanelLine(LiveLine):
    """The launch's line as a widget (`widget`, CSS class wb-panel-line, holding the cell's
    div.wb-live-line) for the panel: the phases
    until the ranks report, then it hides and stops (the run's dashboard below it takes over)."""

    def __init__(self, phases: LaunchPhases, label: str, interval: float = 1.0) -> None:
        import ipywidgets as widgets

        super().__init__(phases, label, interval, ends_with_run=True)
        self.widget = widgets.HTML(self.html(), layout=widgets.Layout(margin="0"))
        # the line inside it is the cell's (div.wb-live-line): one selector finds either
        self.widget.add_class("wb-panel-line")
        self._shown = self.widget.value
        self._begin()

    def _put(self, content: str) -> None:
        self.widget.value = content

    def show(self) -> None:
        super().show()
        if self._trains and self.error is None:
            self.widget.layout.display = "none"
            self._stop.set()
