"""Verdicts in words from a metrics row's step-time breakdown (breakdown.py): input-bound,
communication-bound, a straggler rank. Rank 0 writes them into each row; the dashboard shows the
latest.

Synchronous data parallelism runs at the pace of its slowest rank, so a straggler is named first:
the other ranks' exposed communication is then mostly waiting for it, not the network, and calling
that run communication-bound would send the user after the wrong fix.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from workbench.rundir.metrics_row import PHASES, MetricsRow

__all__ = ["PHASES", "busy", "diagnose", "per_rank", "straggler"]
INPUT_BOUND_SHARE = 0.2
"""Ranks waiting this share of the step for data are input-bound."""
COMM_BOUND_SHARE = 0.3
"""This share of the step in exposed communication is communication-bound."""
STRAGGLER_RATIO = 1.15
"""A rank busy this much longer per step than the median of the others is a straggler..."""
STRAGGLER_MIN_S = 1e-3
"""... by at least this much (a few percent of a 1 ms step is noise)..."""
STRAGGLER_WINDOWS = 3
"""... in each of the last this many logged windows, the same rank each time, by more than
NOISE_FACTOR times how much a rank's own busy time moves from window to window: a 2.6 ms gap on a
13 ms step that moves from rank to rank on a shared box is the box, not a rank."""
NOISE_FACTOR = 2.0


def per_rank(row: MetricsRow) -> dict[str, list[float]] | None:
    """{phase: [seconds per step, per rank]} from a metrics row, or None when it has no
    breakdown."""
    parts = row.phases_ms()
    if parts is None:
        return None
    return {name: [v / 1e3 for v in ms] for name, ms in parts.items()}


def busy(parts: dict[str, list[float]]) -> list[float]:
    """Per rank, the time spent on its own work (everything but waiting for the others in
    communication)."""
    return [
        parts["data"][r] + parts["compute"][r] + parts["optimizer"][r]
        for r in range(len(parts["data"]))
    ]


def _busiest(parts: dict[str, list[float]]) -> tuple[int, float, float] | None:
    """(rank, its busy time, the others' median) when one rank is busier by the ratio and the
    margin."""
    work = busy(parts)
    if len(work) < 2:
        return None
    rank = max(range(len(work)), key=work.__getitem__)
    others = statistics.median(w for r, w in enumerate(work) if r != rank)
    if (
        others > 0
        and work[rank] >= STRAGGLER_RATIO * others
        and work[rank] - others >= STRAGGLER_MIN_S
    ):
        return rank, work[rank], others
    return None


def straggler(windows: Sequence[dict[str, list[float]]]) -> tuple[int, float] | None:
    """(rank, how much slower than the median of the others, in the latest window) when one rank
    holds everyone back: the same rank, by busy time (its own work, the others' waiting left out),
    in each of the last STRAGGLER_WINDOWS windows (oldest first), its lead above the windows' own
    noise."""
    recent = list(windows)[-STRAGGLER_WINDOWS:]
    if len(recent) < STRAGGLER_WINDOWS:
        return None
    named = [found for parts in recent if (found := _busiest(parts)) is not None]
    if len(named) < len(recent) or len({rank for rank, _, _ in named}) != 1:
        return None
    noise = max(
        statistics.pstdev(busy(parts)[r] for parts in recent)
        for r in range(len(recent[-1]["data"]))
    )
    if min(work - others for _, work, others in named) <= NOISE_FACTOR * noise:
        return None
    rank, work, others = named[-1]
    return rank, work / others - 1


def diagnose(
    row: MetricsRow,
    num_workers: int,
    device: str,
    comm_measured: bool = True,
    earlier: Sequence[dict[str, list[float]]] = (),
) -> list[str]:
    """What limits the step, in words with the fix; [] when nothing stands out (or no breakdown).
    `earlier`: the breakdowns (per_rank) of this session's windows before `row`, oldest first: a
    straggler is named only when it holds over several windows."""
    parts = per_rank(row)
    if parts is None:
        return []
    steps = [sum(parts[name][r] for name in PHASES) for r in range(len(parts["data"]))]
    if not all(s > 0 for s in steps):
        return []
    verdicts = []
    slow = straggler([*earlier, parts])
    if slow is not None:
        rank, slower = slow
        verdicts.append(
            f"rank {rank} is {slower:.0%} slower than the others: they wait for it every step "
            "(look for a slower or throttled device, a busier host, or uneven batches)"
        )
    data_share = statistics.mean(d / s for d, s in zip(parts["data"], steps))
    if data_share >= INPUT_BOUND_SHARE:
        fixes = f"raise num_workers (now {num_workers})" + (
            " or pin memory" if device == "cuda" else ""
        )
        verdicts.append(f"input-bound: ranks wait {data_share:.0%} of each step for data; {fixes}")
    comm_share = statistics.mean(c / s for c, s in zip(parts["comm"], steps))
    if comm_measured and slow is None and comm_share >= COMM_BOUND_SHARE:
        verdicts.append(
            f"communication-bound: {comm_share:.0%} of the step in gradient all-reduce not hidden "
            "by compute; try gradient accumulation (fewer all-reduces per sample), bf16 "
            "compression (grad_compression) or zero2"
        )
    return verdicts
