"""The panel's "where": this machine (run here, or plan for catalog GPUs to rent), a Slurm cluster
(a partition `sinfo` lists; Launch submits) or a Ray cluster (Launch starts the ranks as its Ray
Train workers). The target is the hardware a run is planned for; its world size is the run's: the
processes box and GPUs (or ranks) per node x nodes are one number, kept equal whichever the user
changes (on Ray the processes box alone: Ray places the workers)."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets

from workbench.cluster.raytrain.spec import Ray
from workbench.cluster.slurm import Slurm
from workbench.config import RunConfig
from workbench.estimator.catalog import THIS_MACHINE, by_model, load_catalog
from workbench.estimator.target import Target
from workbench.notebook.panel.ray_controls import RayControls, cluster_line
from workbench.notebook.panel.slurm_controls import SlurmControls
from workbench.utils.hardware import detect, resolve_device

STYLE = {"description_width": "140px"}
HERE, SLURM, RAY = "here", "slurm", "ray"


def _where_buttons(cluster: Slurm | Ray | None) -> widgets.ToggleButtons:
    """This machine, a Slurm cluster or a Ray cluster: the cluster when one was given."""
    return widgets.ToggleButtons(
        options=[("this machine", HERE), ("Slurm cluster", SLURM), ("Ray cluster", RAY)],
        value=RAY if isinstance(cluster, Ray) else SLURM if cluster else HERE,
        description="where",
        style=STYLE,
        tooltips=[
            "run here, or plan for GPUs to rent",
            "submit to a Slurm cluster's partition (sinfo's)",
            "run the ranks as Ray Train workers on a Ray cluster",
        ],
    )


def _size_boxes(
    target: Target, cluster: Slurm | None, cfg: RunConfig | None
) -> tuple[widgets.BoundedIntText, widgets.BoundedIntText]:
    """GPUs (ranks) per node and nodes, from the Slurm job when there is one, else the
    target's."""
    per_node = cluster.per_node(cfg or RunConfig()) if cluster else None
    # one under the other, labelled like every control: side by side they overflowed a narrow
    # notebook
    gpus_per_node = widgets.BoundedIntText(
        value=per_node or target.gpus_per_node or 8,
        min=1,
        max=1024,
        description="GPUs per node",
        style=STYLE,
        layout=widgets.Layout(width="220px"),
    )
    nodes = widgets.BoundedIntText(
        value=cluster.nodes if cluster else target.nodes,
        min=1,
        max=4096,
        description="nodes",
        style=STYLE,
        layout=widgets.Layout(width="220px"),
    )
    return gpus_per_node, nodes


