"""Precision names: workbench's ('fp32', 'bf16', 'fp16', 'fp8') and what accelerate and torch call
them, and what fp8 training needs (torchao's Float8, training/parallel/float8.py)."""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from workbench.config.run_config import RunConfig

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise"]
NOT_TRAINED_YET: tuple[str, ...] = ()
"""Precisions named in a config (the estimator plans them) but refused at launch until workbench
trains them: the panel doesn't offer them (a config that has one shows it, marked). None today."""
FP8_INSTALL = "pip install 'workbench[fp8]'"
"""How to get torchao, which fp8 training runs on."""


def accelerate_mixed_precision(precision: str) -> str:
    """accelerate's `mixed_precision` value for a workbench precision ('fp32' is its 'no'). fp8 is
    'bf16' to accelerate: workbench swaps the Linear layers to torchao's Float8Linear itself and the
    rest computes in bf16 (accelerate's own 'fp8' picks and applies an fp8 backend of its own)."""
    return "no" if precision == "fp32" else "bf16" if precision == "fp8" else precision


def torchao_problem() -> str | None:
    """Why fp8 can't train for want of torchao here, or None when torchao.float8 imports."""
    try:
        import torchao.float8  # noqa: F401  (the import is the check)
    except ImportError as e:
        return f"fp8 trains with torchao's Float8, which doesn't import here ({e}); `{FP8_INSTALL}`"
    return None


def check_fp8_recipe(cfg: RunConfig) -> None:
    """fp8_recipe is read with precision='fp8' only: a recipe set with another is warned about."""
    if cfg.fp8_recipe != "tensorwise" and cfg.precision != "fp8":
        warnings.warn(
            f"fp8_recipe={cfg.fp8_recipe!r} with precision={cfg.precision!r}: the recipe "
            "applies to precision='fp8' only and does nothing here",
            stacklevel=4,
        )


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of a CPU matrix unit for bf16: x86's AVX512-BF16 and AMX (its 'flags'
line), Arm's BF16 extension (its 'Features' line). oneDNN runs bf16 matmuls on them at or above
fp32's rate; without one they are emulated."""
NO_BF16_UNIT_SLOWDOWN = 200
"""How much slower bf16 matmuls ran than fp32 on a CPU without a bf16 unit: measured 0.2 against
44.5 GFLOP/s on a 2-core AMD EPYC without avx512_bf16 (issue 47). The refusals quote it; an
estimate uses this machine's own measured rates instead (timing/cpu.py)."""


@functools.cache
def cpu_bf16_unit() -> bool | None:
    """Whether this machine's CPU has a bf16 matrix unit (BF16_CPU_FLAGS), read from its flags in
    /proc/cpuinfo; None where there is no /proc/cpuinfo to read (macOS, Windows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return bool(set(value.split()) & set(BF16_CPU_FLAGS))
    except OSError:
        return None
    return None


def cpu_precision_advice() -> str:
    """Which precision to use on this machine's CPU instead of one it can't run, and why, from its
    flags (cpu_bf16_unit): bf16 where it has a bf16 matrix unit, else fp32, bf16 being emulated and
    about NO_BF16_UNIT_SLOWDOWN times slower there (a figure measured on such a CPU, not here)."""
    unit = cpu_bf16_unit()
    if unit is None:
        return (
            "use fp32 (or bf16 where the CPU has a bf16 matrix unit, AVX512-BF16 or AMX: without "
            f"one bf16 runs ~{NO_BF16_UNIT_SLOWDOWN}x slower)"
        )
    if unit:
        return "use bf16 (this CPU has a bf16 matrix unit) or fp32"
    return (
        f"use fp32 (bf16 on this CPU has no matrix unit: ~{NO_BF16_UNIT_SLOWDOWN}x slower, from "
        "its flags)"
    )
