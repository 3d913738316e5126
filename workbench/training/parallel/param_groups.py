"""Optimizer param groups split by mesh, and merged back for checkpoints.

foreach and fused optimizer kernels refuse a group that mixes plain tensors with DTensors, or
DTensors of different meshes (tensor parallelism with FSDP leaves some parameters unsplit), so such
a layout splits each group by mesh; checkpoints hold the task's own grouping, so any layout loads
them (Strategy.state_dict and Strategy.load merge and split again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def split_groups_by_mesh(optimizer: torch.optim.Optimizer) -> list[int]:
    """Split each param group so plain tensors and DTensors of each mesh sit in groups of their own
    (foreach and fused kernels refuse a mix); returns, per new group, the index of the group it came
    from."""
    origin, groups = [], []
    for index, group in enumerate(optimizer.param_groups):
        parts: dict[Any, list[torch.Tensor]] = {}
        for p in group["params"]:
            parts.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        for params in parts.values():
            groups.append({**group, "params": params})
            origin.append(index)
    optimizer.param_groups[:] = groups
    return origin


def merge_split_groups(
    groups: list[dict[str, Any]], origin: list[int] | None
) -> list[dict[str, Any]]:
    """Param groups split by mesh (split_groups_by_mesh) merged back to the task's grouping;
    `origin[i]` is the task's group that split group i came from (None: not split)."""
    if origin is None:
        return groups
    merged: dict[int, dict[str, Any]] = {}
    for index, group in zip(origin, groups):
        if index in merged:
            merged[index]["params"] = [*merged[index]["params"], *group["params"]]
        else:
            merged[index] = dict(group)
    return [merged[i] for i in sorted(merged)]


def resplit_groups(
    split: list[dict[str, Any]],
    loaded: list[dict[str, Any]],
    origin: list[int] | None,
    name: Callable[[str], str] = str,
) -> list[dict[str, Any]]:
    """This optimizer's own (split) groups with the hyperparameters of the loaded groups that hold
    their parameters (`name`: a parameter's name as the loaded groups spell it)."""
    groups = []
    for index, group in enumerate(split):
        first = name(group["params"][0]) if group["params"] else None
        home = next(
            (g for g in loaded if first in g["params"]), loaded[origin[index] if origin else index]
        )
        hyper = {k: v for k, v in home.items() if k != "params"}
        groups.append({**hyper, "params": group["params"]})
    return groups
