"""Weights digests: equal digests mean bit-identical tensors (the replica check, exported weights,
benches)."""

from __future__ import annotations

import hashlib

import torch


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors of a state dict, by name, bit for bit."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
