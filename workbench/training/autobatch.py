"""micro_batch_size='auto': the largest micro-batch that fits every rank, agreed by all of them.

The launcher proposes a size from the estimate (autobatch.json in the run directory). Each rank then
confirms it with one real forward and backward on its device: on a GPU an out-of-memory error, or a peak
over the free memory, steps the size down; on the CPU the tracked peak must stay within memory_budget_gb (or
an equal share of the machine). Optimizer state, which a trial step doesn't create yet, is added from the
parameters this rank holds (AdamW: two moments). Then one all-reduce takes the smallest size over the
ranks (ranks searching separately would disagree and deadlock DDP), and, with target_global_batch,
accumulation is set to keep the global batch. The search and the choice are recorded.
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

from workbench.training.memory import tracked
from workbench.utils.files import read_json, write_json

if TYPE_CHECKING:
    from workbench.config import ParallelDims, RunConfig
    from workbench.rundir import RunDir
    from workbench.tasks import Task
    from workbench.training.parallel import Strategy

log = logging.getLogger("workbench")
AUTOBATCH = "autobatch.json"
MARGIN = 0.1
"""Keep 10% of the limit free: the real run's fragmentation and workspaces."""


def memory_limit(device: torch.device, cfg: RunConfig, local_ranks: int) -> int:
    """Bytes this rank may use: free GPU memory, or the CPU budget (an equal share of the machine by default)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if cfg.memory_budget_gb:
        return int(cfg.memory_budget_gb * 2**30)
    return int(psutil.virtual_memory().available / max(1, local_ranks))


def _trial_peak(strategy: Strategy, task: Task, dataset: Any, cfg: RunConfig, m: int, collate: Any) -> float:
    """Peak bytes of one forward and backward with `m` samples; inf when the device runs out of memory."""
    from accelerate.utils import send_to_device

    from workbench.training.evaluation import split_loss

    device = strategy.device
    batch = send_to_device(next(iter(DataLoader(dataset, batch_size=m, collate_fn=collate))), device)

    def forward_backward() -> None:
        # No gradient all-reduce (DDP's buckets exist either way): ranks may try different sizes before agreeing.
        with strategy.sync_gradients(last_micro_batch=False), strategy.batch_context(batch):
            with strategy.forward_context():
                loss, _ = split_loss(task.loss(strategy.model, batch))
            strategy.backward(loss)

    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            forward_backward()
            peak = float(torch.cuda.max_memory_allocated(device))
        else:
            peak = float(tracked(strategy, forward_backward)[1]["peak"])
    except torch.cuda.OutOfMemoryError:
        peak = float("inf")
    finally:
        strategy.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return peak + 2 * strategy.measure_held_bytes()["params"]  # AdamW's moments, created at the first update


def choose(cfg: RunConfig, strategy: Strategy, task: Task, dataset: Any, run: RunDir, dims: ParallelDims,
           collate: Any) -> RunConfig:
    """Resolve micro_batch_size='auto' on every rank (collective); returns the config with the sizes chosen.
    `dims`: the run's layout; the batch arithmetic counts its data-parallel ranks (a TP group shares batches)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world, data_ranks = dims.world_size, dims.dp
    proposal = (read_json(run.path / AUTOBATCH) or {}).get("proposed") or 1
    # What doesn't grow with the batch: parameters, gradients and AdamW's two moments.
    fixed = 4 * strategy.measure_held_bytes()["params"]
    limit = memory_limit(strategy.device, cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    usable = limit * (1 - MARGIN)
    per_rank = len(dataset) // data_ranks
    m, tries, own = max(1, min(int(proposal), per_rank)), [], None
    rng = torch.get_rng_state()
    while True:
        # Every rank tries the same size (a sharded forward needs all of them), then one all-reduce takes the
        # smallest size any rank can take: the next size to try, or, when all fit, the answer.
        peak = _trial_peak(strategy, task, dataset, cfg, m, collate)
        tries.append({"micro_batch": m, "peak_bytes": peak if peak != float("inf") else None})
        fits = peak <= usable or m == 1
        if fits:
            mine = m
        elif peak == float("inf"):
            mine = max(1, m // 2)
        else:  # peak = model state + m x bytes per sample: take as many samples as the rest of the limit holds
            per_sample = max(1.0, (peak - fixed) / m)
            mine = max(1, min(m - 1, math.floor((usable - fixed) / per_sample)))
        own = mine if own is None else own  # what this rank alone would take, from its first trial
        agreed = torch.tensor([mine], device=strategy.device)
        if world > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed.item()) == m:
            break
        m = int(agreed.item())
    torch.set_rng_state(rng)  # the trials mustn't shift dropout from what a fixed micro-batch would draw
    chosen = m
    accum = cfg.grad_accum_steps
    if cfg.target_global_batch:
        chosen = max(d for d in range(1, chosen + 1) if cfg.target_global_batch % (d * data_ranks) == 0)
        accum = cfg.target_global_batch // (chosen * data_ranks)
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, {"rank": rank, "limit_bytes": limit, "own_choice": own, "tries": tries})
    else:
        everyone = [{"rank": rank, "limit_bytes": limit, "own_choice": own, "tries": tries}]
    if rank == 0:
        record = {**(read_json(run.path / AUTOBATCH) or {}), "ranks": everyone, "chosen": chosen,
                  "grad_accum_steps": accum, "global_batch": chosen * accum * data_ranks}
        write_json(run.path / AUTOBATCH, record)
        run.event("micro_batch_chosen", micro_batch=chosen, grad_accum_steps=accum,
                  global_batch=chosen * accum * data_ranks)
        log.info("micro_batch_size='auto': %d per rank x %d accumulation (global batch %d)", chosen, accum,
                 chosen * accum * data_ranks)
    return cfg.replace(micro_batch_size=chosen, grad_accum_steps=accum, target_global_batch=0)
