"""How a session's training ends other than by completing: stopped, preempted or diverged. Every
rank keeps the `ending` the summary records; rank 0 records the event."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.rundir import Status

if TYPE_CHECKING:
    from workbench.training.loop import Trainer
    from workbench.training.nonfinite import Divergence


def ended(t: Trainer, status: Status, **details: Any) -> Status:
    """A stop or a preemption, at the step the ranks agreed on (its checkpoint already saved)."""
    step, ckpt = t.state.step, t.run.latest_checkpoint()
    t.ending = {"step": step, "checkpoint": str(ckpt) if ckpt else None, **details}
    if t.main:
        t.run.event(status.value, **t.ending)
    return status


def diverged(t: Trainer, found: Divergence) -> Status:
    """The run diverged at `found.step`: record it, nothing saved. The steps from it on (read at a
    later read point, nonfinite.py) trained on a spoilt state: the counters go back to the last good
    step, which is what the summary reports as trained."""
    cfg, state = t.cfg, t.state
    spoilt = max(0, state.step - (found.step - 1))
    state.step -= spoilt
    state.micro_batches -= spoilt * cfg.grad_accum_steps
    state.samples -= spoilt * t.global_batch
    state.tokens -= spoilt * t.global_batch * (t.tokens_per_sample or 0)
    ckpt = t.run.latest_checkpoint()
    where = f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint was saved before it"
    t.ending = {
        "step": found.step,
        "reason": found.reason,
        "last_checkpoint": str(ckpt) if ckpt else None,
        "message": f"diverged at step {found.step}: {found.reason}; {where}",
    }
    if t.main:
        t.run.event("diverged", **t.ending)
    return Status.DIVERGED
