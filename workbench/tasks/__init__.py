"""Tasks: what to train. `Task` is the base class; built-in tasks are `digits` and `char-gpt`."""

from __future__ import annotations

from .base import Task
from .registry import available, get_task, register_task

__all__ = ["Task", "available", "get_task", "register_task"]
