"""Measurements shared by the trainer and benchmarks: memory, weights digests, model FLOPs utilisation."""

from __future__ import annotations

import hashlib
import resource
import sys

import torch

# Dense peak FLOP/s per GPU by (name fragment, precision): vendor datasheets, no sparsity.
_PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
]


def peak_flops(gpu_name: str, precision: str) -> float | None:
    """The datasheet peak for this GPU and precision, or None when the GPU isn't in the table."""
    for fragment, table in _PEAK_FLOPS:
        if fragment in gpu_name:
            return table.get(precision)
    return None


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
