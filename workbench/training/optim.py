"""The optimizer and its learning-rate schedule."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

log = logging.getLogger("workbench")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings, not biases or norm gains (GPT-2/nanoGPT convention)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def all_on_cuda(model: torch.nn.Module) -> bool:
    """Every trainable parameter lives on a CUDA device: AdamW's fused kernel (one launch for all of
    them) applies. Parameters offloaded to the CPU, or a CPU run, keep the default foreach
    kernels."""
    params = [p for p in model.parameters() if p.requires_grad]
    return bool(params) and all(p.device.type == "cuda" for p in params)


def build_optimizer(
    model: torch.nn.Module, cfg: RunConfig, task: Task | None = None
) -> torch.optim.Optimizer:
    """The task's optimizer (Task.configure_optimizers) or AdamW (fused when every parameter is on a
    GPU); every param group remembers its lr as the peak (`initial_lr`, PyTorch's schedulers' key)
    that the schedule scales."""
    optimizer = task.configure_optimizers(model, cfg) if task is not None else None
    if optimizer is None:
        optimizer = torch.optim.AdamW(
            param_groups(model, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=all_on_cuda(model) or None,
        )
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{type(task).__name__}.configure_optimizers returned {type(optimizer).__name__}: "
            "return a torch.optim.Optimizer over the model's parameters, or None for AdamW"
        )
    else:
        given = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in given]
        if missing:
            log.warning(
                "%s.configure_optimizers leaves %d trainable parameter(s) out (%s): they will not "
                "be updated",
                type(task).__name__,
                len(missing),
                ", ".join(missing[:3]),
            )
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, scale: float) -> float:
    """Every param group's lr = its peak (`initial_lr`) x `scale`; returns the first group's, for
    the log."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"]) * scale
    return float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0
