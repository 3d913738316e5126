"""Figures of runs: loss (train and eval), throughput, memory, learning rate; several runs overlaid."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from matplotlib.figure import Figure  # this module is imported only when something is plotted

if TYPE_CHECKING:
    from .rundir import RunResult

PANELS = ("loss", "throughput", "memory", "lr")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _label(result: RunResult, labels: Sequence[str] | None, i: int) -> str:
    if labels:
        return labels[i]
    s = result.summary
    return f"{result.run_dir.name} ({s.get('precision', '?')}, x{s.get('world_size', '?')})"


def draw(fig: Figure, runs: Sequence[tuple[str, list[dict[str, Any]]]], title: str | None = None) -> Figure:
    """Draw metrics rows of each (label, rows) into `fig` (cleared first); used by plots and the live dashboard."""
    fig.clear()
    ax_loss, ax_tp, ax_mem, ax_lr = fig.subplots(2, 2).flat
    for i, (label, rows) in enumerate(runs):
        color = f"C{i}"
        ax_loss.plot(*_series(rows, "loss"), color=color, label=f"{label} train")
        ex, ey = _series(rows, "eval_loss")
        if ex:
            ax_loss.plot(ex, ey, "o--", color=color, label=f"{label} eval")
        key = "tokens_per_s" if any(r.get("tokens_per_s") for r in rows) else "samples_per_s"
        ax_tp.plot(*_series(rows, key), color=color, label=label)
        ax_tp.set_ylabel(key.replace("_per_s", "/s"))
        mx, my = _series(rows, "peak_memory_bytes")
        ax_mem.plot(mx, [v / 2**20 for v in my], color=color, label=label)
        ax_lr.plot(*_series(rows, "lr"), color=color, label=label)
    ax_lr.ticklabel_format(axis="y", useOffset=False)  # a flat lr would read "1e-9+9.9999e-4"
    ax_loss.set_title("loss")
    ax_tp.set_title("throughput")
    ax_mem.set_title("peak memory (MiB, max over ranks)")
    ax_lr.set_title("learning rate")
    for ax in (ax_loss, ax_tp, ax_mem, ax_lr):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if runs:
        ax_loss.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


class RunFigure(Figure):
    """A Figure that shows itself in Jupyter without `%matplotlib inline` or pyplot."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=90)
        return buf.getvalue()


def plot_runs(results: Sequence[RunResult], labels: Sequence[str] | None = None,
              path: str | Path | None = None) -> Figure:
    """One figure overlaying `results`; saved to `path` when given."""
    fig = RunFigure(figsize=(10, 7))
    draw(fig, [(_label(r, labels, i), r.metrics) for i, r in enumerate(results)],
         title=results[0].run_dir.name if len(results) == 1 else None)
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
