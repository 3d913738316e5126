"""Static HTML snapshots of the panel and the dashboard: the `text/html` half of the widgets'
display bundles, what a notebook executed headless (papermill) and opened without a kernel shows
instead of `VBox(children=...)`. Plain values in, HTML out: the live readings are reading.py's.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.notebook.panel import Panel

_LABEL = "text-align:left;padding-right:1em;color:#666"


def img_tag(png: bytes, css_class: str = "wb-snapshot-figure") -> str:
    data = base64.b64encode(png).decode("ascii")
    return f"<img class='{css_class}' style='max-width:900px' src='data:image/png;base64,{data}'>"


def table(items: Sequence[tuple[str, str]], css_prefix: str) -> str:
    """Label/value rows; each value cell gets a class from its label, for tests and CSS."""

    def css(label: str) -> str:
        return css_prefix + re.sub("[^a-z0-9]+", "-", label.lower()).strip("-")

    # Left-aligned by hand: a notebook's own table style (right-aligned, striped) would scatter
    # the values.
    cells = "".join(
        f"<tr><td style='{_LABEL}'>{html.escape(k)}</td><td style='text-align:left' "
        f"class='{css(k)}'>{html.escape(v)}</td></tr>"
        for k, v in items
    )
    return f"<table style='font-family:monospace'>{cells}</table>"


def dashboard_html(
    name: str,
    status: str,
    progress: str,
    stats: Sequence[tuple[str, str]],
    breakdown: str,
    figure: bytes | str,
) -> str:
    """The dashboard as it stands: run name, status, progress line, numbers, the step-time
    breakdown (its HTML), and the latest figure as PNG bytes or a line saying why there is none."""
    if isinstance(figure, bytes):
        figure_html = img_tag(figure)
    else:
        figure_html = f"<p><i>{html.escape(figure)}</i></p>"
    return (
        f"<div class='wb-snapshot wb-snapshot-dashboard'>"
        f"<div><b>{html.escape(name)}</b> &nbsp; {html.escape(status)}</div>"
        f"<div>{html.escape(progress)}</div>{table(stats, 'wb-snapshot-stat-')}"
        f"{breakdown}{figure_html}</div>"
    )


def panel_html(panel: Panel) -> str:
    """The panel as it stands: the settings, what they imply (global batch, launch, rank layout,
    estimate), its status and error, and the run's dashboard."""
    settings = [
        (name.replace("_", " "), "" if control.value is None else str(control.value))
        for name, control in panel.controls.items()
    ]
    # One line names the run; every setting is a click away (a saved notebook read top to bottom
    # shouldn't wade through twenty rows before what they imply).
    value = {name: control.value for name, control in panel.controls.items()}
    line = ", ".join(
        str(v)
        for v in (
            value.get("task"),
            f"{value.get('num_processes')} processes",
            value.get("parallelism"),
            value.get("precision"),
            f"micro-batch {value.get('micro_batch_size')} x {value.get('grad_accum_steps')}",
            f"{value.get('max_steps')} steps",
        )
        if v is not None
    )
    parts = [
        (
            "<div class='wb-snapshot wb-snapshot-panel'><details "
            "class='wb-snapshot-settings'><summary><b>workbench</b>: "
            f"{html.escape(line)}</summary>"
        ),
        table(settings, "wb-snapshot-setting-"),
        "</details>",
        f"<div>{panel.batch_info.value}</div><div>{panel.launch_info.value}</div>",
        # What the settings imply, as the live panel shows it beside them: the ranks' layout and the
        # estimate.
        f"<div class='wb-snapshot-layout'>{panel.layout_box.value}</div>",
        f"<div class='wb-snapshot-estimate'>{panel.estimate_box.html.value}</div>",
        f"<div>{panel.problem_box.value}</div><div>{panel.status_box.value}</div>",
        f"<div>{panel.error_box.value}</div>",
    ]
    if panel.dashboard is not None:
        # The panel shows the error above, and wait() the final figure: copies would repeat them.
        parts.append(
            panel.dashboard.snapshot_html(show_error=False, figure=not panel.dashboard.final_shown)
        )
    parts.append("</div>")
    return "".join(parts)
