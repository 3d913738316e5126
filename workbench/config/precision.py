"""Precision names: workbench's ('fp32', 'bf16', 'fp16', 'fp8') and what accelerate and torch call them."""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "bf16", "fp16", "fp8"]


def accelerate_mixed_precision(precision: str) -> str:
    """accelerate's `mixed_precision` value for a workbench precision ('fp32' is its 'no')."""
    return "no" if precision == "fp32" else precision
