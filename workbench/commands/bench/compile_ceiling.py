"""The most any compiler could speed a step up: the step's matrix-multiply FLOPs on one rank, at the
best rate this device multiplies matrices, is a time no compiled step goes below (compiling fuses
the other ops; it doesn't remove FLOPs). `workbench bench compile` reports it per layout beside the
measured speed-up.

FLOPs are counted by PyTorch's FlopCounterMode over one forward and backward of a micro-batch, the
CPU attention kernels with the estimator's formulas, halved when causal (the kernels skip the masked
blocks), spread over the ranks as the layout spreads the global batch. The rate: on a GPU, the
catalog's dense peak for the precision; on a CPU, the best of a few large square matmuls timed here
with the threads a rank gets (one when forked, its share of the cores when spawned), while no rank
runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from workbench.config import RunConfig
from workbench.estimator.trace.flops import EXTRA_FLOP_FORMULAS
from workbench.tasks import get_task
from workbench.utils.hardware import detect, resolve_device

_SIZE, _REPEATS = 2048, 5
_IS_CAUSAL_AT = {
    "_scaled_dot_product_flash_attention_for_cpu": 4,
    "_scaled_dot_product_flash_attention_for_cpu_backward": 7,
}
"""Where is_causal sits among each CPU attention kernel's arguments (the tensors counted)."""


@dataclass(frozen=True)
class Floor:
    flops_per_sample: float
    """Matrix-multiply FLOPs of one sample's forward and backward, as FlopCounterMode counts
    them."""
    rate: float
    """FLOP/s one rank reaches at best: measured (CPU) or the datasheet's (GPU)."""
    rate_source: str

    def step_ms(self, global_batch: int, ranks: int) -> float:
        """The step's matmul time on one rank if every multiply ran at `rate` (the global batch
        spread evenly)."""
        return 1e3 * self.flops_per_sample * global_batch / ranks / self.rate


def matmul_floor(cfg: RunConfig, threads: int = 1) -> Floor:
    """The floor of `cfg`'s step on a rank multiplying matrices with `threads` CPU threads (ignored
    on a GPU)."""
    return Floor(_flops_per_sample(cfg), *_rate(cfg, threads))


def _flops_per_sample(cfg: RunConfig) -> float:
    task, size = get_task(cfg.task), int(cfg.micro_batch_size)
    task.options(cfg)
    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg)
    train, _ = task.build_datasets(cfg)
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=size)))
    with FlopCounterMode(display=False, custom_mapping=_attention_formulas()) as counter:
        loss = task.loss(model, batch)
        (loss[0] if isinstance(loss, tuple) else loss).backward()
    return counter.get_total_flops() / size


def _attention_formulas() -> dict[object, object]:
    def causal_half(formula: Any, at: int) -> Any:
        def count(*args: Any, **kwargs: Any) -> int:
            causal = kwargs.get("is_causal", args[at] if len(args) > at else False)
            return formula(*args, **kwargs) // (2 if causal else 1)

        return count

    return {
        op: causal_half(formula, _IS_CAUSAL_AT[op.__name__.split(".")[0]])
        for op, formula in EXTRA_FLOP_FORMULAS.items()
    }


def _rate(cfg: RunConfig, threads: int) -> tuple[float, str]:
    hw = detect()
    if resolve_device(cfg, hw) == "cuda" and hw.gpus:
        from workbench.estimator.catalog import peak_flops

        peak = peak_flops(hw.gpus[0].name, cfg.precision, tf32=cfg.tf32)
        if peak:
            return peak, f"{hw.gpus[0].name}'s datasheet peak ({cfg.precision})"
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(_SIZE, _SIZE, dtype=dtype), torch.randn(_SIZE, _SIZE, dtype=dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(_REPEATS):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    name = "bf16" if dtype is torch.bfloat16 else "fp32"
    on = "one CPU thread" if threads == 1 else f"{threads} CPU threads"
    return 2.0 * _SIZE**3 / best, f"{name} {_SIZE}x{_SIZE} matmul on {on}, best of {_REPEATS}"
