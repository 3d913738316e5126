"""The model's blocks: which submodules are sharded (zero2/zero3/hsdp) and activation-checkpointed
as one unit.

Kept outside training/ so that the preflight checks (config/preflight.py) can look at a model built
on the meta device without importing the trainer."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from workbench.training.parallel.apply import ParallelPlan


def default_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of every ModuleList, and of Sequentials made of one repeated
    class."""
    units: list[nn.Module] = []
    for module in model.modules():
        children = list(module.children())
        repeated = isinstance(module, nn.ModuleList) or (
            isinstance(module, nn.Sequential)
            and len(children) > 1
            and len({type(c) for c in children}) == 1
        )
        if repeated:
            units += [c for c in children if any(True for _ in c.parameters())]
    # A unit inside another unit is sharded by the outer one's own fully_shard call order; keep
    # outermost only.
    inner = {id(m) for u in units for m in u.modules() if m is not u}
    return [u for u in units if id(u) not in inner]


def shard_units(model: nn.Module, task: ParallelPlan) -> list[nn.Module]:
    """Task.shard_units(model) (or another ParallelPlan's) when the task defines it, else the
    repeated blocks; never the root itself."""
    units = task.shard_units(model)
    if units is None:
        return default_units(model)
    owned = {id(m) for m in model.modules()}
    for unit in units:
        if unit is model or id(unit) not in owned:
            raise ValueError(
                f"{getattr(task, 'owner', type(task).__name__)}.shard_units returned "
                f"{type(unit).__name__}, which is "
                + (
                    "the model itself (the root is always a unit; return its blocks)"
                    if unit is model
                    else "not a submodule of the model"
                )
            )
    return list(units)


def _selective_policy() -> object:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    )
    keep = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def checkpoint_units(model: nn.Module, units: list[nn.Module], mode: str) -> list[nn.Module]:
    """Wrap each unit for activation checkpointing ('full' or 'selective'), in place; returns the
    wrappers."""
    if mode == "none":
        return units
    if not units:
        raise ValueError(
            f"activation_checkpointing={mode!r}: the model has no repeated blocks to checkpoint "
            "(no ModuleList of blocks); define Task.shard_units(model) to name them, or set "
            "activation_checkpointing='none'"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    parent_of = {
        id(child): (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
    }
    kwargs = {"context_fn": _selective_policy()} if mode == "selective" else {}
    wrapped = []
    for unit in units:
        parent, name = parent_of[id(unit)]
        wrapper = checkpoint_wrapper(unit, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        setattr(parent, name, wrapper)
        wrapped.append(wrapper)
    return wrapped
