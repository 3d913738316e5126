"""`workbench bench parallelism`: the same config in every parallel layout, side by side in one run.

Layouts: the data-parallel modes (ddp, zero1, zero2, zero3, hsdp), tensor parallel over all ranks
('tp'), pipeline parallel over all ranks ('pp', 1F1B), and on 4+ ranks the hybrids 'zero3xtp' (FSDP
x TP, tp=2) and 'ppxddp' (pp=2 pipelines replicated). Model-parallel layouts have fewer
data-parallel ranks, so they accumulate more micro-batches to keep DDP's global batch (and its
losses).

Per mode: median step time after warm-up and its ratio to DDP, the bytes each rank holds for
parameters, gradients and optimizer state (measured from its shards), the step's tracked peak and
the process peak, and the loss after N steps with its difference from DDP's. Sharding trades step
time for memory; this shows how much of each, on this machine.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import launch
from workbench.utils.files import read_json
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.units import fmt_bytes

WARMUP_STEPS = 5
MODES = (
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "hsdp",
    "tp",
    "pp",
    "zero3xtp",
    "ppxddp",
    "ppinterleaved",
    "ppzerobubble",
    "ppxzero3xtp",
    "hsdpxtp",
    "cp",
    "ppxcp",
)

PARALLELISM_BENCH = RunConfig(
    task="char-gpt",
    num_processes=2,
    micro_batch_size=8,
    max_steps=30,
    lr=1e-3,
    log_every=10,
    eval_batches=2,
    task_options={"preset": "tiny"},
)
"""char-gpt 'tiny' (2 blocks): a shard unit per block, quick on a CPU."""


@dataclass
class ModeRow:
    mode: str
    available: bool
    reason: str = ""
    step_ms: float | None = None
    params_bytes: list[int] = field(default_factory=list)
    grads_bytes: list[int] = field(default_factory=list)
    optimizer_bytes: list[int] = field(default_factory=list)
    tracked_peak_bytes: list[int] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    final_loss: float | None = None


@dataclass
class ParallelismReport:
    device: str
    config: dict[str, Any]
    rows: list[ModeRow]

    def table(self) -> str:
        ddp = next((r for r in self.rows if r.mode == "ddp" and r.available), None)
        c = self.config
        lines = [
            f"workbench bench parallelism on {self.device}: task {c['task']}, {c['num_processes']} "
            f"ranks, micro-batch {c['micro_batch_size']} x {c['grad_accum_steps']}, "
            f"{c['precision']}, {c['max_steps']} steps (median step after {WARMUP_STEPS} warm-up); "
            "bytes per rank (max over ranks)",
            f"  {'layout':13} {'ms/step':>8} {'vs ddp':>7} {'params':>10} {'grads':>10} "
            f"{'optimizer':>10} {'step peak':>10} {'RSS peak':>10} {'loss':>8} {'vs ddp':>9}",
        ]
        for r in self.rows:
            if not r.available:
                lines.append(f"  {r.mode:13} unavailable: {r.reason}")
                continue
            ratio = f"{r.step_ms / ddp.step_ms:.2f}x" if ddp and ddp.step_ms else "-"
            diff = (
                f"{r.final_loss - ddp.final_loss:+.1e}"
                if ddp and ddp.final_loss is not None
                else "-"
            )

            def kib(values: list[int]) -> str:
                return f"{max(values) / 1024:,.1f} KiB" if values else "-"

            lines.append(
                f"  {r.mode:13} {r.step_ms:8.2f} {ratio:>7} {kib(r.params_bytes):>10} "
                f"{kib(r.grads_bytes):>10} {kib(r.optimizer_bytes):>10} "
                f"{kib(r.tracked_peak_bytes):>10} {fmt_bytes(r.peak_memory_bytes, 'MiB'):>10} "
                f"{r.final_loss:8.4f} {diff:>9}"
            )
        return "\n".join(lines)


def _config_for(cfg: RunConfig, mode: str) -> tuple[RunConfig | None, str]:
    n, accum = cfg.num_processes, cfg.grad_accum_steps
    if mode in ("hsdp", "zero3xtp", "ppxddp") and (n < 4 or n % 2):
        return (
            None,
            f"{mode} needs an even num_processes >= 4 (2 groups of 2); try --set num_processes=4 "
            "--set oversubscribe=true",
        )
    if mode == "ppxcp" and n % 4:
        return (
            None,
            "ppxcp needs num_processes a multiple of 4 (pp 2 x cp 2); try --set num_processes=4",
        )
    if mode in ("ppxzero3xtp", "hsdpxtp") and n % 8:
        return (
            None,
            f"{mode} needs num_processes a multiple of 8 (2 x 2 x tp 2); try --set "
            "num_processes=8 --set oversubscribe=true",
        )
    layouts = {
        "hsdp": dict(parallelism="hsdp", dp_shard=2),
        "tp": dict(parallelism="ddp", tp=n, grad_accum_steps=accum * n),
        "pp": dict(parallelism="ddp", pp=n, grad_accum_steps=accum * n, pp_schedule="1f1b"),
        "zero3xtp": dict(parallelism="zero3", tp=2, grad_accum_steps=accum * 2),
        "ppxddp": dict(parallelism="ddp", pp=2, grad_accum_steps=accum * 2, pp_schedule="1f1b"),
        # the interleaved schedules: 2 chunks per rank, the same micro-batches as pp's 1F1B
        "ppinterleaved": dict(
            parallelism="ddp", pp=n, grad_accum_steps=accum * n, pp_schedule="interleaved_1f1b"
        ),
        "ppzerobubble": dict(
            parallelism="ddp", pp=n, grad_accum_steps=accum * n, pp_schedule="zero_bubble"
        ),
        "ppxzero3xtp": dict(parallelism="zero3", pp=2, tp=2, grad_accum_steps=accum * 4),
        "hsdpxtp": dict(parallelism="hsdp", dp_shard=2, tp=2, grad_accum_steps=accum * 2),
        # a CP group shares its batches, as a TP group does: the same sequences per step, each split
        "cp": dict(parallelism="zero3", cp=n, grad_accum_steps=accum * n),
        "ppxcp": dict(parallelism="zero3", pp=2, cp=2, grad_accum_steps=accum * 4),
    }
    return cfg.replace(**{"parallelism": mode, "dp_shard": 0, **layouts.get(mode, {})}), ""


def parallelism(
    cfg: RunConfig, modes: tuple[str, ...] = MODES, json_path: Path | None = None
) -> ParallelismReport:
    """Run `cfg` once per mode; modes that can't run here are listed with the reason instead."""
    hw = detect()
    rows = []
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for mode in modes:
            layout, reason = _config_for(cfg.replace(runs_dir=tmp, run_name=mode), mode)
            if layout is not None:
                # the step peak, a pipeline's per stage (its method in the rank's summary)
                layout = layout.replace(track_memory=True)
            if layout is None:
                rows.append(ModeRow(mode, False, reason))
                continue
            try:
                preflight(layout)
            except ValueError as e:
                rows.append(ModeRow(mode, False, str(e)))
                continue
            result = launch(layout)
            s, ranks = result.summary, result.summary["ranks"]
            steps = read_json(result.dir.timings_path)["step_time_s"]
            times = steps[WARMUP_STEPS:] or [float("nan")]
            rows.append(
                ModeRow(
                    mode,
                    True,
                    step_ms=1e3 * statistics.median(times),
                    params_bytes=[r["params_bytes"] for r in ranks],
                    grads_bytes=[r["grads_bytes"] for r in ranks],
                    optimizer_bytes=[r["optimizer_bytes"] for r in ranks],
                    tracked_peak_bytes=[
                        r["tracked_memory"]["peak"] for r in ranks if r["tracked_memory"]
                    ],
                    peak_memory_bytes=s["peak_memory_bytes"],
                    final_loss=s["final_loss"],
                )
            )
    report = ParallelismReport(
        device=hw.device_line(resolve_device(cfg, hw)), config=cfg.to_dict(), rows=rows
    )
    if json_path is not None:
        write_result(json_path, asdict(report))
    return report
