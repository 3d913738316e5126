"""RunConfig: the one description of a run that the panel, CLI, papermill and run directory share."""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from .files import atomic_write_text
from .hardware import Hardware, detect
from .precision import Precision
from .suggest import unknown_keys

Parallelism = Literal["none", "ddp"]
Device = Literal["auto", "cpu", "cuda"]

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Everything that determines a run. Validated on construction; `check()` adds this machine's limits."""

    task: str = "digits"
    """Registered task name (see `workbench.tasks.available()`) or an import path 'package.module:ClassName'."""
    num_processes: int = 1
    """Ranks to start on this machine: one per GPU, or CPU processes talking over gloo."""
    parallelism: Parallelism = "ddp"
    """'ddp' replicates the model and all-reduces gradients; 'none' is a single plain process."""
    precision: Precision = "fp32"
    """Compute precision: 'bf16'/'fp16' autocast (fp16 with dynamic loss scaling); 'fp8' is rejected for now."""
    device: Device = "auto"
    """'auto' picks CUDA when present, else CPU."""
    micro_batch_size: int = 32
    """Samples per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step; gradients are all-reduced only on the last one."""
    max_steps: int = 100
    """Optimizer steps to train for."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 0
    """Linear warm-up steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio on the last step."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (not biases or norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_every: int = 0
    """Evaluate every N steps (and at the end); 0 evaluates at the end only."""
    eval_batches: int = 0
    """Cap on eval micro-batches per rank; 0 uses the whole eval set."""
    log_every: int = 10
    """Write a metrics row (and check for a stop request) every N steps."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps; 0 saves only at the end (and on stop)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    seed: int = 0
    """Seeds model init, data order and dropout; same seed, same run."""
    runs_dir: str = "runs"
    """Directory holding run directories."""
    run_name: str | None = None
    """Run directory name under runs_dir; None makes '<task>-<timestamp>'."""
    resume: bool = False
    """Continue the run named run_name from its newest complete checkpoint."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    dist_timeout_s: int = 300
    """How long a collective may block before the run fails instead of hanging."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Task-specific settings, e.g. model size for char-gpt; unknown keys are rejected by the task."""

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_processes

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks: micro_batch_size x grad_accum_steps x world size."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def run_dir(self) -> Path | None:
        return Path(self.runs_dir) / self.run_name if self.run_name else None

    def resolved_device(self, hardware: Hardware | None = None) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if (hardware or detect()).has_cuda else "cpu"

    # ---- validation ----------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), _field_types()[f.name])
        positive = ("num_processes", "micro_batch_size", "grad_accum_steps", "max_steps", "log_every",
                    "keep_checkpoints", "dist_timeout_s")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be at least 1")
        for name in ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "num_workers", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be 0 or more")
        if not self.lr > 0 or self.lr > 10:
            raise ValueError(f"lr={self.lr!r}: must be a positive learning rate (typically 1e-5 to 1e-2)")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r}: must be 0 or more (0.1 is typical)")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip={self.grad_clip!r}: must be positive, or 0 to disable clipping")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio!r}: must be between 0 and 1")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps}: longer than max_steps={self.max_steps}; "
                             f"use at most {self.max_steps}")
        if self.parallelism == "none" and self.num_processes > 1:
            raise ValueError(f"parallelism='none' with num_processes={self.num_processes}: 'none' runs one "
                             "process; set parallelism='ddp' or num_processes=1")
        if self.run_name is not None and not _RUN_NAME.match(self.run_name):
            raise ValueError(f"run_name={self.run_name!r}: use letters, digits, '.', '_' and '-' only, "
                             "starting with a letter or digit")
        if self.resume and self.run_name is None:
            raise ValueError("resume=True needs run_name: the run directory to continue (runs_dir/run_name)")
        if not self.task:
            raise ValueError("task='': name a task, e.g. 'digits' or 'char-gpt'")

    def check(self, hardware: Hardware | None = None, task: Any = None) -> None:
        """Validate against this machine and the task (`task`, else the registry); ValueError before anything runs."""
        from .tasks import get_task  # tasks import config, so late

        hw = hardware or detect()
        if self.device == "cuda" and not hw.has_cuda:
            raise ValueError("device='cuda': no CUDA GPU is visible on this machine; use device='auto' or 'cpu'")
        device = self.resolved_device(hw)
        limit = hw.max_processes(device)
        if self.num_processes > limit:
            what = f"{limit} GPU(s)" if device == "cuda" else f"{limit} CPU core(s)"
            raise ValueError(f"num_processes={self.num_processes}: this machine has {what}; "
                             f"use num_processes={limit} or fewer")
        problem = hw.precision_problem(self.precision, device)
        if problem:
            raise ValueError(f"precision={self.precision!r} on {hw.describe(device)}: {problem}")
        (task or get_task(self.task)).check_options(self)

    # ---- copies and files ----------------------------------------------------------------------------
    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with `changes` applied; unknown field names are rejected."""
        _reject_unknown(changes, "RunConfig.replace()")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of RunConfig fields, got {type(data).__name__}")
        _reject_unknown(data, source)
        return cls(**data)

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """The config as YAML; written atomically to `path` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            atomic_write_text(Path(path), text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> RunConfig:
        """Load from YAML; unknown keys are rejected and listed, with the closest field names."""
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        return cls.from_dict(data, source=str(path))

    def with_overrides(self, assignments: list[str]) -> RunConfig:
        """Apply CLI-style 'key=value' strings (values parsed as YAML; 'task_options.n_layer=4' nests)."""
        data = self.to_dict()
        for item in assignments:
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ValueError(f"--set {item!r}: expected key=value, e.g. --set max_steps=200")
            value = _coerce(key, yaml.safe_load(raw) if raw.strip() else None)
            if "." in key:
                head, _, sub = key.partition(".")
                if head != "task_options":
                    raise ValueError(f"--set {item!r}: only task_options.<name> can be nested")
                data["task_options"] = {**data["task_options"], sub: value}
            else:
                _reject_unknown({key: value}, "--set")
                data[key] = value
        return RunConfig.from_dict(data, source="--set")


# ---- helpers -----------------------------------------------------------------------------------------
_TYPES: dict[str, Any] | None = None


def _field_types() -> dict[str, Any]:
    global _TYPES
    if _TYPES is None:
        _TYPES = typing.get_type_hints(RunConfig)
    return _TYPES


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "None")


def _check_type(name: str, value: Any, tp: Any) -> None:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in get_args(tp):
            raise ValueError(f"{name}={value!r}: choose one of {_type_name(tp)}")
        return
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return
        tp = next(a for a in get_args(tp) if a is not type(None))
        origin = typing.get_origin(tp)
    if origin is dict or tp is dict:
        ok = isinstance(value, dict)
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {_type_name(tp)}, got {type(value).__name__}")


def _coerce(key: str, value: Any) -> Any:
    """YAML reads '3e-4' as a string; CLI users mean a number when the field is a float."""
    tp = _field_types().get(key)
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _reject_unknown(data: dict[str, Any], source: str) -> None:
    known = [f.name for f in fields(RunConfig)]
    unknown = unknown_keys(data, known)
    if unknown:
        raise ValueError(f"{source}: unknown RunConfig key(s): {', '.join(unknown)}. Known keys: {', '.join(known)}")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
