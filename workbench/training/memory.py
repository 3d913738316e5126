"""One training step under PyTorch's memory tracker: what each rank holds, by category, at its peak.

`torch.distributed._tools.mem_tracker.MemTracker` follows every tensor an operation creates (a dispatch
mode; nothing is allocated for it) and attributes storage to parameters, gradients, optimizer state,
activations, temporaries and buffers. The step it watches runs slower, so it is opt-in (track_memory) and
watches one step: the second of a session (the first also creates the optimizer state, a one-off), or the
only one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .parallel import Strategy

T = TypeVar("T")

CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Other": "other"}


def tracked(strategy: Strategy, step: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """Run `step` under the memory tracker; returns its result and the bytes by category at the peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(strategy.module, strategy.local_optimizer())
    with tracker:
        result = step()
    from torch.distributed._tools.mem_tracker import _ModState

    peak = tracker.get_tracker_snapshot("peak")
    at_peak = next(iter(peak.values()), {})
    report: dict[str, Any] = {name: int(at_peak.get(category, 0)) for category, name in CATEGORIES.items()}
    report["peak"] = int(at_peak.get("Total", sum(report.values())))
    # Activations saved for backward: what the model holds when its forward returns (largest micro-batch).
    stats = tracker.memory_tracking.get(strategy.module)
    after_forward = [snap.get("Activation", 0) for snaps in (stats.snapshots.get(_ModState.POST_FW, []) if stats
                                                             else []) for snap in snaps.values()]
    report["activations_after_forward"] = int(max(after_forward, default=0))
    return result, report
