"""The panel's controls and the RunConfig they form, kept in step: fill the controls from a config,
read a config from them, and when one control changes, move the ones tied to it (the task's options
with the task, the processes with the target's size, hsdp's shard group with the parallelism, the
precisions' labels with the target's devices). A mixin of Panel (panel.py), which owns the widgets
and the state these methods change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from workbench.config import RunConfig
from workbench.config.mesh_checks import default_shard_group
from workbench.estimator.target import Target
from workbench.notebook.panel.controls import precision_options, read_micro_batch, task_options
from workbench.notebook.panel.panel_state import ACTIVE
from workbench.tasks import Task, get_task

if TYPE_CHECKING:
    from workbench.notebook.panel.panel import Panel


class ConfigControls:
    """The controls as a RunConfig, and a RunConfig as the controls."""

    def _task_options(self: Panel, selected: str) -> list[tuple[str, str]]:
        return task_options(self.user_task, selected)

    def _control_values(self: Panel) -> dict[str, Any]:
        values = {name: control.value for name, control in self.controls.items()}
        values["run_name"] = values["run_name"].strip() or None
        values["micro_batch_size"] = read_micro_batch(values["micro_batch_size"])
        values["task_options"] = self.task_controls.values()
        return values

    @property
    def config(self: Panel) -> RunConfig:
        """The RunConfig as the controls stand; ValueError (RunConfig's message) when they don't
        form one. A config made for this machine's CPU (device='cpu') planned for GPUs elsewhere
        runs on their devices."""
        values = self._control_values()
        if self._base.device == "cpu" and not self.target.cpu_nodes:
            values["device"] = "auto"
        return self._base.replace(**values)

    @config.setter
    def config(self: Panel, cfg: RunConfig) -> None:
        if self.state.status in ACTIVE:
            raise RuntimeError(
                "the settings are frozen while a run is going: stop it or wait for it first"
            )
        self._base = cfg
        self._fill(cfg)

    @property
    def target(self: Panel) -> Target:
        """The hardware the run is planned for (the target controls)."""
        return self.target_controls.target

    def _fill(self: Panel, cfg: RunConfig) -> None:
        with self._quietly():
            c = self.controls
            self.task_controls.set(self._task_object(cfg.task), cfg.task_options)
            c["task"].options = self._task_options(cfg.task)
            self._relabel_precisions(shown=cfg.precision)
            for name, control in c.items():
                value = getattr(cfg, name)
                control.value = (
                    "" if value is None else str(value) if name == "micro_batch_size" else value
                )
            self._follow_target(cfg)
        self._derive()

    def _follow_target(self: Panel, cfg: RunConfig) -> None:
        """A target elsewhere decides the world size: processes become its GPUs x nodes, and the
        panel says so when the config had another count (restored when the target is this machine
        again)."""
        world = self.target_controls.world
        if world is None or self.target_controls.problem() or world == cfg.num_processes:
            return
        self._processes_here = cfg.num_processes
        self.controls["num_processes"].value = world
        self.state.message = (
            f"processes set to {world} for the target's {self.target.describe(cfg)} (the config "
            f"had num_processes={cfg.num_processes})"
        )

    @contextlib.contextmanager
    def _quietly(self: Panel) -> Iterator[None]:
        """Set controls from code without each change re-deriving the panel (the caller derives
        once)."""
        before, self._filling = self._filling, True
        try:
            yield
        finally:
            # nested (a fill that relabels the precisions): still filling after the inner
            self._filling = before

    def _on_control(self: Panel, change: dict[str, Any]) -> None:
        if self._filling:
            return
        self.state.message = ""  # a note about the settings before this change
        c = self.controls
        if change["owner"] is c["task"]:  # the old task's options don't carry over
            self.task_controls.set(self._task_object(change["new"]), {})
        if change["owner"] is c["num_processes"]:
            with self._quietly():  # one world size: GPUs per node follows the processes box
                self.target_controls.follow_processes(change["new"])
        if change["owner"] is c["parallelism"]:
            with self._quietly():  # the shard group is hsdp's alone: a valid size on, 0 off
                c["dp_shard"].value = (
                    default_shard_group(c["num_processes"].value, c["tp"].value)
                    if change["new"] == "hsdp"
                    else 0
                )
        self._derive()

    def _on_target(self: Panel) -> None:
        if self._filling:
            return
        self.state.message = ""
        self._relabel_precisions()
        world, processes = self.target_controls.world, self.controls["num_processes"]
        with self._quietly():
            if world is None and self._processes_here is not None:
                # back on this machine: its own count
                processes.value, self._processes_here = self._processes_here, None
            elif world is not None and not self.target_controls.problem():
                # it follows GPUs x nodes
                if self._processes_here is None:
                    self._processes_here = processes.value
                processes.value = world
        self._derive()

    def _task_object(self: Panel, name: str) -> Task | None:
        """The task named `name` (the user's or the registry's), or None when no task has that
        name."""
        try:
            return self.task_for(name) or get_task(name)
        except ValueError:
            return None

    def task_for(self: Panel, name: str) -> Task | None:
        """The user's Task object when `name` is its name; None means the registry resolves it."""
        return (
            self.user_task if self.user_task is not None and name == self.user_task.name else None
        )

    def _relabel_precisions(self: Panel, shown: str | None = None) -> None:
        """Precisions are marked unavailable for the target's devices, not this machine's. `shown`:
        the value to show (a config's own), offered even where workbench doesn't train it."""
        target = self.target
        hw = target.hardware(self._base)
        device = self.device if target.local else "cpu" if target.cpu_nodes else "cuda"
        control = self.controls["precision"]
        value = shown or control.value
        options, self.precision_reasons = precision_options(device, hw, shown=value)
        with self._quietly():
            control.options, control.value = options, value
            control.tooltip = "; ".join(self.precision_reasons.values()) or None
