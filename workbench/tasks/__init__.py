"""Tasks: what to train. `Task` is the base class, `TaskOption` declares an option; built-in:
`digits`, `char-gpt`."""

from __future__ import annotations

from workbench.tasks.base import Task
from workbench.tasks.options import TaskOption
from workbench.tasks.registry import available, get_task, register_task

__all__ = ["Task", "TaskOption", "available", "get_task", "register_task"]
