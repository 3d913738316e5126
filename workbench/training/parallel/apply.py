"""The parallelize recipe: how a model is made parallel, in torchtitan's order (parallelize_llama),
in one function, `apply_parallelism`, which `parallelize` (this package's __init__.py) calls once
per rank before it hands the result to the run's strategy:

    apply_fp8        precision='fp8': the blocks' Linears swapped to Float8Linear (float8.py), on
                     the plain model, before anything wraps or renames them
    (pp > 1)         the pipeline split: this rank's stages (ParallelPlan.pipeline_stages, loop
                     placement), then every step below per stage, over the stage's own sub-mesh
    on the device    the rank's device (left on the host with cpu_offload: FSDP2 moves each shard)
    apply_tp         the plan over 'tp' (before the checkpoint wrappers rename the submodules it
                     names)
    apply_ac         activation checkpointing per block (the shard units)
    compile_blocks   compile='blocks' per block (training/compiling.py), before FSDP or DDP wraps
                     them
    apply_fsdp       fully_shard (FSDP2) on each block and the root, over the data-parallel dims:
                     ('dp_shard',): zero2 keeps the gathered parameters to backward, zero3 not;
                     ('dp_shard', 'cp'), ('cp',): flattened into 'dp_shard_cp' (torchtitan's
                     name), as the ranks of a CP group hold the same parameters;
                     ('dp_replicate', 'dp_shard'): HSDP, sharded in a group, replicated across
    apply_replicate  ('dp_replicate',) with TP: FSDP2's DDP (replicate_with_fsdp), as
                     DistributedDataParallel refuses DTensor parameters
    apply_ddp        replicated modes without a mesh ('ddp', 'zero1') on more than one rank:
                     DistributedDataParallel over the default group (a pipeline's replicas are
                     averaged by the pipeline instead: DDP breaks under its schedules)
    compile_model    compile='model': the whole parallel model (DDP's wrapper included), or each
                     pipeline stage, last

What the recipe asks of the model comes from one place, its ParallelPlan: which submodules are the
blocks (the shard units: fp8, AC, compile, FSDP), the tensor-parallel plan and the pipeline stages.
A Task is one; a model that declares its own (the next issue's Hugging Face plans) will be another,
without a strategy changing. The mesh comes from device_mesh.build_mesh (parallelize builds it); a
pipeline stage takes its sub-mesh, without 'pp'. The strategies receive the result (ParallelModel)
and build the optimizer, contexts, schedules and checkpoint I/O around it: FSDP2 has sharded the
parameters before any optimizer sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from workbench.config.mesh import shards, virtual_stages
from workbench.tasks.blocks import checkpoint_units, shard_units
from workbench.tasks.model_plans import divide_heads, splits_heads
from workbench.training.compiling import compile_blocks, compile_model
from workbench.training.parallel.device_mesh import DATA_DIMS
from workbench.training.parallel.pipeline_parts import dim_size, local_rank, tied_names
from workbench.training.parallel.strategy import DTYPES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from workbench.config import RunConfig
    from workbench.training.parallel.float8 import Float8Swap
    from workbench.training.parallel.placement import Placement


class ParallelPlan(Protocol):
    """What the recipe asks of the model's owner, all of it: its name (for messages), its blocks,
    its tensor-parallel plan and its pipeline stages. A Task is one (these are its hooks, documented
    there)."""

    name: str

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module] | None: ...

    def tensor_parallel_plan(
        self, model: torch.nn.Module, cfg: RunConfig
    ) -> dict[str, Any] | None: ...

    def pipeline_stages(
        self, model: torch.nn.Module, cfg: RunConfig, stage: int, stages: int
    ) -> torch.nn.Module | None: ...


@dataclass
class ParallelModel:
    """What the recipe hands the strategy."""

    module: torch.nn.Module
    """The model made parallel (FSDP2 and TP modules are their own); a pipeline rank's stages in one
    nn.ModuleList."""
    model: torch.nn.Module
    """What the loop calls: `module`, or the DistributedDataParallel around it."""
    float8: Float8Swap | None = None
    """precision='fp8': what the swap did (the strategy runs its after-update step)."""
    stage_ids: list[int] = field(default_factory=list)
    """pp > 1: the stages `module`'s chunks are, in order."""
    tied: list[list[str]] = field(default_factory=list)
    """pp > 1: the names the full model gives each parameter it ties (one copy per stage now)."""


