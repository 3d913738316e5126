"""Where the panel's widgets go: the settings on the left, what they imply on the right (below the
settings when the notebook is too narrow), then the problem line, the buttons, the status and error
lines and the dashboard. Also the two small makers the panel builds its boxes and buttons with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets


def html_box(css_class: str, value: str = "") -> widgets.HTML:
    box = widgets.HTML(value)
    box.add_class(css_class)
    return box


def make_button(description: str, css_class: str, **kwargs: Any) -> widgets.Button:
    button = widgets.Button(description=description, **kwargs)
    button.add_class(css_class)
    return button


def _implications_column(implications: Sequence[widgets.Widget]) -> widgets.VBox:
    # what the settings imply takes the room left, and goes below the controls when there is too
    # little
    return widgets.VBox(
        [widgets.HTML("<b>What this implies</b>"), *implications],
        layout=widgets.Layout(
            margin="0 0 0 1.5em", flex="1 1 320px", min_width="300px", max_width="560px"
        ),
    )


def panel_box(
    settings: widgets.Widget,
    implications: Sequence[widgets.Widget],
    problem: widgets.Widget,
    buttons: Sequence[widgets.Widget],
    below: Sequence[widgets.Widget],
) -> widgets.VBox:
    """The whole panel: the settings' column beside what they imply, the problem line, the row of
    buttons, and what goes `below` them (status and error lines, the dashboard)."""
    box = widgets.VBox(
        [
            widgets.HTML("<h3 style='margin:0.2em 0'>workbench: configure a run</h3>"),
            widgets.HBox(
                [settings, _implications_column(implications)],
                layout=widgets.Layout(flex_flow="row wrap", align_items="flex-start"),
            ),
            problem,
            widgets.HBox(list(buttons)),
            *below,
        ]
    )
    box.add_class("wb-panel")
    return box
