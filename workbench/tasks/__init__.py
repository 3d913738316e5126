"""Tasks: what to train. A task builds the model and datasets and computes the loss; the trainer does the rest."""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..config import RunConfig

_REGISTRY: dict[str, type[Task] | Task] = {}


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

    def options(self, cfg: RunConfig) -> dict[str, Any]:
        """default_options overridden by cfg.task_options."""
        return {**self.default_options, **cfg.task_options}

    def check_options(self, cfg: RunConfig) -> None:
        """Reject task_options keys this task doesn't know, naming the ones it does."""
        unknown = sorted(set(cfg.task_options) - set(self.default_options))
        if unknown:
            known = ", ".join(sorted(self.default_options)) or "(none)"
            raise ValueError(f"task_options: unknown key(s) {unknown} for task {self.name!r}; known: {known}")


def register_task(cls_or_obj: Any) -> Any:
    """Register a Task subclass (or instance) under its `name`; usable as a decorator."""
    name = getattr(cls_or_obj, "name", None)
    if not isinstance(name, str) or not name or name == Task.name:
        raise ValueError(f"register_task: {cls_or_obj!r} needs a class attribute `name`, e.g. name = 'my-task'")
    _REGISTRY[name] = cls_or_obj
    return cls_or_obj


def available() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_task(name: str) -> Task:
    """A fresh Task for a registered name or an import path 'package.module:ClassName'."""
    _load_builtins()
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return entry() if isinstance(entry, type) else entry
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"task={name!r}: cannot import it ({e}); check the module path and class name") from e
        task = obj() if isinstance(obj, type) else obj
        if not isinstance(task, Task):
            raise ValueError(f"task={name!r}: {attr} is not a workbench.Task subclass")
        return task
    close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"task={name!r}: unknown task{hint}. Known tasks: {', '.join(sorted(_REGISTRY))}; "
                     "or pass task=YourTask() to launch(), or register it with @wb.register_task")


def _load_builtins() -> None:
    # Registration happens on import; Python imports each module once, however often this runs.
    from . import char_gpt, digits  # noqa: F401
