"""The lines every figure of runs is made of: a series of metrics rows by step, drawn thinned, and
remembered so that a live figure can move it; and the styles that keep overlaid runs apart."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workbench.notebook.reading import PLOT_POINTS
from workbench.rundir.metrics_row import MetricsRow

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.lines import Line2D

LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P")
"""Overlaid runs differ in line style and marker as well as colour: printed in grey, or to a
colour-blind reader, the runs stay apart."""

Runs = Sequence[tuple[str, Sequence[MetricsRow]]]
"""(label, rows) of each run drawn."""
Series = Callable[[Sequence[MetricsRow]], tuple[list[float], list[float]]]
"""What a line shows, as a function of the rows: (x, y)."""
Drawn = list[tuple["Line2D", Series]]
"""Each line drawn and the series it shows: what a live figure moves when new rows come."""


def typed_rows(rows: Sequence[MetricsRow | Mapping[str, Any]]) -> list[MetricsRow]:
    """Rows as MetricsRow: the plain dicts of `RunResult.metrics` read as metrics.jsonl's rows."""
    return [r if isinstance(r, MetricsRow) else MetricsRow.from_dict(r) for r in rows]


def series_of(
    rows: Sequence[MetricsRow], value: Callable[[MetricsRow], float | None]
) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that have a value."""
    pts = [(r.step, v) for r in rows if (v := value(r)) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def of(value: Callable[[MetricsRow], float | None], scale: float = 1.0) -> Series:
    """The series of one row field (divided by `scale`) by step."""

    def series(rows: Sequence[MetricsRow]) -> tuple[list[float], list[float]]:
        x, y = series_of(rows, value)
        return x, [v / scale for v in y] if scale != 1.0 else y

    return series


def plot_line(
    ax: Axes, drawn: Drawn, series: Series, rows: Sequence[MetricsRow], **style: Any
) -> Line2D:
    """A line of `series` over `rows` (thinned to PLOT_POINTS), remembered in `drawn` so a live
    figure can move it."""
    (line,) = ax.plot(*thin(*series(rows), PLOT_POINTS), **style)
    drawn.append((line, series))
    return line


def thin(
    x: Sequence[float], y: Sequence[float], most: int
) -> tuple[Sequence[float], Sequence[float]]:
    """At most `most` points, evenly strided, the last always kept (the newest value is what a live
    figure is for)."""
    if len(x) <= most:
        return x, y
    stride = math.ceil(len(x) / (most - 1))
    keep = [*range(0, len(x) - 1, stride), len(x) - 1]
    return [x[i] for i in keep], [y[i] for i in keep]
