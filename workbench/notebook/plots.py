"""Figures of runs: loss (train and eval), throughput, memory, learning rate, and the device monitor's
utilisation and memory per rank when the rows have them; several runs overlaid."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from matplotlib.figure import Figure  # this module is imported only when something is plotted
from matplotlib.ticker import Formatter, LogFormatter

from workbench.rundir.metrics_row import MetricsRow, PerRank

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from workbench.launcher.result import RunResult

PANELS = ("loss", "throughput", "memory", "lr")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P")
"""Overlaid runs differ in line style and marker as well as colour: printed in grey, or to a colour-blind
reader, the runs stay apart."""


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
    "gpu": (MonitorPanel(lambda r: r.gpu_util_pct_per_rank, "GPU utilisation (%, window mean)",
                         1.0, " (needs nvidia-ml-py)"),
            MonitorPanel(lambda r: r.gpu_mem_used_bytes_per_rank,
                         "GPU memory used (GiB, window max)", 2.0**30)),
    "cpu": (MonitorPanel(lambda r: r.cpu_pct_per_rank,
                         "process CPU (%, window mean; 100 = one core)", 1.0),
            MonitorPanel(lambda r: r.rss_bytes_per_rank,
                         "process resident memory (MiB, window max)", 2.0**20)),
}
"""The device monitor's two panels per kind of run."""
EMA_WEIGHT = 0.5
"""Weight of the past in the smoothed loss (per logged row): enough to calm the noise of small batches,
little enough that a 20-row run still shows its shape."""


Runs = Sequence[tuple[str, Sequence[MetricsRow]]]
"""(label, rows) of each run drawn."""


def typed_rows(rows: Sequence[MetricsRow | Mapping[str, Any]]) -> list[MetricsRow]:
    """Rows as MetricsRow: the plain dicts of `RunResult.metrics` read as metrics.jsonl's rows."""
    return [r if isinstance(r, MetricsRow) else MetricsRow.from_dict(r) for r in rows]


