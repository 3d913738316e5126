"""The default learning-rate schedule: linear warm-up, then cosine decay (a leaf module: tasks use
it too)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.config import RunConfig


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then cosine down to
    lr*min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.max_steps - cfg.warmup_steps - 1
    if decay_steps <= 0:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)
