"""`workbench bench mfu`: the model FLOPs utilisation of one device training GPT-2 small's shape,
against the target (45% in bf16, blocks compiled, on one H100: what nanoGPT and torchtitan reach on
that shape).

MFU = the model's training FLOPs per second (the task's own count: 6 x parameters per token plus
attention, as PaLM's appendix B and nanoGPT count) over the device's dense peak in the run's
precision: the catalog's datasheet peak on a GPU, or on a CPU the matmul rate this process measures
(estimator/catalog.this_machine). The rate is taken from the median steady step (the first
`warmup_steps` left out: they compile and fill the caches), not the run's average, which a compile's
first step drags down.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.utils.files import read_json

MFU_BENCH = RunConfig(
    task="char-gpt",
    task_options={"preset": "gpt2-small"},
    num_processes=1,
    precision="bf16",
    compile="blocks",
    micro_batch_size=16,
    max_steps=30,
    log_every=10,
    eval_batches=1,
)
"""GPT-2 small's shape (12 layers, 768 wide, 1,024 tokens of context) at nanoGPT's micro-batch, on
one device."""
TARGET = 0.45
"""The MFU that bf16 with compiled blocks should reach on one H100 (issue 37: the GPU target)."""
TARGET_CLASSES = ("H100", "H200")
"""Accelerators the target applies to; elsewhere the MFU is reported without a verdict."""


@dataclass
class MfuReport:
    device: str
    config: dict
    steps: int
    """Steps timed (after the warm-up)."""
    step_time_s: float
    """Median steady step."""
    tokens_per_s: float
    flops_per_step: float
    peak_flops: float | None
    peak_source: str
    mfu: float | None
    target: float | None
    """TARGET where it applies (an H100-class GPU in the run's precision bf16), else None: no
    verdict."""

    @property
    def passed(self) -> bool:
        return self.target is None or (self.mfu is not None and self.mfu >= self.target)

    def table(self) -> str:
        c = self.config
        mfu = f"{self.mfu:.1%}" if self.mfu is not None else "- (no peak known for this device)"
        if self.mfu is not None and self.mfu > 1:
            # a CPU's peak, measured after the run on a busier machine
            mfu += (
                " (over 100%: the peak was measured lower than the run reached; the machine "
                "was busier then)"
            )
        verdict = (
            f"target {self.target:.0%}: {'met' if self.passed else 'MISSED'}"
            if self.target is not None
            else "no target on this device (the target is for bf16 on one H100 or H200)"
        )
        return "\n".join(
            [
                f"workbench bench mfu on {self.device}: {c['task']} "
                f"{c['task_options'].get('preset', '')}, {c['precision']}, compile={c['compile']}, "
                f"micro-batch {c['micro_batch_size']}",
                f"  median step {self.step_time_s * 1e3:.1f} ms over {self.steps} steady steps, "
                f"{self.tokens_per_s:,.0f} tokens/s, "
                f"{self.flops_per_step / self.step_time_s / 1e12:.2f} TFLOP/s of model FLOPs",
                f"  peak: {self.peak_source}",
                f"  MFU {mfu}; {verdict}",
            ]
        )


def mfu(
    cfg: RunConfig = MFU_BENCH, json_path: Path | None = None, warmup_steps: int = 10
) -> MfuReport:
    """Train `cfg` on one process and report its MFU over the steady steps."""
    from workbench.launcher.launch import launch

    if cfg.num_processes != 1:
        raise ValueError(
            f"bench mfu: num_processes={cfg.num_processes}; MFU is measured on one device: "
            "--set num_processes=1"
        )
    if cfg.max_steps <= warmup_steps + 2:
        raise ValueError(
            f"bench mfu: max_steps={cfg.max_steps} leaves fewer than 3 steps after the "
            f"{warmup_steps} warm-up steps; use max_steps={warmup_steps + 10} or more"
        )
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        result = launch(cfg.replace(runs_dir=tmp, run_name="mfu"), progress=False)
        times = (read_json(result.dir.timings_path) or {}).get("step_time_s") or []
        summary = result.summary
    steady = times[warmup_steps:]
    if not steady:
        raise RuntimeError(
            f"bench mfu: the run recorded {len(times)} step times, none after the warm-up"
        )
    step_s = statistics.median(steady)
    flops_per_sample, tokens_per_sample = _counts(cfg)
    flops_per_step = flops_per_sample * cfg.global_batch_size
    peak, source, on_target = _peak(cfg)
    tokens = cfg.global_batch_size * tokens_per_sample / step_s
    report = MfuReport(
        device=summary.get("device", "?"),
        config=cfg.to_dict(),
        steps=len(steady),
        step_time_s=step_s,
        tokens_per_s=tokens,
        flops_per_step=flops_per_step,
        peak_flops=peak,
        peak_source=source,
        mfu=flops_per_step / step_s / peak if peak else None,
        target=TARGET if on_target else None,
    )
    if json_path is not None:
        write_result(json_path, {**asdict(report), "passed": report.passed})
    return report


def _counts(cfg: RunConfig) -> tuple[float, int]:
    """The task's training FLOPs and tokens per sample, counted on a model built on the meta device
    (no memory)."""
    import torch

    from workbench.tasks import get_task

    task = get_task(cfg.task)
    with torch.device("meta"):
        model = task.build_model(cfg)
    flops = task.flops_per_sample(cfg, model)
    if not flops:
        raise ValueError(
            f"bench mfu: task {cfg.task!r} does not count its FLOPs (Task.flops_per_sample); "
            "use a task that does, e.g. char-gpt"
        )
    return flops, task.tokens_per_sample(cfg) or 0


def _peak(cfg: RunConfig) -> tuple[float | None, str, bool]:
    """(peak FLOP/s, where it comes from, whether the target applies) for the device the run trained
    on."""
    from workbench.estimator.catalog import lookup, peak_flops, this_machine
    from workbench.utils.hardware import detect, resolve_device

    hw = detect()
    if hw.gpus and resolve_device(cfg, hw) == "cuda":
        name = hw.gpus[0].name
        # what the trainer's own MFU divides by
        peak = peak_flops(name, cfg.precision, tf32=cfg.tf32)
        if peak is None:
            return None, f"{name}: no catalog peak in {cfg.precision} to measure against", False
        accel = lookup(name)
        on_target = cfg.precision == "bf16" and accel.name.upper().startswith(TARGET_CLASSES)
        return (
            peak,
            f"{accel.name}'s dense {cfg.precision} peak from the catalog: {peak / 1e12:.0f} "
            "TFLOP/s",
            on_target,
        )
    machine = this_machine()
    peak = machine.peak(cfg.precision) or machine.peak("fp32")
    return peak, f"{machine.name}: its matmul rate measured here, {peak / 1e12:.3f} TFLOP/s", False
