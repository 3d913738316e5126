"""micro_batch_size='auto': the largest micro-batch that fits every rank, agreed by all of them.

The launcher proposes a size from the estimate (autobatch.json in the run directory). Each rank then
confirms it with one real forward and backward on its device: on a GPU an out-of-memory error, or a
peak over the free memory, steps the size down; on the CPU the tracked peak must stay within
memory_budget_gb (or an equal share of the machine). Optimizer state, which a trial step doesn't
create yet, is added from the parameters this rank holds (AdamW: two moments). Then one all-reduce
takes the smallest size over the ranks (ranks searching separately would disagree and deadlock DDP),
and, with target_global_batch, accumulation is set to keep the global batch. The search and the
choice are recorded.

Under a pipeline (pp > 1) a trial is one schedule run over the step's grad_accum_steps micro-batches
(a stage's peak depends on how many are in flight), so every rank tries the same size and the
smallest any stage can take wins; accumulation stays as set (the schedule's micro-batch count) and
target_global_batch picks among the sizes that divide it. When the estimate can't trace the pipeline
(no proposal), the ranks measure sizes 1 and 2 and extrapolate the first size to try, as the
proposal would. The stages' shapes are inferred again afterwards.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from workbench.training.observe.memory import tracked
from workbench.training.observe.stage_memory import live_tracked

if TYPE_CHECKING:
    from workbench.config import ParallelDims, RunConfig
    from workbench.rundir import RunDir
    from workbench.tasks import Task
    from workbench.training.parallel import Strategy

log = logging.getLogger("workbench")
MARGIN = 0.1
"""Keep 10% of the limit free: the real run's fragmentation and workspaces."""


