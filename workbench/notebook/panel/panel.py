"""wb.Panel: pick a run's settings in widgets, see what they imply, launch, stop, and watch it
train.

State lives in a traitlets model (`PanelState`); one observer re-derives every widget from it, so
the view can't drift from the state whichever way it changed: a control, a button, a method call, or
the thread that waits for the run. The logic needs no browser: tests drive the widgets' values and
methods. The controls and the RunConfig are kept in step by `ConfigControls` (panel_config.py), the
buttons' actions are `RunActions` (running.py), and panel_widgets.py arranges the widgets.
"""

from __future__ import annotations

import contextlib
import html
import logging
import threading
from typing import Any

import ipywidgets as widgets

from workbench.cluster.slurm import Slurm
from workbench.config import PARALLELISM_MODES, RunConfig
from workbench.config.mesh import INTERLEAVED
from workbench.estimator.target import Target, check_plan
from workbench.launcher.launch import Run
from workbench.launcher.processes import describe_launch
from workbench.launcher.result import RunResult
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.panel.controls import build_controls
from workbench.notebook.panel.estimates import EstimateBox
from workbench.notebook.panel.mesh_view import layout_html
from workbench.notebook.panel.panel_config import ConfigControls
from workbench.notebook.panel.panel_state import ACTIVE, PanelState
from workbench.notebook.panel.panel_widgets import html_box, make_button, panel_box
from workbench.notebook.panel.running import RunActions
from workbench.notebook.panel.target_controls import TargetControls
from workbench.notebook.panel.task_controls import TaskControls
from workbench.notebook.panel.view import batch_html, blocked_reason, error_html, status_html
from workbench.rundir import Status
from workbench.tasks import Task
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.kernel import in_kernel

log = logging.getLogger("workbench")


def _check_arguments(cfg: Any, task: Any, cluster: Any) -> None:
    """TypeError, with an example of the right kind, for an argument of the wrong kind."""
    if task is not None and not isinstance(task, Task):
        raise TypeError(
            f"task={task!r}: pass an instance of a workbench.Task subclass, e.g. task=MyTask()"
        )
    if cluster is not None and not isinstance(cluster, Slurm):
        raise TypeError(
            f"cluster={cluster!r}: pass a workbench.Slurm, e.g. cluster=wb.Slurm(partition='gpu')"
        )
    if cfg is not None and not isinstance(cfg, RunConfig):
        raise TypeError(
            f"cfg={cfg!r}: pass a workbench.RunConfig, e.g. wb.Panel(wb.RunConfig(task='digits'))"
        )


