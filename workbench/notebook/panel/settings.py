"""The panel's settings: the controls for a RunConfig's fields, the task's options and where the run
goes, and the RunConfig they form, kept in step. `SettingsForm` fills the controls from a config,
reads a config from them, and when one control changes moves the ones tied to it (the task's options
with the task, the processes with the target's size, hsdp's shard group with the parallelism, the
precisions' labels with the target's devices), then tells the panel, which re-derives its state."""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable, Iterator
from typing import Any

import ipywidgets as widgets

from workbench.cluster.raytrain.spec import Ray
from workbench.cluster.slurm import Slurm
from workbench.config import PARALLELISM_MODES, RunConfig
from workbench.config.mesh import INTERLEAVED
from workbench.config.mesh_checks import default_shard_group
from workbench.estimator.target import Target
from workbench.notebook.panel.controls import (
    build_controls,
    precision_note_html,
    precision_options,
    precision_tooltip,
    read_micro_batch,
    task_options,
)
from workbench.notebook.panel.state import PanelState
from workbench.notebook.panel.target_controls import TargetControls
from workbench.notebook.panel.task_controls import TaskControls
from workbench.notebook.panel.widgets import html_box
from workbench.tasks import Task, get_task
from workbench.utils.hardware import detect, resolve_device


class SettingsForm:
    """The controls as a RunConfig, and a RunConfig as the controls.

    `widget` is the column to place; `config` the RunConfig the controls form (ValueError when they
    don't); `fill(cfg)` shows a config; `show(...)` re-derives the controls' own view (frozen, which
    are shown, the notes beside them) and is called by the panel's one observer. Each change a user
    makes calls `changed()` once, after the controls tied to it have followed.
    """

    def __init__(
        self,
        base: RunConfig,
        state: PanelState,
        changed: Callable[[], None],
        *,
        user_task: Task | None,
        target: Target | None,
        cluster: Slurm | Ray | None,
    ) -> None:
        self.base = base
        """The config the controls were filled from: fields without a control keep its values."""
        self.user_task = user_task
        self._state = state
        self._changed = changed
        self._filling = False
        self.target_controls = TargetControls(target, cluster, base)
        self.target_controls.on_change(self._on_target)
        self.device = resolve_device(base, detect())
        self.controls, self.precision_reasons = build_controls(
            self.device, self._task_options(base.task)
        )
        for control in self.controls.values():
            control.observe(self._on_control, names="value")
        self.task_controls = TaskControls(self.task_object(base.task), base.task_options)
        self.task_controls.on_change(self._on_task_option)
        self.limit = widgets.HTML()
        """What the target offers, beside the processes box."""
        self.processes_note = html_box("wb-moved-note")
        """Says so when a change elsewhere moved the processes box (the state's notes)."""
        self.processes_note.add_class("wb-processes-note")
        self.mode_info = html_box("wb-mode-info")
        """The chosen parallelism mode in a line, below its dropdown."""
        self.precision_note = html_box(
            "wb-precision-note", precision_note_html(self.precision_reasons)
        )
        """Why the unavailable precisions are, under their dropdown (their labels stay short)."""
        self.widget = self._column()

    def _column(self) -> widgets.VBox:
        c = self.controls
        # the controls keep their width
        return widgets.VBox(
            [
                c["task"],
                self.task_controls.widget,
                self.target_controls.widget,
                widgets.HBox([c["num_processes"], self.limit]),
                self.processes_note,
                c["oversubscribe"],
                c["parallelism"],
                self.mode_info,
                c["dp_shard"],
                c["tp"],
                c["cp"],
                c["pp"],
                c["pp_schedule"],
                c["pp_virtual_stages"],
                c["activation_checkpointing"],
                c["compile"],
                c["precision"],
                self.precision_note,
                c["micro_batch_size"],
                c["grad_accum_steps"],
                c["max_steps"],
                c["lr"],
                c["run_name"],
            ],
            layout=widgets.Layout(flex="0 0 auto"),
        )

    # ---- controls <-> RunConfig ------------------------------------------------------------------
    def _task_options(self, selected: str) -> list[tuple[str, str]]:
        return task_options(self.user_task, selected)

    def _control_values(self) -> dict[str, Any]:
        values = {name: control.value for name, control in self.controls.items()}
        values["run_name"] = values["run_name"].strip() or None
        values["micro_batch_size"] = read_micro_batch(values["micro_batch_size"])
        values["task_options"] = self.task_controls.values()
        return values

    @property
    def config(self) -> RunConfig:
        """The RunConfig as the controls stand; ValueError (RunConfig's message) when they don't
        form one. A config made for this machine's CPU (device='cpu') planned for GPUs elsewhere
        runs on their devices."""
        values = self._control_values()
        if self.base.device == "cpu" and not self.target.cpu_nodes:
            values["device"] = "auto"
        return self.base.replace(**values)

    @property
    def target(self) -> Target:
        """The hardware the run is planned for (the target controls)."""
        return self.target_controls.target

    def fill(self, cfg: RunConfig) -> None:
        """Show `cfg` in the controls (it becomes the base for fields without one), then tell the
        panel once."""
        self.base = cfg
        self._state.notes = {}
        with self._quietly():
            c = self.controls
            self.task_controls.set(self.task_object(cfg.task), cfg.task_options)
            c["task"].options = self._task_options(cfg.task)
            self._relabel_precisions(shown=cfg.precision)
            for name, control in c.items():
                value = getattr(cfg, name)
                control.value = (
                    "" if value is None else str(value) if name == "micro_batch_size" else value
                )
            self._follow_target(cfg)
        self._changed()

    def _follow_target(self, cfg: RunConfig) -> None:
        """A target elsewhere decides the world size: processes become its GPUs x nodes, and the
        panel says so when the config had another count (restored when the target is this machine
        again)."""
        world = self.target_controls.world
        if world is None or self.target_controls.problem() or world == cfg.num_processes:
            return
        self._state.processes_here = cfg.num_processes
        self.controls["num_processes"].value = world
        self._state.notes = {
            "num_processes": f"processes {cfg.num_processes} → {world}: the target's "
            f"{self.target_controls.size_text()}"
        }
        self._state.message = (
            f"processes set to {world} for the target's {self.target.describe(cfg)} (the config "
            f"had num_processes={cfg.num_processes})"
        )

    @contextlib.contextmanager
    def _quietly(self) -> Iterator[None]:
        """Set controls from code without each change re-deriving the panel (the caller derives
        once)."""
        before, self._filling = self._filling, True
        try:
            yield
        finally:
            # nested (a fill that relabels the precisions): still filling after the inner
            self._filling = before

    def _on_control(self, change: dict[str, Any]) -> None:
        if self._filling:
            return
        # notes about the settings before this change
        self._state.message, notes = "", {}
        c = self.controls
        if change["owner"] is c["task"]:  # the old task's options don't carry over
            self.task_controls.set(self.task_object(change["new"]), {})
        if change["owner"] is c["num_processes"]:
            with self._quietly():  # one world size: GPUs per node follows the processes box
                moved = self.target_controls.follow_processes(change["new"])
            if moved:
                notes["gpus_per_node"] = moved
        if change["owner"] is c["parallelism"]:
            with self._quietly():  # the shard group is hsdp's alone: a valid size on, 0 off
                c["dp_shard"].value = (
                    default_shard_group(c["num_processes"].value, c["tp"].value)
                    if change["new"] == "hsdp"
                    else 0
                )
        self._state.notes = notes
        self._changed()

    def _on_task_option(self, values: dict[str, Any]) -> None:
        if not self._filling:
            self._state.notes = {}  # they were about the change before this one
            self._changed()

    def _on_target(self) -> None:
        if self._filling:
            return
        s = self._state
        s.message = ""
        self._relabel_precisions()
        world, processes = self.target_controls.world, self.controls["num_processes"]
        before, why = processes.value, ""
        with self._quietly():
            if world is None and s.processes_here is not None:
                # back on this machine: its own count
                processes.value, s.processes_here = s.processes_here, None
                why = "this machine's count from before the target changed"
            elif world is not None and not self.target_controls.problem():
                # it follows GPUs x nodes
                if s.processes_here is None:
                    s.processes_here = processes.value
                processes.value = world
                why = f"the target's {self.target_controls.size_text()}"
        s.notes = (
            {"num_processes": f"processes {before} → {processes.value}: {why}"}
            if processes.value != before
            else {}
        )
        self._changed()

    def task_object(self, name: str) -> Task | None:
        """The task named `name` (the user's or the registry's), or None when no task has that
        name."""
        try:
            return self.task_for(name) or get_task(name)
        except ValueError:
            return None

    def task_for(self, name: str) -> Task | None:
        """The user's Task object when `name` is its name; None means the registry resolves it."""
        return (
            self.user_task if self.user_task is not None and name == self.user_task.name else None
        )

    def _relabel_precisions(self, shown: str | None = None) -> None:
        """Precisions are marked unavailable for the target's devices, not this machine's. `shown`:
        the value to show (a config's own), offered even where workbench doesn't train it."""
        target = self.target
        hw = target.hardware(self.base)
        device = self.device if target.local else "cpu" if target.cpu_nodes else "cuda"
        control = self.controls["precision"]
        value = shown or control.value
        options, self.precision_reasons = precision_options(device, hw, shown=value)
        with self._quietly():
            control.options, control.value = options, value
            control.tooltip = precision_tooltip(self.precision_reasons)
        self.precision_note.value = precision_note_html(self.precision_reasons)

    # ---- the controls' own view ------------------------------------------------------------------
    def show(
        self,
        cfg: RunConfig | None,
        target: Target,
        *,
        frozen: bool,
        notes: dict[str, str] | None = None,
    ) -> None:
        """Re-derive the controls' view: frozen while a run goes, shown only where they mean
        something for these settings, the notes beside them (`notes`: what the last change moved,
        by the moved control's field)."""
        for control in self.controls.values():
            control.disabled = frozen
        self.task_controls.disabled = frozen
        notes = notes or {}
        self.limit.value = self.target_controls.limit_html(
            cfg, self.controls["num_processes"].value
        )
        self.processes_note.value = note_html(notes.get("num_processes", ""))
        self.target_controls.moved_note.value = note_html(notes.get("gpus_per_node", ""))
        c = self.controls
        parallelism = c["parallelism"].value
        c["dp_shard"].layout.display = None if parallelism == "hsdp" else "none"
        piped = (cfg.pp if cfg else c["pp"].value) > 1
        c["pp_schedule"].layout.display = None if piped else "none"
        c["pp_virtual_stages"].layout.display = (
            None if piped and c["pp_schedule"].value in INTERLEAVED else "none"
        )
        cpu_here = target.local and not detect().has_cuda
        c["oversubscribe"].layout.display = None if cpu_here else "none"
        self.mode_info.value = (
            f"<small>{html.escape(PARALLELISM_MODES.get(parallelism, ''))}</small>"
        )


def note_html(note: str) -> str:
    """A control another change moved, said beside it ('' when none moved)."""
    if not note:
        return ""
    return (
        "<small style='color:#8a5a00;margin-left:144px;display:block;max-width:236px;"
        "line-height:1.35'>"
        f"↳ {html.escape(note)}</small>"
    )
