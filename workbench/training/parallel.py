"""Where the model is made parallel: the one place a parallelism mode changes the training step.

Following torchtitan, "parallelize the model" is kept apart from the loop: the loop asks the strategy to
wrap the model and optimizer, to hold back gradient sync on all but the last micro-batch, to run backward,
to clip and to step, and never looks at how. Today the strategy is data parallel (DDP) through
accelerate.prepare, which also owns autocast and fp16 loss scaling.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..config import RunConfig


class DataParallel:
    """Replicas on every rank with gradients all-reduced (DDP); a single plain process for 'none'."""

    name = "ddp"

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.accelerator = accelerator
        self.model, self.optimizer = accelerator.prepare(model, optimizer)

    def sync_gradients(self, last_micro_batch: bool) -> AbstractContextManager[Any]:
        """Gradients are all-reduced only on the micro-batch that ends the step."""
        return nullcontext() if last_micro_batch else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)

    def step(self) -> bool:
        """Apply the update and clear the gradients; True when fp16 loss scaling skipped it (overflow)."""
        self.optimizer.step()
        skipped = self.accelerator.scaler is not None and self.accelerator.optimizer_step_was_skipped
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def unwrapped(self) -> torch.nn.Module:
        """The model without its parallel wrapper, for weights digests and export."""
        return self.accelerator.unwrap_model(self.model)


def parallelize(cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> DataParallel:
    """Make `model` parallel as cfg.parallelism asks; the loop then trains through the returned strategy."""
    return DataParallel(accelerator, model, optimizer)
