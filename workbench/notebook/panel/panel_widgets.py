"""Where the panel's widgets go: the controls on the left, what they imply on the right (below the
controls when the notebook is too narrow), then the problem line, the buttons, the status and error
lines and the dashboard. Also the two small makers the panel builds its boxes and buttons with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

if TYPE_CHECKING:
    from workbench.notebook.panel.panel import Panel


def html_box(css_class: str, value: str = "") -> widgets.HTML:
    box = widgets.HTML(value)
    box.add_class(css_class)
    return box


def make_button(description: str, css_class: str, **kwargs: Any) -> widgets.Button:
    button = widgets.Button(description=description, **kwargs)
    button.add_class(css_class)
    return button


def _controls_column(panel: Panel) -> widgets.VBox:
    c = panel.controls
    # the controls keep their width
    return widgets.VBox(
        [
            c["task"],
            panel.task_controls.widget,
            panel.target_controls.widget,
            widgets.HBox([c["num_processes"], panel.limit]),
            c["oversubscribe"],
            c["parallelism"],
            panel.mode_info,
            c["dp_shard"],
            c["tp"],
            c["cp"],
            c["pp"],
            c["pp_schedule"],
            c["pp_virtual_stages"],
            c["activation_checkpointing"],
            c["compile"],
            c["precision"],
            c["micro_batch_size"],
            c["grad_accum_steps"],
            c["max_steps"],
            c["lr"],
            c["run_name"],
        ],
        layout=widgets.Layout(flex="0 0 auto"),
    )


def _implications_column(panel: Panel) -> widgets.VBox:
    # what the settings imply takes the room left, and goes below the controls when there is too
    # little
    return widgets.VBox(
        [
            widgets.HTML("<b>What this implies</b>"),
            panel.batch_info,
            panel.launch_info,
            panel.layout_box,
            panel.estimate_box.widget,
        ],
        layout=widgets.Layout(
            margin="0 0 0 1.5em", flex="1 1 320px", min_width="300px", max_width="560px"
        ),
    )


def panel_box(panel: Panel) -> widgets.VBox:
    """The whole panel, from the widgets `panel` has built."""
    box = widgets.VBox(
        [
            widgets.HTML("<h3 style='margin:0.2em 0'>workbench: configure a run</h3>"),
            widgets.HBox(
                [_controls_column(panel), _implications_column(panel)],
                layout=widgets.Layout(flex_flow="row wrap", align_items="flex-start"),
            ),
            panel.problem_box,
            widgets.HBox(
                [
                    panel.launch_button,
                    panel.stop_button,
                    panel.resume_button,
                    panel.yaml_path,
                    panel.save_button,
                ]
            ),
            panel.status_box,
            panel.error_box,
            panel.dashboard_box,
        ]
    )
    box.add_class("wb-panel")
    return box
