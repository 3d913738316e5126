"""Model FLOPs utilisation: the task's FLOPs per sample over the accelerator catalog's peak."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from workbench.config import RunConfig
    from workbench.tasks import Task


@dataclass(frozen=True)
class ModelFlops:
    flops_per_sample: float | None
    """The task's count (None: it doesn't say)."""
    peak_flops: float | None
    """One device's peak at the run's precision (None: not a GPU in the catalog)."""
    world: int

    @classmethod
    def of(
        cls, task: Task, cfg: RunConfig, model: torch.nn.Module, device: torch.device, world: int
    ) -> ModelFlops:
        from workbench.utils.hardware import detect

        peak = None
        gpus = detect().gpus
        if device.type == "cuda" and gpus:  # the catalog's peaks, loaded on GPU ranks only
            from workbench.estimator.catalog import peak_flops

            peak = peak_flops(gpus[0].name, cfg.precision, tf32=cfg.tf32)
        return cls(task.flops_per_sample(cfg, model), peak, world)

    def mfu(self, samples_per_s: float) -> float | None:
        """The fraction of the devices' peak the run's samples per second use (None: unknown)."""
        if not (self.peak_flops and self.flops_per_sample):
            return None
        return self.flops_per_sample * samples_per_s / self.world / self.peak_flops
