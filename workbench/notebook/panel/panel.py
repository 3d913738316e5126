"""wb.Panel: pick a run's settings in widgets, see what they imply, launch, stop, and watch it train.

State lives in a traitlets model (`PanelState`); one observer re-derives every widget from it, so the
view can't drift from the state whichever way it changed: a control, a button, a method call, or the
thread that waits for the run. The logic needs no browser: tests drive the widgets' values and methods.
"""

from __future__ import annotations

import html
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import Run, start
from workbench.launcher.processes import describe_launch
from workbench.launcher.result import RunResult
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.panel.controls import build_controls, read_micro_batch, task_options
from workbench.notebook.panel.estimates import EstimateBox
from workbench.notebook.panel.mesh_view import layout_html
from workbench.notebook.panel.panel_state import ACTIVE, PanelState
from workbench.notebook.panel.view import RESUMABLE, error_html, save_yaml, status_html
from workbench.rundir import ENDED, RunFailedError, Status
from workbench.rundir.run_files import resume_config
from workbench.tasks import Task
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.kernel import in_kernel

log = logging.getLogger("workbench")

def _error_text(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, RunFailedError) else f"{type(exc).__name__}: {exc}"


def _html(css_class: str, value: str = "") -> widgets.HTML:
    box = widgets.HTML(value)
    box.add_class(css_class)
    return box


def _button(description: str, css_class: str, **kwargs: Any) -> widgets.Button:
    button = widgets.Button(description=description, **kwargs)
    button.add_class(css_class)
    return button


