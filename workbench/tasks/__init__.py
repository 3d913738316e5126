"""Tasks: what to train. `Task` is the base class; built-in tasks are `digits` and `char-gpt`."""

from __future__ import annotations

from workbench.tasks.base import Task
from workbench.tasks.registry import available, get_task, register_task

__all__ = ["Task", "available", "get_task", "register_task"]
