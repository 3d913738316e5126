"""summary.json: one schema (versioned) for how a run stands, and the statuses a run goes
through."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

SCHEMA_VERSION = 1
"""Bumped when a key changes meaning or type; readers accept older versions (missing keys are
None)."""


class Status(str, Enum):
    """Where a run stands. A str, so `summary["status"] == "completed"` keeps working."""

    STARTING = "starting"
    RUNNING = "running"
    COMPLETED = "completed"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    """A signal (SIGTERM, SIGHUP, preempt_signal) made the ranks checkpoint and exit: resume it."""
    DIVERGED = "diverged"
    """The loss or gradient norm became NaN/inf; no checkpoint was written after it."""
    FAILED = "failed"
    UNKNOWN = "unknown"
    """summary.json names a status this version doesn't know (a newer workbench wrote it, or it was
    edited): read as it is, never taken for another, and no ending is written over it."""

    @property
    def ended(self) -> bool:
        """After these, the run's files no longer change."""
        return self in ENDED

    def __str__(self) -> str:
        return self.value

    # Equal to its string, so hash like it too ('completed' in ENDED), whatever Enum's default on
    # this Python.
    __hash__ = str.__hash__


ENDED = frozenset(
    {Status.COMPLETED, Status.STOPPED, Status.PREEMPTED, Status.DIVERGED, Status.FAILED}
)
UNKNOWN_STATUS = "status_unknown"
"""Where Summary.extra keeps the status of a summary.json that names one this version doesn't
know."""
RESUMABLE = frozenset({Status.STOPPED, Status.PREEMPTED, Status.FAILED})
"""Endings a run can continue from (its newest complete checkpoint)."""


@dataclass(kw_only=True)
class Summary:
    """The content of summary.json. Rank 0 fills the launch and result fields; the launcher fills
    `error`."""

    schema_version: int = SCHEMA_VERSION
    """Version of this schema the file was written with."""
    status: Status = Status.STARTING
    """starting | running | completed | stopped | preempted | diverged | failed."""
    run_name: str | None = None
    """The run directory's name."""
    task: str | None = None
    """The task that ran (registered name or import path)."""
    started_at: float | None = None
    """Unix time this session of the run was launched."""
    wall_time_s: float | None = None
    """Seconds from launch to the last status change (start-up, eval and checkpoints included)."""
    world_size: int | None = None
    """Ranks over all machines."""
    parallelism: str | None = None
    tp: int | None = None
    """Tensor-parallel size (1: none)."""
    mesh: dict[str, int] | None = None
    """The rank layout as named dimension sizes: pp, dp_replicate, dp_shard, tp."""
    precision: str | None = None
    device: str | None = None
    """The devices in words, e.g. 'CPU (2 cores)' or '8 x NVIDIA H100 80GB HBM3'."""
    device_class: str | None = None
    """'cpu' or 'cuda-<model>': the key regression baselines are kept under."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks."""
    micro_batch_size: int | None = None
    """Samples per rank per forward/backward, as run (micro_batch_size='auto' resolved)."""
    grad_accum_steps: int | None = None
    n_params: int | None = None
    data: list[dict[str, Any]] = field(default_factory=list)
    """Datasets the run read: manifest name, version and sha256 per file."""
    steps: int | None = None
    """Optimizer steps done (over all sessions of a resumed run)."""
    steps_this_session: int | None = None
    final_loss: float | None = None
    """Mean training loss of the last logged window."""
    samples_per_s: float | None = None
    """Run average over this session's training time."""
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    """Max over ranks: CUDA max allocated, or peak RSS on CPU."""
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)
    skipped_steps: int | None = None
    """fp16 steps the loss scaler skipped (overflow)."""
    train_time_s: float | None = None
    """Time in training steps over all sessions."""
    mfu: float | None = None
    """Model FLOPs utilisation (GPUs with a known peak)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: pid, device, compute dtype, threads, peak memory, bytes held for parameters,
    gradients and optimizer state, weights sha256 (replicated modes)."""
    compile: dict[str, Any] | None = None
    """compile on: mode, backend, the first step's seconds (compiling), graphs, graph breaks by
    reason, recompilations and inductor's cache folder (rank 0's)."""
    checkpoints: dict[str, Any] | None = None
    """This session's checkpoints: whether written in the background (checkpoint_async) and why,
    and per checkpoint the seconds the training loop was blocked by it (stall_s)."""
    weights_sha256: str | None = None
    """sha256 of the full weights written to model.safetensors at the end of the session."""
    eval: dict[str, float] = field(default_factory=dict)
    """Final eval metrics, stored as top-level 'eval_<name>' keys."""
    error: dict[str, Any] | None = None
    """When failed: rank, type, message, traceback (and other_ranks)."""
    ending: dict[str, Any] | None = None
    """When preempted or diverged: the step, the signal or the non-finite value, the last good
    checkpoint."""
    attempt: int | None = None
    """Which launch of this run directory wrote the summary (1, then 2 after a resume or restart,
    ...)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version doesn't know (written by a newer workbench), kept on rewrite."""

    @property
    def status_text(self) -> str:
        """The status as summary.json says it: for an unknown one, the word written there."""
        if self.status is Status.UNKNOWN:
            return str(self.extra.get(UNKNOWN_STATUS))
        return self.status.value

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("eval", "extra"):
                continue
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, Status) else value
        out.update({k if k.startswith("eval_") else f"eval_{k}": v for k, v in self.eval.items()})
        extra = dict(self.extra)
        if UNKNOWN_STATUS in extra:
            written = extra.pop(UNKNOWN_STATUS)
            if self.status is Status.UNKNOWN:
                out["status"] = written
        return {**extra, **out}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Summary:
        data = dict(data or {})
        known = {f.name for f in fields(cls)} - {"eval", "extra"}
        kwargs: dict[str, Any] = {k: data.pop(k) for k in list(data) if k in known}
        kwargs["eval"] = {k: data.pop(k) for k in list(data) if k.startswith("eval_")}
        kwargs["extra"] = data
        try:
            kwargs["status"] = Status(kwargs.get("status", Status.STARTING))
            if kwargs["status"] is Status.UNKNOWN:
                raise ValueError("'unknown' is a reader's word, never written")
        except (ValueError, TypeError):
            # kept as written, and written back so on a rewrite (to_dict)
            kwargs["extra"][UNKNOWN_STATUS] = kwargs.pop("status")
            kwargs["status"] = Status.UNKNOWN
        for key in ("data", "peak_memory_bytes_per_rank", "ranks"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        return cls(**kwargs)

    def replace(self, **changes: Any) -> Summary:
        return dataclasses.replace(self, **changes)