class Panel:
    """Controls for a RunConfig, what they imply, Launch/Stop, and the live dashboard of the run.

    `Panel(cfg)` fills the controls from `cfg`; fields without a control keep cfg's values. Pass your own
    Task object as `task=` to offer it beside the built-in tasks. In a notebook the panel displays itself.
    """

    poll_interval = 1.0
    """Seconds between dashboard reads of the run directory."""

    def __init__(self, cfg: RunConfig | None = None, *, task: Task | None = None, display: bool = True,
                 estimate: bool = True) -> None:
        if task is not None and not isinstance(task, Task):
            raise TypeError(f"task={task!r}: pass an instance of a workbench.Task subclass, e.g. task=MyTask()")
        if cfg is not None and not isinstance(cfg, RunConfig):
            raise TypeError(f"cfg={cfg!r}: pass a workbench.RunConfig, e.g. wb.Panel(wb.RunConfig(task='digits'))")
        self.user_task = task
        base = cfg or (RunConfig(task=task.name) if task else RunConfig())
        if task is not None and base.task != task.name:
            base = base.replace(task=task.name)
        self._base = base
        self.state = PanelState()
        self.run: Run | None = None
        self.result: RunResult | None = None
        self.dashboard: Dashboard | None = None
        self._failure: BaseException | None = None
        self._finished = threading.Event()
        self._final_shown = False
        self._filling = False
        self._lock = threading.RLock()  # the waiting thread and the kernel both change status
        self.live_estimate = estimate
        """Estimate memory, time and cost as the controls change (it traces a step in this process)."""
        self._build_widgets(base)
        self.state.observe(self._render)
        self._fill(base)
        self._displayed_in: int | None = None
        self._display: Any = None  # the handle that refreshes the static snapshot when a run ends
        if display and in_kernel():
            from IPython import get_ipython
            from IPython.display import display as show

            self._display = show(self._repr_mimebundle_(), raw=True, display_id=True)
            self._displayed_in = get_ipython().execution_count

    # ---- widgets ------------------------------------------------------------------------------------
    def _build_widgets(self, base: RunConfig) -> None:
        hw = detect()
        self.device = resolve_device(base, hw)
        self.max_processes = hw.max_processes(self.device)
        self.controls, self.precision_reasons = build_controls(self.device, self._task_options(base.task))
        for control in self.controls.values():
            control.observe(self._on_control, names="value")
        limit = widgets.HTML(f"<small style='white-space:nowrap'>up to {self.max_processes} on "
                             f"{html.escape(hw.describe(self.device))}</small>")

        self.batch_info = _html("wb-batch")
        self.launch_info = _html("wb-launch-info")
        self.estimate_box = EstimateBox(base.num_processes)
        for control in (self.estimate_box.target, self.estimate_box.gpus, self.estimate_box.nodes):
            control.observe(lambda change: self._request_estimate(), names="value")
        self.problem_box = _html("wb-problem")
        self.launch_button = _button("Launch", "wb-launch", button_style="success", icon="play")
        self.stop_button = _button("Stop", "wb-stop", button_style="warning", icon="stop",
                                   tooltip="Ranks agree on a step, save a checkpoint and exit")
        self.yaml_path = widgets.Text(value="run.yaml", description="YAML file",
                                      layout=widgets.Layout(width="260px"))
        self.save_button = _button("Save as YAML", "wb-save", icon="save",
                                   tooltip="Write the config for `workbench train FILE`")
        self.resume_button = _button("Resume", "wb-resume", icon="forward",
                                     tooltip="Continue the last run from its newest checkpoint, with these settings")
        for button, action in ((self.launch_button, self.launch), (self.stop_button, self.stop),
                               (self.resume_button, self.resume), (self.save_button, self.save_yaml)):
            button.on_click(self._on_click(action))
        self.status_box = _html("wb-status-line")
        self.error_box = _html("wb-error")
        self.dashboard_box = widgets.VBox([])
        c = self.controls
        left = widgets.VBox([c["task"], widgets.HBox([c["num_processes"], limit]), c["parallelism"], c["dp_shard"],
                             c["tp"], c["pp"], c["pp_schedule"], c["activation_checkpointing"], c["precision"],
                             c["micro_batch_size"], c["grad_accum_steps"], c["max_steps"], c["lr"], c["run_name"]])
        self.layout_box = _html("wb-layout-box")
        right = widgets.VBox([widgets.HTML("<b>What this implies</b>"), self.batch_info, self.launch_info,
                              self.layout_box, self.estimate_box.widget],
                             layout=widgets.Layout(margin="0 0 0 2em", max_width="560px"))
        self.widget = widgets.VBox([
            widgets.HTML("<h3 style='margin:0.2em 0'>workbench: configure a run</h3>"),
            widgets.HBox([left, right]), self.problem_box,
            widgets.HBox([self.launch_button, self.stop_button, self.resume_button, self.yaml_path, self.save_button]),
            self.status_box, self.error_box, self.dashboard_box,
        ])
        self.widget.add_class("wb-panel")

    def _task_options(self, selected: str) -> list[tuple[str, str]]:
        return task_options(self.user_task, selected)

    @property
    def estimates(self) -> widgets.HTML:
        """The estimate box's HTML: memory per rank against the target, time and cost, what to change."""
        return self.estimate_box.html

    def _request_estimate(self) -> None:
        # While a run goes, its ranks have the cores; the box shows the estimate it was launched with.
        if self.live_estimate and self.state.status not in ACTIVE:
            cfg = self.state.config if not self.state.problem else None
            self.estimate_box.request(cfg, self.task_for(cfg.task) if cfg else None)

    # ---- controls <-> RunConfig ---------------------------------------------------------------------
    def _control_values(self) -> dict[str, Any]:
        values = {name: control.value for name, control in self.controls.items()}
        values["run_name"] = values["run_name"].strip() or None
        values["micro_batch_size"] = read_micro_batch(values["micro_batch_size"])
        return values

    @property
    def config(self) -> RunConfig:
        """The RunConfig as the controls stand; ValueError (RunConfig's message) when they don't form one."""
        return self._base.replace(**self._control_values())

    @config.setter
    def config(self, cfg: RunConfig) -> None:
        if self.state.status in ACTIVE:
            raise RuntimeError("the settings are frozen while a run is going: stop it or wait for it first")
        self._base = cfg
        self._fill(cfg)

    def _fill(self, cfg: RunConfig) -> None:
        self._filling = True
        try:
            c = self.controls
            c["task"].options = self._task_options(cfg.task)
            for name, control in c.items():
                value = getattr(cfg, name)
                control.value = "" if value is None else str(value) if name == "micro_batch_size" else value
        finally:
            self._filling = False
        self._derive()

    def _on_control(self, change: dict[str, Any]) -> None:
        if not self._filling:
            self._derive()

    def task_for(self, name: str) -> Task | None:
        """The user's Task object when `name` is its name; None means the registry resolves it."""
        return self.user_task if self.user_task is not None and name == self.user_task.name else None

    def _derive(self) -> None:
        cfg: RunConfig | None = None
        try:
            cfg = self.config
            preflight(cfg, task=self.task_for(cfg.task))
            problem = ""
        except ValueError as e:  # cfg stays None when RunConfig itself refused the values
            problem = str(e)
        with self.state.hold_trait_notifications():
            self.state.config = cfg
            self.state.problem = problem
        self._render()
        self._request_estimate()

    # ---- the one view of the state ------------------------------------------------------------------
    def _render(self, change: Any = None) -> None:
        with self._lock:
            s = self.state
            frozen = s.status in ACTIVE or s.busy
            for control in self.controls.values():
                control.disabled = frozen
            self.launch_button.disabled = frozen or s.config is None or bool(s.problem)
            self.stop_button.disabled = s.status != Status.RUNNING or s.busy
            self.resume_button.disabled = frozen or not self._resumable() or s.config is None or bool(s.problem)
            self.save_button.disabled = s.busy or s.config is None
            self.yaml_path.disabled = s.busy
            cfg = s.config
            if cfg is None or s.problem:  # nothing would launch: say nothing that reads as if it would
                self.batch_info.value = "global batch: –"
                self.launch_info.value = "<i>not launchable as set: see the problem below</i>" if cfg else ""
            else:
                procs = f"{cfg.num_processes} process" + ("es" if cfg.num_processes > 1 else "")
                self.batch_info.value = (f"global batch <b>{cfg.global_batch_size or 'chosen at launch'}</b> = "
                                         f"{cfg.micro_batch_size} micro-batch × {cfg.grad_accum_steps} "
                                         f"accumulation × {procs}")
                self.launch_info.value = html.escape(describe_launch(cfg))
            self.layout_box.value = layout_html(cfg, s.problem)
            self.problem_box.value = ("" if not s.problem else
                                      "<div style='color:#b00020;white-space:pre-wrap'>⚠ "
                                      f"{html.escape(s.problem)}</div>")
            self.status_box.value = status_html(s, self.run.run_dir.name if self.run else "",
                                                resumable=self._resumable())
            self.error_box.value = error_html(s.error)

    # ---- actions ------------------------------------------------------------------------------------
    def _on_click(self, action: Callable[[], Any]) -> Callable[[Any], None]:
        def handler(_button: Any) -> None:
            # ipywidgets would send a callback's exception to the browser console, where nobody looks.
            self.state.busy = True
            try:
                self.state.error = ""
                action()
            except Exception as e:  # noqa: BLE001  (shown in the panel instead)
                self.state.error = _error_text(e)
            finally:
                self.state.busy = False
        return handler

    def launch(self) -> Run:
        """Launch the run the controls describe (the Launch button); returns the Run handle at once."""
        return self._go(lambda: self.config, "launching")

    def _resumable(self) -> bool:
        return (self.run is not None and self.state.status in RESUMABLE
                and self.run.dir.latest_checkpoint() is not None)

    def resume(self, **changes: Any) -> Run:
        """Continue the last run from its newest checkpoint (the Resume button), in its run directory, with the
        settings the controls show now plus `changes`; what differs from the run's config may change."""
        def config() -> RunConfig:
            if self.run is None or not self._resumable():
                raise RuntimeError("nothing to resume: Resume continues a stopped, preempted, failed or completed "
                                   "run that saved a checkpoint; Launch starts a new run")
            old, new = self.run.config, self.config.replace(**changes)
            differ = {f.name: getattr(new, f.name) for f in fields(new) if getattr(new, f.name) != getattr(old, f.name)
                      and f.name not in ("run_name", "runs_dir", "resume", "resume_allow")}
            self.state.message = ("resuming with " + ", ".join(f"{k}={v!r}" for k, v in differ.items())
                                  if differ else "")
            return resume_config(old, self.run.run_dir, differ)
        return self._go(config, "resuming")

    def _go(self, make_config: Callable[[], RunConfig], status: str) -> Run:
        with self._lock:
            if self.state.status in ACTIVE:
                raise RuntimeError(f"a run is going ({self.run.run_dir.name if self.run else '?'}): stop it or "
                                   "wait for it (panel.wait()) before launching another")
            if self.state.problem:
                raise ValueError(self.state.problem)
            self.state.message = ""
            cfg = make_config()
            self.state.error = ""
            before, self.state.status = self.state.status, status
            self.estimate_box.cancel()
        try:
            run = start(cfg, task=self.task_for(cfg.task))
        except BaseException:
            self.state.status = before if status == "resuming" else "ready"
            raise
        self.run, self.result, self._failure, self._final_shown = run, None, None, False
        self._finished = finished = threading.Event()
        self.dashboard = Dashboard(run.run_dir, max_steps=run.config.max_steps, interval=self.poll_interval,
                                   show_error=False)  # the panel shows the error once, itself
        self.dashboard_box.children = [self.dashboard.widget]
        self.dashboard.start()
        self.state.status = Status.RUNNING.value
        threading.Thread(target=self._watch, args=(run, self.dashboard, finished), daemon=True,
                         name=f"wb-panel-{run.run_dir.name}").start()
        return run

    def _watch(self, run: Run, dashboard: Dashboard, finished: threading.Event) -> None:
        """Wait for the run in a thread, so the kernel stays free; then record how it ended."""
        result, failure = None, None
        try:
            while True:
                try:
                    result = run.wait()
                    break
                except TimeoutError:
                    # Run.stop() polls the process from the kernel's thread; if that poll reaped the exit first,
                    # this wait saw no exit code yet. It is recorded now, so asking again answers.
                    continue
        except BaseException as e:  # noqa: BLE001  (RunFailedError, or anything else: shown, never lost)
            failure = e
        try:
            dashboard.stop()
        except Exception:  # noqa: BLE001
            log.exception("dashboard of %s: final refresh failed", run.run_dir)
        with self._lock:
            self.result, self._failure = result, failure
            status = result.status if result is not None else run.dir.observed_status()[0]
            with self.state.hold_trait_notifications():
                self.state.error = "" if failure is None else _error_text(failure)
                self.state.status = str(status if status in ENDED else Status.FAILED)
        finished.set()
        self._request_estimate()  # the cores are free again: the box shows what the settings imply

    def stop(self) -> None:
        """Ask the ranks to save a checkpoint and exit (the Stop button); returns at once, see wait()."""
        with self._lock:
            if self.run is None or self.state.status not in (Status.RUNNING, "stopping"):
                self.state.message = "nothing is running to stop"
                return
            self.run.stop()
            if self.state.status == Status.RUNNING:
                self.state.status = "stopping"

    def wait(self, timeout: float | None = None, *, show: bool = True) -> RunResult:
        """Block until the run ends; returns its RunResult or raises RunFailedError, like Run.wait().

        In a notebook the final figure is displayed as a static image, so the saved notebook keeps it.
        Interrupting the kernel while waiting asks the run to stop (checkpoint), then re-raises.
        """
        if self.run is None:
            raise RuntimeError("nothing to wait for: launch a run first (panel.launch() or the Launch button)")
        try:
            if not self._finished.wait(timeout):
                raise TimeoutError(f"run {self.run.run_dir.name} still running after {timeout}s; call wait() "
                                   "again or stop()")
        except KeyboardInterrupt:
            self.stop()
            raise
        if show and not self._final_shown and self.dashboard is not None:
            self._final_shown = True
            self.dashboard.show_final()
            if self._display is not None:  # a saved notebook shows the panel as it ended, not as it began
                self._display.update(self._repr_mimebundle_(), raw=True)
        if self._failure is not None:
            raise self._failure
        assert self.result is not None
        return self.result

    def save_yaml(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the config as YAML (the Save button, to the path in the text box) for `workbench train`."""
        cfg = self.config
        target, self.state.message = save_yaml(cfg, str(path if path is not None else self.yaml_path.value),
                                               own_task=self.task_for(cfg.task) is not None)
        return target

    # ---- display ------------------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython import get_ipython
        from IPython.display import display

        shell = get_ipython()
        # The constructor already showed the panel in this cell; `wb.Panel(cfg)` as a cell's last line
        # would otherwise show it twice.
        if shell is None or shell.execution_count != self._displayed_in:
            self._display = display(self._repr_mimebundle_(), raw=True, display_id=True)

    def __repr__(self) -> str:
        return f"<workbench.Panel status={self.state.status!r} run={self.run.run_dir.name if self.run else None!r}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The live widget, plus a static snapshot for frontends without a kernel (papermill output, nbconvert)."""
        from workbench.notebook.snapshot import panel_html

        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = panel_html(self)
        return bundle
