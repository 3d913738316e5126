"""The dtype a rank really computes in, probed on its first forward: proof that autocast is on (each
rank's summary reports it as compute_dtype)."""

from __future__ import annotations

from typing import Any

import torch


def first_leaf_dtype(model: torch.nn.Module, *, compiled: bool = False) -> dict[str, str]:
    """Record the dtype the first Linear/Conv actually computes in: proof that autocast is on.

    Returns a dict that a forward hook fills with 'dtype' on the first forward pass. Under
    torch.compile the probe is the last Linear/Conv (a head, outside the compiled blocks), and the
    hook does nothing while dynamo traces: a side effect there would break the graph, or keep a
    checkpointed block from compiling at all. A probe inside a compiled region records nothing (the
    dtype stays unknown rather than guessed).
    """
    seen: dict[str, str] = {}
    leaves = [
        m
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d))
    ]
    if not leaves:
        return seen
    leaf = leaves[-1] if compiled else leaves[0]

    def hook(_m: Any, _i: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if isinstance(out, torch.Tensor) and "dtype" not in seen:
            seen["dtype"] = str(out.dtype).removeprefix("torch.")
            handle.remove()

    handle = leaf.register_forward_hook(hook)
    return seen
