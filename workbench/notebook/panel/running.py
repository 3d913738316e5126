"""The panel's run: launch or resume it, watch it in a thread, stop it, wait for it. `RunControl`
records everything it learns of the run (its handle, its status and Slurm job or Ray driver, how it
ended, whether it saved a checkpoint) in the panel's state, from which the panel's observer draws
the view."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import ipywidgets as widgets

from workbench.config import RunConfig
from workbench.estimator.report import settings_line
from workbench.estimator.target import check_here
from workbench.launcher.launch import Run, start
from workbench.launcher.phases import LaunchPhases, announcing
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.live_view import PanelLine
from workbench.notebook.panel.estimates import EstimateBox
from workbench.notebook.panel.settings import SettingsForm
from workbench.notebook.panel.state import ACTIVE, PanelState
from workbench.rundir import ENDED, RunFailedError, Status
from workbench.rundir.run_files import resume_config

log = logging.getLogger("workbench")
JOB_POLL_S = 2.0
"""Seconds between asking Slurm for a submitted run's job state, or Ray for its driver's (the
status line shows it)."""


def error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RunFailedError) else f"{type(exc).__name__}: {exc}"


class RunControl:
    """Launch, Resume, Stop and wait, on the panel's state: the settings come from `form`, the
    run's dashboard goes into `dashboard_box`, and `ended()` is called once a run has ended."""

    def __init__(
        self,
        state: PanelState,
        form: SettingsForm,
        estimate_box: EstimateBox,
        dashboard_box: widgets.Box,
        lock: threading.RLock,
        ended: Callable[[], None],
    ) -> None:
        self.state = state
        self.form = form
        self.estimate_box = estimate_box
        self.dashboard_box = dashboard_box
        self.lock = lock
        """Held while the status changes: the waiting thread and the kernel both change it."""
        self._ended = ended

    def launch(self, poll_interval: float) -> Run:
        """Launch the run the controls describe; returns the Run handle at once."""
        return self._go(lambda: self.form.config, "launching", poll_interval)

    def resume(self, changes: dict[str, Any], poll_interval: float) -> Run:
        """Continue the last run from its newest checkpoint, in its run directory, with the settings
        the controls show now plus `changes`."""
        s = self.state

        def config() -> RunConfig:
            if s.run is None or not s.resumable:
                raise RuntimeError(
                    "nothing to resume: Resume continues a stopped, preempted, failed or completed "
                    "run that saved a checkpoint; Launch starts a new run"
                )
            old, new = s.run.config, self.form.config.replace(**changes)
            differ = {
                f.name: getattr(new, f.name)
                for f in fields(new)
                if getattr(new, f.name) != getattr(old, f.name)
                and f.name not in ("run_name", "runs_dir", "resume", "resume_allow")
            }
            s.message = (
                "resuming with " + ", ".join(f"{k}={v!r}" for k, v in differ.items())
                if differ
                else ""
            )
            return resume_config(old, s.run.run_dir, differ)

        return self._go(config, "resuming", poll_interval)

    def _go(self, make_config: Callable[[], RunConfig], status: str, poll_interval: float) -> Run:
        s = self.state
        with self.lock:
            if s.status in ACTIVE:
                raise RuntimeError(
                    f"a run is going ({s.run_name or '?'}): stop it or "
                    "wait for it (panel.wait()) before launching another"
                )
            if s.problem:
                raise ValueError(s.problem)
            s.message = ""
            cfg = make_config()
            check_here(cfg, self.form.target)
            # a Slurm job or a wb.Ray Launch submits, or None: this machine
            cluster = self.form.target_controls.cluster()
            s.error, s.job = "", ""
            before, s.status = s.status, status
            # The launch speaks at once: its phase (checking, preparing data, starting N
            # processes, waiting for the cluster) and the time since the click, until the ranks
            # report; first, before the estimate's end is waited for (seconds, under load).
            phases = LaunchPhases()
            line = PanelLine(phases, cfg.run_name or cfg.task)
            self.dashboard_box.children = [line.widget]
        try:
            self.estimate_box.cancel()
            with announcing(phases):
                run = start(cfg, task=self.form.task_for(cfg.task), cluster=cluster)
        except BaseException as e:
            line.close(e)  # "not launched", and in which phase
            s.status = before if status == "resuming" else "ready"
            raise
        line.follow(run)
        # the panel shows the error once, itself
        dashboard = Dashboard(
            run.run_dir, max_steps=run.config.max_steps, interval=poll_interval, show_error=False
        )
        finished = threading.Event()
        with s.hold_trait_notifications():
            s.run, s.run_name, s.dashboard = run, run.run_dir.name, dashboard
            s.result, s.failure, s.checkpoint, s.final_shown = None, None, False, False
            s.finished = finished
        self.dashboard_box.children = [line.widget, dashboard.widget]
        self.estimate_box.show_measured(None, None, None)
        dashboard.observe(self._on_reading, names="reading")
        dashboard.start()
        s.status = Status.RUNNING.value
        threading.Thread(
            target=self._watch,
            args=(run, dashboard, finished, line),
            daemon=True,
            name=f"wb-panel-{run.run_dir.name}",
        ).start()
        return run

    def _watch(
        self, run: Run, dashboard: Dashboard, finished: threading.Event, line: PanelLine
    ) -> None:
        """Wait for the run in a thread, so the kernel stays free; then record how it ended."""
        result, failure = None, None
        # a Slurm run: its job's state, Slurm's reason while it waits; a Ray run: its driver's
        job = getattr(run, "job_line", None)
        if job is None and getattr(run, "start_method", None) == "ray":
            from workbench.notebook.panel.ray_controls import driver_line

            job = functools.partial(driver_line, run)
        try:
            while True:
                if job is not None:
                    self.state.job = job()
                try:
                    result = run.wait(timeout=JOB_POLL_S if job is not None else None)
                    break
                except TimeoutError:
                    # Run.stop() polls the process from the kernel's thread; if that poll reaped the
                    # exit first, this wait saw no exit code yet. It is recorded now, so asking
                    # again answers.
                    continue
        except BaseException as e:  # noqa: BLE001
            # RunFailedError, or anything else: shown, never lost
            failure = e
        line.close()  # ended before its ranks reported: the line's thread stops with the run
        try:
            dashboard.stop()
        except Exception:  # noqa: BLE001
            log.exception("dashboard of %s: final refresh failed", run.run_dir)
        # what the view needs of the ended run, read here once: rendering reads no files
        checkpoint = run.dir.latest_checkpoint() is not None
        with self.lock:
            s = self.state
            status = result.status if result is not None else run.dir.observed_status()[0]
            with s.hold_trait_notifications():
                s.result, s.failure, s.checkpoint = result, failure, checkpoint
                s.error = "" if failure is None else error_text(failure)
                s.job = ""
                s.status = str(status if status in ENDED else Status.FAILED)
        finished.set()
        self._ended()  # the cores are free again: the box shows what the settings imply

    def _on_reading(self, change: Any) -> None:
        """The run's latest logged step, beside the estimate it was launched with."""
        dashboard = self.state.dashboard
        rows = dashboard.train_rows if dashboard is not None else []
        if rows and self.measures_the_settings():
            last = rows[-1]
            self.estimate_box.show_measured(
                last.step_time_s, last.peak_memory_bytes, last.samples_per_s
            )

    def measures_the_settings(self) -> bool:
        """The last run ran what the controls say now (here or on the cluster planned for): its
        figures belong beside the estimate."""
        cfg, run = self.state.config, self.state.run
        if run is None or cfg is None or not self.form.target.launchable:
            return False
        ran = run.config
        return settings_line(cfg.to_dict(), cfg.num_processes) == settings_line(
            ran.to_dict(), ran.num_processes
        )

    def stop(self) -> None:
        """Ask the ranks to save a checkpoint and exit; returns at once, see wait()."""
        s = self.state
        with self.lock:
            if s.run is None or s.status not in (Status.RUNNING, "stopping"):
                s.message = "nothing is running to stop"
                return
            s.run.stop()
            if s.status == Status.RUNNING:
                s.status = "stopping"

    def join(self, timeout: float | None) -> None:
        """Block until the run has ended and the state says how; TimeoutError after `timeout`
        seconds. Interrupting the kernel while waiting asks the run to stop (checkpoint), then
        re-raises."""
        s = self.state
        if s.run is None:
            raise RuntimeError(
                "nothing to wait for: launch a run first (panel.launch() or the Launch button)"
            )
        try:
            if not s.finished.wait(timeout):
                raise TimeoutError(
                    f"run {s.run_name} still running after {timeout}s; call wait() again or stop()"
                )
        except KeyboardInterrupt:
            self.stop()
            raise
