"""The start and the end of one rank's training session around the trainer's loop (loop.py): the
announcement (the started or resumed event, the running status, the log line), rank 0's progress
bar, and the finish (the summary fields, the replica check, the exported weights, the final status
and the step times). The summary's fields themselves are session_summary.py's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.rundir import Status
from workbench.training.compiling import tell_report
from workbench.training.session_summary import (
    check_replicas,
    export_weights,
    running_fields,
    summary_fields,
)
from workbench.training.weights import save_rank_value

if TYPE_CHECKING:
    from workbench.training.loop import Trainer


def announce(t: Trainer, resumed_from: str | None) -> None:
    """Rank 0 says the session started (or resumed from a checkpoint): the event, the running
    status and one log line."""
    if not t.main:
        return
    cfg = t.cfg
    t.run.event(
        "resumed" if resumed_from else "started",
        step=t.state.step,
        world_size=t.world,
        device=str(t.device),
        checkpoint=resumed_from,
    )
    t.run.set_status(Status.RUNNING, **running_fields(t))
    t.log.info(
        "training %s: %d ranks on %s, %s, global batch %d, %d params",
        cfg.task,
        t.world,
        t.device.type,
        cfg.precision,
        t.global_batch,
        t.n_params,
    )


def progress_bar(t: Trainer) -> Any:
    """Rank 0's progress bar over the run's steps, when asked for; None otherwise."""
    if not (t.progress and t.main):
        return None
    # Plain text, not tqdm.auto: a rank is a forked process and can't drive the kernel's
    # widgets; its stderr still reaches the notebook through the kernel's captured file
    # descriptors.
    from tqdm import tqdm

    return tqdm(
        total=t.cfg.max_steps,
        initial=t.state.step,
        desc=f"{t.cfg.task} x{t.world}",
        unit="step",
        dynamic_ncols=True,
    )


def finish(t: Trainer, status: Status, steps0: int, samples0: int, tokens0: int) -> dict[str, Any]:
    """The session's summary fields (rates over this session's steps, from the counters it started
    with); unless it diverged, the replica check, the exported weights and the task's rank value.
    Rank 0 writes the final status and the step times. Returns the fields."""
    t.at(t.state.step, "finishing")
    session_time = sum(t.step_times) or 1e-9
    tokens = t.state.tokens - tokens0
    fields = summary_fields(
        t,
        samples_per_s=(t.state.samples - samples0) / session_time,
        tokens_per_s=tokens / session_time if tokens else None,
        steps_run=t.state.step - steps0,
    )
    if status is not Status.DIVERGED:
        check_replicas(t, fields)
        fields["weights_sha256"] = export_weights(t)
        value = t.task.rank_value(t.parallel.model, t.cfg)
        if value is not None:
            save_rank_value(t.run, t.rank, value)
    fields["checkpoints"] = t.checkpoints.finish()  # waits for a write still in flight
    if t.compiled.on:
        fields["compile"] = tell_report(t)
    if t.main:
        t.run.set_status(status, **running_fields(t), **fields, ending=t.ending)
        t.run.write_timings(t.step_times)
        if status is Status.COMPLETED:
            t.run.event("completed", step=t.state.step)
    t.accelerator.wait_for_everyone()
    return fields
