"""`workbench bench overhead`: the trainer against a hand-written loop, side by side in one run, in
one layout (--mode): ddp (Accelerate), zero3 (FSDP2), tp (tensor parallel) or pp (pipeline, 1F1B);
hand_loops.py has them.

Both train the same model on the same data with the same seed, on the same number of forked ranks,
and are interleaved in pairs, which goes first alternating (A B, B A, ...), so machine noise hits
both alike. Reported: median step time of each after warm-up, the ratio, the overhead per step (the
median over the back-to-back pairs of their difference, so a machine that speeds up or slows down
between pairs doesn't count), and how far apart the final full weights are: bitwise equal, or their
largest difference. The verdict is on that median: a typical step. The mean step times are reported
beside it: they also carry what the trainer does every log_every steps (one all-gather, a metrics
row, the trackers) and at its last step (evaluation, the final checkpoint).
"""

from __future__ import annotations

import logging
import math
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from workbench.commands.bench.hand_loops import HAND_MODES, HandLoop, hand_loop, run_hand_loop
from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.config.preflight import preflight
from workbench.launcher.launch import launch
from workbench.utils.files import read_json
from workbench.utils.hardware import resolve_device

log = logging.getLogger("workbench")
WARMUP_STEPS = 10
WEIGHTS_RTOL = 1e-6
"""Weights that are not bitwise equal still match within this fraction of the largest weight's
magnitude."""

BENCH = RunConfig(
    task="digits",
    num_processes=2,
    device="cpu",
    precision="fp32",
    micro_batch_size=64,
    max_steps=200,
    lr=1e-3,
    warmup_steps=10,
    weight_decay=0.01,
    log_every=10,
    seed=0,
    task_options={"hidden": 512},
)
"""ddp's run: an MLP on digits."""
LAYOUT_BENCH = BENCH.replace(
    task="char-gpt", micro_batch_size=8, eval_batches=2, task_options={"preset": "tiny"}
)
"""zero3's, tp's and pp's run: char-gpt 'tiny', whose two blocks are shard units and pipeline stages
and which has a TP plan; its evaluation at the end (in the trainer's last step only) is held to 2
batches."""
HAND_LOOPS_LEAVE_OUT = {
    "precision": "fp32",
    "compile": "off",
    "activation_checkpointing": "none",
    "cpu_offload": False,
    "grad_compression": "none",
}
"""What the hand-written zero3, tp and pp loops don't do: a run must leave these as they are."""


def bench_config(
    mode: str, num_processes: int, steps: int, cfg: RunConfig | None = None
) -> RunConfig:
    """The run `mode` is measured on (cfg, default BENCH for ddp and LAYOUT_BENCH otherwise), laid
    out as its hand-written loop is: all ranks data-parallel (ddp, zero3), one TP group (tp), or one
    pipeline (pp: 1F1B, at least a micro-batch per stage)."""
    if mode not in HAND_MODES:
        raise ValueError(
            f"mode={mode!r}: the overhead bench has hand-written loops for {', '.join(HAND_MODES)}"
        )
    base = cfg or (BENCH if mode == "ddp" else LAYOUT_BENCH)
    layouts = {
        "ddp": {},
        "zero3": {"parallelism": "zero3"},
        "tp": {"tp": num_processes},
        "pp": {
            "pp": num_processes,
            "pp_schedule": "1f1b",
            "grad_accum_steps": max(base.grad_accum_steps, num_processes),
        },
    }
    out = base.replace(
        max_steps=steps,
        num_processes=num_processes,
        **{"parallelism": "ddp", "tp": 1, "pp": 1, **layouts[mode]},
    )
    differs = [
        f"{k}={getattr(out, k)!r}"
        for k, v in HAND_LOOPS_LEAVE_OUT.items()
        if getattr(out, k) != v and not (mode == "ddp" and k == "precision")
    ]
    if differs:
        raise ValueError(
            f"mode={mode!r}: the hand-written loop doesn't do {', '.join(differs)}; leave "
            f"{', '.join(f'{k}={v!r}' for k, v in HAND_LOOPS_LEAVE_OUT.items())}"
        )
    return out


