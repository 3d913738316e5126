"""FLOP formulas torch's FlopCounterMode lacks: the CPU attention kernels (a trace on the CPU would
count attention as zero FLOPs otherwise)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_sdpa(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


EXTRA_FLOP_FORMULAS = {
    op: formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward),
    )
    if (op := getattr(aten, name, None)) is not None
}
