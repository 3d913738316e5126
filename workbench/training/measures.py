"""Measurements shared by the trainer and benchmarks: memory, weights digests, model FLOPs utilisation."""

from __future__ import annotations

import hashlib
import resource
import sys

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: max allocated by PyTorch on this device; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer, bit for bit: equal digests mean identical weights."""
    return state_digest(model.state_dict())


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors of a state dict, by name, bit for bit."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
