"""The step-time breakdown as HTML: a stacked bar per rank (data, compute, exposed communication,
optimizer, the rest), the straggler the verdict names marked (by its own work, the measure the
verdict uses), and the verdicts in words. Shared by the live dashboard and its static snapshot;
plain HTML so it shows in any frontend, papermill output included."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from workbench.training.observe.verdicts import PHASES, busy, per_rank

if TYPE_CHECKING:
    from workbench.rundir import MetricsRow

COLOURS = {
    "data": "#e6a700",
    "compute": "#3b7dd8",
    "comm": "#d9534f",
    "optimizer": "#5cb85c",
    "other": "#999999",
}
LABELS = {
    "data": "waiting for data",
    "compute": "forward+backward",
    "comm": "exposed communication",
    "optimizer": "optimizer",
    "other": "the rest",
}


def _bar(rank: int, parts: dict[str, float], scale: float, own: float | None) -> str:
    """`own`: the rank's own work (verdicts.busy) when it is the straggler, else None."""
    total = sum(parts.values())
    segments = "".join(
        f"<div class='wb-breakdown-{name}' title='{LABELS[name]}: {1e3 * s:.2f} ms "
        f"({s / total:.0%})' "
        f"style='width:{100 * s / scale:.2f}%;background:{COLOURS[name]}'></div>"
        for name, s in parts.items()
        if s > 0
    )
    mark = (
        f" <b class='wb-slowest'>◀ straggler: {1e3 * own:.1f} ms of its own work</b>"
        if own is not None
        else ""
    )
    return (
        f"<div class='wb-breakdown-rank' data-rank='{rank}' "
        "style='display:flex;align-items:center;gap:6px;margin:2px 0'><span "
        f"style='width:4em;font-family:monospace'>rank {rank}</span><div "
        f"style='display:flex;width:320px;height:14px;background:#f2f2f2'>{segments}</div><span "
        f"style='font-family:monospace;font-size:90%'>{1e3 * total:.1f} ms{mark}</span></div>"
    )


def breakdown_html(row: MetricsRow | None) -> str:
    """The latest window's breakdown, or '' when the row has none."""
    parts = per_rank(row) if row is not None else None
    if row is None or parts is None:
        return ""
    ranks = len(parts["data"])
    steps = [sum(parts[name][r] for name in PHASES) for r in range(ranks)]
    scale = max(steps) or 1.0
    # the verdict's rank
    slowest = row.slowest_rank if row.slowest_rank is not None and ranks > 1 else -1
    work = busy(parts)
    bars = "".join(
        _bar(r, {name: parts[name][r] for name in PHASES}, scale, work[r] if r == slowest else None)
        for r in range(ranks)
    )
    legend = " ".join(
        f"<span style='color:{COLOURS[name]}'>■</span> {LABELS[name]}" for name in PHASES
    )
    if row.comm_measured is False:
        legend += " (communication runs inside forward+backward in this mode and is counted there)"
    verdicts = "".join(
        f"<div class='wb-verdict'>⚠ {html.escape(v)}</div>" for v in row.verdicts or []
    )
    return (
        f"<div class='wb-breakdown'><b>where the step time goes</b> <small>(step {row.step}, "
        f"mean per step of the last window)</small>{bars}<small>{legend}</small>{verdicts}"
        "</div>"
    )