class Panel(ConfigControls, RunActions):
    """Controls for a RunConfig, what they imply, Launch/Stop, and the live dashboard of the run.

    `Panel(cfg)` fills the controls from `cfg`; fields without a control keep cfg's values. Pass
    your own Task object as `task=` to offer it beside the built-in tasks; `target=` plans for
    catalog GPUs; `cluster=wb.Slurm(...)` starts with "where" on that Slurm cluster (Launch
    submits). In a notebook the panel displays itself.
    """

    poll_interval = 1.0
    """Seconds between dashboard reads of the run directory."""

    def __init__(
        self,
        cfg: RunConfig | None = None,
        *,
        task: Task | None = None,
        target: Target | str | None = None,
        cluster: Slurm | None = None,
        display: bool = True,
        estimate: bool = True,
    ) -> None:
        _check_arguments(cfg, task, cluster)
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
        self._processes_here: int | None = None
        """The processes box's value on this machine while the target is elsewhere (restored on
        return)."""
        self._lock = threading.RLock()  # the waiting thread and the kernel both change status
        self.live_estimate = estimate
        """Estimate memory, time and cost as the controls change (it traces a step in this
        process)."""
        self._build_widgets(
            base, Target(gpu=target) if isinstance(target, str) else target, cluster
        )
        self.state.observe(self._render)
        self._fill(base)
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
    def _build_widgets(self, base: RunConfig, target: Target | None, cluster: Slurm | None) -> None:
        self._build_inputs(base, target, cluster)
        self._build_outputs()
        self._build_buttons()
        self.widget = panel_box(self)

    def _build_inputs(self, base: RunConfig, target: Target | None, cluster: Slurm | None) -> None:
        """Where the run goes, a control per RunConfig field the panel edits, the task's options."""
        self.target_controls = TargetControls(target, cluster, base)
        self.target_controls.on_change(self._on_target)
        self.device = resolve_device(base, detect())
        self.controls, self.precision_reasons = build_controls(
            self.device, self._task_options(base.task)
        )
        for control in self.controls.values():
            control.observe(self._on_control, names="value")
        self.task_controls = TaskControls(self._task_object(base.task), base.task_options)
        self.task_controls.on_change(lambda values: None if self._filling else self._derive())

    def _build_outputs(self) -> None:
        """The boxes `_render` fills: what the settings imply, the problem, status and error lines,
        and the room for the run's dashboard."""
        self.limit = widgets.HTML()
        self.mode_info = html_box("wb-mode-info")
        self.batch_info = html_box("wb-batch")
        self.launch_info = html_box("wb-launch-info")
        self.layout_box = html_box("wb-layout-box")
        self.estimate_box = EstimateBox()
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

    def _derive(self) -> None:
        # first, before anything that takes time: what the panel shows is for the settings before
        # this change
        self.estimate_box.mark_stale()
        cfg: RunConfig | None = None
        try:
            cfg = self.config
            # where the run goes comes first: a plan for a cluster that can't be read says that, not
            # a size
            problem = self.target_controls.problem()
            if not problem:
                check_plan(cfg, self.target, self.task_for(cfg.task))
        except ValueError as e:  # cfg stays None when RunConfig itself refused the values
            problem = str(e)
        with self.state.hold_trait_notifications():
            self.state.config = cfg
            self.state.problem = problem
        if not self.measures_the_settings():  # a run's figures belong to the settings it ran with
            self.estimate_box.show_measured(None, None, None)
        self._render()
        self._request_estimate()

    # ---- the one view of the state ---------------------------------------------------------------
    def _render(self, change: Any = None) -> None:
        with self._lock:
            s = self.state
            frozen = s.status in ACTIVE or s.busy
            for control in self.controls.values():
                control.disabled = frozen
            self.task_controls.disabled = frozen
            blocked = blocked_reason(s, self.target)
            self.launch_button.disabled = frozen or bool(blocked)
            self.launch_button.button_style = "" if self.launch_button.disabled else "success"
            self.stop_button.disabled = s.status != Status.RUNNING or s.busy
            # a disabled button keeps its colour in ipywidgets; an orange Stop reads as "press me"
            self.stop_button.button_style = "" if self.stop_button.disabled else "warning"
            self.resume_button.disabled = frozen or not self._resumable() or bool(blocked)
            self.save_button.disabled = s.busy or s.config is None
            self.yaml_path.disabled = s.busy
            cfg = s.config
            self.batch_info.value = batch_html(cfg)
            self.launch_info.value = self._launch_html(cfg, s.problem)
            self.limit.value = self.target_controls.limit_html(cfg)
            self._show_fields(cfg)
            self.layout_box.value = layout_html(cfg, s.problem)
            self.problem_box.value = (
                ""
                if not s.problem
                else "<div style='color:#b00020;white-space:pre-wrap'>⚠ "
                f"{html.escape(s.problem)}</div>"
            )
            # the problem line says why a plan can't run; the status line only points at it
            self.status_box.value = status_html(
                s,
                self.run.run_dir.name if self.run else "",
                resumable=self._resumable(),
                blocked="see the problem above" if s.problem else blocked,
            )
            self.error_box.value = error_html(s.error)

    def _launch_html(self, cfg: RunConfig | None, problem: str) -> str:
        """How Launch starts the run: its processes here, the Slurm job it submits, or only a
        plan."""
        target = self.target
        if cfg is None:
            return ""
        if problem:
            return ""
        if target.local:
            return html.escape(describe_launch(cfg))
        if target.partition:
            return f"Launch submits a Slurm job: {html.escape(target.describe(cfg))}"
        return f"planned for {html.escape(target.describe(cfg))}"

    def _show_fields(self, cfg: RunConfig | None) -> None:
        """Controls that mean something only for some settings are shown only then."""
        c = self.controls
        parallelism = c["parallelism"].value
        c["dp_shard"].layout.display = None if parallelism == "hsdp" else "none"
        piped = (cfg.pp if cfg else c["pp"].value) > 1
        c["pp_schedule"].layout.display = None if piped else "none"
        c["pp_virtual_stages"].layout.display = (
            None if piped and c["pp_schedule"].value in INTERLEAVED else "none"
        )
        cpu_here = self.target.local and not detect().has_cuda
        c["oversubscribe"].layout.display = None if cpu_here else "none"
        self.mode_info.value = (
            f"<small>{html.escape(PARALLELISM_MODES.get(parallelism, ''))}</small>"
        )

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
        return (
            f"<workbench.Panel status={self.state.status!r} "
            f"run={self.run.run_dir.name if self.run else None!r}>"
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The live widget, plus a static snapshot for frontends without a kernel (papermill output,
        nbconvert)."""
        from workbench.notebook.snapshot import panel_html

        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = panel_html(self)
        return bundle
