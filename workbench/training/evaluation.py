"""Evaluation: every rank evaluates its shard of the eval set; the means are reduced over ranks."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader, DistributedSampler

from workbench.training.task_checks import check_metrics, differing_keys

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task


def split_loss(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Task.loss returns a scalar tensor or (scalar tensor, {metric: value})."""
    loss, extras = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"Task.loss must return a scalar tensor (or (tensor, dict)), got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss, extras


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    task: Task,
    dataset: Any,
    cfg: RunConfig,
    accelerator: Accelerator,
    collate_fn: Any,
    forward_context: Callable[[], AbstractContextManager[Any]],
    shard: tuple[int, int] | None = None,
    eval_loss: Callable[[Any], tuple[torch.Tensor, dict[str, Any]] | None] | None = None,
    batch_context: Callable[[Any], AbstractContextManager[Any]] | None = None,
) -> dict[str, float]:
    """Mean loss (and task metrics) over the eval set: {'eval_loss': ..., 'eval_<metric>': ...}.
    `shard` is (data-parallel rank, size) when it differs from the process's (tensor parallel: a TP
    group evaluates the same batches, and counts them once per rank in both the sums and the count).
    `eval_loss` replaces the task's loss on the whole model (pipeline parallel: only the last stage
    has a loss; the others get None and count nothing). `batch_context` is the strategy's (context
    parallel: each rank evaluates its slice of the sequences, and the slices' means average to the
    whole's)."""
    device = accelerator.device
    rank, world = shard or (accelerator.process_index, accelerator.num_processes)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(
        dataset, batch_size=cfg.micro_batch_size, sampler=sampler, collate_fn=collate_fn
    )
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    # the metric keys of the first batch, that every batch must return
    keys: list[str] | None = None
    count = torch.zeros((), device=device, dtype=torch.float64)
    for i, batch in enumerate(loader):
        if cfg.eval_batches and i >= cfg.eval_batches:
            break
        batch = send_to_device(batch, device, non_blocking=True)
        got = _batch_loss(model, task, batch, forward_context, eval_loss, batch_context)
        if got is None:
            continue
        loss, extras = got
        check_metrics(task, extras)  # a few isinstance checks per batch: nothing beside its forward
        keys = _same_keys(task, keys, extras)
        n = len(batch[0]) if isinstance(batch, (tuple, list)) else cfg.micro_batch_size
        for name, value in {"loss": loss, **extras}.items():
            value = torch.as_tensor(value, device=device, dtype=torch.float64)
            totals[name] = (
                totals.get(name, torch.zeros((), device=device, dtype=torch.float64)) + value * n
            )
        count += n
    model.train()
    return _means_over_ranks(task, accelerator, totals, count, pipelined=eval_loss is not None)


def _batch_loss(
    model: torch.nn.Module,
    task: Task,
    batch: Any,
    forward_context: Callable[[], AbstractContextManager[Any]],
    eval_loss: Callable[[Any], tuple[torch.Tensor, dict[str, Any]] | None] | None,
    batch_context: Callable[[Any], AbstractContextManager[Any]] | None,
) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """One batch's loss and metrics: the strategy's `eval_loss` when it has one (None: no loss on
    this rank), else the task's, under the strategy's batch and forward contexts."""
    if eval_loss is not None:
        return eval_loss(batch)
    with batch_context(batch) if batch_context else nullcontext(), forward_context():
        return split_loss(task.loss(model, batch))


def _same_keys(task: Task, keys: list[str] | None, extras: dict[str, Any]) -> list[str]:
    """The batch's metric keys, which must be the earlier batches' `keys` (None: the first
    batch)."""
    if keys is not None and sorted(extras) != keys:
        raise ValueError(
            f"{type(task).__name__}.loss returned metrics {keys} on one eval batch and "
            f"{sorted(extras)} on another; return the same keys on every call (0.0 where there "
            "is nothing to report), as evaluation averages each over every batch"
        )
    return sorted(extras)


def _means_over_ranks(
    task: Task,
    accelerator: Accelerator,
    totals: dict[str, torch.Tensor],
    count: torch.Tensor,
    *,
    pipelined: bool,
) -> dict[str, float]:
    """Each metric's sum over all ranks divided by the samples counted over all ranks, as
    {'eval_<name>': mean}. `pipelined`: the ranks without a loss hold no metrics."""
    names = sorted(totals)
    # The ranks reduce their sums by position: they must hold the same names, or the reduction mixes
    # metrics up (or waits forever for a tensor of another size). One small gather per evaluation
    # agrees them first.
    parts = gather_object([names]) if accelerator.num_processes > 1 else [names]
    if pipelined:  # ranks without a loss must still reduce the same metrics, as zeros
        names = sorted({name for part in parts for name in part})
    else:
        problem = differing_keys(task, parts, "in evaluation (with the loss)")
        if problem:
            raise ValueError(problem)
    zero = torch.zeros((), device=accelerator.device, dtype=torch.float64)
    stacked = torch.stack([totals.get(k, zero) for k in names] + [count])
    summed = accelerator.reduce(stacked, "sum").cpu()
    return {f"eval_{k}": float(summed[i] / summed[-1]) for i, k in enumerate(names)}