@dataclass
class OverheadReport:
    steps: int
    num_processes: int
    repeats: int
    trainer_median_s: float
    hand_median_s: float
    trainer_mean_s: float
    hand_mean_s: float
    ratio: float
    overhead_ms: float
    budget_ms: float
    weights_equal: bool
    """Bitwise: every digest of the trainer's weights (summary, each replica) is the hand loop's."""
    device: str
    log_every: int
    mode: str = "ddp"
    task: str = "digits"
    weights_max_abs_diff: float = 0.0
    """Largest |trainer - hand| over the full weights (the trainer's model.safetensors), worst
    pair."""
    weights_max_abs: float = 0.0
    """Largest |weight| of the trainer's, the scale WEIGHTS_RTOL is a fraction of."""

    @property
    def weights_match(self) -> bool:
        return (
            self.weights_equal or self.weights_max_abs_diff <= WEIGHTS_RTOL * self.weights_max_abs
        )

    @property
    def passed(self) -> bool:
        return self.weights_match and self.overhead_ms <= self.budget_ms

    def weights_line(self) -> str:
        line = (
            f"  weights bitwise equal: {self.weights_equal} (max abs difference "
            f"{self.weights_max_abs_diff:.3g}"
        )
        if self.weights_equal:
            return line + ")"
        within = "within" if self.weights_match else "BEYOND"
        return line + (
            f"; {within} the tolerance {WEIGHTS_RTOL:g} x max |w| = "
            f"{WEIGHTS_RTOL * self.weights_max_abs:.3g})"
        )

    def table(self) -> str:
        return "\n".join(
            [
                (
                    f"workbench bench overhead --mode {self.mode}: {self.task}, "
                    f"{self.num_processes} ranks on {self.device}, {self.steps} steps x "
                    f"{self.repeats} repeats, median after {WARMUP_STEPS} warm-up steps"
                ),
                f"  hand-written loop   {self.hand_median_s * 1e3:8.3f} ms/step",
                f"  workbench trainer   {self.trainer_median_s * 1e3:8.3f} ms/step",
                f"  ratio               {self.ratio:8.4f}",
                (
                    f"  means               {self.hand_mean_s * 1e3:8.3f} / "
                    f"{self.trainer_mean_s * 1e3:.3f} ms/step (hand / trainer; the trainer's "
                    f"include its logging steps, every {self.log_every}, and its last)"
                ),
                (
                    f"  overhead            {self.overhead_ms:8.3f} ms/step, median of the "
                    f"{self.repeats} back-to-back pairs' differences (budget 1% + 1 ms = "
                    f"{self.budget_ms:.3f} ms)"
                ),
                self.weights_line(),
                f"  verdict: {'PASS' if self.passed else 'FAIL'}",
            ]
        )


@dataclass
class _Side:
    """One side of a pair: its step times after warm-up, its weights' digests, its full weights."""

    times: list[float]
    digests: set[str]
    weights: dict[str, torch.Tensor]
    final_loss: float | None = None
    """The loss of the last logging window (the trainer's last metrics row), where the side reports
    one."""


def _trainer(cfg: RunConfig, tmp: str, i: int) -> _Side:
    from safetensors.torch import load_file

    result = launch(cfg.replace(runs_dir=tmp, run_name=f"trainer-{i}"))
    summary = result.summary
    digests = {
        d
        for d in [summary.get("weights_sha256"), *(r["weights_sha256"] for r in summary["ranks"])]
        if d
    }
    return _Side(
        read_json(result.dir.timings_path)["step_time_s"][WARMUP_STEPS:],
        digests,
        load_file(str(result.dir.weights_path)),
        summary.get("final_loss"),
    )


def _hand(cfg: RunConfig, tmp: str, i: int, mode: str, loop: HandLoop = hand_loop) -> _Side:
    hand_dir = Path(tmp, f"hand-{i}")
    hand_dir.mkdir()
    out = run_hand_loop(cfg, str(hand_dir), mode, loop)
    return _Side(
        out["step_time_s"][WARMUP_STEPS:],
        {out["weights_sha256"]},
        torch.load(out["weights"], weights_only=True),
        out.get("final_loss"),
    )


