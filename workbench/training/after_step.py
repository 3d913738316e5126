"""What is due after a training step: the metrics row, an evaluation and a checkpoint when their
intervals come round, then the ending the ranks agreed on (a stop, or a preemption whose state is
saved). Each comes after a read of the non-finite flags (nonfinite.py), so a diverged state is never
logged, evaluated or saved. The trainer's loop (loop.py) calls `after_step` once per step."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from workbench.rundir import MetricsRow, Status
from workbench.training.endings import diverged, ended
from workbench.training.evaluation import evaluate
from workbench.training.nonfinite import Divergence

if TYPE_CHECKING:
    import torch

    from workbench.training.loop import Trainer
    from workbench.training.stop_vote import VoteResult


def after_step(
    t: Trainer, grad_norm: torch.Tensor | None, verdict: VoteResult, bar: Any
) -> Status | None:
    """Log, evaluate and checkpoint when due, each after a read of the non-finite flags
    (nonfinite.py), so a diverged state is never logged, evaluated or saved; the status the run
    ends with, if it ends now."""
    cfg, step = t.cfg, t.state.step
    final = step == cfg.max_steps
    # A preempted rank has a grace period to save its state: no eval then.
    evaluate_now = (
        t.eval_ds is not None
        and not verdict.signal
        and bool(final or verdict.stop or (cfg.eval_every and step % cfg.eval_every == 0))
    )
    checkpoint_now = t.checkpoints.due(step, final, verdict.ends)
    if t.metrics.due(step, final) or verdict.ends:
        row = t.metrics.log(t.state, grad_norm, t.elapsed_s(), t.lr)
        if isinstance(row, Divergence):
            return diverged(t, row)
        if bar is not None:
            bar.set_postfix(loss=f"{row.loss:.4f}", samples_s=f"{row.samples_per_s:.0f}")
    elif evaluate_now or checkpoint_now:  # a read point of its own
        found = t.nonfinite.read(t.accelerator)
        if found is not None:
            return diverged(t, found)
    if evaluate_now:
        _evaluate(t, step)
    if checkpoint_now:
        t.at(step, "checkpoint")
        t.state.train_time_s = t.elapsed_s()
        t.checkpoints.save(t.state)
        t.metrics.restart_clock()
    return _agreed_ending(t, verdict, final)


def _evaluate(t: Trainer, step: int) -> None:
    """Evaluate this rank's shard of the eval set under the strategy's contexts, and write the
    reduced means as the step's eval row."""
    t.at(step, "evaluation")
    t.eval_row = evaluate(
        t.model,
        t.task,
        t.eval_ds,
        t.cfg,
        t.accelerator,
        t.collate_fn,
        t.parallel.forward_context,
        shard=(t.dp_rank, t.dp_world),
        eval_loss=t.parallel.eval_loss,
        batch_context=t.parallel.batch_context,
    )
    t.metrics.write(MetricsRow.for_eval(step, t.eval_row))
    t.metrics.restart_clock()


def _agreed_ending(t: Trainer, verdict: VoteResult, final: bool) -> Status | None:
    """The ending the stop vote agreed on (a preemption, then a stop), else completed at the last
    step, else None: the run goes on."""
    step = t.state.step
    if verdict.signal:
        return ended(
            t,
            Status.PREEMPTED,
            signal=signal.Signals(verdict.signal).name,
            message=f"{signal.Signals(verdict.signal).name} at step {step}: the ranks "
            "checkpointed and exited",
        )
    if verdict.stop:
        return ended(t, Status.STOPPED)
    return Status.COMPLETED if final else None
