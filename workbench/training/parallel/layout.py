"""A module laid out over a mesh of tensor- and data-parallel dimensions, in torchtitan's order
(parallelize_llama): tensor parallelism over 'tp' first, then activation checkpointing and compile per block,
then data parallelism over the mesh's other dimensions, each block and then the root:

    ('dp_shard',)                  fully_shard (FSDP2): zero2 keeps the gathered parameters to backward, zero3 not
    ('dp_shard', 'cp'), ('cp',)    fully_shard over the two flattened into 'dp_shard_cp' (torchtitan's name): the
                                   ranks of a CP group hold the same parameters, so FSDP shards over them too
    ('dp_replicate', 'dp_shard')   fully_shard on the 2-D sub-mesh: HSDP, sharded within a group, replicated across
    ('dp_replicate',)              replicate, FSDP2's DDP (torch.distributed._composable.replicate_with_fsdp):
                                   DistributedDataParallel refuses DTensor parameters (it broadcasts and buckets
                                   plain tensors), PyTorch's replicate is the DDP that composes with TP

apply_layout is the one place this order lives: TensorParallel calls it for the whole model, and a pipeline
stage can call it for its own part (its mesh is then the stage's sub-mesh, without 'pp').
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from workbench.config.mesh import ParallelDims
from workbench.tasks.blocks import checkpoint_units
from workbench.training.compiling import compile_blocks
from workbench.training.parallel.strategy import DTYPES

if TYPE_CHECKING:
    from workbench.config import RunConfig

DATA_DIMS = ("dp_replicate", "dp_shard", "cp")
"""The mesh dimensions the parameters are replicated or sharded over, outermost first (cp: the ranks of a CP group
see one batch, but hold the same parameters)."""


def layout_mesh(cfg: RunConfig, device_type: str, world: int) -> DeviceMesh:
    """The mesh of a run with tp > 1 or cp > 1 (and pp = 1): its dimensions larger than 1 among dp_replicate,
    dp_shard, cp and tp (tp always when cp is 1), outermost first, so the ranks of one TP group are neighbours:
    ('tp',) for pure TP, ('dp_shard', 'tp') for FSDP x TP, ('dp_replicate', 'tp') for DDP x TP, all three for
    HSDP x TP; ('cp',), ('dp_shard', 'cp'), ('dp_shard', 'cp', 'tp') and so on with context parallelism."""
    sizes = ParallelDims.of(cfg, world).sizes
    names = tuple(name for name in (*DATA_DIMS, "tp") if sizes[name] > 1 or (name == "tp" and sizes["cp"] == 1))
    return init_device_mesh(device_type, tuple(sizes[name] for name in names), mesh_dim_names=names)


def data_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The data-parallel dimensions of `mesh` (what apply_layout shards or replicates over), outermost first."""
    return tuple(name for name in DATA_DIMS if name in (mesh.mesh_dim_names or ()))


def apply_layout(module: torch.nn.Module, mesh: DeviceMesh, cfg: RunConfig, plan: dict[str, Any] | None,
                 units: list[torch.nn.Module], *, tracing: bool = False) -> None:
    """Make `module` parallel over `mesh` (dimensions among dp_replicate, dp_shard and tp) in place: `plan`
    (Task.tensor_parallel_plan, names relative to `module`) over 'tp', activation checkpointing and
    compile='blocks' on `units` (the module's repeated blocks, as the task built them), then fully_shard or
    replicate on each unit and the root over the data-parallel dimensions, with cfg's precision (parameters
    cast, gradients reduced in fp32) and cpu_offload. `tracing`: an estimate's trace (compile is left out)."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names and plan:
        parallelize_module(module, mesh["tp"], plan)
    # Checkpoint wrappers rename submodules, so they come after the plan that names them; FSDP wraps last.
    units = checkpoint_units(module, units, cfg.activation_checkpointing)
    compile_blocks(cfg, units, tracing=tracing)
    data = data_dims(mesh)
    if not data:
        return
    dtype = DTYPES.get(cfg.precision)
    precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    if data == ("dp_replicate",):
        try:
            from torch.distributed._composable.replicate_with_fsdp import replicate
        except ImportError as e:  # PyTorch's DDP for DTensors is recent; DistributedDataParallel refuses them
            raise ValueError(f"parallelism='ddp' with tp={cfg.tp}: torch {torch.__version__} has no FSDP2-based "
                             "replicate (torch.distributed._composable.replicate_with_fsdp) to replicate a TP'd "
                             "model with; use parallelism='zero2', or a newer torch") from e
        for unit in [*units, module]:
            replicate(unit, mesh=mesh["dp_replicate"], mp_policy=precision)
        return
    # Pinned host memory is what makes the copies to and from a GPU asynchronous; a CPU mesh has nothing to pin.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cfg.cpu_offload else OffloadPolicy()
    dp_mesh = _shard_mesh(mesh, data)
    for unit in [*units, module]:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=cfg.parallelism != "zero2", mp_policy=precision,
                    offload_policy=offload)


def _shard_mesh(mesh: DeviceMesh, data: tuple[str, ...]) -> DeviceMesh:
    """The mesh fully_shard takes: the sharding dimensions (dp_shard, cp) as one, flattened into 'dp_shard_cp' when
    both are there, under 'dp_replicate' for HSDP."""
    shard = tuple(name for name in data if name != "dp_replicate")
    if len(shard) > 1:
        # Kept as _flatten returns it: slicing a flattened dimension back out of the root mesh is deprecated.
        flat = mesh[shard]._flatten("dp_shard_cp")
        return DeviceMesh._concatenate([mesh["dp_replicate"], flat]) if "dp_replicate" in data else flat
    return mesh[data] if len(data) > 1 else mesh[data[0]]
