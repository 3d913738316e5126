"""Precision names: workbench's ('fp32', 'bf16', 'fp16', 'fp8') and what accelerate and torch call
them, and what fp8 training needs (torchao's Float8, training/parallel/float8.py)."""

from __future__ import annotations

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
