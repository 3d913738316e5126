"""The micro-batches of one optimizer step, shared by the trainer and the estimator's trace, so the
estimate runs exactly the step the trainer runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import send_to_device

from workbench.training.evaluation import split_loss
from workbench.training.observe.memory import next_micro_batch
from workbench.training.task_checks import explain_ddp_error

if TYPE_CHECKING:
    from workbench.tasks import Task
    from workbench.training.parallel import Strategy
    from workbench.training.task_checks import CheckedTask


def accumulate(
    strategy: Strategy,
    task: Task | CheckedTask,
    batches: Iterator[Any],
    accum: int,
    device: torch.device,
    at: Callable[[str], None] | None = None,
    before_last_backward: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Forward and backward over `accum` micro-batches, gradient sync held back until the last;
    returns the step's mean loss, on the device (nothing here reads it). `at` is told the phase (for
    a hang report); `before_last_backward` is called before the last backward, so the trainer's vote
    (stop_vote.py) runs while backward does."""
    if strategy.pipelined:  # the pipeline schedule runs the micro-batches itself
        return strategy.pipeline_step(batches, accum, at, before_last_backward)
    step_loss = torch.zeros((), device=device)
    try:  # free in Python 3.11 unless something raises
        for micro in range(accum):
            last = micro == accum - 1
            if at is not None:
                at("data")
            # Asynchronous from pinned batches (pin_memory): the copy overlaps the previous work;
            # the stream still orders it before the forward that reads it.
            batch = send_to_device(next(batches), device, non_blocking=True)
            if at is not None:
                at("forward/backward (Task.loss)")
            with strategy.sync_gradients(last), strategy.batch_context(batch):
                with strategy.forward_context():
                    loss, _ = split_loss(task.loss(strategy.model, batch))
                step_loss += loss.detach().float() / accum
                if last and before_last_backward is not None:
                    before_last_backward()
                strategy.backward(loss / accum)
            if not last:
                next_micro_batch()
    except RuntimeError as e:
        explain_ddp_error(e)
        raise
    return step_loss
