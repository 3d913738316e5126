"""The device monitor's row of a figure of runs: utilisation and memory, per rank for one run (which
rank's device idles, fills up or runs hot), and for several runs overlaid the busiest rank of each,
in the run's own style (lines per rank and per run would need a legend of runs x ranks, and colours
that mean two things)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from workbench.notebook.figure_lines import LINESTYLES, MARKERS, Drawn, Runs, Series, plot_line
from workbench.rundir.metrics_row import MetricsRow, PerRank

if TYPE_CHECKING:
    from matplotlib.axes import Axes


class MonitorPanel(NamedTuple):
    """One panel of the device monitor's figure row."""

    values: Callable[[MetricsRow], PerRank | None]
    """The row's per-rank values it draws."""
    title: str
    unit: float
    """What the values are divided by (bytes to GiB, ...)."""
    missing: str = ""
    """Why the values may be missing, said where they are."""


MONITOR_PANELS: dict[str, tuple[MonitorPanel, ...]] = {
    "gpu": (
        MonitorPanel(
            lambda r: r.gpu_util_pct_per_rank,
            "GPU utilisation (%, window mean)",
            1.0,
            " (needs nvidia-ml-py)",
        ),
        MonitorPanel(
            lambda r: r.gpu_mem_used_bytes_per_rank, "GPU memory used (GiB, window max)", 2.0**30
        ),
    ),
    "cpu": (
        MonitorPanel(
            lambda r: r.cpu_pct_per_rank, "process CPU (%, window mean; 100 = one core)", 1.0
        ),
        MonitorPanel(
            lambda r: r.rss_bytes_per_rank, "process resident memory (MiB, window max)", 2.0**20
        ),
    ),
}
"""The device monitor's two panels per kind of run."""


def monitor_kind(rows: Sequence[MetricsRow]) -> str | None:
    """'gpu' or 'cpu' when the rows carry device monitoring (training/observe/monitor.py), else
    None: the figure grows a row."""
    if any(r.gpu_util_pct_per_rank or r.gpu_mem_used_bytes_per_rank for r in rows):
        return "gpu"
    return "cpu" if any(r.cpu_pct_per_rank for r in rows) else None


def _per_rank(panel: MonitorPanel, rank: int) -> Series:
    def series(rows: Sequence[MetricsRow]) -> tuple[list[float], list[float]]:
        pts = [
            (r.step, v[rank] / panel.unit)
            for r in rows
            if (v := panel.values(r)) and rank < len(v) and v[rank] is not None
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    return series


def monitor_ranks(rows: Sequence[MetricsRow], panel: MonitorPanel) -> int:
    return max((len(v) for r in rows if (v := panel.values(r))), default=0)


def _busiest(panel: MonitorPanel) -> Series:
    """A run's highest value over its ranks, per row."""

    def series(rows: Sequence[MetricsRow]) -> tuple[list[float], list[float]]:
        pts = [
            (r.step, max(x for x in v if x is not None) / panel.unit)
            for r in rows
            if (v := panel.values(r)) and any(x is not None for x in v)
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    return series


def draw_monitor(axes: Sequence[Axes], runs: Runs, kind: str, drawn: Drawn) -> None:
    """One run: a line per rank. Several: a line per run, its busiest rank, in the style the run has
    in the other panels."""
    for ax, panel in zip(axes, MONITOR_PANELS[kind]):
        if len(runs) == 1:
            rows = runs[0][1]
            for rank in range(monitor_ranks(rows, panel)):
                plot_line(
                    ax,
                    drawn,
                    _per_rank(panel, rank),
                    rows,
                    color=f"C{rank}",
                    label=f"rank {rank}",
                    marker=".",
                    markersize=3,
                )
            ax.set_title(panel.title)
        else:
            for i, (label, rows) in enumerate(runs):
                if monitor_ranks(rows, panel):
                    plot_line(
                        ax,
                        drawn,
                        _busiest(panel),
                        rows,
                        color=f"C{i}",
                        label=label,
                        linestyle=LINESTYLES[i % len(LINESTYLES)],
                        marker=MARKERS[i % len(MARKERS)],
                        markersize=3,
                    )
            ax.set_title(f"{panel.title}\nthe busiest rank of each run")
        ax.set_ylim(bottom=0)
        if ax.get_lines():
            ax.legend(fontsize="small")
        else:
            ax.text(
                0.5,
                0.5,
                "not measured" + panel.missing,
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="#777",
            )
