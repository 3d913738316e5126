"""A rank's peak memory, as its metrics rows and summary report it."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by PyTorch on this device; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)
