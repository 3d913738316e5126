"""Precision names: workbench's ('fp32', 'bf16', 'fp16', 'fp8') and what accelerate and torch call them."""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
NOT_TRAINED_YET = ("fp8",)
"""Named in a config (the estimator plans it) but refused at launch until workbench trains it: the panel doesn't
offer it (a config that has it shows it, marked)."""


def accelerate_mixed_precision(precision: str) -> str:
    """accelerate's `mixed_precision` value for a workbench precision ('fp32' is its 'no')."""
    return "no" if precision == "fp32" else precision
