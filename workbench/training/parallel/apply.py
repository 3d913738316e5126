"""How a module is made parallel, in torchtitan's order (parallelize_llama: apply_tp, apply_ac,
apply_compile, apply_fsdp), as plain functions that every mode and every pipeline chunk runs through
`apply_parallelism`:

    apply_tp         the task's plan over 'tp' (before the checkpoint wrappers rename the
                     submodules it names)
    apply_ac         activation checkpointing per block (Task.shard_units)
    compile_blocks   compile='blocks' per block (compiling.py), before FSDP or DDP wraps them
    apply_fsdp       fully_shard (FSDP2) on each block and the root, over the data-parallel dims:
                     ('dp_shard',): zero2 keeps the gathered parameters to backward, zero3 not;
                     ('dp_shard', 'cp'), ('cp',): flattened into 'dp_shard_cp' (torchtitan's
                     name), as the ranks of a CP group hold the same parameters;
                     ('dp_replicate', 'dp_shard'): HSDP, sharded in a group, replicated across
    apply_replicate  ('dp_replicate',) with TP: FSDP2's DDP (replicate_with_fsdp), as
                     DistributedDataParallel refuses DTensor parameters

The fp8 swap (float8.py) comes first and compile='model' last (parallelize, in __init__.py);
replicated modes without TP are wrapped in DistributedDataParallel by their strategy after
apply_parallelism (replicated.py). The mesh comes from device_mesh.build_mesh; a pipeline stage
passes its sub-mesh, without 'pp'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from workbench.tasks.blocks import checkpoint_units
from workbench.training.compiling import compile_blocks
from workbench.training.parallel.device_mesh import DATA_DIMS
from workbench.training.parallel.strategy import DTYPES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from workbench.config import RunConfig


def data_dims(mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The data-parallel dimensions of `mesh` (what apply_parallelism shards or replicates over),
    outermost first."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return tuple(name for name in DATA_DIMS if name in names)


def apply_parallelism(
    module: torch.nn.Module,
    mesh: DeviceMesh | None,
    cfg: RunConfig,
    plan: dict[str, Any] | None,
    units: list[torch.nn.Module],
    *,
    tracing: bool = False,
) -> list[torch.nn.Module]:
    """Make `module` parallel over `mesh` in place, in torchtitan's order: `plan`
    (Task.tensor_parallel_plan, names relative to `module`) over 'tp', activation checkpointing and
    compile='blocks' on `units` (the module's repeated blocks, as the task built them), then
    fully_shard or replicate on each unit and the root over the data-parallel dimensions. `mesh`
    None: no mesh dimensions (AC and compile only). `tracing`: an estimate's trace (compile is left
    out). Returns the units as wrapped (checkpoint wrappers)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" in names and plan:
        apply_tp(module, mesh, plan)
    units = apply_ac(module, units, cfg)
    compile_blocks(cfg, units, tracing=tracing)
    data = data_dims(mesh)
    if mesh is None or not data:
        return units
    if data == ("dp_replicate",):
        apply_replicate(module, units, mesh, cfg)
    else:
        apply_fsdp(module, units, mesh, cfg)
    return units


def apply_tp(module: torch.nn.Module, mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, mesh["tp"], plan)


def apply_ac(
    module: torch.nn.Module, units: list[torch.nn.Module], cfg: RunConfig
) -> list[torch.nn.Module]:
    """Activation checkpointing per unit: the units as wrapped (after TP, whose plan names the
    submodules the wrappers rename)."""
    return checkpoint_units(module, units, cfg.activation_checkpointing)


def precision_policy(cfg: RunConfig) -> MixedPrecisionPolicy:
    """Compute in bf16/fp16, keep fp32 master weights and reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = DTYPES.get(cfg.precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def apply_fsdp(
    module: torch.nn.Module, units: list[torch.nn.Module], mesh: DeviceMesh, cfg: RunConfig
) -> None:
    """fully_shard each unit, then the root, over the mesh's sharding dimensions, with cfg's
    precision and cpu_offload."""
    # FSDP's modules are imported only where a mode shards: they cost a rank start-up time.
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # Pinned host memory is what makes the copies to and from a GPU asynchronous; a CPU mesh has
    # nothing to pin.
    offload = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
        if cfg.cpu_offload
        else OffloadPolicy()
    )
    dp_mesh = _shard_mesh(mesh, data_dims(mesh))
    for unit in [*units, module]:
        fully_shard(
            unit,
            mesh=dp_mesh,
            reshard_after_forward=cfg.parallelism != "zero2",
            mp_policy=precision_policy(cfg),
            offload_policy=offload,
        )


def apply_replicate(
    module: torch.nn.Module, units: list[torch.nn.Module], mesh: DeviceMesh, cfg: RunConfig
) -> None:
    """PyTorch's FSDP2-based replicate over 'dp_replicate' on each unit and the root (DDP x TP)."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError as e:  # PyTorch's DDP for DTensors is recent; DDP refuses them
        raise ValueError(
            f"parallelism='ddp' with tp={cfg.tp}: torch {torch.__version__} has no "
            "FSDP2-based replicate (torch.distributed._composable."
            "replicate_with_fsdp) to replicate a TP'd model with; use "
            "parallelism='zero2', or a newer torch"
        ) from e
    for unit in [*units, module]:
        replicate(unit, mesh=mesh["dp_replicate"], mp_policy=precision_policy(cfg))


def _shard_mesh(mesh: DeviceMesh, data: tuple[str, ...]) -> DeviceMesh:
    """The mesh fully_shard takes: the sharding dimensions (dp_shard, cp) as one, flattened into
    'dp_shard_cp' when both are there, under 'dp_replicate' for HSDP; the mesh itself when it has no
    other dimension."""
    from torch.distributed.device_mesh import DeviceMesh

    shard = tuple(name for name in data if name != "dp_replicate")
    if len(shard) > 1:
        # Kept as _flatten returns it: slicing a flattened dimension back out of the root mesh is
        # deprecated.
        flat = mesh[shard]._flatten("dp_shard_cp")
        return (
            DeviceMesh._concatenate([mesh["dp_replicate"], flat])
            if "dp_replicate" in data
            else flat
        )
    if tuple(mesh.mesh_dim_names or ()) == data:  # a sharded mode's own mesh: nothing to slice
        return mesh
    return mesh[data] if len(data) > 1 else mesh[data[0]]
