"""The panel's buttons and what they start: launch, resume, stop and wait for a run, save its YAML.
A mixin of Panel (panel.py), which owns the widgets and the state these methods change."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.config import RunConfig
from workbench.estimator.model import settings_line
from workbench.estimator.target import check_here
from workbench.launcher.launch import Run, start
from workbench.launcher.result import RunResult
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.panel.panel_state import ACTIVE
from workbench.notebook.panel.view import RESUMABLE, save_yaml
from workbench.rundir import ENDED, RunFailedError, Status
from workbench.rundir.run_files import resume_config

if TYPE_CHECKING:
    from workbench.notebook.panel.panel import Panel

log = logging.getLogger("workbench")
JOB_POLL_S = 2.0
"""Seconds between asking Slurm for a submitted run's job state (the status line shows it)."""


def error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RunFailedError) else f"{type(exc).__name__}: {exc}"


class RunActions:
    """Launch, Resume, Stop, wait and Save, on the panel's state."""

    # ---- actions ---------------------------------------------------------------------------------
    def _on_click(self: Panel, action: Callable[[], Any]) -> Callable[[Any], None]:
        def handler(_button: Any) -> None:
            # ipywidgets would send a callback's exception to the browser console, where nobody
            # looks.
            self.state.busy = True
            try:
                self.state.error = ""
                action()
            except Exception as e:  # noqa: BLE001  (shown in the panel instead)
                self.state.error = error_text(e)
            finally:
                self.state.busy = False

        return handler

    def launch(self: Panel) -> Run:
        """Launch the run the controls describe (the Launch button); returns the Run handle at
        once."""
        return self._go(lambda: self.config, "launching")

    def _resumable(self: Panel) -> bool:
        return (
            self.run is not None
            and self.state.status in RESUMABLE
            and self.run.dir.latest_checkpoint() is not None
        )

    def resume(self: Panel, **changes: Any) -> Run:
        """Continue the last run from its newest checkpoint (the Resume button), in its run
        directory, with the settings the controls show now plus `changes`; what differs from the
        run's config may change."""

        def config() -> RunConfig:
            if self.run is None or not self._resumable():
                raise RuntimeError(
                    "nothing to resume: Resume continues a stopped, preempted, failed or completed "
                    "run that saved a checkpoint; Launch starts a new run"
                )
            old, new = self.run.config, self.config.replace(**changes)
            differ = {
                f.name: getattr(new, f.name)
                for f in fields(new)
                if getattr(new, f.name) != getattr(old, f.name)
                and f.name not in ("run_name", "runs_dir", "resume", "resume_allow")
            }
            self.state.message = (
                "resuming with " + ", ".join(f"{k}={v!r}" for k, v in differ.items())
                if differ
                else ""
            )
            return resume_config(old, self.run.run_dir, differ)

        return self._go(config, "resuming")

    def _go(self: Panel, make_config: Callable[[], RunConfig], status: str) -> Run:
        with self._lock:
            if self.state.status in ACTIVE:
                raise RuntimeError(
                    f"a run is going ({self.run.run_dir.name if self.run else '?'}): stop it or "
                    "wait for it (panel.wait()) before launching another"
                )
            if self.state.problem:
                raise ValueError(self.state.problem)
            self.state.message = ""
            cfg = make_config()
            check_here(cfg, self.target)
            # a Slurm job Launch submits, or None: this machine
            cluster = self.target_controls.cluster()
            self.state.error, self.state.job = "", ""
            before, self.state.status = self.state.status, status
            self.estimate_box.cancel()
        try:
            run = start(cfg, task=self.task_for(cfg.task), cluster=cluster)
        except BaseException:
            self.state.status = before if status == "resuming" else "ready"
            raise
        self.run, self.result, self._failure, self._final_shown = run, None, None, False
        self._finished = finished = threading.Event()
        # the panel shows the error once, itself
        self.dashboard = Dashboard(
            run.run_dir,
            max_steps=run.config.max_steps,
            interval=self.poll_interval,
            show_error=False,
        )
        self.dashboard_box.children = [self.dashboard.widget]
        self.estimate_box.show_measured(None, None, None)
        self.dashboard.observe(self._on_reading, names="reading")
        self.dashboard.start()
        self.state.status = Status.RUNNING.value
        threading.Thread(
            target=self._watch,
            args=(run, self.dashboard, finished),
            daemon=True,
            name=f"wb-panel-{run.run_dir.name}",
        ).start()
        return run

    def _watch(self: Panel, run: Run, dashboard: Dashboard, finished: threading.Event) -> None:
        """Wait for the run in a thread, so the kernel stays free; then record how it ended."""
        result, failure = None, None
        # a Slurm run: its job's state, Slurm's reason while it waits
        job = getattr(run, "job_line", None)
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
        try:
            dashboard.stop()
        except Exception:  # noqa: BLE001
            log.exception("dashboard of %s: final refresh failed", run.run_dir)
        with self._lock:
            self.result, self._failure = result, failure
            status = result.status if result is not None else run.dir.observed_status()[0]
            with self.state.hold_trait_notifications():
                self.state.error = "" if failure is None else error_text(failure)
                self.state.job = ""
                self.state.status = str(status if status in ENDED else Status.FAILED)
        finished.set()
        self._request_estimate()  # the cores are free again: the box shows what the settings imply

    def _on_reading(self: Panel, change: Any) -> None:
        """The run's latest logged step, beside the estimate it was launched with."""
        rows = self.dashboard.train_rows if self.dashboard is not None else []
        if rows and self.measures_the_settings():
            last = rows[-1]
            self.estimate_box.show_measured(
                last.step_time_s, last.peak_memory_bytes, last.samples_per_s
            )

    def measures_the_settings(self: Panel) -> bool:
        """The last run ran what the controls say now (here or on the cluster planned for): its
        figures belong beside the estimate."""
        cfg = self.state.config
        if self.run is None or cfg is None or not self.target.launchable:
            return False
        ran = self.run.config
        return settings_line(cfg.to_dict(), cfg.num_processes) == settings_line(
            ran.to_dict(), ran.num_processes
        )

    def stop(self: Panel) -> None:
        """Ask the ranks to save a checkpoint and exit (the Stop button); returns at once, see
        wait()."""
        with self._lock:
            if self.run is None or self.state.status not in (Status.RUNNING, "stopping"):
                self.state.message = "nothing is running to stop"
                return
            self.run.stop()
            if self.state.status == Status.RUNNING:
                self.state.status = "stopping"

    def wait(self: Panel, timeout: float | None = None, *, show: bool = True) -> RunResult:
        """Block until the run ends; returns its RunResult or raises RunFailedError, like
        Run.wait().

        In a notebook the final figure is displayed as a static image, so the saved notebook keeps
        it. Interrupting the kernel while waiting asks the run to stop (checkpoint), then re-raises.
        """
        if self.run is None:
            raise RuntimeError(
                "nothing to wait for: launch a run first (panel.launch() or the Launch button)"
            )
        try:
            if not self._finished.wait(timeout):
                raise TimeoutError(
                    f"run {self.run.run_dir.name} still running after {timeout}s; call wait() "
                    "again or stop()"
                )
        except KeyboardInterrupt:
            self.stop()
            raise
        if show and not self._final_shown and self.dashboard is not None:
            self._final_shown = True
            self.dashboard.show_final()
            if self._display is not None:
                # a saved notebook shows the panel as it ended, not as it began
                from workbench.regress.recording import headless

                if headless():
                    # with the estimate the run's end asked for, not "estimating..."
                    # (Panel.__init__)
                    with contextlib.suppress(TimeoutError):
                        self.estimate_box.wait(timeout=60)
                self._display.update(self._repr_mimebundle_(), raw=True)
        if self._failure is not None:
            raise self._failure
        assert self.result is not None
        return self.result

    def _estimate_arrived(self: Panel, change: dict[str, Any]) -> None:
        """Executed headless (papermill), the saved snapshot is the last displayed: refresh it when
        an estimate arrives after the cell ended. Only there: re-displaying re-creates the live
        widget under a person's cursor."""
        from workbench.regress.recording import headless

        if change["new"] in ("done", "error") and self._display is not None and headless():
            self._display.update(self._repr_mimebundle_(), raw=True)

    def save_yaml(self: Panel, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the config as YAML (the Save button, to the path in the text box) for `workbench
        train`."""
        cfg = self.config
        target, self.state.message = save_yaml(
            cfg,
            str(path if path is not None else self.yaml_path.value),
            own_task=self.task_for(cfg.task) is not None,
        )
        return target
