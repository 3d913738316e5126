"""The panel's target: the hardware a run is planned for (this machine, or a catalog accelerator x GPUs per
node x nodes). Its world size is the run's: with a catalog target, the processes box and GPUs x nodes are one
number, kept equal whichever of them the user changes."""

from __future__ import annotations

import html

import ipywidgets as widgets

from workbench.config import RunConfig
from workbench.estimator.catalog import THIS_MACHINE, load_catalog
from workbench.estimator.target import Target
from workbench.utils.hardware import detect, resolve_device

STYLE = {"description_width": "140px"}


class TargetControls:
    """Dropdown of targets, GPUs per node and nodes (shown for catalog targets only), and the line that says
    what the target has."""

    def __init__(self, target: Target | None = None) -> None:
        target = target or Target()
        names = sorted(load_catalog(target.catalog))
        self.catalog = target.catalog
        self.gpu = widgets.Dropdown(options=[("this machine", THIS_MACHINE), *[(n, n) for n in names]],
                                    value=target.gpu, description="target", style=STYLE,
                                    layout=widgets.Layout(width="380px"),
                                    tooltip="the hardware the run is planned for: checks, rank layout and "
                                            "estimate are for it")
        small = {"description_width": "90px"}
        self.gpus_per_node = widgets.BoundedIntText(value=target.gpus_per_node or 8, min=1, max=1024,
                                                    description="GPUs per node", style=small,
                                                    layout=widgets.Layout(width="170px"))
        self.nodes = widgets.BoundedIntText(value=target.nodes, min=1, max=4096, description="nodes", style=small,
                                            layout=widgets.Layout(width="170px"))
        for control, css in ((self.gpu, "wb-target"), (self.gpus_per_node, "wb-target-gpus"),
                             (self.nodes, "wb-target-nodes")):
            control.add_class(css)
        self.size_box = widgets.HBox([self.gpus_per_node, self.nodes], layout=widgets.Layout(margin="0 0 0 144px"))
        self.widget = widgets.VBox([self.gpu, self.size_box])
        self.refresh()

    @property
    def local(self) -> bool:
        return self.gpu.value == THIS_MACHINE

    @property
    def target(self) -> Target:
        if self.local:
            return Target(catalog=self.catalog)
        return Target(gpu=self.gpu.value, gpus_per_node=self.gpus_per_node.value, nodes=self.nodes.value,
                      catalog=self.catalog)

    @property
    def world(self) -> int | None:
        """Ranks the target has in all, or None on this machine (the processes box decides)."""
        return None if self.local else self.gpus_per_node.value * self.nodes.value

    def refresh(self) -> None:
        self.size_box.layout.display = "none" if self.local else None

    def follow_processes(self, processes: int) -> bool:
        """The processes box changed: make GPUs per node follow it when the nodes divide it. False when they
        don't (the plan's check then says what would work)."""
        if self.local or processes < 1 or processes % self.nodes.value:
            return False
        self.gpus_per_node.value = processes // self.nodes.value
        return True

    def limit_html(self, cfg: RunConfig | None) -> str:
        """What the target offers, beside the processes box."""
        if self.local:
            hw = detect()
            device = resolve_device(cfg, hw) if cfg else ("cuda" if hw.has_cuda else "cpu")
            text = f"up to {hw.max_processes(device)} on {hw.describe(device)}"
        else:
            text = f"= {self.gpus_per_node.value} GPUs × {self.nodes.value} node" + "s" * (self.nodes.value > 1)
        return f"<small style='white-space:nowrap'>{html.escape(text)}</small>"
