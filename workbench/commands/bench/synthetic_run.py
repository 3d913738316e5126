"""The run `workbench bench big-run` reads: a completed digits run on 2 ranks, written without
training, whose metrics.jsonl holds `rows` training rows shaped as a real run's (the keys, value
types and sizes of a digits run's rows: per-rank memory and step-time breakdown, the verdicts, ~1.1
KB a row) and an eval row every `eval_every` steps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.rundir import RunDir

ROWS = 200_000
EVAL_EVERY = 1000
VERDICT = (
    "communication-bound: 62% of the step in gradient all-reduce not hidden by compute; try "
    "gradient accumulation (fewer all-reduces per sample), bf16 compression (grad_compression) or "
    "zero2"
)
"""The verdict a 2-rank CPU digits run logs on most rows (copied from one)."""


def write_big_run(run_dir: Path, rows: int = ROWS, eval_every: int = EVAL_EVERY) -> Path:
    """A completed 2-rank digits run in `run_dir` whose metrics.jsonl holds `rows` training rows
    shaped as a real run's, and an eval row every `eval_every` steps; returns metrics.jsonl's
    path."""
    from workbench.rundir import RunDir

    run = RunDir(run_dir)
    _write_config(run, rows)  # creates the directory
    run.write_metrics(_metrics_rows(rows, eval_every))
    last = run.last_train_row()
    assert last is not None
    _complete(run, rows, final_loss=last["loss"])
    return run.metrics_path


def _write_config(run: RunDir, rows: int) -> None:
    """The config of a 2-rank digits run of `rows` steps, each logged."""
    from workbench.config import RunConfig

    run.write_config(
        RunConfig(
            task="digits",
            num_processes=2,
            max_steps=rows,
            log_every=1,
            seed=0,
            runs_dir=str(run.path.parent),
            run_name=run.name,
        )
    )


def _metrics_rows(rows: int, eval_every: int) -> Iterator[dict[str, Any]]:
    """metrics.jsonl's rows, made as they are written (200,000 dicts at once would take ~750 MB): a
    training row each step, an eval row every `eval_every` steps and at the last."""
    from workbench.rundir.metrics_row import MetricsRow

    rnd, elapsed = random.Random(0), 0.0
    for step in range(1, rows + 1):
        row = _train_row(rnd, step, rows, elapsed)
        if step == 1:
            assert MetricsRow.from_dict(row).to_dict() == row, "a row of the schema"
        elapsed += row["step_time_s"]
        yield row
        if step % eval_every == 0 or step == rows:
            yield _eval_row(step, rows)


def _train_row(rnd: random.Random, step: int, rows: int, elapsed: float) -> dict[str, Any]:
    """Training row `step` of `rows`, `elapsed` seconds in: a digits run's keys, the numbers drawn
    from `rnd`."""
    step_s = 0.009 * (1 + 0.2 * rnd.random())
    ms = [1000 * step_s, 1000 * step_s * (1 + 0.05 * rnd.random())]
    return {
        "step": step,
        "epoch": step // 14,
        "loss": 2.3 * 0.9999**step + 0.05 * rnd.random(),
        "lr": 1e-3 * (1 - step / (rows + 1)),
        "step_time_s": step_s,
        "samples_per_s": 128 / step_s,
        "peak_memory_bytes": 301_379_584 + rnd.randrange(1 << 20),
        "peak_memory_bytes_per_rank": [301_379_584 + rnd.randrange(1 << 20), 295_436_288],
        "skipped_steps": 0,
        "params_bytes_per_rank": [104_488, 104_488],
        "grads_bytes_per_rank": [104_488, 104_488],
        "optimizer_bytes_per_rank": [209_000, 209_000],
        "samples": 128 * step,
        "elapsed_s": elapsed,
        "eta_s": step_s * (rows - step),
        "step_time_ms_per_rank": ms,
        "data_ms_per_rank": [rnd.random(), rnd.random()],
        "compute_ms_per_rank": [1.3 + rnd.random(), 1.2 + rnd.random()],
        "comm_ms_per_rank": [5.3 + rnd.random(), 5.1 + rnd.random()],
        "optimizer_ms_per_rank": [1.1 + rnd.random() / 10, 0.9 + rnd.random() / 10],
        "other_ms_per_rank": [0.17, 0.12],
        "comm_measured": True,
        "verdicts": [VERDICT],
        "rss_bytes_per_rank": [283_652_096, 277_905_408],
        "grad_norm": 0.2 + rnd.random() / 10,
        "schema_version": 1,
    }


def _eval_row(step: int, rows: int) -> dict[str, Any]:
    """Eval row `step` of `rows`: loss and accuracy improving with the steps."""
    return {
        "step": step,
        "eval_loss": 2.3 * 0.9999**step + 0.01,
        "eval_accuracy": min(1.0, step / rows),
        "schema_version": 1,
    }


def _complete(run: RunDir, rows: int, final_loss: float) -> None:
    """The run's events and status as a completed run's, and its (empty) timings."""
    from workbench.rundir import Status

    run.event("started", step=0)
    run.set_status(
        Status.COMPLETED,
        world_size=2,
        parallelism="ddp",
        precision="fp32",
        steps=rows,
        final_loss=final_loss,
        global_batch_size=128,
        samples_per_s=12_000.0,
    )
    run.event("completed", step=rows)
    run.write_timings([])