def apply_parallelism(
    cfg: RunConfig, where: Placement, model: torch.nn.Module, plan: ParallelPlan
) -> ParallelModel:
    """The recipe (the module docstring's steps, in that order): `model` made parallel over
    `where.mesh` in place, as cfg asks. `where.tracing` (an estimate's trace) leaves out the fp8
    swap, compile and DDP."""
    swap = apply_fp8(cfg, model, plan, where)
    if cfg.pp > 1:
        return _pipeline(cfg, where, model, plan, swap)
    if not cfg.cpu_offload:  # offloaded, FSDP2 moves each shard to the device as it's needed
        model = on_device(model, where)
    tp_plan = plan.tensor_parallel_plan(model, cfg) if cfg.tp > 1 else None
    if tp_plan is None and cfg.tp > 1:
        raise ValueError(f"tp={cfg.tp}: task {plan.name!r} has no tensor-parallel plan")
    _apply_steps(model, where.mesh, cfg, tp_plan, shard_units(model, plan), where.tracing)
    wrapped = apply_ddp(model, where, cfg) if where.mesh is None else model
    compile_model(cfg, wrapped, tracing=where.tracing)
    return ParallelModel(model, wrapped, swap)


def apply_fp8(
    cfg: RunConfig, model: torch.nn.Module, plan: ParallelPlan, where: Placement
) -> Float8Swap | None:
    """precision='fp8': the swap, first, on the plain model; a traced estimate prices fp8 only."""
    if cfg.precision != "fp8" or where.tracing:
        return None
    from workbench.training.parallel.float8 import swap_linears

    return swap_linears(cfg, model, plan, where.device)


def _apply_steps(
    module: torch.nn.Module,
    mesh: DeviceMesh | None,
    cfg: RunConfig,
    tp_plan: dict[str, Any] | None,
    units: list[torch.nn.Module],
    tracing: bool,
) -> None:
    """TP, AC, compile='blocks', then FSDP2 or replicate, on `module` (the model, or a pipeline
    stage) over `mesh` in place: `tp_plan` (names relative to `module`) over 'tp', activation
    checkpointing and compile='blocks' on `units` (the module's blocks, as built), then fully_shard
    or replicate on each unit and the root over the data-parallel dimensions. `mesh` None: no mesh
    dimensions (AC and compile only)."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "tp" in names and tp_plan:
        apply_tp(module, mesh, tp_plan)
    units = apply_ac(module, units, cfg)
    compile_blocks(cfg, units, tracing=tracing)
    data = data_dims(mesh)
    if mesh is None or not data:
        return
    if data == ("dp_replicate",):
        apply_replicate(module, units, mesh, cfg)
    else:
        apply_fsdp(module, units, mesh, cfg)


# ---- the pipeline split ------------------------------------------------------------------------
def stage_ids(cfg: RunConfig, mesh: DeviceMesh) -> list[int]:
    """The stages this rank holds: r, r + pp, r + 2 pp, ... of pp x virtual_stages (PyTorch's loop
    placement, which ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble expect)."""
    first = local_rank(mesh, "pp")
    return [first + k * cfg.pp for k in range(virtual_stages(cfg))]


def _pipeline(
    cfg: RunConfig,
    where: Placement,
    model: torch.nn.Module,
    plan: ParallelPlan,
    swap: Float8Swap | None,
) -> ParallelModel:
    """This rank's stages of `model` (the plan's pipeline_stages), each made parallel over the
    mesh's other dimensions, in one nn.ModuleList (one optimizer steps them all)."""
    assert where.mesh is not None  # a pipeline always has one (device_mesh.mesh_dims)
    ids = stage_ids(cfg, where.mesh)
    total = cfg.pp * virtual_stages(cfg)
    tied = tied_names(model)  # of the whole model, before the split gives each stage a copy
    chunks = []
    for stage in ids:
        chunk = plan.pipeline_stages(model, cfg, stage, total)
        if chunk is None:
            raise ValueError(f"pp={cfg.pp}: task {plan.name!r} has no pipeline stages")
        chunks.append(chunk)
    _refuse_shared(chunks, ids)
    stages = torch.nn.ModuleList([_stage(cfg, where, model, plan, c) for c in chunks])
    return ParallelModel(stages, stages, swap, ids, tied)


