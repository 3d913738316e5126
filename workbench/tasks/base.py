"""Task: what to train. A task builds the model and datasets and computes the loss; the trainer does the rest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..suggest import did_you_mean

if TYPE_CHECKING:
    from ..config import RunConfig


class Task:
    """Base class for user and built-in tasks.

    Subclass it anywhere (a notebook cell included), then `wb.launch(cfg, task=MyTask())`, or decorate the
    class with `@wb.register_task` and name it in `RunConfig(task=...)`.
    """

    name: ClassVar[str] = "task"
    default_options: ClassVar[dict[str, Any]] = {}
    """Task options and their defaults; RunConfig.task_options may override these keys, no others."""

    def build_model(self, cfg: RunConfig) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_model(cfg) must return a torch.nn.Module")

    def build_datasets(self, cfg: RunConfig) -> tuple[Any, Any | None]:
        raise NotImplementedError(f"{type(self).__name__}.build_datasets(cfg) must return (train, eval or None)")

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor | tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.loss(model, batch) must return a scalar tensor")

    # Optional hooks ------------------------------------------------------------------------------------
    def collate_fn(self, cfg: RunConfig) -> Any:
        """DataLoader collate function; None uses PyTorch's default."""
        return None

    def tokens_per_sample(self, cfg: RunConfig) -> int | None:
        """Tokens in one sample, for token tasks (tokens/s); None for others."""
        return None

    def flops_per_sample(self, cfg: RunConfig, model: torch.nn.Module) -> float | None:
        """Training FLOPs (forward + backward) per sample, for MFU on GPUs; None when unknown."""
        return None

    def shard_units(self, model: torch.nn.Module) -> list[torch.nn.Module] | None:
        """Submodules to shard (zero2/zero3/hsdp) and checkpoint (activation_checkpointing) as units, in
        forward order; the root is always a unit on top. None means the repeated blocks (children of a
        ModuleList). Tied parameters must sit in one unit (or both in the root)."""
        return None

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        """default_options overridden by cfg.task_options."""
        return {**self.default_options, **cfg.task_options}

    def check_options(self, cfg: RunConfig) -> None:
        """Reject task_options keys this task doesn't know, naming the ones it does."""
        unknown = sorted(set(cfg.task_options) - set(self.default_options))
        if unknown:
            known = ", ".join(sorted(self.default_options)) or "(none)"
            hints = "".join(did_you_mean(k, self.default_options) for k in unknown)
            raise ValueError(f"task_options: unknown key(s) {unknown} for task {self.name!r}; known: {known}{hints}")
