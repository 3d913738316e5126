"""Where a rank sits, as the recipe and a strategy need to know it: the few things they ask of
accelerate's Accelerator, and what a traced estimate adds (a mesh built before fake mode, the
stages' parameters its fake group can't gather). Every strategy reads these as declared attributes;
accelerate's Accelerator becomes one in `Placement.of`, the estimator's fake rank is one
(estimator/trace/fake_world.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Placement:
    """One rank of a world of `num_processes`, on `device`."""

    device: torch.device
    num_processes: int
    process_index: int = 0
    mesh: DeviceMesh | None = None
    """The run's mesh when built beforehand (a traced estimate: DeviceMesh needs real tensors);
    None: parallelize builds it (device_mesh.build_mesh) before the recipe runs."""
    tracing: bool = False
    """A traced estimate: fake tensors and a fake process group, so no DDP, compile or fp8 swap."""
    stage_params: list[set[str]] | None = None
    """Pipeline, traced: the parameter names each stage holds (what the ranks would gather from each
    other)."""

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @classmethod
    def of(cls, accelerator: Any) -> Placement:
        """`accelerator` (accelerate's Accelerator, or anything with its device and num_processes)
        as a Placement; a Placement as it is. One process is rank 0, whatever else it declares."""
        if isinstance(accelerator, Placement):
            return accelerator
        rank = accelerator.process_index if accelerator.num_processes > 1 else 0
        return cls(accelerator.device, accelerator.num_processes, rank)
