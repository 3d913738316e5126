"""What the ranks leave about themselves in a run directory, read back for the run's ending:
ranks/rank_<r>.json heartbeats (`ranks_at`: the steps the ranks had completed and where they were,
for a preemption's message) and errors/rank_<r>.json (`is_fallout`: an error caused by another
rank's death or hang, listed after the error that caused it). RunDir writes both files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.utils.files import read_json

_FALLOUT = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "nccl communicator was aborted",
    "processgroupnccl",
    "got signal: 15",
    "timed out",
    "timeout",
    "pair closure",
    "removed as another rank's write failed",
)


def is_fallout(error: dict[str, Any]) -> bool:
    """An error caused by another rank's death or hang: a collective that lost its peer or timed
    out, the launcher's SIGTERM, or a checkpoint another rank's failed write removed
    (training.checkpoint_failures.SWEPT)."""
    message = error.get("message", "").lower()
    return error.get("type") == "SignalException" or any(s in message for s in _FALLOUT)


def ranks_at(ranks_path: Path) -> tuple[int | None, str]:
    """From the ranks' heartbeats in `ranks_path`: the steps they had completed, and '; the ranks
    had completed N step(s), last seen in PHASE' for a preemption's message once they had started
    training ('' before)."""
    beats = [b for p in ranks_path.glob("rank_*.json") if isinstance(b := read_json(p), dict)]
    steps = [b["step"] for b in beats if isinstance(b.get("step"), int)]
    phases = sorted({str(b.get("phase")) for b in beats} - {"starting", "ended", "None"})
    if not steps or not (max(steps) or phases):
        return None, ""
    return max(steps), f"; the ranks had completed {max(steps)} step(s)" + (
        f", last seen in {', '.join(map(repr, phases))}" if phases else ""
    )
