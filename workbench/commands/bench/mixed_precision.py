"""`workbench bench precision`: one config in every precision this machine supports, side by
side."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import launch
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.units import fmt_bytes

PRECISION_BENCH = RunConfig(
    task="char-gpt",
    num_processes=1,
    micro_batch_size=32,
    max_steps=50,
    lr=1e-3,
    log_every=10,
    eval_batches=4,
    task_options={"preset": "small"},
)
"""nanoGPT's shakespeare-char model on one device: small enough for a CPU, big enough to load a
GPU."""


@dataclass
class PrecisionRow:
    precision: str
    available: bool
    reason: str = ""
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    mfu: float | None = None
    final_loss: float | None = None
    compute_dtype: str | None = None


@dataclass
class PrecisionReport:
    device: str
    config: dict
    rows: list[PrecisionRow]

    def table(self) -> str:
        base = next((r for r in self.rows if r.precision == "fp32" and r.available), None)
        lines = [
            f"workbench bench precision on {self.device}: task {self.config['task']}, "
            f"{self.config['num_processes']} rank(s), micro-batch "
            f"{self.config['micro_batch_size']}, {self.config['max_steps']} steps",
            f"  {'precision':10} {'dtype':9} {'samples/s':>10} {'tokens/s':>10} {'vs fp32':>8} "
            f"{'peak MiB':>9} {'MFU':>6} {'final loss':>10}",
        ]
        for r in self.rows:
            if not r.available:
                lines.append(f"  {r.precision:10} unavailable: {r.reason}")
                continue
            speed = (
                f"{r.samples_per_s / base.samples_per_s:.2f}x" if base and r.samples_per_s else "-"
            )
            tokens = f"{r.tokens_per_s:10.0f}" if r.tokens_per_s else f"{'-':>10}"
            mfu = f"{r.mfu:6.1%}" if r.mfu is not None else f"{'-':>6}"
            lines.append(
                f"  {r.precision:10} {r.compute_dtype or '?':9} {r.samples_per_s:10.0f} {tokens} "
                f"{speed:>8} {fmt_bytes(r.peak_memory_bytes or 0, 'MiB', '5.0f'):>9} {mfu} "
                f"{r.final_loss:10.4f}"
            )
        return "\n".join(lines)


def precision(cfg: RunConfig, json_path: Path | None = None) -> PrecisionReport:
    """Run `cfg` once per precision, side by side, and compare throughput, memory, MFU and loss.

    Precisions this machine can't run are listed with the reason instead of being run.
    """
    hw = detect()
    device = resolve_device(cfg, hw)
    rows = []
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for p in ("fp32", "bf16", "fp16", "fp8"):
            problem = hw.precision_problem(p, device)
            if problem:
                rows.append(PrecisionRow(p, available=False, reason=problem))
                continue
            run_cfg = cfg.replace(precision=p, runs_dir=tmp, run_name=p)
            try:
                # what the model can't do in this precision (fp8: no Linear to swap)
                preflight(run_cfg)
            except ValueError as e:
                rows.append(PrecisionRow(p, available=False, reason=str(e)))
                continue
            s = launch(run_cfg).summary
            rows.append(
                PrecisionRow(
                    p,
                    True,
                    samples_per_s=s["samples_per_s"],
                    tokens_per_s=s.get("tokens_per_s"),
                    peak_memory_bytes=s["peak_memory_bytes"],
                    mfu=s.get("mfu"),
                    final_loss=s["final_loss"],
                    compute_dtype=s["ranks"][0]["compute_dtype"],
                )
            )
    report = PrecisionReport(device=hw.device_line(device), config=cfg.to_dict(), rows=rows)
    if json_path is not None:
        write_result(json_path, asdict(report))
    return report
