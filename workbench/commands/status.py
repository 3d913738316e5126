"""`workbench status RUN_DIR`: how a run stands, read from its directory, for people and for
scripts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from workbench.launcher.preempted import EXIT_PREEMPTED
from workbench.rundir import MetricsRow, RunDir, Status
from workbench.utils.units import fmt_duration


def describe_run(path: Path) -> tuple[str, int]:
    """The report, and an exit code: 0 running or ended well, 1 failed/diverged/gone (or a status
    this version doesn't know), 75 preempted, 2 not a run.

    A summary that says 'running' for a run whose processes are all gone is reported as failed, with
    why; a summary.json that can't be read raises ValueError naming it (no status is guessed for
    it).
    """
    run = RunDir(Path(path).expanduser())
    if not run.summary_path.exists():
        raise ValueError(f"{run.path}: not a run directory (no summary.json)")
    summary = run.summary()
    # one look: a heartbeat old by the clocks' difference is re-read
    status, why = run.observed_status(settle=True)
    # read from the file's end: a run of 200,000 rows costs the rows shown
    newest = run.last_train_row()
    cfg = run.config()
    if status is Status.UNKNOWN:
        why = (
            f"{run.summary_path.name} says {summary.status_text!r}, which this version of "
            "workbench doesn't know (a newer one wrote it?): upgrade workbench to read it"
        )
    lines = [f"{run.name}: {status.value}" + (f" ({why})" if why else "")]
    if newest is not None:
        last = MetricsRow.from_dict(newest)
        total = f"/{cfg.max_steps}" if cfg else ""
        lines.append(
            f"  step {last.step}{total}, loss {last.loss:.4g}, "
            f"{last.samples_per_s or 0:,.0f} samples/s (last window)"
        )
    if status in (Status.RUNNING, Status.STARTING):
        seen = run.observe()
        lines.append(f"  processes: {seen.reason}")
    if summary.ending:
        lines.append(f"  ending: {ending_line(summary.ending, status)}")
    if summary.error and status is Status.FAILED:
        where = (
            f"rank {summary.error['rank']}"
            if summary.error.get("rank") is not None
            else "the launcher"
        )
        lines.append(
            f"  error: {where}: {summary.error.get('type')}: {summary.error.get('message')}"
        )
    checkpoints = run.checkpoints()
    if checkpoints:
        lines.append(f"  newest checkpoint: step {checkpoints[-1][0]} ({checkpoints[-1][1]})")
    if summary.started_at:
        lines.append(
            f"  started {fmt_duration(time.time() - summary.started_at)} ago, attempt "
            f"{summary.attempt or 1}"
        )
    code = {
        Status.FAILED: 1,
        Status.DIVERGED: 1,
        Status.UNKNOWN: 1,
        Status.PREEMPTED: EXIT_PREEMPTED,
    }.get(status, 0)
    return "\n".join(lines), code


def ending_line(ending: Any, status: Status) -> str:
    """Summary.ending as a line of text: its message, else the status at its step (with the reason
    or signal); then the checkpoint to resume from and any other key, unless the message says
    them."""
    if not isinstance(ending, dict):
        return str(ending)
    text = str(ending.get("message") or "")
    if not text:
        why = [str(ending[k]) for k in ("reason", "signal") if ending.get(k)]
        step = f" at step {ending['step']}" if ending.get("step") is not None else ""
        text = f"{status.value}{step}" + (f": {', '.join(why)}" if why else "")
    parts = [text]
    for key in ("checkpoint", "last_checkpoint"):
        if (
            key in ending
            and str(ending[key]) not in text
            and (ending[key] or "checkpoint" not in text)
        ):
            parts.append(f"checkpoint {ending[key]}" if ending[key] else "no checkpoint")
    told = {"message", "step", "reason", "signal", "checkpoint", "last_checkpoint"}
    parts += [
        f"{k}: {v}" for k, v in ending.items() if k not in told and v not in (None, "", [], {})
    ]
    return "; ".join(parts)
