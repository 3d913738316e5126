"""wb.runs(runs_dir): the past runs in a folder as one table (text in a terminal, HTML in a
notebook), newest first, read from each run's summary.json and the tail of its metrics.jsonl;
wb.compare(...): runs overlaid."""

from __future__ import annotations

import html
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.rundir.metrics_row import newest_train_row
from workbench.rundir.run_dir import RunDir
from workbench.rundir.run_files import STATUS_COLORS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from workbench.launcher.result import RunResult

COLUMNS = (
    "name",
    "status",
    "task",
    "layout",
    "precision",
    "steps",
    "loss",
    "eval",
    "samples/s",
    "started",
)


def _layout_name(summary: Any) -> str:
    """'zero3 x 4, tp 2': the data-parallel mode over the world size, then the model-parallel
    sizes."""
    mesh = summary.mesh or {}
    split = [f"{k} {mesh[k]}" for k in ("tp", "pp", "cp") if (mesh.get(k) or 1) > 1]
    world = f" x {summary.world_size}" if summary.world_size else ""
    return ", ".join([f"{summary.parallelism or '?'}{world}", *split])


def _eval(row: dict[str, Any] | None) -> str:
    if not row:
        return ""
    return ", ".join(
        f"{k.removeprefix('eval_')} {v:.4g}"
        for k, v in row.items()
        if k.startswith("eval_") and isinstance(v, (int, float))
    )


def _row(folder: RunDir) -> dict[str, Any]:
    """One run's columns; a run whose summary can't be read is listed as such, not skipped."""
    try:
        summary = folder.summary()
        status = folder.observed_status()[0].value
    except ValueError as e:
        return {
            "name": folder.name,
            "status": "unreadable",
            "task": str(e).split(":")[0],
            "started_at": None,
        }
    tail = list(folder.tail_rows())  # read once for both rows
    # a badly typed row is skipped with a warning, as `workbench status` does
    train = newest_train_row(tail, folder.metrics_path) or {}
    evaluated = next((r for r in tail if any(k.startswith("eval_") for k in r)), None)
    loss = summary.final_loss if summary.final_loss is not None else train.get("loss")
    rate = (
        summary.samples_per_s if summary.samples_per_s is not None else train.get("samples_per_s")
    )
    return {
        "name": folder.name,
        "status": status,
        "task": summary.task or "",
        "layout": _layout_name(summary),
        "precision": summary.precision or "",
        "steps": summary.steps if summary.steps is not None else train.get("step"),
        "loss": loss,
        "eval": _eval(evaluated),
        "samples/s": rate,
        "started_at": summary.started_at,
    }


def _cell(column: str, row: dict[str, Any]) -> str:
    value = row.get(column)
    if column == "started":
        started = row.get("started_at")
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(started)) if started else ""
    if value is None:
        return ""
    if column == "loss":
        return f"{value:.4g}"
    if column == "samples/s":
        return f"{value:,.0f}"
    return str(value)


