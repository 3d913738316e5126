"""track_memory where PyTorch's MemTracker can't follow the pipeline schedule: the zero-bubble
schedule.

It splits each backward into torch.autograd.grad over the stage's inputs, then over its weights, and
the module hooks MemTracker relies on fail there (PyTorch 2.13: "A leaf node was passed to
_will_engine_execute_node but we are currently running autograd.grad(). This is currently not
supported."). Instead this rank's live tensors are measured by category at each point the schedule
hands over: after every forward of a chunk and after every backward (input or weight), and after the
update. Parameters, gradients and optimizer state are read from the model and the optimizer, the
receive buffers from the stages, activations are the tensors autograd saved for backward that are
still alive (saved_tensors_hooks sees each as it is saved; FSDP's gathered parameters are among them
under zero2). Each storage counts once. The peak is the largest sample: what lives between
operations, so an operation's own temporaries are missed; on CUDA `allocator_peak` adds
torch.cuda.max_memory_allocated over the step, which includes them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from workbench.training.parallel import Strategy

T = TypeVar("T")
METHOD = (
    "live tensors by category sampled after each forward and backward of the stage (MemTracker "
    "can't follow the zero-bubble schedule's split backward)"
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LiveTensors:
    """Samples this rank's live tensors by category (a tracker for memory.watching)."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.saved: list[weakref.ref[torch.Tensor]] = []
        self.peak: dict[str, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(weakref.ref(t))
        return t

    def __enter__(self) -> LiveTensors:
        self._hooks.__enter__()
        self.sample()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self.sample()

    def sample(self) -> None:
        """Bytes by category now; kept when the total is the largest so far."""
        s, opt = self.strategy, self.strategy.local_optimizer()
        params = list(s.module.parameters())
        seen: set[int] = set()
        groups = {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": [
                v
                for state in opt.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ],
            "buffers": s.receive_buffers(),
            "activations": [t for ref in self.saved if (t := ref()) is not None],
        }
        now = {name: _bytes(tensors, seen) for name, tensors in groups.items()}
        now["peak"] = sum(now.values())
        if now["peak"] > self.peak.get("peak", -1):
            self.peak = now


def _bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages of `tensors` not in `seen` (then added to it)."""
    total = 0
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def live_tracked(strategy: Strategy, step: Callable[[], T]) -> tuple[T, dict[str, Any]]:
    """Run `step` sampling the live tensors (see the module docstring); its result and the
    categories at the largest sample, in memory.tracked's keys (temporaries: not seen, 0)."""
    from workbench.training.observe.memory import watching

    device = strategy.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tracker = LiveTensors(strategy)
    with watching(tracker):
        result = step()
    report: dict[str, Any] = {**tracker.peak, "temporaries": 0, "activations_after_forward": None}
    if device.type == "cuda":
        report["allocator_peak"] = int(torch.cuda.max_memory_allocated(device))
    return result, report
