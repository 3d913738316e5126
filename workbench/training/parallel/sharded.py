"""Sharded modes on PyTorch's FSDP2 (`fully_shard`): 'zero2', 'zero3' (alias 'fsdp') and 'hsdp'.

Each shard unit (the model's repeated blocks, or what Task.shard_units names), then the root,
becomes an FSDP2 module whose parameters are DTensors sharded over the data-parallel mesh; the
optimizer state follows the parameters. zero2 keeps the gathered parameters from forward to backward
(reshard_after_forward=False), zero3 frees them after each unit's forward; hsdp shards within groups
of dp_shard ranks and replicates across groups (a 2-D mesh). Gradients are reduce-scattered after
every micro-batch, so they stay sharded during accumulation (torchtitan does the same: holding them
back would mean a full gradient per rank). accelerate is not asked to wrap anything: it turns an
FSDP plugin into DDP on CPU without a word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from workbench.tasks.blocks import shard_units
from workbench.training.parallel.apply import apply_parallelism
from workbench.training.parallel.strategy import Strategy, on_device

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task


class Sharded(Strategy):
    """apply.apply_parallelism over ('dp_shard',) or ('dp_replicate', 'dp_shard'): AC and compile
    per block, then FSDP2 on each block and the root."""

    sharded = True

    def __init__(
        self,
        cfg: RunConfig,
        accelerator: Accelerator,
        model: torch.nn.Module,
        task: Task,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        super().__init__(cfg, accelerator)
        self.name = cfg.parallelism
        if not cfg.cpu_offload:
            model = on_device(model, self.accelerator)
        apply_parallelism(
            model, self.mesh, cfg, None, shard_units(model, task), tracing=self.accelerator.tracing
        )
        self.model = self.module = model
        # after fully_shard: its parameters are the sharded DTensors
        self.optimizer = make_optimizer(model)
        if cfg.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device.type)

    def facts(self) -> dict[str, Any]:
        assert self.mesh is not None  # a sharded mode always has one (device_mesh.mesh_dims)
        return {"mesh": dict(zip(self.mesh.mesh_dim_names or (), self.mesh.mesh.shape))}
