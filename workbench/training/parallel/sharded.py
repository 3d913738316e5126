"""Sharded modes on PyTorch's FSDP2 (`fully_shard`): 'zero2', 'zero3' (alias 'fsdp') and 'hsdp'.

Each shard unit (the model's repeated blocks, or what Task.shard_units names), then the root, becomes an
FSDP2 module whose parameters are DTensors sharded over the data-parallel mesh; the optimizer state follows
the parameters. zero2 keeps the gathered parameters from forward to backward (reshard_after_forward=False),
zero3 frees them after each unit's forward; hsdp shards within groups of dp_shard ranks and replicates
across groups (a 2-D mesh). Gradients are reduce-scattered after every micro-batch, so they stay sharded
during accumulation (torchtitan does the same: holding them back would mean a full gradient per rank).
accelerate is not asked to wrap anything: it turns an FSDP plugin into DDP on CPU without a word.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from workbench.config.mesh import ParallelDims
from workbench.training.parallel.strategy import DTYPES, Strategy, on_device

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig


def data_parallel_mesh(cfg: RunConfig, device_type: str, world: int) -> DeviceMesh:
    """1-D ('dp_shard') over all ranks, or 2-D ('dp_replicate', 'dp_shard') for hsdp."""
    dims = ParallelDims.of(cfg, world)
    if dims.dp_replicate > 1:
        return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))


class Sharded(Strategy):
    sharded = True

    def __init__(self, cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module, units: list[torch.nn.Module],
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        super().__init__(cfg, accelerator)
        self.name = cfg.parallelism
        # A traced estimate builds its mesh before entering fake mode, as DeviceMesh needs real tensors.
        self.mesh = getattr(accelerator, "mesh", None) or data_parallel_mesh(cfg, self.device.type,
                                                                             accelerator.num_processes)
        dtype = DTYPES.get(cfg.precision)
        # Compute in bf16/fp16, keep fp32 master weights and reduce gradients in fp32.
        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
        if not cfg.cpu_offload:
            model = on_device(model, accelerator)
        reshard = cfg.parallelism != "zero2"
        for unit in units:
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=precision,
                        offload_policy=offload)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard, mp_policy=precision, offload_policy=offload)
        self.model = self.module = model
        self.optimizer = make_optimizer(model)  # after fully_shard: its parameters are the sharded DTensors
        if cfg.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device.type)

    def facts(self) -> dict[str, Any]:
        return {"mesh": dict(zip(self.mesh.mesh_dim_names or (), self.mesh.mesh.shape))}
