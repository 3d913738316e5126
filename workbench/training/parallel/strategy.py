"""What every parallelism strategy does the same way: precision, backward, clipping, the update, the bytes
each rank holds, and checkpoints through torch.distributed.checkpoint (DCP).

A checkpoint holds the model and optimizer state keyed by parameter name, in DCP's format: a run can resume
with another number of ranks or another mode (saved by zero3 on 2 ranks, resumed by ddp on 1), and DCP
reshards. The portable copy at the end of a run is one safetensors file of the full weights.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from workbench.training.measures import state_digest
from workbench.utils.distributed import single_process_dcp

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.training.breakdown import DDPCommStats

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def on_device(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """The model on the rank's device; a traced estimate's model already has (fake) storage there."""
    return model if getattr(accelerator, "tracing", False) else model.to(accelerator.device)


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for `t`: its local shard for a DTensor."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


class Strategy:
    """The training-step operations that depend on how the model is parallel; subclasses wrap the model."""

    name = "base"
    sharded = False
    """Parameters are sharded at rest: no rank holds the full weights."""

    def __init__(self, cfg: RunConfig, accelerator: Accelerator) -> None:
        self.cfg, self.accelerator = cfg, accelerator
        self.device = accelerator.device
        self.model: torch.nn.Module
        self.module: torch.nn.Module  # the model without a DDP wrapper (FSDP2 modules are their own)
        self.optimizer: torch.optim.Optimizer
        self.scaler: Any = None
        self.held_bytes: dict[str, int] = {}
        """Parameter, gradient and optimizer-state bytes this rank holds, measured at the first update."""
        self.comm_stats: DDPCommStats | None = None
        """The gradient all-reduce not hidden by compute, where DDP measures it."""

    # ---- the step -------------------------------------------------------------------------------------
    def forward_context(self) -> AbstractContextManager[Any]:
        """Autocast for replicated modes; sharded modes cast parameters instead (MixedPrecisionPolicy)."""
        return nullcontext()

    def batch_context(self, batch: Any) -> AbstractContextManager[Any]:
        """What the forward and the backward of `batch` run in together, around forward_context: context parallel
        shards the batch's sequences over its group there (ring attention's backward needs it too)."""
        return nullcontext()

    def sync_gradients(self, last_micro_batch: bool) -> AbstractContextManager[Any]:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self) -> bool:
        """Apply the update and clear the gradients; True when fp16 loss scaling skipped it (overflow)."""
        skipped = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        if not self.held_bytes:
            self.held_bytes = self.measure_held_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    # ---- what this rank holds -------------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        """What this rank can show about its parallel setup (hooks, mesh), for the summary."""
        return {}

    def local_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer whose state lives on this rank (ZeRO-1: the rank's partition)."""
        return self.optimizer

    def measure_held_bytes(self) -> dict[str, int]:
        params = list(self.module.parameters())
        return {"params": sum(local_bytes(p) for p in params),
                "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
                "optimizer": optimizer_state_bytes(self.local_optimizer())}

    def weights_digest(self) -> str | None:
        """sha256 of this rank's full weights (replicated modes); None where ranks hold shards."""
        return None if self.sharded else state_digest(self.module.state_dict())

    # ---- checkpoints (collective: every rank calls) ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{'model': ..., 'optim': ...} keyed by parameter name, as DCP saves and loads it."""
        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def save(self, path: Path) -> None:
        """The model into path/model and the optimizer into path/optim (DCP, sharded as the ranks hold it)."""
        state = self.state_dict()
        with single_process_dcp():
            dcp.save({"model": state["model"]}, checkpoint_id=str(path / "model"))
            dcp.save({"optim": state["optim"]}, checkpoint_id=str(path / "optim"))

    def load(self, path: Path) -> None:
        """Load a checkpoint saved by any mode and number of ranks; DCP reshards it into this layout."""
        state = self.state_dict()
        with single_process_dcp():
            dcp.load({"model": state["model"]}, checkpoint_id=str(path / "model"))
            dcp.load({"optim": state["optim"]}, checkpoint_id=str(path / "optim"))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full weights on CPU, on rank 0 (other ranks get {})."""
        if not dist.is_initialized():  # one process, no group: nothing to gather
            return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.module, options=options)
