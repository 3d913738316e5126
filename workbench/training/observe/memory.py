"""One training step under PyTorch's memory tracker: what each rank holds, by category, at its peak.

`torch.distributed._tools.mem_tracker.MemTracker` follows every tensor an operation creates (a
dispatch mode; nothing is allocated for it) and attributes storage to parameters, gradients,
optimizer state, activations, temporaries and buffers. The step it watches runs slower, so it is
opt-in (track_memory) and watches one step: the second of a session (the first also creates the
optimizer state, a one-off), or the only one.

Under a pipeline schedule (pp > 1) the tracker runs as it does for gradient accumulation: it refuses
a root module forwarded twice in one step ("MemTracker does not support memory tracking for multiple
iterative calls"), so its per-module counts restart before each micro-batch's stage forward
(pipeline.py's stage, through next_micro_batch; the peak is kept). A stage's chunks all count (one
FSDPMemTracker over every sharded chunk), and the receive buffers PipelineStage keeps across steps,
made before the tracked step, are handed to it as communication buffers. `method` names the tracker
that measured a rank (its summary's tracked_memory).

`peak_memory_bytes` is the plain peak every rank reports (its metrics rows and summary), tracked
step or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from workbench.training.parallel import Strategy

T = TypeVar("T")
_ACTIVE: list[Any] = []
"""The tracker watching the current step, if any (the trainer's, or an estimate's trace)."""


def watching(tracker: Any) -> Any:
    """Register `tracker` as the one watching (a context manager around the tracked step)."""
    import contextlib

    @contextlib.contextmanager
    def scope() -> Any:
        _ACTIVE.append(tracker)
        try:
            with tracker:
                yield tracker
        finally:
            _ACTIVE.remove(tracker)

    return scope()


def next_micro_batch(module: Any = None) -> None:
    """Between the micro-batches of an accumulated step, and before each forward of a pipeline
    stage's `module`: the tracker counts a module's forward once per pass, so its per-module counts
    restart (its peak is kept). A stage's other chunks keep theirs: their backwards for earlier
    micro-batches are still to come."""
    tracker = _ACTIVE[-1] if _ACTIVE else None
    if tracker is None or not hasattr(tracker, "memory_tracking"):
        return
    if module is None:
        tracker.reset_mod_stats()
        return
    for m in module.modules():
        tracker.memory_tracking.pop(m, None)


def stage_point() -> None:
    """After a pipeline stage's forward or backward: a tracker that samples
    (stage_memory.LiveTensors) samples."""
    if _ACTIVE and hasattr(_ACTIVE[-1], "sample"):
        _ACTIVE[-1].sample()


def summarize(snapshot: dict[Any, dict[str, Any]], device: Any) -> dict[str, int]:
    """A tracker's snapshot on `device` by workbench's categories (MemTracker's and FSDPMemTracker's
    names alike). On a GPU the snapshot also has the host's tensors (the batch before it moves): not
    counted."""
    import torch

    device = torch.device(device)
    own = next((v for k, v in snapshot.items() if torch.device(k).type == device.type), {})
    s = {str(getattr(k, "value", k)): v for k, v in own.items()}
    return {
        "params": s.get("Sharded Param", 0) + s.get("Unsharded Param", 0) + s.get("Parameter", 0),
        "grads": s.get("Sharded Grad", 0) + s.get("Unsharded Grad", 0) + s.get("Gradient", 0),
        "optimizer": s.get("OptState", 0) + s.get("Optstate", 0),
        "activations": s.get("Activation", 0),
        "buffers": s.get("All Gather", 0) + s.get("Reduce Scatter", 0),
        "temporaries": s.get("Temp", 0)
        + s.get("Buffer", 0)
        + s.get("Inputs", 0)
        + s.get("Other", 0),
        "peak": s.get("Total", 0),
    }


def activations_after_forward(tracker: Any, module: Any) -> int:
    """Activations saved for backward: what the model holds when its forward returns (a pipeline
    stage's chunks: the most when any of them returns)."""
    import torch

    if isinstance(module, torch.nn.ModuleList):
        return max((activations_after_forward(tracker, chunk) for chunk in module), default=0)
    stats = tracker.memory_tracking.get(module)
    # MemTracker snapshots the module at POST_FW; FSDPMemTracker at AFT_POST_FW (after resharding).
    snaps = [
        snap
        for state, snaps in (stats.snapshots.items() if stats else ())
        if getattr(state, "name", state) in ("POST_FW", "AFT_POST_FW")
        for snap in snaps
    ]
    # MemTracker's categories are str enums, FSDPMemTracker's plain ones: compare by value.
    return int(
        max(
            (
                v
                for snap in snaps
                for s in snap.values()
                for k, v in s.items()
                if str(getattr(k, "value", k)) == "Activation"
            ),
            default=0,
        )
    )


def _fsdp_root(module: Any) -> Any:
    """The FSDP2 module FSDPMemTracker takes: the model, or a pipeline stage's first sharded chunk;
    None when nothing is sharded."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return module
    chunks = module if isinstance(module, torch.nn.ModuleList) else ()
    return next((c for c in chunks if isinstance(c, FSDPModule)), None)


def method(strategy: Strategy) -> str:
    """Which tracker `tracked` runs for `strategy` (and how it follows a pipeline schedule)."""
    name = "FSDPMemTracker" if _fsdp_root(strategy.module) is not None else "MemTracker"
    if strategy.pipelined:
        return (
            f"{name} (PyTorch's), its module counts restarted before each micro-batch's stage "
            "forward"
        )
    return f"{name} (PyTorch's)"


def _global_peak_only(tracker: Any) -> None:
    """Keep only the tracker's global peak up to date at each operation. MemTracker also updates a
    peak for every module it has seen, at every operation: a walk over its module table in which
    each entry's weak reference asks `hasattr(module, "_fix_weakref")` through
    nn.Module.__getattr__, which raises. For GPT-2 small that was half the tracked step's time (1.7
    s of an estimate's 3.6-s trace on 2 cores), and workbench reads no per-module peak: the step's
    peak, and the root module's snapshot after forward (taken by its own hook, not by this update).
    A torch whose tracker lacks these attributes keeps its own update."""
    from copy import deepcopy

    from torch.distributed._tools import mem_tracker

    total = getattr(mem_tracker, "_TOTAL_KEY", None)
    if total is None or not all(
        hasattr(tracker, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
    ):
        return

    def update(peak_state: Any) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap[total]:
                tracker._peak_mem[dev] = snap[total]
                tracker._peak_mem_snap[dev] = deepcopy(snap)

    tracker._update_peak_stats = update


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


def _no_hooks_on_frozen(tracker: Any, module: Any) -> None:
    """MemTracker registers a gradient hook on every parameter it meets, and registering one on a
    parameter that doesn't require gradients raises ("cannot register a hook on a tensor that
    doesn't require gradient"): a frozen base under LoRA, outside FSDP2 (ddp, zero1, tp). A frozen
    parameter never gets a gradient, so there is nothing to hook: it is entered as hooked already,
    with handles that remove nothing (the tracker removes every handle it holds on exit)."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if handles is None:  # a torch whose tracker keeps its hooks elsewhere
        return
    for p in module.parameters():
        if not p.requires_grad:
            handles[p] = (_NoHook(), _NoHook())


def tracked(
    strategy: Strategy, step: Callable[[], T], inputs: tuple[Any, ...] = ()
) -> tuple[T, dict[str, int]]:
    """Run `step` under PyTorch's memory tracker (FSDPMemTracker for a sharded model, MemTracker
    otherwise); returns its result and the bytes by category at the peak, with the activations after
    forward."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    root = _fsdp_root(strategy.module)
    received = strategy.receive_buffers()
    if root is not None:
        tracker: Any = FSDPMemTracker(root, strategy.local_optimizer())
        # It walks the root's modules for FSDP states: a stage's every chunk (it checks the type
        # only here).
        tracker._root_mod = strategy.module
        if inputs or received:
            tracker.track_inputs((*inputs, *received))
    else:
        tracker = MemTracker()
        _no_hooks_on_frozen(tracker, strategy.module)
        tracker.track_external(strategy.module, strategy.local_optimizer(), *inputs, *received)
    _global_peak_only(tracker)
    with watching(tracker):
        result = step()
    report = summarize(tracker.get_tracker_snapshot("peak"), strategy.device)
    # The receive buffers live through the whole step, so they are in the peak, tracked as inputs
    # (temporaries).
    moved = min(
        report["temporaries"],
        sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in received
            }.values()
        ),
    )
    report["temporaries"] -= moved
    report["buffers"] += moved
    report["activations_after_forward"] = activations_after_forward(tracker, strategy.module)
    return result, report


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by PyTorch on this device; CPU: this process's peak resident set size."""
    import resource
    import sys

    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