def _series(rows: Sequence[MetricsRow],
            value: Callable[[MetricsRow], float | None]) -> tuple[list[float], list[float]]:
    pts = [(r.step, v) for r in rows if (v := value(r)) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def monitor_kind(rows: Sequence[MetricsRow]) -> str | None:
    """'gpu' or 'cpu' when the rows carry device monitoring (monitor.py), else None: the figure
    grows a row."""
    if any(r.gpu_util_pct_per_rank or r.gpu_mem_used_bytes_per_rank for r in rows):
        return "gpu"
    return "cpu" if any(r.cpu_pct_per_rank for r in rows) else None


def _per_rank(rows: Sequence[MetricsRow], panel: MonitorPanel,
              rank: int) -> tuple[list[float], list[float]]:
    pts = [(r.step, v[rank] / panel.unit) for r in rows
           if (v := panel.values(r)) and rank < len(v) and v[rank] is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw_monitor(axes: Sequence[Axes], runs: Runs, kind: str) -> None:
    """One line per rank (colour) and run (line style): which rank's device idles, fills up or runs hot."""
    for ax, panel in zip(axes, MONITOR_PANELS[kind]):
        for i, (label, rows) in enumerate(runs):
            ranks = max((len(v) for r in rows if (v := panel.values(r))), default=0)
            for rank in range(ranks):
                name = f"rank {rank}" if len(runs) == 1 else f"{label} rank {rank}"
                ax.plot(*_per_rank(rows, panel, rank), color=f"C{rank}", label=name,
                        linestyle=LINESTYLES[i % len(LINESTYLES)], marker=".", markersize=3)
        ax.set_title(panel.title)
        ax.set_ylim(bottom=0)
        if ax.get_lines():
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not measured" + panel.missing, ha="center", va="center",
                    transform=ax.transAxes, color="#777")


def ema(values: Sequence[float], weight: float = EMA_WEIGHT) -> list[float]:
    """Exponential moving average, debiased so the first points aren't pulled towards zero."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


def sci(value: float, digits: int = 2) -> str:
    """3e-4 rather than 0.000300: the way learning rates are written in papers and configs."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.{max(1, digits) - 1}e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


class _SciFormatter(Formatter):
    """Tick labels in `sci` style, with as many digits as it takes to tell neighbouring ticks apart: a slowly
    decaying learning rate would otherwise read 1e-3, 1e-3, 1e-3."""

    digits = 2

    def set_locs(self, locs: Sequence[float]) -> None:
        super().set_locs(locs)
        self.digits = next((d for d in range(2, 8) if len({sci(v, d) for v in locs}) == len(set(locs))), 8)

    def __call__(self, x: float, pos: int | None = None) -> str:
        return sci(x, self.digits)


class _PlainLogFormatter(LogFormatter):
    """Log-axis labels as 0.6 and 2 rather than 6x10^-1; which ticks get a label stays LogFormatter's choice."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return f"{x:g}" if super().__call__(x, pos) else ""


def _label(result: RunResult, labels: Sequence[str] | None, i: int) -> str:
    if labels:
        return labels[i]
    s = result.summary
    return f"{result.run_dir.name} ({s.get('precision', '?')}, x{s.get('world_size', '?')})"


def _draw_loss(ax: Axes, rows: Sequence[MetricsRow], label: str, style: dict[str, Any]) -> None:
    x, y = _series(rows, lambda r: r.loss)
    if len(x) >= 4:
        # The raw curve faint, the smoothed one on top in the run's style: the trend reads at a glance and
        # the noise stays visible.
        ax.plot(x, y, color=style["color"], alpha=0.3, linewidth=0.8)
        ax.plot(x, ema(y), label=f"{label} train (EMA)", **style)
    else:
        ax.plot(x, y, label=f"{label} train", **style)
    ex, ey = _series(rows, lambda r: r.eval_loss)
    if ex:
        ax.plot(ex, ey, linestyle="none", marker=style["marker"], markersize=8, markerfacecolor="none",
                markeredgewidth=1.5, color=style["color"], label=f"{label} eval")


def _draw_run(axes: Sequence[Axes], rows: Sequence[MetricsRow], label: str, i: int) -> None:
    """One run's loss, throughput, memory and learning rate, in the style of the i-th run."""
    ax_loss, ax_tp, ax_mem, ax_lr = axes
    n = max(1, len(_series(rows, lambda r: r.loss)[0]))
    style = {"color": f"C{i}", "linestyle": LINESTYLES[i % len(LINESTYLES)],
             "marker": MARKERS[i % len(MARKERS)], "markevery": max(1, n // 8), "markersize": 4}
    _draw_loss(ax_loss, rows, label, style)
    tokens = any(r.tokens_per_s for r in rows)
    rate: Callable[[MetricsRow], float | None] = \
        (lambda r: r.tokens_per_s) if tokens else (lambda r: r.samples_per_s)
    ax_tp.plot(*_series(rows, rate), label=label, **style)
    ax_tp.set_ylabel(("tokens/s" if tokens else "samples/s") + " (per logged window)")
    mx, my = _series(rows, lambda r: r.peak_memory_bytes)
    ax_mem.plot(mx, [v / 2**20 for v in my], label=label, **style)
    ax_lr.plot(*_series(rows, lambda r: r.lr), label=label, **style)


def draw(fig: Figure, runs: Sequence[tuple[str, Sequence[MetricsRow | Mapping[str, Any]]]],
         title: str | None = None, *, log_loss: bool = False,
         drawn_at: int | None = None) -> Figure:
    """Draw metrics rows of each (label, rows) into `fig` (cleared first); used by plots and the
    live dashboard. Rows are MetricsRow, or the plain dicts of metrics.jsonl.

    log_loss: the loss axis on a log scale. drawn_at: the step the rows reach, written on the figure so a
    live or saved picture says how current it is.
    """
    fig.clear()
    typed: Runs = [(label, typed_rows(rows)) for label, rows in runs]
    kind = monitor_kind([r for _, rows in typed for r in rows])
    ax_loss, ax_tp, ax_mem, ax_lr, *ax_monitor = fig.subplots(3 if kind else 2, 2).flat
    for i, (label, rows) in enumerate(typed):
        _draw_run((ax_loss, ax_tp, ax_mem, ax_lr), rows, label, i)
    if log_loss and any(v > 0 for _, rows in typed for v in _series(rows, lambda r: r.loss)[1]):
        ax_loss.set_yscale("log")
        ax_loss.yaxis.set_major_formatter(_PlainLogFormatter())
        ax_loss.yaxis.set_minor_formatter(_PlainLogFormatter(minor_thresholds=(2, 0.5)))
    # From zero: a wobble of 1 MiB on 300 must look like one, not like a leak.
    top = max((v for _, rows in typed for v in _series(rows, lambda r: r.peak_memory_bytes)[1]),
              default=0) / 2**20
    ax_mem.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax_mem.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax_lr.yaxis.set_major_formatter(_SciFormatter())
    ax_loss.set_title("loss" + (" (log scale)" if ax_loss.get_yscale() == "log" else ""))
    ax_tp.set_title("throughput")
    ax_mem.set_title("peak memory (MiB, max over ranks)")
    ax_lr.set_title("learning rate")
    if kind:
        _draw_monitor(ax_monitor, typed, kind)
    for ax in (ax_loss, ax_tp, ax_mem, ax_lr, *ax_monitor):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if typed:
        ax_loss.legend(fontsize="small")
        if len(typed) > 1:
            ax_tp.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    if drawn_at is not None:
        fig.text(0.995, 0.005, f"drawn at step {drawn_at}", ha="right", va="bottom", fontsize="small",
                 color="#555")
    fig.tight_layout(rect=(0, 0.03 if drawn_at is not None else 0, 1, 1))
    return fig


class RunFigure(Figure):
    """A Figure that shows itself in Jupyter without `%matplotlib inline` or pyplot."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90)
        return buf.getvalue()


def plot_runs(results: Sequence[RunResult], labels: Sequence[str] | None = None,
              path: str | Path | None = None, *, log_loss: bool = False) -> Figure:
    """One figure overlaying `results`; saved to `path` when given."""
    rows = [r.dir.metrics_rows() for r in results]
    fig = RunFigure(figsize=(10, 10 if any(monitor_kind(run) for run in rows) else 7))
    draw(fig, [(_label(r, labels, i), run) for i, (r, run) in enumerate(zip(results, rows))],
         title=results[0].run_dir.name if len(results) == 1 else None, log_loss=log_loss)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
