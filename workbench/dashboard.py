"""A live view of a run, read from its run directory: progress with ETA, the latest numbers, and figures.

The run directory is the only thing watched, so a dashboard works the same for runs launched from a panel,
from `wb.launch(cfg, wait=False)` or from the shell. A daemon thread polls it and updates widgets; the
kernel stays free to run cells (widget updates from a thread reach the browser without the kernel's help).
"""

from __future__ import annotations

import html
import io
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from .kernel import in_kernel
from .rundir import ENDED, RunDir, Status
from .units import fmt_bytes, fmt_duration

log = logging.getLogger("workbench")

def _num(value: float | None, spec: str = ".4g") -> str:
    return "–" if value is None else format(value, spec)


class Dashboard:
    """Live progress, numbers and figures of the run in `run_dir` (a path, a Run or a RunResult).

    `start()` polls in a background thread until the run ends; `refresh()` does one poll by hand.
    Displaying the dashboard shows its widgets; `show_final()` adds the figure as a static image, which
    is what a notebook executed headless (papermill) keeps.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | Any, *, interval: float = 1.0,
                 figure_interval: float = 2.0, max_steps: int | None = None) -> None:
        self.run_dir = Path(getattr(run_dir, "run_dir", run_dir))
        self.dir = RunDir(self.run_dir)
        self.interval = interval
        # Rendering the figure costs a few tenths of a second of CPU that the ranks would rather have.
        self.figure_interval = max(interval, figure_interval)
        self._max_steps = max_steps
        self.rows: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self._observed: tuple[Status, str] = (Status.STARTING, "")
        self._png = b""
        self._drawn_rows = -1
        self._drawn_at = 0.0
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._figure: Any = None

        self.title = widgets.HTML(layout=widgets.Layout(margin="0"))
        self.title.add_class("wb-dash-title")
        self.progress = widgets.IntProgress(value=0, min=0, max=max(1, max_steps or 1), bar_style="info",
                                            layout=widgets.Layout(width="320px"))
        self.progress.add_class("wb-progress")
        self.progress_text = widgets.HTML()
        self.progress_text.add_class("wb-progress-text")
        self.stats = widgets.HTML()
        self.stats.add_class("wb-stats")
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="900px"))
        self.image.add_class("wb-figure")
        self.widget = widgets.VBox([self.title, widgets.HBox([self.progress, self.progress_text]),
                                    self.stats, self.image])
        self.widget.add_class("wb-dashboard")
        self.refresh(draw=False)

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
    def status(self) -> str:
        """The run's status; 'failed' once a run that says it runs has lost all its processes."""
        return str(self._observed[0])

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("loss") is not None]

    @property
    def eval_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("eval_loss") is not None]

    def refresh(self, draw: bool = True, force_draw: bool = False) -> bool:
        """Read the run directory and update the widgets; True once the run has ended."""
        with self._lock:
            self.rows = self.dir.metrics()
            self.summary = self.dir.summary().to_dict()
            self._observed = self.dir.observed_status()
            self._update_text()
            due = time.monotonic() - self._drawn_at >= self.figure_interval - 0.05
            if draw and len(self.rows) != self._drawn_rows and (due or force_draw or self.ended):
                self._draw()
            return self.ended

    def _update_text(self) -> None:
        train, evals, max_steps = self.train_rows, self.eval_rows, self.max_steps
        last = train[-1] if train else {}
        step = int(self.summary.get("steps") or 0) if self.ended else 0
        step = max(step, int(last.get("step", 0)))
        self.title.value = (f"<b>{html.escape(self.run_dir.name)}</b> &nbsp; "
                            f"<span class='wb-run-status'>{html.escape(self.status)}</span>")
        if max_steps:
            self.progress.max = max_steps
            self.progress.value = min(step, max_steps)
        self.progress.bar_style = {Status.COMPLETED: "success", Status.FAILED: "danger", Status.DIVERGED: "danger",
                                   Status.STOPPED: "warning", Status.PREEMPTED: "warning"}.get(self.status, "info")
        total = f"/{max_steps}" if max_steps else ""
        pct = f" ({100 * step / max_steps:.0f}%)" if max_steps else ""
        if self.ended:
            when = f" in {fmt_duration(self.summary.get('wall_time_s'))}" if self.summary.get("wall_time_s") else ""
            tail = f"{self.status}{when}"
        elif train:
            tail = f"ETA {fmt_duration(last.get('eta_s'))}"
        else:
            tail = "starting the ranks…"
        self.progress_text.value = f"step {step}{total}{pct} · {tail}"
        self.stats.value = self._stats_html(last, evals[-1] if evals else {})

    def _stats_html(self, last: dict[str, Any], last_eval: dict[str, Any]) -> str:
        items: list[tuple[str, str]] = [("loss", _num(last.get("loss")))]
        if last_eval:
            items.append(("eval loss", f"{_num(last_eval.get('eval_loss'))} (step {last_eval.get('step')})"))
            for key, value in last_eval.items():
                if key.startswith("eval_") and key != "eval_loss" and isinstance(value, (int, float)):
                    items.append((key.replace("_", " "), _num(value)))
        items.append(("samples/s", _num(last.get("samples_per_s"), ",.0f")))
        if last.get("tokens_per_s") is not None:
            items.append(("tokens/s", _num(last.get("tokens_per_s"), ",.0f")))
        if last.get("step_time_s") is not None:
            items.append(("step time", f"{1000 * last['step_time_s']:.1f} ms"))
        per_rank = last.get("peak_memory_bytes_per_rank") or []
        if per_rank:
            items.append(("peak memory", ", ".join(f"rank {i}: {fmt_bytes(b)}" for i, b in enumerate(per_rank))))
        elif last.get("peak_memory_bytes") is not None:
            items.append(("peak memory", f"{fmt_bytes(last['peak_memory_bytes'])} (max over ranks)"))
        items.append(("learning rate", _num(last.get("lr"), ".3g")))
        if self.status == Status.FAILED:
            error = self.summary.get("error") or {"type": "Lost", "message": self._observed[1]}
            where = f"rank {error['rank']}" if error.get("rank") is not None else "the launcher"
            items.append(("error", f"{where}: {error.get('type', 'Error')}: {error.get('message', '')}"))
        elif (self.summary.get("ending") or {}).get("message"):
            items.append(("ending", self.summary["ending"]["message"]))
        cells = "".join(f"<tr><td style='padding-right:1em;color:#666'>{html.escape(k)}</td>"
                        f"<td class='wb-stat-{re.sub('[^a-z0-9]+', '-', k.lower())}'>{html.escape(v)}</td></tr>"
                        for k, v in items)
        return f"<table style='font-family:monospace'>{cells}</table>"

    # ---- figures ------------------------------------------------------------------------------------
    def _draw(self) -> None:
        png = self.figure_png()
        if png:
            self.image.value = png

    def figure_png(self) -> bytes:
        """The figure of the rows read so far, as PNG bytes (empty before the first metrics row)."""
        with self._lock:
            if not self.rows:
                return b""
            if len(self.rows) == self._drawn_rows and self._png:
                return self._png
            from matplotlib.figure import Figure

            from .plots import draw

            started = time.monotonic()
            if self._figure is None:
                self._figure = Figure(figsize=(9, 5.5), dpi=80)
            s = self.summary
            label = f"x{s.get('world_size', '?')} {s.get('precision', '')}".strip()
            draw(self._figure, [(label, self.rows)], title=self.run_dir.name)
            buf = io.BytesIO()
            self._figure.savefig(buf, format="png")
            self._png, self._drawn_rows, self._drawn_at = buf.getvalue(), len(self.rows), started
            return self._png

    def show_final(self) -> None:
        """Display the figure as a static image output, so a saved or papermill-executed notebook keeps it."""
        png = self.figure_png()
        if png and in_kernel():
            from IPython.display import Image, display

            display(Image(data=png, format="png"))

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

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def watch(run: Any, **kwargs: Any) -> Dashboard:
    """Show a live dashboard of `run` (a Run, RunResult or run directory) in the notebook and start polling."""
    dashboard = Dashboard(run, **kwargs).start()
    if in_kernel():
        from IPython.display import display

        display(dashboard.widget)
    return dashboard
