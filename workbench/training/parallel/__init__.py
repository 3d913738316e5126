"""Where the model is made parallel: the one place a parallelism mode changes the training step.

Following torchtitan, "parallelize the model" is kept apart from the loop. `parallelize` does it in
three steps, each once:

1. the placement: the rank's Placement with the run's mesh (device_mesh.build_mesh), and a process
   group of one where one process shards;
2. the recipe (apply.py's apply_parallelism): fp8 swap -> (pp: the pipeline split, then per stage)
   tensor parallel -> activation checkpointing -> compile='blocks' -> FSDP2 / replicate / DDP ->
   compile='model', with what it asks of the model from its ParallelPlan (the Task);
3. the strategy the plan names (`STRATEGIES`, chosen by `layout`: pp > cp > tp > sharded > zero1 >
   replicated) around the parallel model: the optimizer, the contexts, the gradient sync, the
   pipeline schedule and checkpoint I/O.

The loop then asks the strategy to hold back gradient sync on all but the last micro-batch, to run
backward, to clip and to step, and never looks at how. replicated.py: 'none', 'ddp', 'zero1';
sharded.py: 'zero2', 'zero3'/'fsdp', 'hsdp' (FSDP2); tensor.py: tp > 1, alone or with data
parallelism (FSDP, HSDP or DDP x TP); context.py: cp > 1 (sequences split over a CP group, FSDP over
dp_shard x cp, with or without TP); pipeline.py: pp > 1 (the schedule over this rank's stages:
pipeline_parts.py, pipeline_state.py); strategy.py: what every strategy shares (precision,
checkpoints through DCP, the bytes each rank holds); float8.py: the fp8 swap; param_groups.py: the
optimizer's groups split by mesh; device_mesh.py: the mesh; placement.py: where a rank sits.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from workbench.config import SHARDED
from workbench.tasks.model_plans import ModelPlan
from workbench.training.parallel.apply import apply_parallelism
from workbench.training.parallel.device_mesh import build_mesh
from workbench.training.parallel.placement import Placement
from workbench.training.parallel.strategy import Strategy

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task

__all__ = ["Placement", "Strategy", "parallelize", "strategy_module"]

STRATEGIES: dict[str, tuple[str, str]] = {
    "pipeline": ("workbench.training.parallel.pipeline", "PipelineParallel"),
    "context": ("workbench.training.parallel.context", "ContextParallel"),
    "tensor": ("workbench.training.parallel.tensor", "TensorParallel"),
    "sharded": ("workbench.training.parallel.sharded", "Sharded"),
    "zero1": ("workbench.training.parallel.replicated", "ZeroOne"),
    "replicated": ("workbench.training.parallel.replicated", "Replicated"),
}
"""Each layout's strategy: (module, class). A module is imported only when its layout runs: torch's
pipelining, tensor-parallel and FSDP modules cost a rank a second of start-up between them."""


def layout(cfg: RunConfig) -> str:
    """The key of `cfg`'s strategy in STRATEGIES: the outermost dimension above 1 decides (a
    pipeline stage holds the other dimensions inside it; context parallel, TP's layout with
    sequences split over 'cp')."""
    if cfg.pp > 1:
        return "pipeline"
    if cfg.cp > 1:
        return "context"
    if cfg.tp > 1:
        return "tensor"
    if cfg.parallelism in SHARDED:
        return "sharded"
    return "zero1" if cfg.parallelism == "zero1" else "replicated"


def strategy_module(cfg: RunConfig) -> str:
    """The module of the strategy `cfg` trains with (a fork-mode supervisor imports it before
    forking)."""
    return STRATEGIES[layout(cfg)][0]


def strategy_class(cfg: RunConfig) -> type[Strategy]:
    module, name = STRATEGIES[layout(cfg)]
    cls: type[Strategy] = getattr(importlib.import_module(module), name)
    return cls


def ensure_process_group(where: Placement) -> None:
    """One process runs without a process group, but sharding (a zero3 checkpoint resumed on one
    rank, say) needs one: a group of one, in memory."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if where.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def placed(cfg: RunConfig, accelerator: Accelerator | Placement) -> Placement:
    """The rank's Placement with the run's mesh (a traced estimate's, built beforehand, kept);
    every layout but plain replication ensures a process group first (ZeRO-1 partitions over
    one)."""
    where = Placement.of(accelerator)
    if layout(cfg) != "replicated":
        ensure_process_group(where)
    if where.mesh is None:
        where = replace(where, mesh=build_mesh(cfg, where.device.type, where.num_processes))
    return where


def parallelize(
    cfg: RunConfig,
    accelerator: Accelerator | Placement,
    model: torch.nn.Module,
    task: Task,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
) -> Strategy:
    """Make `model` parallel as cfg asks (the recipe, apply.apply_parallelism) and return the
    strategy the loop trains through. `accelerator`: accelerate's Accelerator, or a Placement (an
    estimate's fake rank)."""
    where = placed(cfg, accelerator)
    # The Task's hooks first, then what the model declares for itself (a transformers model's
    # blocks and tensor-parallel plan): tasks/model_plans.py.
    parallel = apply_parallelism(cfg, where, model, ModelPlan(task))
    strategy = strategy_class(cfg).around(cfg, where, parallel, task, make_optimizer)
    strategy.float8 = parallel.float8
    return strategy