@dataclass
class RunsTable:
    """The runs of a folder, newest first: `table[name]` (or `table[0]`) is that run's RunResult,
    `table.compare(names...)` overlays them, `table.rows` holds the columns as values."""

    runs_dir: Path
    rows: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[RunResult]:
        return (self[i] for i in range(len(self.rows)))

    def __getitem__(self, key: int | str) -> RunResult:
        from workbench.launcher.result import RunResult

        names = self.names
        if isinstance(key, int):
            return RunResult.load(self.runs_dir / names[key])
        if key not in names:
            raise KeyError(
                f"{key!r}: no run of that name in {self.runs_dir} (it has {len(names)}: "
                f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            )
        return RunResult.load(self.runs_dir / key)

    @property
    def names(self) -> list[str]:
        return [r["name"] for r in self.rows]

    def compare(self, *keys: int | str, **kwargs: Any) -> Figure:
        """The runs named (or at those places in the table) overlaid: loss, throughput, memory."""
        return compare(*(self[k] for k in keys), **kwargs)

    def __repr__(self) -> str:
        if not self.rows:
            return f"no runs in {self.runs_dir}"
        cells = [[_cell(c, r) for c in COLUMNS] for r in self.rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<i>no runs in {html.escape(str(self.runs_dir))}</i>"
        head = "".join(
            f"<th title='{c}' style='{_style(c)}'>{HTML_HEADERS.get(c, c)}</th>" for c in COLUMNS
        )
        body = [
            f"<tr data-run='{html.escape(r['name'], quote=True)}'>"
            + "".join(f"<td style='{_style(c)}'>{_html_cell(c, r)}</td>" for c in COLUMNS)
            + "</tr>"
            for r in self.rows
        ]
        return (
            f"<table class='wb-runs' style='font-size:12px'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
            f"<small>{len(self.rows)} run(s) in {html.escape(str(self.runs_dir))}</small>"
        )


# The HTML table fits a notebook's output area in a 1280 px window with the file browser open
# (about 850 px), one line a run: no cell wraps, free-length text ends in an ellipsis with the
# whole in a tooltip, headers and dates are short, the font 12 px (JupyterLab's is 13). The styles
# are inline: they win over JupyterLab's `td {white-space: normal}`, which wrapped names, 'ddp x 2'
# and dates.
NOWRAP = "white-space:nowrap"
CLIPPED = {"name": "16em", "eval": "8em"}
"""Columns of free-length text, and the width past which they end in an ellipsis."""
HTML_HEADERS = {"precision": "prec."}
"""Headers wider than their column's values, shortened (the whole word is the header's tooltip)."""


def _style(column: str) -> str:
    align = "right" if column in ("steps", "loss", "samples/s") else "left"
    return f"text-align:{align};{NOWRAP};padding:0.35em 0.4em"


def _html_cell(column: str, row: dict[str, Any]) -> str:
    text = _cell(column, row)
    if column in CLIPPED:
        return _clipped(text, CLIPPED[column])
    if column == "status":
        color = STATUS_COLORS.get(row["status"], "#555")
        return f"<span style='color:{color}'>{html.escape(text)}</span>"
    if column == "started" and row.get("started_at"):
        # this year's runs without the year: '11-29 01:59', the whole date in the tooltip
        started = time.localtime(row["started_at"])
        short = "%m-%d %H:%M" if started.tm_year == time.localtime().tm_year else "%Y-%m-%d"
        return (
            f"<span title='{time.strftime('%Y-%m-%d %H:%M:%S', started)}'>"
            f"{time.strftime(short, started)}</span>"
        )
    return html.escape(text)


def _clipped(text: str, width: str) -> str:
    """`text` cut at `width` with an ellipsis, whole in its title. A span, not the cell: browsers
    don't clip a table cell to its max-width."""
    return (
        f"<span title='{html.escape(text, quote=True)}' style='display:inline-block;"
        f"max-width:{width};overflow:hidden;text-overflow:ellipsis;{NOWRAP};"
        f"vertical-align:top'>{html.escape(text)}</span>"
    )


def runs(runs_dir: str | os.PathLike[str] = "runs", *, limit: int | None = None) -> RunsTable:
    """The runs in `runs_dir` (folders with a summary.json), newest first; `limit`: only that
    many."""
    root = Path(runs_dir).expanduser()
    if not root.is_dir():
        raise ValueError(
            f"runs_dir={str(runs_dir)!r}: no such folder; runs go to RunConfig.runs_dir ('runs' "
            "unless set)"
        )
    folders = [RunDir(p) for p in root.iterdir() if p.is_dir() and (p / "summary.json").is_file()]
    rows = sorted(
        (_row(f) for f in folders),
        key=lambda r: (r.get("started_at") or 0, r["name"]),
        reverse=True,
    )
    return RunsTable(root, rows[:limit] if limit is not None else rows)


def compare(
    *runs: Any,
    labels: list[str] | None = None,
    path: str | os.PathLike[str] | None = None,
    log_loss: bool | None = None,
) -> Figure:
    """Runs overlaid in one figure (loss, throughput, memory): RunResults, Runs or run
    directories."""
    from workbench.launcher.result import RunResult
    from workbench.notebook.plots import plot_runs
    from workbench.rundir.run_files import RunFiles

    if not runs:
        raise ValueError("compare(): name at least one run (a RunResult, a Run or a run directory)")
    # not RunResult.load, which refuses a folder that isn't a run: the check below names every such
    # folder at once
    results = [
        r if isinstance(r, RunFiles) else RunResult(Path(r), RunDir(r).config()) for r in runs
    ]
    missing = [str(r.run_dir) for r in results if not r.dir.metrics_path.exists()]
    if missing:
        raise ValueError(
            f"compare(): no metrics.jsonl in {', '.join(missing)}: not a run directory, or a run "
            "that logged nothing yet"
        )
    return plot_runs(results, labels, path, log_loss=log_loss)  # type: ignore[arg-type]
