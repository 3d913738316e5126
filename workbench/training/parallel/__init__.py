"""Where the model is made parallel: the one place a parallelism mode changes the training step.

Following torchtitan, "parallelize the model" is kept apart from the loop: the loop asks the
strategy to hold back gradient sync on all but the last micro-batch, to run backward, to clip and to
step, and never looks at how. replicated.py: 'none', 'ddp', 'zero1'; sharded.py: 'zero2',
'zero3'/'fsdp', 'hsdp' (FSDP2); tensor.py: tp > 1, alone or with data parallelism (FSDP, HSDP or DDP
x TP, applied by apply.py); context.py: cp > 1 (sequences split over a CP group, FSDP over
dp_shard x cp, with or without TP); pipeline.py: pp > 1 (stage chunks per rank, each with the other
dimensions inside: pipeline_parts.py, pipeline_state.py); strategy.py: what every strategy shares
(precision, checkpoints through DCP, the bytes each rank holds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from workbench.config import SHARDED
from workbench.tasks.blocks import shard_units
from workbench.training.compiling import compile_model
from workbench.training.parallel.placement import Placement
from workbench.training.parallel.strategy import Strategy

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task

__all__ = ["Placement", "Strategy", "parallelize", "strategy_module"]


def ensure_process_group(accelerator: Placement) -> None:
    """One process runs without a process group, but sharding (a zero3 checkpoint resumed on one
    rank, say) needs one: a group of one, in memory."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def strategy_module(cfg: RunConfig) -> str:
    """The module of the strategy `cfg` trains with (a fork-mode supervisor imports it before
    forking)."""
    if cfg.pp > 1:
        return "workbench.training.parallel.pipeline"
    if cfg.cp > 1:
        return "workbench.training.parallel.context"
    if cfg.tp > 1:
        return "workbench.training.parallel.tensor"
    if cfg.parallelism in SHARDED:
        return "workbench.training.parallel.sharded"
    return "workbench.training.parallel.replicated"


def parallelize(
    cfg: RunConfig,
    accelerator: Accelerator,
    model: torch.nn.Module,
    task: Task,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
) -> Strategy:
    """Make `model` parallel as cfg.parallelism asks, with activation checkpointing and compile per
    shard unit (compile='model': the parallel model); the loop then trains through the returned
    strategy."""
    where = Placement.of(accelerator)
    swap = None
    # First, before TP, AC, compile and FSDP2 wrap the Linears; a traced estimate prices fp8 only.
    if cfg.precision == "fp8" and not where.tracing:
        from workbench.training.parallel.float8 import swap_linears

        swap = swap_linears(cfg, model, task, where.device)
    strategy = _parallel(cfg, where, model, task, make_optimizer)
    strategy.float8 = swap
    if not strategy.pipelined:  # a pipeline compiles each of its chunks itself
        compile_model(cfg, strategy.model, tracing=where.tracing)
    return strategy


def _parallel(
    cfg: RunConfig,
    accelerator: Placement,
    model: torch.nn.Module,
    task: Task,
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
) -> Strategy:
    # Each strategy's module is imported only when its mode runs: torch's pipelining,
    # tensor-parallel and FSDP modules cost a rank a second of start-up between them.
    if cfg.pp > 1:  # each rank keeps its stage of the model
        from workbench.training.parallel.pipeline import PipelineParallel

        ensure_process_group(accelerator)
        return PipelineParallel(cfg, accelerator, model, task, make_optimizer)
    if cfg.cp > 1:  # TensorParallel's layout with sequences split over 'cp' in each forward
        from workbench.training.parallel.context import ContextParallel

        ensure_process_group(accelerator)
        return ContextParallel(cfg, accelerator, model, task, make_optimizer)
    if cfg.tp > 1:
        # the plan names submodules as the task built them: TP before checkpoint wrappers
        from workbench.training.parallel.tensor import TensorParallel

        ensure_process_group(accelerator)
        return TensorParallel(cfg, accelerator, model, task, make_optimizer)
    if cfg.parallelism in (*SHARDED, "zero1"):
        ensure_process_group(accelerator)
    if cfg.parallelism in SHARDED:  # AC, compile, then FSDP2 (apply.apply_parallelism)
        from workbench.training.parallel.sharded import Sharded

        return Sharded(cfg, accelerator, model, task, make_optimizer)
    from workbench.training.parallel.apply import apply_parallelism
    from workbench.training.parallel.replicated import Replicated, ZeroOne

    # The same layout without a mesh (AC and compile per block), before DistributedDataParallel
    # wraps it.
    apply_parallelism(model, None, cfg, None, shard_units(model, task), tracing=accelerator.tracing)

    if cfg.parallelism == "zero1":
        return ZeroOne(cfg, accelerator, model, make_optimizer)
    return Replicated(cfg, accelerator, model, make_optimizer)
