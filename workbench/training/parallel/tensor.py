"""Tensor parallelism (Megatron style, torch.distributed.tensor.parallel), alone or inside FSDP2 (FSDP x TP).

The task's plan (Task.tensor_parallel_plan) splits its matrices over the 'tp' dimension of the mesh: each rank
of a TP group holds a slice of every planned Linear (a DTensor), the rest stays replicated. With a data-parallel
size above 1 the TP'd model is then sharded by fully_shard over the data-parallel dimension(s), TP first as
torchtitan does: a 2-D mesh ('dp_shard', 'tp'). The ranks of one TP group see the same batches and draw the
same dropout masks (the loop seeds by the data-parallel coordinate).

Two things the built-ins don't do with a mix of DTensor and plain parameters, or DTensors on different meshes:
foreach/fused optimizer kernels (so each param group is split by mesh) and clip_grad_norm_ (so the norm is
summed here, one full_tensor() per DTensor gradient). Checkpoints go through DCP like every other mode, with
the optimizer's param groups merged back to the task's own grouping, so any layout can load them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from workbench.config.mesh import ParallelDims
from workbench.tasks.blocks import checkpoint_units, shard_units
from workbench.training.compiling import compile_blocks
from workbench.training.parallel.strategy import DTYPES, Strategy, on_device
from workbench.utils.distributed import single_process_dcp

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task


def tensor_parallel_mesh(cfg: RunConfig, device_type: str, world: int) -> DeviceMesh:
    """('tp',) for pure TP, ('dp_shard', 'tp') for FSDP x TP; rank = dp index x tp + tp index."""
    dims = ParallelDims.of(cfg, world)
    if dims.dp == 1:
        return init_device_mesh(device_type, (dims.tp,), mesh_dim_names=("tp",))
    return init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp_shard", "tp"))


def split_groups_by_mesh(optimizer: torch.optim.Optimizer) -> list[int]:
    """Split each param group so plain tensors and DTensors of each mesh sit in groups of their own (foreach
    and fused kernels refuse a mix); returns, per new group, the index of the group it came from."""
    origin, groups = [], []
    for index, group in enumerate(optimizer.param_groups):
        parts: dict[Any, list[torch.Tensor]] = {}
        for p in group["params"]:
            parts.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        for params in parts.values():
            groups.append({**group, "params": params})
            origin.append(index)
    optimizer.param_groups[:] = groups
    return origin


def clip_mixed_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over plain and DTensor gradients on any meshes: a DTensor's norm is made whole
    (full_tensor sums the squares of its shards), a replicated plain gradient counts once."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for g in grads:
        norm = torch.linalg.vector_norm(g, 2)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.float() ** 2
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


class TensorParallel(Strategy):
    """parallelize_module with the task's plan over 'tp', then fully_shard over 'dp_shard' when dp > 1."""

    sharded = True

    def __init__(self, cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module, task: Task,
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        super().__init__(cfg, accelerator)
        world = accelerator.num_processes
        self.name = f"tp{cfg.tp}" if world == cfg.tp else f"{cfg.parallelism}x tp{cfg.tp}"
        # A traced estimate builds its mesh before entering fake mode, as DeviceMesh needs real tensors.
        self.mesh = getattr(accelerator, "mesh", None) or tensor_parallel_mesh(cfg, self.device.type, world)
        model = on_device(model, accelerator)
        plan = task.tensor_parallel_plan(model, cfg)
        if plan is None:
            raise ValueError(f"tp={cfg.tp}: task {task.name!r} has no tensor-parallel plan")
        parallelize_module(model, self.mesh["tp"], plan)
        units = checkpoint_units(model, shard_units(model, task), cfg.activation_checkpointing)
        compile_blocks(cfg, units, tracing=getattr(accelerator, "tracing", False))  # TP, AC, compile, then FSDP
        dtype = DTYPES.get(cfg.precision)
        self.data_parallel = "dp_shard" in (self.mesh.mesh_dim_names or ())
        if self.data_parallel:
            precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
            reshard = cfg.parallelism != "zero2"
            for unit in [*units, model]:
                fully_shard(unit, mesh=self.mesh["dp_shard"], reshard_after_forward=reshard, mp_policy=precision)
        self.model = self.module = model
        self.optimizer = make_optimizer(model)
        self._origin = split_groups_by_mesh(self.optimizer)

    def forward_context(self) -> Any:
        """Pure TP computes under autocast; FSDP x TP casts parameters instead (MixedPrecisionPolicy)."""
        dtype = DTYPES.get(self.cfg.precision)
        if dtype is None or self.data_parallel:
            return super().forward_context()
        return torch.autocast(self.device.type, dtype=dtype)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_mixed_grad_norm_(list(self.module.parameters()), max_norm)

    def facts(self) -> dict[str, Any]:
        """The mesh, this rank's place in it, and how each split parameter is placed and what it holds here."""
        names = self.mesh.mesh_dim_names or ()
        coords = self.mesh.get_coordinate() or []
        split = {name: {"placements": [repr(pl) for pl in p.placements], "local_shape": list(p.to_local().shape),
                        "global_shape": list(p.shape), "mesh": list(p.device_mesh.mesh_dim_names or ())}
                 for name, p in self.module.named_parameters() if isinstance(p, DTensor)}
        return {"mesh": dict(zip(names, self.mesh.mesh.shape)), "coordinates": dict(zip(names, coords)),
                "tp_params": split}

    # ---- checkpoints: param groups as the task made them -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._merged(super().state_dict())

    def _merged(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's param groups merged back to the task's grouping (what other layouts save)."""
        merged: dict[int, dict[str, Any]] = {}
        for index, group in zip(self._origin, state["optim"]["param_groups"]):
            if index in merged:
                merged[index]["params"] = [*merged[index]["params"], *group["params"]]
            else:
                merged[index] = dict(group)
        return {**state, "optim": {**state["optim"], "param_groups": [merged[i] for i in sorted(merged)]}}

    def load(self, path: Path) -> None:
        """As Strategy.load, with the checkpoint's param groups split again the way this optimizer is."""
        state = super().state_dict()
        split = copy.deepcopy(state["optim"]["param_groups"])
        merged = self._merged(state)
        with single_process_dcp():
            dcp.load({"model": merged["model"]}, checkpoint_id=str(path / "model"))
            dcp.load({"optim": merged["optim"]}, checkpoint_id=str(path / "optim"))
        loaded = merged["optim"]["param_groups"]
        regrouped = []
        for index, group in zip(self._origin, split):
            home = next((g for g in loaded if group["params"] and group["params"][0] in g["params"]), loaded[index])
            regrouped.append({**{k: v for k, v in home.items() if k != "params"}, "params": group["params"]})
        optim = {**merged["optim"], "param_groups": regrouped}
        set_state_dict(self.module, self.optimizer, model_state_dict=merged["model"], optim_state_dict=optim)