class TargetControls:
    """Where the run goes (this machine, a Slurm or a Ray cluster), the device it is planned for,
    GPUs (ranks) per node and nodes, and the line that says what the target has. `on_change`
    callbacks run once per change."""

    def __init__(
        self,
        target: Target | None = None,
        cluster: Slurm | Ray | None = None,
        cfg: RunConfig | None = None,
    ) -> None:
        slurm = cluster if isinstance(cluster, Slurm) else None
        target = target or Target()
        self.catalog = target.catalog
        self.names = sorted(load_catalog(target.catalog))
        self.where = _where_buttons(cluster)
        self.gpu = widgets.Dropdown(
            options=self._gpu_options(),
            value=target.gpu,
            description="target",
            style=STYLE,
            layout=widgets.Layout(width="380px"),
            tooltip="the hardware the run is planned for: checks, rank layout and "
            "estimate are for it",
        )
        self.gpus_per_node, self.nodes = _size_boxes(target, slurm, cfg)
        for control, css in (
            (self.where, "wb-where"),
            (self.gpu, "wb-target"),
            (self.gpus_per_node, "wb-target-gpus"),
            (self.nodes, "wb-target-nodes"),
        ):
            control.add_class(css)
        self.slurm = SlurmControls(slurm)
        self.ray = RayControls(cluster if isinstance(cluster, Ray) else None)
        self.moved_note = widgets.HTML()
        """Says so when a change elsewhere moved GPUs per node (the panel's state.notes)."""
        self.moved_note.add_class("wb-moved-note")
        self.moved_note.add_class("wb-gpus-note")
        self.size_box = widgets.VBox([self.gpus_per_node, self.moved_note, self.nodes])
        self.widget = widgets.VBox(
            [self.where, self.slurm.widget, self.ray.widget, self.gpu, self.size_box]
        )
        self._callbacks: list[Callable[[], None]] = []
        self._refreshing = False
        self._observe_controls()
        if slurm is not None:
            self.slurm.read()
        self.refresh()  # a Ray cluster is read on ↻ only: connecting takes seconds

    def _observe_controls(self) -> None:
        """Every control of the target, Slurm's and Ray's included, and sinfo's or Ray's answer
        call `_changed`."""
        for control in (
            self.where,
            self.gpu,
            self.gpus_per_node,
            self.nodes,
            self.slurm.partition,
            self.slurm.time,
            self.slurm.options,
            *self.ray.values,
        ):
            control.observe(self._changed, names="value")
        self.slurm.on_read(self._changed)
        self.ray.on_read(self._changed)

    def on_change(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def _changed(self, change: Any = None) -> None:
        if self._refreshing:
            return
        if (
            change is not None
            and change.get("owner") is self.where
            and change["new"] == SLURM
            and not self.slurm.found
        ):
            self.slurm.read()  # calls back here once the partitions are in
            return
        self.refresh()
        for callback in self._callbacks:
            callback()

    @property
    def on_slurm(self) -> bool:
        return self.where.value == SLURM

    @property
    def on_ray(self) -> bool:
        return self.where.value == RAY

    @property
    def elsewhere(self) -> bool:
        """On a cluster (Slurm or Ray): the GPU model is the cluster's, never this machine."""
        return self.on_slurm or self.on_ray

    @property
    def local(self) -> bool:
        return not self.elsewhere and self.gpu.value == THIS_MACHINE

    @property
    def target(self) -> Target:
        if self.on_slurm:
            part = self.slurm.part or {"gpus": 0, "cpus": 0}
            return Target(
                gpu=self.gpu.value if part["gpus"] else THIS_MACHINE,
                gpus_per_node=self.gpus_per_node.value,
                nodes=self.nodes.value,
                catalog=self.catalog,
                partition=self.slurm.partition.value or "?",
                cpus_per_node=0 if part["gpus"] else part["cpus"],
            )
        if self.on_ray:
            return self.ray.target(self.gpu.value, self.catalog)
        if self.local:
            return Target(catalog=self.catalog)
        return Target(
            gpu=self.gpu.value,
            gpus_per_node=self.gpus_per_node.value,
            nodes=self.nodes.value,
            catalog=self.catalog,
        )

    def cluster(self) -> Slurm | Ray | None:
        """The Slurm job or the wb.Ray Launch submits, or None when the run goes to this
        machine."""
        if self.on_ray:
            return self.ray.spec()
        if not self.on_slurm:
            return None
        return self.slurm.slurm(nodes=self.nodes.value, per_node=self.gpus_per_node.value)

    def problem(self, cfg: RunConfig | None = None) -> str:
        """Why the where-controls can't form a target to launch `cfg` on ('' when they can)."""
        if self.on_ray:
            return self.ray.problem(cfg)
        return self.slurm.problem() if self.on_slurm else ""

    @property
    def world(self) -> int | None:
        """Ranks the target has in all, or None on this machine or Ray (the processes box
        decides: Ray places as many workers)."""
        if self.local or self.on_ray:
            return None
        return self.gpus_per_node.value * self.nodes.value

    def _gpu_options(self, *, with_this_machine: bool = True) -> list[tuple[str, str]]:
        return [("this machine", THIS_MACHINE)] * with_this_machine + [(n, n) for n in self.names]

    def refresh(self) -> None:
        """Show what the choice needs: Slurm's box, the GPU model for a GPU partition, the sizes,
        their bounds."""
        self._refreshing = True
        try:
            self.slurm.widget.layout.display = None if self.on_slurm else "none"
            self.slurm.info.value = self.slurm.info_html()
            self.ray.widget.layout.display = None if self.on_ray else "none"
            self.ray.info.value = self.ray.info_html()
            part = self.slurm.part if self.on_slurm else None
            gpus = bool(part and part["gpus"]) or (self.on_ray and self.ray.gpus.value > 0)
            if self.on_slurm:
                self._bound_to(part)
            else:
                self.gpus_per_node.max, self.nodes.max = 1024, 4096
            options = self._gpu_options(with_this_machine=not self.elsewhere)
            if self.gpu.options != tuple(options):
                keep = self.gpu.value if self.gpu.value in self.names else self.names[0]
                self.gpu.options = options  # back on this machine, the plan is for it again
                self.gpu.value = keep if self.elsewhere else THIS_MACHINE
            # the GPU model the cluster reports: the partition's GRES type, Ray's accelerator_type
            found = part["gpu_type"] if part is not None else None
            if self.on_ray:
                found = self.ray.accelerator_type()
            if gpus and found:
                self.gpu.value = by_model(found, load_catalog(self.catalog)) or self.gpu.value
            self.gpu.description = "GPU model" if self.elsewhere else "target"
            self.gpu.layout.display = None if not self.elsewhere or gpus else "none"
            self.gpus_per_node.description = (
                "GPUs per node" if not self.on_slurm or gpus else "ranks per node"
            )
            # on Ray the processes box is the size: Ray places the workers on its nodes
            self.size_box.layout.display = "none" if self.local or self.on_ray else None
        finally:
            self._refreshing = False

    def _bound_to(self, part: dict[str, Any] | None) -> None:
        """Nodes and GPUs (CPU partitions: ranks) per node within what the partition has."""
        if part is None:
            return
        per_node = part["gpus"] or max(1, part["cpus"])
        self.nodes.max, self.gpus_per_node.max = max(1, part["nodes"]), per_node
        self.nodes.value = min(self.nodes.value, self.nodes.max)
        self.gpus_per_node.value = min(self.gpus_per_node.value, per_node)

    def follow_processes(self, processes: int) -> str:
        """The processes box changed: make GPUs per node follow it when the nodes divide it, and
        return what moved, in words ('GPUs per node 8 → 6 to fit 12 processes on 2 nodes'). '' when
        nothing moved: the nodes don't divide it (the plan's check then says what would work), or
        it already fits."""
        if self.local or self.on_ray or processes < 1 or processes % self.nodes.value:
            return ""
        per_node, before = processes // self.nodes.value, self.gpus_per_node.value
        if per_node > self.gpus_per_node.max or per_node == before:
            return ""
        self._refreshing = True
        try:
            self.gpus_per_node.value = per_node
        finally:
            self._refreshing = False
        nodes = self.nodes.value
        return (
            f"{self.gpus_per_node.description} {before} → {per_node} to fit {processes} "
            f"processes on {nodes} node{'s' * (nodes != 1)}"
        )

    def size_text(self) -> str:
        """The target's size as its controls say: '6 GPUs × 2 nodes' ('ranks' on a CPU
        partition)."""
        part = self.slurm.part if self.on_slurm else None
        unit = "GPU" if not self.on_slurm or (part and part["gpus"]) else "rank"
        per_node, nodes = self.gpus_per_node.value, self.nodes.value
        return f"{per_node} {unit}{'s' * (per_node != 1)} × {nodes} node{'s' * (nodes != 1)}"

    def limit_html(self, cfg: RunConfig | None, processes: int) -> str:
        """What the target offers, beside the processes box (holding `processes`): derived from
        both on every change, so it never states a sum the box doesn't hold ('= 6 GPUs × 2 nodes'
        beside 12; '≠ 12 = 6 GPUs × 2 nodes', in red, beside 7)."""
        if self.on_ray:
            return self._ray_limit_html(processes)
        if self.local:
            hw = detect()
            device = resolve_device(cfg, hw) if cfg else ("cuda" if hw.has_cuda else "cpu")
            limit = hw.max_processes(device)
            text = f"up to {limit} on {hw.device_line(device)}"
            over = processes > limit and not (cfg is not None and cfg.oversubscribe)
        else:
            world = self.gpus_per_node.value * self.nodes.value
            over = processes != world
            text = f"≠ {world} = {self.size_text()}" if over else f"= {self.size_text()}"
        colour = ";color:#b00020" if over else ""
        return (
            f"<small class='wb-limit' data-matches='{str(not over).lower()}' "
            f"style='white-space:nowrap{colour}'>{html.escape(text)}</small>"
        )

    def _ray_limit_html(self, processes: int) -> str:
        """Beside the processes box on Ray: the workers it asks for, and what the cluster has once
        read."""
        spec = self.ray
        each = f"CPU {spec.cpus.value:g}" + (
            f", GPU {spec.gpus.value:g}" if spec.gpus.value else ""
        )
        text = f"= {processes} Ray worker{'s' * (processes != 1)} of {each}"
        if spec.nodes is not None:
            text += f"; the cluster: {cluster_line(spec.nodes)}"
        return (
            f"<small class='wb-limit' data-matches='true' style='white-space:nowrap'>"
            f"{html.escape(text)}</small>"
        )
