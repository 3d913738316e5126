"""Figures of runs: loss (train and eval), throughput, memory, learning rate, and the device
monitor's utilisation and memory per rank when the rows have them; several runs overlaid.
`LiveFigure` is the dashboard's: built once, then redrawn in place as rows arrive."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from matplotlib.figure import Figure  # this module is imported only when something is plotted
from matplotlib.layout_engine import TightLayoutEngine

from workbench.notebook.axis_format import SciFormatter, loss_on_log_scale, set_loss_scale
from workbench.notebook.figure_lines import (
    LINESTYLES,
    MARKERS,
    Drawn,
    Runs,
    of,
    plot_line,
    series_of,
    thin,
    typed_rows,
)
from workbench.notebook.monitor_figure import (
    MONITOR_PANELS,
    draw_monitor,
    monitor_kind,
    monitor_ranks,
)
from workbench.notebook.reading import PLOT_POINTS, sampled_rows
from workbench.rundir.metrics_row import MetricsRow

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.text import Text

    from workbench.launcher.result import RunResult

PANELS = ("loss", "throughput", "memory", "lr")
EMA_WEIGHT = 0.5
"""Weight of the past in the smoothed loss (per logged row): enough to calm the noise of small
batches, little enough that a 20-row run still shows its shape."""


LIVE_POINTS = 400
"""The most points a line of the live figure draws: a long run's thousands of rows, thinned, look
the same and cost a fraction to render."""


def ema(values: Sequence[float], weight: float = EMA_WEIGHT) -> list[float]:
    """Exponential moving average, debiased so the first points aren't pulled towards zero."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


def _label(result: RunResult, labels: Sequence[str] | None, i: int) -> str:
    if labels:
        return labels[i]
    s = result.summary
    return f"{result.run_dir.name} ({s.get('precision', '?')}, x{s.get('world_size', '?')})"


def _loss_ema(rows: Sequence[MetricsRow]) -> tuple[list[float], list[float]]:
    x, y = series_of(rows, lambda r: r.loss)
    return x, ema(y)


def _draw_loss(
    ax: Axes,
    rows: Sequence[MetricsRow],
    label: str,
    style: dict[str, Any],
    drawn: Drawn,
    live: bool,
    several: bool = False,
) -> None:
    """The run's training loss (smoothed once there are enough points) and its evaluations. Several
    runs: the legend names each run once, and one entry says what the hollow markers are
    (`_legend_loss`)."""
    loss = of(lambda r: r.loss)
    # a live figure smooths from the start: its lines stay what they are
    if live or len(loss(rows)[0]) >= 4:
        # The raw curve faint, the smoothed one on top in the run's style: the trend reads at a
        # glance and the noise stays visible.
        plot_line(ax, drawn, loss, rows, color=style["color"], alpha=0.3, linewidth=0.8)
        plot_line(
            ax, drawn, _loss_ema, rows, label=label if several else f"{label} train (EMA)", **style
        )
    else:
        plot_line(ax, drawn, loss, rows, label=label if several else f"{label} train", **style)
    if any(r.eval_loss is not None for r in rows):
        plot_line(
            ax,
            drawn,
            of(lambda r: r.eval_loss),
            rows,
            linestyle="none",
            marker=style["marker"],
            markersize=8,
            markerfacecolor="none",
            markeredgewidth=1.5,
            color=style["color"],
            label="_eval" if several else f"{label} eval",
        )


def _legend_loss(ax: Axes, several: bool) -> None:
    """Several runs: one entry per run (its train line, smoothed when drawn faint behind), and a
    grey hollow marker for 'eval' when any run evaluated."""
    if several and any(line.get_label() == "_eval" for line in ax.get_lines()):
        ax.plot(
            [],
            [],
            linestyle="none",
            marker="o",
            markersize=8,
            markerfacecolor="none",
            markeredgewidth=1.5,
            color="#555",
            label="eval (hollow markers)",
        )
    ax.legend(fontsize="small")


def _rate(rows: Sequence[MetricsRow]) -> tuple[Callable[[MetricsRow], float | None], str]:
    if any(r.tokens_per_s for r in rows):
        return (lambda r: r.tokens_per_s), "tokens/s"
    return (lambda r: r.samples_per_s), "samples/s"