def weights_difference(
    trainer: dict[str, torch.Tensor], hand: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(largest |trainer - hand|, largest |trainer|) over the tensors; inf when their names or
    shapes differ."""
    if trainer.keys() != hand.keys() or any(trainer[k].shape != hand[k].shape for k in trainer):
        return math.inf, 0.0
    diff = max(
        (
            float((trainer[k].double() - hand[k].double()).abs().max())
            for k in trainer
            if trainer[k].numel()
        ),
        default=0.0,
    )
    scale = max((float(t.double().abs().max()) for t in trainer.values() if t.numel()), default=0.0)
    return diff, scale


def overhead(
    steps: int = 200,
    repeats: int = 9,
    num_processes: int = 2,
    cfg: RunConfig | None = None,
    json_path: Path | None = None,
    mode: str = "ddp",
    device: str | None = None,
) -> OverheadReport:
    """Measure the trainer's per-step overhead over a hand-written loop of `mode` (see module
    docstring); `device` (cpu, cuda, auto) replaces the config's, which is the CPU by default."""
    cfg = bench_config(mode, num_processes, steps, cfg)
    if device is not None:
        cfg = cfg.replace(device=device)
    preflight(cfg)
    if steps <= WARMUP_STEPS:
        raise ValueError(f"steps={steps}: must exceed the {WARMUP_STEPS} warm-up steps")
    pairs = run_pairs(cfg, repeats, mode)
    report = pairs_report(pairs, cfg, steps, repeats, num_processes, mode)
    if json_path is not None:
        write_result(json_path, {**asdict(report), "passed": report.passed})
    return report


@dataclass
class _Pairs:
    """What the back-to-back pairs measured, all together."""

    trainer_times: list[float] = field(default_factory=list)
    hand_times: list[float] = field(default_factory=list)
    paired: list[float] = field(default_factory=list)
    """Each pair's difference of median step times, trainer's less the hand loop's."""
    digests: set[str] = field(default_factory=set)
    diff: float = 0.0
    """Largest |trainer - hand| over the full weights, worst pair."""
    scale: float = 0.0
    """Largest |weight| of the trainer's, any pair."""
    final_losses: list[tuple[float | None, float | None]] = field(default_factory=list)
    """Each pair's final losses, (trainer's, hand loop's): None where a side reports none."""

    def add(self, i: int, t: _Side, h: _Side) -> None:
        self.trainer_times += t.times
        self.hand_times += h.times
        # Each pair ran back to back: their difference is free of the machine's drift between
        # pairs.
        self.paired.append(statistics.median(t.times) - statistics.median(h.times))
        log.debug(
            "pair %d (%s first): %+.3f ms", i, "hand" if i % 2 else "trainer", 1e3 * self.paired[-1]
        )
        self.digests |= t.digests | h.digests
        self.final_losses.append((t.final_loss, h.final_loss))
        pair_diff, pair_scale = weights_difference(t.weights, h.weights)
        self.diff, self.scale = max(self.diff, pair_diff), max(self.scale, pair_scale)


def run_pairs(cfg: RunConfig, repeats: int, mode: str, loop: HandLoop = hand_loop) -> _Pairs:
    """`repeats` pairs of runs, the trainer's and the hand loop's (`loop`, default the one of
    `mode`), back to back."""
    pairs = _Pairs()
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for i in range(repeats):
            # Alternate which goes first: the second of a pair may find the machine warmer (or
            # busier).
            if i % 2 == 0:
                t, h = _trainer(cfg, tmp, i), _hand(cfg, tmp, i, mode, loop)
            else:
                h = _hand(cfg, tmp, i, mode, loop)
                t = _trainer(cfg, tmp, i)
            pairs.add(i, t, h)
    return pairs


def pairs_report(
    pairs: _Pairs, cfg: RunConfig, steps: int, repeats: int, num_processes: int, mode: str
) -> OverheadReport:
    """The pairs' medians and means, the overhead (the median of the pairs' differences) against
    its budget (1% of the hand loop's step + 1 ms), and how far apart the weights ended."""
    tm, hm = statistics.median(pairs.trainer_times), statistics.median(pairs.hand_times)
    return OverheadReport(
        steps=steps,
        num_processes=num_processes,
        repeats=repeats,
        trainer_median_s=tm,
        hand_median_s=hm,
        trainer_mean_s=statistics.fmean(pairs.trainer_times),
        hand_mean_s=statistics.fmean(pairs.hand_times),
        ratio=tm / hm,
        overhead_ms=statistics.median(pairs.paired) * 1e3,
        budget_ms=0.01 * hm * 1e3 + 1.0,
        weights_equal=len(pairs.digests) == 1,
        device=resolve_device(cfg),
        log_every=cfg.log_every,
        mode=mode,
        task=str(cfg.task),
        weights_max_abs_diff=pairs.diff,
        weights_max_abs=pairs.scale,
    )
