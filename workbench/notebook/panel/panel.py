"""wb.Panel: pick a run's settings in widgets, see what they imply, launch, stop, and watch it
train.

All of the panel's state lives in one traitlets model (`PanelState`, state.py): the settings' config
and problem, the status, the run's handle and how it ended, the estimate box's traits. One observer
re-derives every widget from it, so the view can't drift from the state whichever way it changed: a
control, a button, a method call, or the thread that waits for the run. The logic needs no browser:
tests drive the widgets' values and methods. The controls and the RunConfig are kept in step by
`SettingsForm` (settings.py), the run is started, watched and stopped by `RunControl` (running.py),
and widgets.py arranges the widgets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from workbench.cluster.raytrain.spec import Ray
from workbench.cluster.slurm import Slurm
from workbench.config import RunConfig
from workbench.estimator.target import Target, plan_problems
from workbench.launcher.launch import Run
from workbench.launcher.result import RunResult
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.panel.estimates import EstimateBox
from workbench.notebook.panel.mesh_view import layout_html
from workbench.notebook.panel.running import RunControl, error_text
from workbench.notebook.panel.settings import SettingsForm
from workbench.notebook.panel.state import ACTIVE, PanelState
from workbench.notebook.panel.target_controls import TargetControls
from workbench.notebook.panel.task_controls import TaskControls
from workbench.notebook.panel.view import (
    batch_html,
    blocked_reason,
    error_html,
    launch_html,
    problem_html,
    save_yaml,
    status_html,
)
from workbench.notebook.panel.widgets import html_box, make_button, panel_box
from workbench.rundir import Status
from workbench.tasks import Task
from workbench.utils.kernel import in_kernel

log = logging.getLogger("workbench")


def _check_arguments(cfg: Any, task: Any, cluster: Any) -> None:
    """TypeError, with an example of the right kind, for an argument of the wrong kind."""
    if task is not None and not isinstance(task, Task):
        raise TypeError(
            f"task={task!r}: pass an instance of a workbench.Task subclass, e.g. task=MyTask()"
        )
    if cluster is not None and not isinstance(cluster, (Slurm, Ray)):
        raise TypeError(
            f"cluster={cluster!r}: pass a workbench.Slurm or a workbench.Ray, e.g. "
            "cluster=wb.Slurm(partition='gpu') or cluster=wb.Ray(address='HOST:6379')"
        )
    if cfg is not None and not isinstance(cfg, RunConfig):
        raise TypeError(
            f"cfg={cfg!r}: pass a workbench.RunConfig, e.g. wb.Panel(wb.RunConfig(task='digits'))"
        )


class Panel:
    """Controls for a RunConfig, what they imply, Launch/Stop, and the live dashboard of the run.

    `Panel(cfg)` fills the controls from `cfg`; fields without a control keep cfg's values. Pass
    your own Task object as `task=` to offer it beside the built-in tasks; `target=` plans for
    catalog GPUs; `cluster=wb.Slurm(...)` starts with "where" on that Slurm cluster (Launch
    submits), `cluster=wb.Ray(...)` on that Ray cluster (Launch starts the ranks as its workers;
    the cluster is read only when you press ↻). In a notebook the panel displays itself.
    """

    poll_interval = 1.0
    """Seconds between dashboard reads of the run directory."""

    def __init__(
        self,
        cfg: RunConfig | None = None,
        *,
        task: Task | None = None,
        target: Target | str | None = None,
        cluster: Slurm | Ray | None = None,
        display: bool = True,
        estimate: bool = True,
    ) -> None:
        _check_arguments(cfg, task, cluster)
        base = cfg or (RunConfig(task=task.name) if task else RunConfig())
        if task is not None and base.task != task.name:
            base = base.replace(task=task.name)
        self.state = PanelState()
        self._lock = threading.RLock()  # the waiting thread and the kernel both change status
        self.live_estimate = estimate
        """Estimate memory, time and cost as the controls change (it traces a step in this
        process)."""
        self.form = SettingsForm(
            base,
            self.state,
            self._derive,
            user_task=task,
            target=Target(gpu=target) if isinstance(target, str) else target,
            cluster=cluster,
        )
        self._build_outputs()
        self._build_buttons()
        self.runs = RunControl(
            self.state,
            self.form,
            self.estimate_box,
            self.dashboard_box,
            self._lock,
            ended=self._request_estimate,
        )
        self.widget = panel_box(
            self.form.widget,
            [self.batch_info, self.launch_info, self.layout_box, self.estimate_box.widget],
            self.problem_box,
            [
                self.launch_button,
                self.stop_button,
                self.resume_button,
                self.yaml_path,
                self.save_button,
            ],
            [self.status_box, self.error_box, self.dashboard_box],
        )
        self.state.observe(self._render)
        self.form.fill(base)
        self._displayed_in: int | None = None
        self._display: Any = None  # the handle that refreshes the static snapshot when a run ends
        self.estimate_box.state.observe(self._estimate_arrived, names="status")
        if display and in_kernel():
            self._show_in_notebook(estimate)

    def _show_in_notebook(self, estimate: bool) -> None:
        from IPython import get_ipython
        from IPython.display import display as show

        from workbench.regress.recording import headless

        # the saved output is all its reader gets: with the estimate, then
        if estimate and headless():
            with contextlib.suppress(TimeoutError):
                self.estimate_box.wait(timeout=60)
        self._display = show(self._repr_mimebundle_(), raw=True, display_id=True)
        self._displayed_in = get_ipython().execution_count

    # ---- widgets ---------------------------------------------------------------------------------
    def _build_outputs(self) -> None:
        """The boxes `_render` fills: what the settings imply, the problem, status and error lines,
        and the room for the run's dashboard."""
        self.batch_info = html_box("wb-batch")
        self.launch_info = html_box("wb-launch-info")
        self.layout_box = html_box("wb-layout-box")
        self.estimate_box = EstimateBox(self.state.estimate)
        self.problem_box = html_box("wb-problem")
        self.status_box = html_box("wb-status-line")
        self.error_box = html_box("wb-error")
        self.dashboard_box = widgets.VBox([])

    def _build_buttons(self) -> None:
        self.launch_button = make_button("Launch", "wb-launch", button_style="success", icon="play")
        self.stop_button = make_button(
            "Stop",
            "wb-stop",
            button_style="warning",
            icon="stop",
            tooltip="Ranks agree on a step, save a checkpoint and exit",
        )
        self.yaml_path = widgets.Text(
            value="run.yaml", description="YAML file", layout=widgets.Layout(width="260px")
        )
        self.save_button = make_button(
            "Save as YAML",
            "wb-save",
            icon="save",
            tooltip="Write the config for `workbench train FILE`",
        )
        self.resume_button = make_button(
            "Resume",
            "wb-resume",
            icon="forward",
            tooltip="Continue the last run from its newest checkpoint, with these settings",
        )
        for button, action in (
            (self.launch_button, self.launch),
            (self.stop_button, self.stop),
            (self.resume_button, self.resume),
            (self.save_button, self.save_yaml),
        ):
            button.on_click(self._on_click(action))

    # ---- the settings' widgets and what they form (SettingsForm) ---------------------------------
    @property
    def controls(self) -> dict[str, widgets.ValueWidget]:
        """The controls, keyed by the RunConfig field each sets."""
        return self.form.controls

    @property
    def task_controls(self) -> TaskControls:
        """The controls for the task's options (TaskControls)."""
        return self.form.task_controls

    @property
    def target_controls(self) -> TargetControls:
        """Where the run goes: this machine, catalog GPUs, a Slurm partition or a Ray cluster
        (TargetControls)."""
        return self.form.target_controls

    @property
    def limit(self) -> widgets.HTML:
        """What the target offers, beside the processes box."""
        return self.form.limit

    @property
    def mode_info(self) -> widgets.HTML:
        """The chosen parallelism mode in a line."""
        return self.form.mode_info

    @property
    def device(self) -> str:
        """This machine's device for the config the panel was made with."""
        return self.form.device

    @property
    def user_task(self) -> Task | None:
        """The Task object passed as `task=`, offered beside the built-in tasks."""
        return self.form.user_task

    @property
    def config(self) -> RunConfig:
        """The RunConfig as the controls stand; ValueError (RunConfig's message) when they don't
        form one."""
        return self.form.config

    @config.setter
    def config(self, cfg: RunConfig) -> None:
        if self.state.status in ACTIVE:
            raise RuntimeError(
                "the settings are frozen while a run is going: stop it or wait for it first"
            )
        self.form.fill(cfg)

    @property
    def target(self) -> Target:
        """The hardware the run is planned for (the target controls)."""
        return self.form.target

    def task_for(self, name: str) -> Task | None:
        """The user's Task object when `name` is its name; None means the registry resolves it."""
        return self.form.task_for(name)

    # ---- the run (RunControl; its handle and ending are in the state) ----------------------------
    @property
    def run(self) -> Run | None:
        """The last run launched from the panel."""
        return self.state.run

    @property
    def result(self) -> RunResult | None:
        """How the last run ended, once it has and didn't fail."""
        return self.state.result

    @property
    def dashboard(self) -> Dashboard | None:
        """The last run's live dashboard."""
        return self.state.dashboard

    @dashboard.setter
    def dashboard(self, dashboard: Dashboard | None) -> None:
        self.state.dashboard = dashboard

    def _on_click(self, action: Callable[[], Any]) -> Callable[[Any], None]:
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

    def launch(self) -> Run:
        """Launch the run the controls describe (the Launch button); returns the Run handle at
        once."""
        return self.runs.launch(self.poll_interval)

    def resume(self, **changes: Any) -> Run:
        """Continue the last run from its newest checkpoint (the Resume button), in its run
        directory, with the settings the controls show now plus `changes`; what differs from the
        run's config may change."""
        return self.runs.resume(changes, self.poll_interval)

    def stop(self) -> None:
        """Ask the ranks to save a checkpoint and exit (the Stop button); returns at once, see
        wait()."""
        self.runs.stop()

    def wait(self, timeout: float | None = None, *, show: bool = True) -> RunResult:
        """Block until the run ends; returns its RunResult or raises RunFailedError, like
        Run.wait().

        In a notebook the final figure is displayed as a static image, so the saved notebook keeps
        it. Interrupting the kernel while waiting asks the run to stop (checkpoint), then re-raises.
        """
        self.runs.join(timeout)
        s = self.state
        if show and not s.final_shown and s.dashboard is not None:
            s.final_shown = True
            s.dashboard.show_final()
            if self._display is not None:
                # a saved notebook shows the panel as it ended, not as it began
                from workbench.regress.recording import headless

                if headless():
                    # with the estimate the run's end asked for, not "estimating..."
                    # (Panel.__init__)
                    with contextlib.suppress(TimeoutError):
                        self.estimate_box.wait(timeout=60)
                self._display.update(self._repr_mimebundle_(), raw=True)
        if s.failure is not None:
            raise s.failure
        assert s.result is not None
        return s.result

    def measures_the_settings(self) -> bool:
        """The last run ran what the controls say now (here or on the cluster planned for): its
        figures belong beside the estimate."""
        return self.runs.measures_the_settings()

    def save_yaml(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the config as YAML (the Save button, to the path in the text box) for `workbench
        train`."""
        cfg = self.config
        target, self.state.message = save_yaml(
            cfg,
            str(path if path is not None else self.yaml_path.value),
            own_task=self.task_for(cfg.task) is not None,
        )
        return target

    # ---- the estimate ----------------------------------------------------------------------------
    @property
    def estimates(self) -> widgets.HTML:
        """The estimate box's HTML: memory per rank against the target, time and cost, what to
        change."""
        return self.estimate_box.html

    def _request_estimate(self) -> None:
        # While a run goes, its ranks have the cores; the box shows the estimate it was launched
        # with.
        if self.live_estimate and self.state.status not in ACTIVE:
            # a plan that can't run gets no figures and no verdict: its reason is above
            if self.state.problem:
                self.estimate_box.withhold("none while the plan can't run")
                return
            # A plan for hardware elsewhere can't launch here but is a plan to estimate, on its
            # target.
            cfg = self.state.config
            self.estimate_box.request(cfg, self.task_for(cfg.task) if cfg else None, self.target)

    def _estimate_arrived(self, change: dict[str, Any]) -> None:
        """Executed headless (papermill), the saved snapshot is the last displayed: refresh it when
        an estimate arrives after the cell ended. Only there: re-displaying re-creates the live
        widget under a person's cursor."""
        from workbench.regress.recording import headless

        if change["new"] in ("done", "error") and self._display is not None and headless():
            self._display.update(self._repr_mimebundle_(), raw=True)

    # ---- the state from the settings -------------------------------------------------------------
    def _derive(self) -> None:
        """The settings changed (SettingsForm calls this once per change): their config, target and
        problem into the state, then a new estimate."""
        # first, before anything that takes time: what the panel shows is for the settings before
        # this change
        self.estimate_box.mark_stale()
        cfg: RunConfig | None = None
        target = self.target
        try:
            cfg = self.config
            # where the run goes comes first: a plan for a cluster that can't be read says that, not
            # a size
            where = self.target_controls.problem(cfg)
            # every refusal at once: fixing one shouldn't reveal the next
            problems = [where] if where else plan_problems(cfg, target, self.task_for(cfg.task))
        except ValueError as e:  # cfg stays None when RunConfig itself refused the values
            problems = [str(e)]
        with self.state.hold_trait_notifications():
            self.state.config = cfg
            self.state.problems = problems
            self.state.problem = "\n".join(problems)
            self.state.target = target
        if not self.measures_the_settings():  # a run's figures belong to the settings it ran with
            self.estimate_box.show_measured(None, None, None)
        self._render()
        self._request_estimate()

    # ---- the one view of the state ---------------------------------------------------------------
    def _render(self, change: Any = None) -> None:
        with self._lock:
            s = self.state
            frozen = s.status in ACTIVE or s.busy
            self.form.show(s.config, s.target, frozen=frozen, notes=s.notes)
            blocked = blocked_reason(s)
            self.launch_button.disabled = frozen or bool(blocked)
            self.launch_button.button_style = "" if self.launch_button.disabled else "success"
            self.stop_button.disabled = s.status != Status.RUNNING or s.busy
            # a disabled button keeps its colour in ipywidgets; an orange Stop reads as "press me"
            self.stop_button.button_style = "" if self.stop_button.disabled else "warning"
            self.resume_button.disabled = frozen or not s.resumable or bool(blocked)
            self.save_button.disabled = s.busy or s.config is None
            self.yaml_path.disabled = s.busy
            self.batch_info.value = batch_html(s.config)
            self.launch_info.value = launch_html(s)
            self.layout_box.value = layout_html(s.config, s.problem)
            self.problem_box.value = problem_html(s.problems)
            # the problem lines say why a plan can't run; the status line only points at them
            many = len(s.problems) > 1
            self.status_box.value = status_html(
                s,
                blocked=(
                    f"see the {len(s.problems)} problems above" if many else "see the problem above"
                )
                if s.problem
                else blocked,
            )
            self.error_box.value = error_html(s.error)

    # ---- display ---------------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython import get_ipython
        from IPython.display import display

        shell = get_ipython()
        # The constructor already showed the panel in this cell; `wb.Panel(cfg)` as a cell's last
        # line would otherwise show it twice.
        if shell is None or shell.execution_count != self._displayed_in:
            self._display = display(self._repr_mimebundle_(), raw=True, display_id=True)

    def __repr__(self) -> str:
        return f"<workbench.Panel status={self.state.status!r} run={self.state.run_name or None!r}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The live widget, plus a static snapshot for frontends without a kernel (papermill output,
        nbconvert)."""
        from workbench.notebook.snapshot import panel_html

        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = panel_html(self)
        return bundle
