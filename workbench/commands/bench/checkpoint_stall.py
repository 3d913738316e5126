"""`workbench bench checkpoint`: how long a checkpoint stops training, written synchronously against
in the background (checkpoint_async), side by side in one run.

Per layout, two arms of the same run: checkpoints written whole ('sync') and written in the
background ('async'). The stall is what each checkpoint blocked the training loop for, as the
trainer measures it (summary.json's checkpoints.stall_s: the copy to host memory and the start of a
background write, or a whole synchronous write; waiting for the previous write counts too). The
final checkpoint is shown apart: the run waits for its write to end either way. The write time runs
from a checkpoint's start to its manifest; a background write shares the cores and the disk with
training while it runs, which the step time beside it shows as far as this machine's noise lets it.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import start
from workbench.rundir import RunDir
from workbench.utils.files import read_json
from workbench.utils.hardware import detect, resolve_device

log = logging.getLogger("workbench")

CHECKPOINT_BENCH = RunConfig(
    task="char-gpt",
    task_options={"preset": "small"},
    num_processes=2,
    device="cpu",
    micro_batch_size=2,
    max_steps=16,
    checkpoint_every=2,
    keep_checkpoints=2,
    log_every=4,
    eval_batches=1,
    trackers=[],
)
"""char-gpt 'small' (10.7M parameters: a 130 MB checkpoint with AdamW's state) on 2 CPU ranks, a
checkpoint every other step."""
LAYOUTS = ("ddp", "zero3")
ARMS = {"sync": "off", "async": "on"}
"""Each arm's checkpoint_async."""


@dataclass
class ArmRun:
    """One run of one arm."""

    layout: str
    arm: str
    stall_s: list[float]
    """Per checkpoint, in order: seconds rank 0's training loop was blocked by it (the last is the
    final one)."""
    write_s: list[float]
    """Per checkpoint: seconds from its start to its manifest."""
    step_s: list[float]
    checkpoint_mb: float


@dataclass
class CheckpointReport:
    device: str
    config: dict[str, Any]
    runs: list[ArmRun] = field(default_factory=list)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One row per layout and arm, as the benchmarks page shows them."""
        return [
            {
                "layout": run.layout,
                "writes": "background" if run.arm == "async" else "synchronous",
                "checkpoint MB": round(run.checkpoint_mb, 1),
                "checkpoints": len(run.stall_s),
                "stall per checkpoint s (median)": round(statistics.median(run.stall_s[:-1]), 3),
                "final checkpoint stall s": round(run.stall_s[-1], 3),
                "write s (median)": round(statistics.median(run.write_s), 3),
                "step s (median)": round(statistics.median(run.step_s), 3),
            }
            for run in self.runs
        ]

    @property
    def run(self) -> str:
        """The run every arm made, in words."""
        cfg = self.config
        return (
            f"{cfg['task']} {cfg['task_options']}, {cfg['num_processes']} ranks, micro-batch "
            f"{cfg['micro_batch_size']}, {cfg['max_steps']} steps, a checkpoint every "
            f"{cfg['checkpoint_every']}"
        )

    def table(self) -> str:
        lines = [
            f"workbench bench checkpoint: {self.run}, on {self.device}",
            f"  {'layout':7} {'writes':12} {'MB':>6} {'stall/ckpt s':>13} {'final s':>8} "
            f"{'write s':>8} {'step s':>7}",
        ]
        for row in self.rows:
            lines.append(
                f"  {row['layout']:7} {row['writes']:12} {row['checkpoint MB']:>6.0f} "
                f"{row['stall per checkpoint s (median)']:>13.3f} "
                f"{row['final checkpoint stall s']:>8.3f} {row['write s (median)']:>8.3f} "
                f"{row['step s (median)']:>7.2f}"
            )
        lines += [
            "  stall/ckpt: the training loop blocked by a checkpoint (median over those "
            "before the last);",
            "  final: the last one, whose write the run waits for either way",
        ]
        return "\n".join(lines)


def _run_arm(cfg: RunConfig, layout: str, arm: str) -> ArmRun:
    run = start(cfg)
    try:
        result = run.wait()
    finally:
        if not run.done():
            run.kill()
    files = RunDir(result.run_dir)
    saved = [e for e in files.events() if e.get("event") == "checkpoint_saved"]
    newest = files.latest_checkpoint()
    size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) if newest else 0
    timings = read_json(files.timings_path) or {}
    return ArmRun(
        layout,
        arm,
        list(result.summary["checkpoints"]["stall_s"]),
        [e["write_s"] for e in saved],
        list(timings.get("step_time_s", [])),
        size / 1e6,
    )


def checkpoint_stall(
    cfg: RunConfig = CHECKPOINT_BENCH,
    layouts: tuple[str, ...] = LAYOUTS,
    json_path: Path | None = None,
) -> CheckpointReport:
    """Per layout, the same run with checkpoints written synchronously and in the background (module
    docstring); the arms alternate their order from one layout to the next."""
    if cfg.checkpoint_every < 1 or cfg.max_steps < 2 * cfg.checkpoint_every:
        raise ValueError(
            f"checkpoint_every={cfg.checkpoint_every} with max_steps={cfg.max_steps}: "
            "the bench needs a checkpoint before the final one, e.g. "
            "checkpoint_every=2 with max_steps=16"
        )
    hw = detect()
    report = CheckpointReport(device=hw.device_line(resolve_device(cfg, hw)), config=cfg.to_dict())
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for i, layout in enumerate(layouts):
            for arm in list(ARMS) if i % 2 == 0 else list(reversed(ARMS)):
                arm_cfg = cfg.replace(
                    parallelism=layout,
                    checkpoint_async=ARMS[arm],
                    runs_dir=tmp,
                    run_name=f"{layout}-{arm}",
                )
                preflight(arm_cfg)
                report.runs.append(_run_arm(arm_cfg, layout, arm))
                log.info("%s %s: stalls %s", layout, arm, report.runs[-1].stall_s)
    if json_path is not None:
        write_result(
            json_path,
            {
                "device": report.device,
                "run": report.run,
                "rows": report.rows,
                "runs": [asdict(r) for r in report.runs],
            },
        )
    return report
