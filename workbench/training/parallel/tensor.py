"""Tensor parallelism (Megatron style, torch.distributed.tensor.parallel), alone or with data
parallelism.

The recipe (apply.py) has split the model before this strategy receives it: the plan
(Task.tensor_parallel_plan) over the 'tp' dimension of the mesh, each rank of a TP group holding a
slice of every planned Linear (a DTensor), the rest replicated; with a data-parallel size above 1
the TP'd model then made data parallel over the mesh's other dimensions (torchtitan's order): FSDP
x TP ('dp_shard', 'tp'), HSDP x TP ('dp_replicate', 'dp_shard', 'tp') or DDP x TP ('dp_replicate',
'tp', PyTorch's FSDP2-based replicate). The ranks of one TP group see the same batches and draw the
same dropout masks (the loop seeds by the data-parallel coordinate).

Three things the built-ins don't do with a mix of DTensor and plain parameters, or DTensors on
different meshes: foreach/fused optimizer kernels (so each param group is split by mesh),
clip_grad_norm_ (so the norm is summed here, one full_tensor() per DTensor gradient) and fp16's loss
scaler (so it unscales each rank's local shards). Checkpoints go through Strategy's DCP state-dict
path like every other mode (the param groups split by mesh are merged back to the task's grouping
there: param_groups.py), so any layout can load them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from workbench.training.parallel.apply import data_dims
from workbench.training.parallel.param_groups import split_groups_by_mesh
from workbench.training.parallel.strategy import DTYPES, Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from workbench.config import RunConfig
    from workbench.training.parallel.placement import Placement


def placement_facts(
    mesh: DeviceMesh, named_parameters: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """({'mesh': sizes, 'coordinates': this rank's}, per DTensor parameter: placements, local and
    global shape, mesh dimensions): what a rank shows of how it is laid out."""
    names = mesh.mesh_dim_names or ()
    coords = mesh.get_coordinate() or []
    split = {
        name: {
            "placements": [repr(pl) for pl in p.placements],
            "local_shape": list(p.to_local().shape),
            "global_shape": list(p.shape),
            "mesh": list(p.device_mesh.mesh_dim_names or ()),
        }
        for name, p in named_parameters
        if isinstance(p, DTensor)
    }
    return {
        "mesh": dict(zip(names, mesh.mesh.shape)),
        "coordinates": dict(zip(names, coords)),
    }, split


@torch.no_grad()
def squared_norm(grads: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The squared 2-norm of plain and DTensor gradients on any meshes, as if each DTensor were
    whole. Each rank sums the squares of its local shards per (mesh, placements); an all-reduce per
    such group and split dimension makes the sum whole (not a DTensor reduction per gradient), and a
    replicated gradient counts once. The sums are taken on `device` (default: the first gradient's):
    offloaded shards sit on the CPU, and NCCL reduces GPU tensors only."""
    device = device or (grads[0].device if grads else None)
    sums: dict[Any, torch.Tensor] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        local = g.to_local() if isinstance(g, DTensor) else g
        square = torch.linalg.vector_norm(local, 2, dtype=torch.float32).to(device) ** 2
        sums[key] = sums[key] + square if key in sums else square
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key, square in sums.items():
        if key is not None:
            mesh, placements = key
            # Summed along every mesh dimension the values are split on: all but Replicate (FSDP x
            # TP's _StridedShard included); plain all-reduces, as a DTensor redistribution costs
            # more on a scalar.
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():
                    dist.all_reduce(square, group=mesh.get_group(dim))
        total = total + square
    return total


@torch.no_grad()
def scale_gradients_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale each gradient this rank holds so the norm `total` becomes at most `max_norm`."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))


def clip_mixed_grad_norm_(
    params: list[torch.Tensor], max_norm: float, device: torch.device | None = None
) -> torch.Tensor:
    """clip_grad_norm_ over plain and DTensor gradients on any meshes (the built-in refuses a
    mix)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = squared_norm(grads, device).sqrt()
    scale_gradients_(grads, total, max_norm)
    return total


class LocalShardGradScaler(ShardedGradScaler):
    """fp16 loss scaling for DTensor gradients: each rank checks and unscales the shards it holds,
    and ShardedGradScaler's all-reduce of the overflow flag makes every rank skip the same steps.
    PyTorch's own unscale takes DTensors only in a list of nothing else, and pure TP mixes them with
    plain gradients (embeddings, norms): 'aten._amp_foreach_non_finite_check_and_unscale_: got mixed
    torch.Tensor and DTensor'."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                        if not allow_fp16 and local.dtype == torch.float16:
                            raise ValueError("Attempting to unscale FP16 gradients.")
                        grads[local.device, local.dtype].append(local)
            # a flag per device (offloaded shards are on the CPU)
            found = {found_inf.device: found_inf}
            for (device, _), local_grads in grads.items():
                if device not in found:
                    found[device] = found_inf.to(device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    local_grads, found[device], inv_scale.to(device)
                )
        return found


class TensorParallel(Strategy):
    """A model the recipe split over 'tp' by the plan, then made data parallel over the mesh's other
    dimensions (apply.py)."""

    sharded = True

    def __init__(
        self,
        cfg: RunConfig,
        where: Placement,
        model: torch.nn.Module,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        super().__init__(cfg, where)
        world = self.accelerator.num_processes
        self.name = f"tp{cfg.tp}" if world == cfg.tp else f"{cfg.parallelism} x tp{cfg.tp}"
        self.data_parallel = data_dims(self.mesh)
        self.model = self.module = model
        self.optimizer = make_optimizer(model)
        self._origin = split_groups_by_mesh(self.optimizer)
        if cfg.precision == "fp16":
            self.scaler = LocalShardGradScaler(device=self.device.type)

    def forward_context(self) -> Any:
        """Pure TP computes under autocast; with data parallelism FSDP2 casts parameters instead
        (MixedPrecisionPolicy)."""
        dtype = DTYPES.get(self.cfg.precision)
        if dtype is None or self.data_parallel:
            return super().forward_context()
        return torch.autocast(self.device.type, dtype=dtype)

    def sync_gradients(self, last_micro_batch: bool) -> Any:
        """DDP x TP all-reduces gradients on the micro-batch that ends the step only, as DDP's
        no_sync does; FSDP2's sharded layouts reduce-scatter every micro-batch (held back, each rank
        would keep full gradients)."""
        if self.data_parallel == ("dp_replicate",):
            self.module.set_requires_gradient_sync(last_micro_batch)  # type: ignore[operator]
        return super().sync_gradients(last_micro_batch)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.scaler is not None:
            # the norm and the clipping are of the true gradients, not the scaled ones
            self.scaler.unscale_(self.optimizer)
        return clip_mixed_grad_norm_(list(self.module.parameters()), max_norm, self.device)

    def facts(self) -> dict[str, Any]:
        """The mesh, this rank's place in it, and how each split parameter is placed and what it
        holds here."""
        where, split = placement_facts(self.mesh, self.module.named_parameters())
        return {**where, "tp_params": split}
