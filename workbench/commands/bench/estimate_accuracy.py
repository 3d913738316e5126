"""`workbench bench estimate`: the estimate against the measured peak per rank, for every data-parallel mode
and two model shapes, side by side in one run.

Measured is PyTorch's memory tracker on the real run on CPU (track_memory), torch.cuda.max_memory_allocated on a
GPU. The estimate compared is its tensor bytes (the runtime overhead it adds for the CUDA context or the
interpreter is not a tensor and is left out of both sides).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from workbench.config import RunConfig
from workbench.launcher.launch import launch
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.units import fmt_bytes

SHAPES = {
    "digits MLP (hidden 512)": RunConfig(task="digits", num_processes=2, micro_batch_size=64, max_steps=4,
                                         log_every=2, task_options={"hidden": 512}),
    "char-gpt tiny (2 x 64, ctx 64)": RunConfig(task="char-gpt", num_processes=2, micro_batch_size=16, max_steps=4,
                                                log_every=2, eval_batches=1, task_options={"preset": "tiny"}),
}
MODES = ("ddp", "zero1", "zero2", "zero3")


@dataclass
class EstimateRow:
    shape: str
    mode: str
    measured_bytes: int
    estimated_bytes: int
    model_state_exact: bool

    @property
    def error(self) -> float:
        return self.estimated_bytes / self.measured_bytes - 1


@dataclass
class EstimateReport:
    device: str
    rows: list[EstimateRow]

    def table(self) -> str:
        lines = [f"workbench bench estimate on {self.device}: peak per rank, estimated (tensors) against measured "
                 "(max over ranks)",
                 f"  {'shape':32} {'mode':6} {'measured':>10} {'estimated':>10} {'error':>7} {'model state':>12}"]
        for r in self.rows:
            measured, estimated = fmt_bytes(r.measured_bytes), fmt_bytes(r.estimated_bytes)
            lines.append(f"  {r.shape:32} {r.mode:6} {measured:>10} {estimated:>10} "
                         f"{r.error:+7.1%} {'exact' if r.model_state_exact else 'DIFFERS':>12}")
        return "\n".join(lines)


def estimate_accuracy(shapes: dict[str, RunConfig] | None = None, modes: tuple[str, ...] = MODES,
                      json_path: Path | None = None) -> EstimateReport:
    """Run each shape under each mode for real (memory tracked) and estimate it; compare per rank."""
    from workbench.estimator import estimate

    hw = detect()
    rows = []
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for shape, base in (shapes or SHAPES).items():
            for mode in modes:
                cfg = base.replace(parallelism=mode, runs_dir=tmp, run_name=None, track_memory=True)
                ranks = launch(cfg).summary["ranks"]
                cuda = resolve_device(cfg, hw) == "cuda"
                measured = [r["peak_memory_bytes"] if cuda else r["tracked_memory"]["peak"] for r in ranks]
                est = estimate(cfg, hw.gpus[0].name if cuda else None, cfg.num_processes)
                exact = all(est.ranks[r["rank"]].held == {k: r[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}
                            for r in ranks)
                rows.append(EstimateRow(shape, mode, max(measured), max(r.tensors for r in est.ranks), exact))
    report = EstimateReport(device=hw.describe(resolve_device(cfg, hw)), rows=rows)
    if json_path is not None:
        Path(json_path).write_text(json.dumps({"device": report.device, "rows": [asdict(r) for r in rows]}, indent=2))
    return report