def _refuse_shared(chunks: list[torch.nn.Module], stage_ids: list[int]) -> None:
    """Two chunks of one rank holding one parameter would step it twice (and FSDP can't own it
    twice)."""
    seen: dict[int, int] = {}
    for chunk, stage in zip(chunks, stage_ids):
        for p in chunk.parameters():
            if seen.setdefault(id(p), stage) != stage:
                raise ValueError(
                    f"pipeline stages {seen[id(p)]} and {stage} sit on one rank and share a "
                    "parameter (tied weights); use fewer virtual stages (pp_virtual_stages) or "
                    "more stages (pp)"
                )


def _stage(
    cfg: RunConfig,
    where: Placement,
    model: torch.nn.Module,
    plan: ParallelPlan,
    chunk: torch.nn.Module,
) -> torch.nn.Module:
    """One stage made parallel by the same steps, on the stage's own dimensions: tensor parallel
    over 'tp', activation checkpointing and compilation per block, then FSDP2 over the
    data-parallel dimensions for the sharded modes (HSDP: 'dp_replicate' x 'dp_shard'; with cp,
    'dp_shard' x 'cp'); compile='model' last, per stage. Replicated pipelines ('ddp') are averaged
    by the pipeline, never wrapped."""
    mesh = where.mesh
    assert mesh is not None
    if not cfg.cpu_offload:
        chunk = on_device(chunk, where)
    names = [
        *(("dp_replicate",) * (cfg.parallelism == "hsdp")),
        *(("dp_shard",) * shards(cfg.parallelism)),
        *(("cp",) * (dim_size(mesh, "cp") > 1)),
        *(("tp",) * (dim_size(mesh, "tp") > 1)),
    ]
    held = {id(m) for m in chunk.modules()}
    units = [u for u in shard_units(model, plan) if id(u) in held]
    if not units and cfg.activation_checkpointing != "none":
        # a stage without blocks: nothing to checkpoint
        cfg = cfg.replace(activation_checkpointing="none")
    tp_plan = stage_tp_plan(plan.tensor_parallel_plan(model, cfg), chunk) if "tp" in names else None
    stage_mesh = (mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]) if names else None
    _apply_steps(chunk, stage_mesh, cfg, tp_plan, units, where.tracing)
    compile_model(cfg, chunk, tracing=where.tracing)
    return chunk


def stage_tp_plan(plan: dict[str, Any] | None, chunk: torch.nn.Module) -> dict[str, Any]:
    """The entries of the model's tensor-parallel plan that name modules of this stage: a key may
    hold `*` for any name at its level (transformers' 'model.layers.*.self_attn.q_proj'), matched
    level by level with fnmatch as parallelize_module matches it; the others belong to other
    stages (parallelize_module would warn about each)."""
    from fnmatch import fnmatch

    names = [name.split(".") for name, _ in chunk.named_modules()]  # '' (the stage) included

    def held(key: str) -> bool:
        parts = key.split(".")
        return any(
            len(name) == len(parts) and all(fnmatch(n, p) for n, p in zip(name, parts))
            for name in names
        )

    return {k: v for k, v in (plan or {}).items() if held(k)}


# ---- the steps ---------------------------------------------------------------------------------
def on_device(model: torch.nn.Module, where: Placement) -> torch.nn.Module:
    """The model on the rank's device; a traced estimate's model already has (fake) storage
    there."""
    return model if where.tracing else model.to(where.device)


def data_dims(mesh: DeviceMesh | None) -> tuple[str, ...]:
    """The data-parallel dimensions of `mesh` (what the recipe shards or replicates over),
    outermost first."""
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return tuple(name for name in DATA_DIMS if name in names)


def apply_tp(module: torch.nn.Module, mesh: DeviceMesh, plan: dict[str, Any]) -> None:
    """The plan over 'tp'; a transformers model's attention modules then count their own share of
    the heads (tasks/model_plans.divide_heads)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, mesh["tp"], plan)
    if splits_heads(module):
        divide_heads(module, mesh["tp"].size())


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


def apply_ddp(module: torch.nn.Module, where: Placement, cfg: RunConfig) -> torch.nn.Module:
    """DistributedDataParallel around `module` over the default group when there is more than one
    rank ('ddp', 'zero1'); the module itself otherwise. A traced estimate leaves DDP out: its
    buckets live in C++, out of the trace's sight; the estimate adds them (one copy of the
    gradients) and their all-reduce from their known size."""
    if where.num_processes == 1 or where.tracing:
        return module
    from torch.nn.parallel import DistributedDataParallel

    ids = [where.device.index] if where.device.type == "cuda" else None
    return DistributedDataParallel(
        module, device_ids=ids, find_unused_parameters=cfg.find_unused_parameters
    )


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
