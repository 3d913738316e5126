"""Task names: the built-in tasks, the ones users register, and 'package.module:ClassName' import
paths."""

from __future__ import annotations

import importlib
from typing import Any

from workbench.tasks.base import Task
from workbench.utils.suggest import did_you_mean

BUILTIN: dict[str, str] = {
    "digits": "workbench.tasks.digits:DigitsTask",
    "char-gpt": "workbench.tasks.char_gpt:CharGPTTask",
    "hf-causal-lm": "workbench.tasks.hf.causal_lm:CausalLMTask",
    "hf-sequence-classification": "workbench.tasks.hf.classification:SequenceClassificationTask",
}
"""Built-in tasks by import path: imported when first asked for, so `import workbench` stays
light."""

_REGISTRY: dict[str, type[Task] | Task] = {}


def register_task(cls_or_obj: Any) -> Any:
    """Register a Task subclass (or instance) under its `name`; usable as a decorator."""
    name = getattr(cls_or_obj, "name", None)
    if not isinstance(name, str) or not name or name == Task.name:
        raise ValueError(
            f"register_task: {cls_or_obj!r} needs a class attribute `name`, e.g. name = 'my-task'"
        )
    _REGISTRY[name] = cls_or_obj
    return cls_or_obj


def available() -> list[str]:
    return sorted({*BUILTIN, *_REGISTRY})


def _import(path: str, name: str) -> Task:
    module_name, _, attr = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"task={name!r}: cannot import it ({e}); check the module path and class name"
        ) from e
    task = obj() if isinstance(obj, type) else obj
    if not isinstance(task, Task):
        raise ValueError(f"task={name!r}: {attr} is not a workbench.Task subclass")
    return task


def get_task(name: str) -> Task:
    """A fresh Task for a registered name, a built-in one, or an import path
    'package.module:ClassName'."""
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return entry() if isinstance(entry, type) else entry
    if name in BUILTIN:
        return _import(BUILTIN[name], name)
    if ":" in name:
        return _import(name, name)
    raise ValueError(
        f"task={name!r}: unknown task{did_you_mean(name, available())}. Known tasks: "
        f"{', '.join(available())}; or pass task=YourTask() to launch(), or register it with "
        "@wb.register_task"
    )