def _draw_run(
    axes: Sequence[Axes],
    rows: Sequence[MetricsRow],
    label: str,
    i: int,
    drawn: Drawn,
    live: bool = False,
    several: bool = False,
) -> None:
    """One run's loss, throughput, memory and learning rate, in the style of the i-th run."""
    ax_loss, ax_tp, ax_mem, ax_lr = axes
    # the points drawn: see _plot
    n = max(1, min(PLOT_POINTS, len(series_of(rows, lambda r: r.loss)[0])))
    style = {
        "color": f"C{i}",
        "linestyle": LINESTYLES[i % len(LINESTYLES)],
        "marker": MARKERS[i % len(MARKERS)],
        "markevery": max(1, n // 8),
        "markersize": 4,
    }
    _draw_loss(ax_loss, rows, label, style, drawn, live, several)
    rate, unit = _rate(rows)
    plot_line(ax_tp, drawn, of(rate), rows, label=label, **style)
    ax_tp.set_ylabel(unit + " (per logged window)")
    plot_line(ax_mem, drawn, of(lambda r: r.peak_memory_bytes, 2**20), rows, label=label, **style)
    plot_line(ax_lr, drawn, of(lambda r: r.lr), rows, label=label, **style)


class _Drawing(NamedTuple):
    """What a live figure moves: the lines and their series, and the axes rescaled by rule, not by
    their data."""

    lines: Drawn
    loss: Axes
    memory: Axes
    monitor: list[Axes]
    stamp: Text | None


def _memory_top(runs: Runs) -> float:
    return (
        max(
            (v for _, rows in runs for v in series_of(rows, lambda r: r.peak_memory_bytes)[1]),
            default=0,
        )
        / 2**20
    )


def _draw(
    fig: Figure, typed: Runs, title: str | None, log: bool, drawn_at: int | None, live: bool = False
) -> _Drawing:
    fig.clear()
    kind = monitor_kind([r for _, rows in typed for r in rows])
    ax_loss, ax_tp, ax_mem, ax_lr, *ax_monitor = fig.subplots(3 if kind else 2, 2).flat
    drawn: Drawn = []
    for i, (label, rows) in enumerate(typed):
        _draw_run(
            (ax_loss, ax_tp, ax_mem, ax_lr), rows, label, i, drawn, live, several=len(typed) > 1
        )
    set_loss_scale(ax_loss, log)
    if len(typed) > 1:
        ax_loss.set_title(ax_loss.get_title() + ", train smoothed (EMA)")
    # From zero: a wobble of 1 MiB on 300 must look like one, not like a leak.
    top = _memory_top(typed)
    ax_mem.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax_mem.ticklabel_format(axis="y", useOffset=False, style="plain")
    ax_lr.yaxis.set_major_formatter(SciFormatter())
    ax_tp.set_title("throughput")
    ax_mem.set_title("peak memory (MiB, max over ranks)")
    ax_lr.set_title("learning rate")
    if kind:
        draw_monitor(ax_monitor, typed, kind, drawn)
    for ax in (ax_loss, ax_tp, ax_mem, ax_lr, *ax_monitor):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if typed:
        _legend_loss(ax_loss, several=len(typed) > 1)
        if len(typed) > 1:
            ax_tp.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    stamp = None
    if drawn_at is not None:
        stamp = fig.text(
            0.995,
            0.005,
            f"drawn at step {drawn_at}",
            ha="right",
            va="bottom",
            fontsize="small",
            color="#555",
        )
    # The tight layout applied once, not kept as the figure's layout engine: savefig would then draw
    # every figure twice, once to lay it out.
    TightLayoutEngine(rect=(0, 0.03 if drawn_at is not None else 0, 1, 1)).execute(fig)
    return _Drawing(drawn, ax_loss, ax_mem, ax_monitor, stamp)


def draw(
    fig: Figure,
    runs: Sequence[tuple[str, Sequence[MetricsRow | Mapping[str, Any]]]],
    title: str | None = None,
    *,
    log_loss: bool | None = None,
    drawn_at: int | None = None,
) -> Figure:
    """Draw metrics rows of each (label, rows) into `fig` (cleared first). Rows are MetricsRow, or
    the plain dicts of metrics.jsonl.

    log_loss: the loss axis on a log scale (True), linear (False), or with None, log once the loss
    spans a decade (LOG_LOSS_SPAN). drawn_at: the step the rows reach, written on the figure so a
    live or saved picture says how current it is.
    """
    typed: Runs = [(label, typed_rows(rows)) for label, rows in runs]
    _draw(fig, typed, title, loss_on_log_scale(typed, log_loss), drawn_at)
    return fig


class LiveFigure:
    """The dashboard's figure of one run, redrawn in place as rows come: the axes, titles, legends
    and the panels are built once (again only when what they show changes: an eval row, the device
    monitor's ranks), and each new picture only moves the lines' data, thinned to LIVE_POINTS, and
    rescales (the loss axis turning log included). That keeps a redraw to the cost of rendering the
    PNG, a fraction of building the figure."""

    def __init__(self) -> None:
        self.figure = Figure(figsize=(9, 5.5), dpi=80)
        self.builds = 0
        """How many times the figure was built rather than moved (for tests and the benchmark)."""
        self._key: tuple[Any, ...] | None = None
        self._drawing: _Drawing | None = None

    @staticmethod
    def figure_key(runs: Runs) -> tuple[Any, ...]:
        """What the built figure depends on, beyond the lines' data."""
        rows = [r for _, run in runs for r in run]
        kind = monitor_kind(rows)
        ranks = tuple(monitor_ranks(rows, panel) for panel in MONITOR_PANELS[kind]) if kind else ()
        return (
            kind,
            ranks,
            any(r.eval_loss is not None for r in rows),
            _rate(rows)[1],
            tuple(name for name, _ in runs),
        )

    def png(
        self,
        label: str,
        rows: Sequence[MetricsRow],
        *,
        title: str,
        log_loss: bool | None,
        drawn_at: int,
    ) -> bytes:
        """The figure of `rows` as PNG bytes."""
        runs = [(label, rows)]
        log = loss_on_log_scale(runs, log_loss)
        key = self.figure_key(runs)
        if key != self._key or self._drawing is None:
            # a third row: the device monitor
            self.figure.set_size_inches(9, 8 if key[0] else 5.5)
            self._drawing = _draw(self.figure, runs, title, log, drawn_at, live=True)
            self._key = key
            self.builds += 1
        self._move(self._drawing, runs, drawn_at, log)
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png")
        return buf.getvalue()

    @staticmethod
    def _move(drawing: _Drawing, runs: Runs, drawn_at: int, log: bool) -> None:
        rows = runs[0][1]
        if (drawing.loss.get_yscale() == "log") != log:
            set_loss_scale(drawing.loss, log)
        for line, series in drawing.lines:
            x, y = thin(*series(rows), LIVE_POINTS)
            line.set_data(x, y)
            if line.get_markevery() is not None:
                line.set_markevery(max(1, len(x) // 8))
        for ax in {id(line.axes): line.axes for line, _ in drawing.lines}.values():
            ax.relim()
            ax.autoscale_view()
        top = _memory_top(runs)
        drawing.memory.set_ylim(0, top * 1.15 if top > 0 else 1)
        for ax in drawing.monitor:
            ax.set_ylim(bottom=0)
        if drawing.stamp is not None:
            drawing.stamp.set_text(f"drawn at step {drawn_at}")


class RunFigure(Figure):
    """A Figure that shows itself in Jupyter without `%matplotlib inline` or pyplot."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90)
        return buf.getvalue()


def plot_runs(
    results: Sequence[RunResult],
    labels: Sequence[str] | None = None,
    path: str | Path | None = None,
    *,
    log_loss: bool | None = None,
) -> Figure:
    """One figure overlaying `results`; saved to `path` when given. log_loss as `draw` takes it
    (None: log once the loss spans a decade). Each run is drawn from `sampled_rows`: a long one
    costs what is drawn."""
    rows = [sampled_rows(r.dir.metrics_path, PLOT_POINTS) for r in results]
    fig = RunFigure(figsize=(10, 10 if any(monitor_kind(run) for run in rows) else 7))
    draw(
        fig,
        [(_label(r, labels, i), run) for i, (r, run) in enumerate(zip(results, rows))],
        title=results[0].run_dir.name if len(results) == 1 else None,
        log_loss=log_loss,
    )
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
