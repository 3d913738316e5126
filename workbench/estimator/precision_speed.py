"""How fast the same plan runs in the other precisions its target supports, for the estimate's time
verdict (report.py's Estimate.time_verdict).

The traced step is priced again with another precision: the FLOPs and the ops don't change with
precision, the rate they run at does. On this machine's CPU the rates are measured (the machine
profile's matmuls per dtype, timing/cpu.py); on a catalog GPU they are the datasheet peaks at the
catalog's efficiency (timing/gpu.py). The ratio of the two priced computes scales the estimate's
own compute (learning from past runs included); its exposed communication stays as it is.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.config import precision as precisions
from workbench.estimator.timing.gpu import matmul_precision
from workbench.estimator.timing.step import cpu_profile, raw_step

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.estimator.catalog import Accelerator
    from workbench.estimator.report import Estimate
    from workbench.estimator.trace.step import StepTrace

log = logging.getLogger("workbench")

CANDIDATES = ("fp32", "bf16", "fp16")
"""The precisions a plan is compared in (fp8 is a choice of its own: its hardware, its recipe)."""


@dataclass(frozen=True)
class PrecisionSpeed:
    """The same plan's step in another precision."""

    precision: str
    step_s: float
    why: str
    """What the difference rests on: 'bf16 matmuls at 0.2 against 44.5 GFLOP/s fp32, measured
    here; no bf16 matrix unit in the CPU's flags' or 'datasheet peaks: 67 TFLOP/s fp32 against 989
    bf16'."""


def supported(target: Accelerator) -> list[str]:
    """The precisions of CANDIDATES the target trains in: on a CPU fp32 and bf16 (fp16 is refused
    there), on a GPU those its catalog entry lists a peak for."""
    if target.kind == "cpu":
        return ["fp32", "bf16"]
    return [p for p in CANDIDATES if target.peak(p) is not None]


def other_precisions(
    cfg: RunConfig, trace: StepTrace, est: Estimate, network: str
) -> list[PrecisionSpeed]:
    """`est`'s plan (`cfg`, traced as `trace`) in each other precision its target supports,
    fastest first."""
    if cfg.precision not in CANDIDATES:
        return []
    target = est.target
    here = _compute_s(cfg, trace, target, est.nodes, network)
    if here <= 0:
        return []
    busy = max(0.0, est.step_s - est.exposed_comm_s)
    out = []
    for precision in supported(target):
        if precision == cfg.precision:
            continue
        try:
            # the changed config is a what-if, never run: its own warnings (fp8_recipe without
            # fp8, say) are not the user's
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                other = cfg.replace(precision=precision)
        except ValueError as e:
            log.debug("estimate: no %s what-if for this plan: %s", precision, e)
            continue
        there = _compute_s(other, trace, target, est.nodes, network)
        step = busy * there / here + est.exposed_comm_s
        out.append(PrecisionSpeed(precision, step, _why(cfg, other, trace, target)))
    return sorted(out, key=lambda p: p.step_s)


def _compute_s(
    cfg: RunConfig, trace: StepTrace, target: Accelerator, nodes: int, network: str
) -> float:
    """The traced step's compute in cfg's precision, before learning (collectives left out: they
    don't change with it)."""
    return raw_step(cfg, trace, {}, target, nodes, network)[0].compute_s


def _why(cfg: RunConfig, other: RunConfig, trace: StepTrace, target: Accelerator) -> str:
    """What the two precisions' speeds rest on: this CPU's measured matmul rates (and its bf16
    unit, from its flags), or the GPU's datasheet peaks."""
    if target.kind == "cpu":
        profile = cpu_profile(cfg, trace.world)

        def rate(precision: str) -> float:
            dtype = "bf16" if precision == "bf16" else "fp32"
            rows = profile.matmul.get(dtype) or profile.matmul["fp32"]
            return max(r for _, r in rows) / 1e9

        words = (
            f"{cfg.precision} matmuls at {_digits(rate(cfg.precision))} against "
            f"{_digits(rate(other.precision))} GFLOP/s {other.precision}, measured here"
        )
        if precisions.cpu_bf16_unit() is False:
            words += "; no bf16 matrix unit (AVX512-BF16, AMX) in the CPU's flags"
        return words
    mine, theirs = matmul_precision(cfg, target), matmul_precision(other, target)
    return (
        f"datasheet peaks: {_digits(target.peak_flops[mine] / 1e12)} TFLOP/s {mine} against "
        f"{_digits(target.peak_flops[theirs] / 1e12)} {theirs}"
        + (", tf32 off" if cfg.precision == "fp32" and not cfg.tf32 and mine == "fp32" else "")
    )


def _digits(x: float) -> str:
    """Three significant digits, without an exponent: '0.2', '44.5', '989'."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
