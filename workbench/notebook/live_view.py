"""What `wb.launch` shows in a notebook while it blocks: one compact line that follows the run (a
progress bar, the step, ETA, loss and step time), updated in place, that becomes the run's static
summary when it ends.

It is plain HTML updated through a display id, not a widget: it needs no widget state, so a notebook
saved by papermill or nbconvert keeps the final summary readable. The numbers are the dashboard's
(`Dashboard` reads the run directory without being shown; its figure is never drawn here).
"""

from __future__ import annotations

import html
import logging
import threading
from typing import Any

from workbench.notebook.reading import fmt_num
from workbench.rundir.run_files import STATUS_COLORS

log = logging.getLogger("workbench")


class LiveView:
    """Follows `run` (a Run or SlurmRun) in the cell's output until `close()`. `interval`: seconds
    between updates."""

    def __init__(self, run: Any, interval: float = 1.0) -> None:
        from IPython.display import HTML, display

        from workbench.notebook.dashboard import Dashboard

        self.interval = interval
        self.dashboard = Dashboard(run, interval=interval)
        self._html = HTML
        self._handle = display(HTML(self.html()), display_id=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._follow, name="workbench-live-view", daemon=True
        )
        self._thread.start()

    def html(self) -> str:
        """The line as the run directory stands."""
        d = self.dashboard
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
            "<div class='wb-live' "
            f"data-status='{html.escape(status)}'><b>{html.escape(d.run_dir.name)}</b> <span "
            f"style='color:{color}'>{html.escape(status)}</span> "
            f"{bar}{html.escape(' · '.join(parts))}</div>"
        )

    def show(self) -> None:
        """Read the run directory and update the line now."""
        self.dashboard.refresh(draw=False)
        self._handle.update(self._html(self.html()))

    def _follow(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.show()
            except Exception:  # a view must never break the launch it shows
                log.debug("the live view could not update", exc_info=True)

    def close(self) -> None:
        """Stop following and leave the final line: the run's ending as its directory records it."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.show()
        except Exception:
            log.warning("the live view could not show the run's ending", exc_info=True)
