"""Traces already made, reused: a change that doesn't change the traced step (target, steps, prices,
learning rate, the GPU count of a replicated run) is answered from the trace in memory instead of a
new one. A new trace forks a child; what makes that child slow is paid once here instead (warm(), a
frozen heap)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from workbench.estimator import progress
from workbench.estimator.trace.step import StepTrace, trace_step

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

SIZE = 32
"""Traces kept (a few KiB each): enough for a session of trying layouts back and forth in the
panel."""
NOT_TRACED = frozenset(
    {
        "max_steps",
        "lr",
        "warmup_steps",
        "min_lr_ratio",
        "run_name",
        "runs_dir",
        "log_every",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "keep_checkpoints",
        "resume",
        "resume_allow",
        "trackers",
        "seed",
        "monitor_interval_s",
        "idle_util_pct",
        "idle_after_s",
        "preempt_signal",
        "preempt_grace_s",
        "max_restarts",
        "restart_backoff_s",
        "profile_steps",
        "dist_timeout_s",
        "start_method",
        "max_skipped_steps",
        "oversubscribe",
        "target_global_batch",
        "memory_budget_gb",
        "compile",
        "compile_backend",
        "find_unused_parameters",
        "checkpoint_async",
    }
)
"""RunConfig fields that change neither the model, the layout nor one step's tensors: a trace stands
for every value of them. Any other field (including ones added later) keys the cache."""
_CACHE: OrderedDict[tuple[Any, ...], StepTrace] = OrderedDict()
_LOCK = threading.Lock()
_LOCAL = threading.local()
_FROZEN = [0]
"""Traces under way with the heap frozen (gc.unfreeze waits for the last)."""
_STATS = {"hits": 0, "traces": 0}
CHILD_MODULES = (
    "accelerate",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.utils.flop_counter",
    "torch._subclasses.fake_tensor",
    "torch.distributed._tools.fake_collectives",
    "torch.distributed._tools.fsdp2_mem_tracker",
    "torch.distributed._tools.mem_tracker",
    "workbench.training.observe.memory",
    "workbench.training.optim",
    "workbench.training.parallel",
    "workbench.training.parallel.sharded",
    "workbench.training.parallel.tensor",
    "workbench.training.step",
)
"""What a trace child imports (step.py, fake_world.py and the trainer's strategies): warm() loads
them here."""


class NotCached(LookupError):
    """Inside cache_only(): the step has no trace in memory yet, and making one was not allowed."""


def _world_free(cfg: RunConfig) -> bool:
    """A replicated run's traced step is the same on any number of ranks: DDP's all-reduce is priced
    from the gradients' size (the trace leaves DDP out), and every rank holds the whole model."""
    return cfg.parallelism in ("none", "ddp") and cfg.tp == 1 and cfg.pp == 1


def key(
    cfg: RunConfig, task: Task, world: int, rank: int, gpu_target: bool, gpus_per_node: int | None
) -> tuple[Any, ...]:
    fields = {k: v for k, v in cfg.to_dict().items() if k not in NOT_TRACED}
    if _world_free(cfg):
        fields.pop("num_processes", None)
        world, rank, gpus_per_node = 0, 0, 0
    kind = type(task)
    # the class object itself, not its name: a task redefined in a notebook cell is a new class
    return (
        kind.__module__,
        kind.__qualname__,
        id(kind),
        json.dumps(fields, sort_keys=True, default=str),
        world,
        rank,
        gpu_target,
        gpus_per_node,
    )


def cached_trace(
    cfg: RunConfig,
    task: Task,
    *,
    world: int,
    rank: int = 0,
    gpu_target: bool = False,
    gpus_per_node: int | None = None,
) -> StepTrace:
    """trace_step(...), or the trace of an equivalent step made earlier in this process."""
    k = key(cfg, task, world, rank, gpu_target, gpus_per_node)
    with _LOCK:
        hit = _CACHE.get(k)
        if hit is not None:
            _CACHE.move_to_end(k)
            _STATS["hits"] += 1
            return dataclasses.replace(hit, world=world, rank=rank)
    if getattr(_LOCAL, "cache_only", False):
        raise NotCached(f"no trace of this step yet ({cfg.task}, {cfg.parallelism}, world {world})")
    if not warm.cache_info().currsize:
        progress.phase("importing what a trace runs (once per interpreter)")
    warm()
    with _frozen_heap():
        trace = trace_step(
            cfg, task, world=world, rank=rank, gpu_target=gpu_target, gpus_per_node=gpus_per_node
        )
    with _LOCK:
        _STATS["traces"] += 1
        _CACHE[k] = trace
        while len(_CACHE) > SIZE:
            _CACHE.popitem(last=False)
    return trace


def clear() -> None:
    with _LOCK:
        _CACHE.clear()


def stats() -> dict[str, int]:
    """Answers from memory ('hits') and new traces made ('traces') in this process so far."""
    with _LOCK:
        return dict(_STATS)


@contextlib.contextmanager
def cache_only() -> Iterator[None]:
    """Within it (this thread), a step without a trace in memory raises NotCached instead of being
    traced: an answer that costs milliseconds or none at all, for callers that would rather wait
    (debounce) before a trace."""
    before = getattr(_LOCAL, "cache_only", False)
    _LOCAL.cache_only = True
    try:
        yield
    finally:
        _LOCAL.cache_only = before


@functools.cache
def warm() -> None:
    """Import, in this process and once, what every trace child runs: a forked child inherits them,
    so no trace after the first re-imports DTensor, FSDP, the memory tracker and the trainer's
    strategies (about 1.5 s of each child's 2.5 s for digits on 2 cores). Safe to call from a
    background thread while nothing traces."""
    for name in CHILD_MODULES:
        importlib.import_module(name)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """gc.freeze() across the fork: the child's gc.collect() calls then skip every object it
    inherited (torch's imports leave a heap that takes ~0.15 s per full collection), as CPython's
    docs advise before a fork. The parent's own objects go back to the collector when the trace
    returns."""
    with _LOCK:
        _FROZEN[0] += 1
        gc.freeze()
    try:
        yield
    finally:
        with _LOCK:
            _FROZEN[0] -= 1
            if not _FROZEN[0]:
                gc.unfreeze()
