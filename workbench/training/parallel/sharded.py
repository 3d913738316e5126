"""Sharded modes on PyTorch's FSDP2 (`fully_shard`): 'zero2', 'zero3' (alias 'fsdp') and 'hsdp'.

The recipe (apply.py) has sharded the model before this strategy receives it: each shard unit
(the model's repeated blocks, or what Task.shard_units names), then the root, became an FSDP2 module
whose parameters are DTensors sharded over the data-parallel mesh; the optimizer state follows the
parameters. zero2 keeps the gathered parameters from forward to backward
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

from workbench.training.parallel.strategy import Strategy

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.training.parallel.placement import Placement


class Sharded(Strategy):
    """A model the recipe sharded over ('dp_shard',) or ('dp_replicate', 'dp_shard'): FSDP2 on each
    block and the root (apply.apply_fsdp)."""

    sharded = True

    def __init__(
        self,
        cfg: RunConfig,
        where: Placement,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        super().__init__(cfg, where)
        self.name = cfg.parallelism
        self.model = self.module = model
        # after fully_shard (the recipe): its parameters are the sharded DTensors
        self.optimizer = make_optimizer(model)
        if cfg.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device.type)

    def facts(self) -> dict[str, Any]:
        assert self.mesh is not None  # a sharded mode always has one (device_mesh.mesh_dims)
        return {"mesh": dict(zip(self.mesh.mesh_dim_names or (), self.mesh.mesh.shape))}
