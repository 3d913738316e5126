"""Where the model is made parallel: the one place a parallelism mode changes the training step.

Following torchtitan, "parallelize the model" is kept apart from the loop: the loop asks the strategy to
hold back gradient sync on all but the last micro-batch, to run backward, to clip and to step, and never
looks at how. replicated.py: 'none', 'ddp', 'zero1'; sharded.py: 'zero2', 'zero3'/'fsdp', 'hsdp' (FSDP2);
tensor.py: tp > 1, alone or inside FSDP2 (FSDP x TP); pipeline.py: pp > 1 (one stage per rank); base.py: precision, checkpoints (DCP),
the bytes each rank holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from workbench.tasks.blocks import checkpoint_units, shard_units
from workbench.config import SHARDED
from workbench.training.parallel.base import Strategy
from workbench.training.parallel.pipeline import PipelineParallel
from workbench.training.parallel.replicated import Replicated, ZeroOne
from workbench.training.parallel.sharded import Sharded
from workbench.training.parallel.tensor import TensorParallel

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task

__all__ = ["Strategy", "parallelize"]


def ensure_process_group(accelerator: Accelerator) -> None:
    """One process runs without a process group, but sharding (a zero3 checkpoint resumed on one rank, say)
    needs one: a group of one, in memory."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def parallelize(cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module, task: Task,
                make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> Strategy:
    """Make `model` parallel as cfg.parallelism asks, with activation checkpointing per shard unit; the loop
    then trains through the returned strategy."""
    if cfg.pp > 1:  # each rank keeps its stage of the model
        ensure_process_group(accelerator)
        return PipelineParallel(cfg, accelerator, model, task, make_optimizer)
    if cfg.tp > 1:  # the plan names submodules as the task built them: TP before checkpoint wrappers
        ensure_process_group(accelerator)
        return TensorParallel(cfg, accelerator, model, task, make_optimizer)
    units = checkpoint_units(model, shard_units(model, task), cfg.activation_checkpointing)
    if cfg.parallelism in (*SHARDED, "zero1"):
        ensure_process_group(accelerator)
    if cfg.parallelism in SHARDED:
        return Sharded(cfg, accelerator, model, units, make_optimizer)
    if cfg.parallelism == "zero1":
        return ZeroOne(cfg, accelerator, model, make_optimizer)
    return Replicated(cfg, accelerator, model, make_optimizer)