def memory_limit(device: torch.device, cfg: RunConfig, local_ranks: int) -> int:
    """Bytes this rank may use: free GPU memory, or the CPU budget (an equal share of the machine by
    default)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if cfg.memory_budget_gb:
        return int(cfg.memory_budget_gb * 2**30)
    return int(psutil.virtual_memory().available / max(1, local_ranks))


def _trial_peak(
    strategy: Strategy, task: Task, dataset: Any, cfg: RunConfig, m: int, collate: Any
) -> float:
    """Peak bytes of one forward and backward with `m` samples; inf when the device runs out of
    memory."""
    from accelerate.utils import send_to_device

    from workbench.training.evaluation import split_loss

    device = strategy.device
    batch = send_to_device(
        next(iter(DataLoader(dataset, batch_size=m, collate_fn=collate))), device
    )

    def forward_backward() -> None:
        if strategy.pipelined:  # the step's micro-batches through the schedule
            strategy.pipeline_step(iter([batch] * cfg.grad_accum_steps), cfg.grad_accum_steps)
            return
        # No gradient all-reduce (DDP's buckets exist either way): ranks may try different sizes
        # before agreeing.
        with strategy.sync_gradients(last_micro_batch=False), strategy.batch_context(batch):
            with strategy.forward_context():
                loss, _ = split_loss(task.loss(strategy.model, batch))
            strategy.backward(loss)

    try:
        if strategy.pipelined:
            # Stages infer a micro-batch's shapes at their first step (with autograd.grad calls the
            # tracker can't follow) and keep them: fresh ones for this size, initialized outside the
            # measurement.
            strategy.fresh_schedule()
            forward_backward()
            strategy.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            forward_backward()
            peak = float(torch.cuda.max_memory_allocated(device))
        elif strategy.split_backward:  # MemTracker can't follow it (observe/stage_memory.py)
            peak = float(live_tracked(strategy, forward_backward)[1]["peak"])
        else:
            peak = float(tracked(strategy, forward_backward)[1]["peak"])
    except torch.cuda.OutOfMemoryError:
        peak = float("inf")
    finally:
        strategy.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # AdamW's moments, created at the first update
    return peak + 2 * strategy.measure_held_bytes()["params"]


def _first_size(
    strategy: Strategy,
    task: Task,
    dataset: Any,
    cfg: RunConfig,
    collate: Any,
    usable: float,
    most: int,
    tries: list[dict[str, Any]],
) -> int:
    """No proposal (a pipeline the estimate can't trace): sizes 1 and 2 measured here give the bytes
    per sample, the largest size under `usable` the first to try; agreed over the ranks (every rank
    tries the same sizes)."""
    one = _trial_peak(strategy, task, dataset, cfg, 1, collate)
    two = _trial_peak(strategy, task, dataset, cfg, 2, collate) if most > 1 else one
    tries += [{"micro_batch": 1, "peak_bytes": one}, {"micro_batch": 2, "peak_bytes": two}][
        : 1 + (most > 1)
    ]
    per_sample = max(1.0, two - one)
    first = max(1, min(most, int((usable - one) // per_sample) + 1)) if math.isfinite(two) else 1
    agreed = torch.tensor([first], device=strategy.device)
    if dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


def _with_target(cfg: RunConfig, m: int, data_ranks: int) -> tuple[int, int]:
    """(micro-batch, accumulation) for the largest fitting size `m`: with target_global_batch, the
    largest size up to m that divides it, and the accumulation that makes it up; a pipeline keeps
    its accumulation."""
    target, accum = cfg.target_global_batch, cfg.grad_accum_steps
    if not target:
        return m, accum
    # config checks: under a pipeline, target is a multiple of accum x data ranks, so size 1 always
    # divides
    if cfg.pp > 1:
        return max(d for d in range(1, m + 1) if target % (d * accum * data_ranks) == 0), accum
    chosen = max(d for d in range(1, m + 1) if target % (d * data_ranks) == 0)
    return chosen, target // (chosen * data_ranks)


def choose(
    cfg: RunConfig,
    strategy: Strategy,
    task: Task,
    dataset: Any,
    run: RunDir,
    dims: ParallelDims,
    collate: Any,
) -> RunConfig:
    """Resolve micro_batch_size='auto' on every rank (collective); returns the config with the sizes
    chosen. `dims`: the run's layout; the batch arithmetic counts its data-parallel ranks (a TP
    group shares batches)."""
    world, data_ranks = dims.world_size, dims.dp
    proposal = (run.autobatch() or {}).get("proposed")
    # What doesn't grow with the batch: parameters, gradients and AdamW's two moments.
    fixed = 4 * strategy.measure_held_bytes()["params"]
    limit = memory_limit(strategy.device, cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    usable = limit * (1 - MARGIN)
    per_rank = len(dataset) // data_ranks
    tries: list[dict[str, Any]] = []
    rng = torch.get_rng_state()
    if proposal is None:
        proposal = _first_size(strategy, task, dataset, cfg, collate, usable, per_rank, tries)
    first = max(1, min(int(proposal), per_rank))
    m, own = _agree(strategy, task, dataset, cfg, collate, first, usable, fixed, world, tries)
    # the trials mustn't shift dropout from what a fixed micro-batch would draw
    torch.set_rng_state(rng)
    if strategy.pipelined:
        strategy.fresh_schedule()  # shapes inferred at the trials' sizes
    chosen, accum = _with_target(cfg, m, data_ranks)
    _record(run, world, data_ranks, chosen, accum, limit_bytes=limit, own_choice=own, tries=tries)
    return cfg.replace(micro_batch_size=chosen, grad_accum_steps=accum, target_global_batch=0)


def _agree(
    strategy: Strategy,
    task: Task,
    dataset: Any,
    cfg: RunConfig,
    collate: Any,
    m: int,
    usable: float,
    fixed: float,
    world: int,
    tries: list[dict[str, Any]],
) -> tuple[int, int]:
    """From the first size `m`: the size every rank fits, and the size this rank alone would take
    (from its first trial). Each trial is appended to `tries`."""
    own = None
    while True:
        # Every rank tries the same size (a sharded forward needs all of them), then one all-reduce
        # takes the smallest size any rank can take: the next size to try, or, when all fit, the
        # answer.
        peak = _trial_peak(strategy, task, dataset, cfg, m, collate)
        tries.append({"micro_batch": m, "peak_bytes": peak if peak != float("inf") else None})
        mine = _size_that_fits(m, peak, usable, fixed)
        own = mine if own is None else own  # what this rank alone would take, from its first trial
        agreed = torch.tensor([mine], device=strategy.device)
        if world > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed.item()) == m:
            return m, own
        m = int(agreed.item())


def _size_that_fits(m: int, peak: float, usable: float, fixed: float) -> int:
    """The size this rank can take after a trial of `m` samples peaked at `peak` bytes: m when it
    fit (or is 1), half of it after an out-of-memory error, else as many as the limit holds."""
    if peak <= usable or m == 1:
        return m
    if peak == float("inf"):
        return max(1, m // 2)
    # peak = model state + m x bytes per sample: take as many samples as the rest of the
    # limit holds
    per_sample = max(1.0, (peak - fixed) / m)
    return max(1, min(m - 1, math.floor((usable - fixed) / per_sample)))


def _record(run: RunDir, world: int, data_ranks: int, chosen: int, accum: int, **mine: Any) -> None:
    """Gather every rank's search (`mine`: its limit, own choice and tries; collective), and on
    rank 0 record it with the choice in autobatch.json, the run's events and the log."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, {"rank": rank, **mine})
    else:
        everyone = [{"rank": rank, **mine}]
    if rank != 0:
        return
    record = {
        **(run.autobatch() or {}),
        "ranks": everyone,
        "chosen": chosen,
        "grad_accum_steps": accum,
        "global_batch": chosen * accum * data_ranks,
    }
    run.write_autobatch(record)
    run.event(
        "micro_batch_chosen",
        micro_batch=chosen,
        grad_accum_steps=accum,
        global_batch=chosen * accum * data_ranks,
    )
    log.info(
        "micro_batch_size='auto': %d per rank x %d accumulation (global batch %d)",
        chosen,
        accum,
        chosen * accum * data_ranks,
    )
