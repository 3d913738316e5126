"""One training step traced under fake tensors and a fake process group: what a rank of a run would hold,
compute and send, without a GPU, without the other ranks, and without allocating the model.

The model is built on the meta device, given fake storage, and made parallel by the trainer's own
strategies (training/parallel) for a fake world of the target size; then the trainer's own step runs twice:
once with FLOPs and collectives counted, once under PyTorch's memory tracker (FSDPMemTracker for sharded
modes, MemTracker otherwise), after the optimizer state exists, so the peak is the steady state's. This is
torchtitan's recipe (scripts/estimate), extended to every mode workbench runs.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

TRACE_LOCK = threading.Lock()
"""One trace at a time per process (each forks a child that holds the fake process group)."""


@dataclass
class Placement:
    """What a strategy asks of an Accelerator, for one simulated rank of a fake world."""

    device: torch.device
    num_processes: int
    process_index: int = 0
    mesh: Any = None
    tracing: bool = True

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0


@dataclass
class StepTrace:
    """What one rank holds (bytes by category at the step's peak), computes and sends in one step."""

    rank: int
    world: int
    memory: dict[str, int]
    """params, grads, optimizer, activations, buffers, temporaries, peak: the tracked step's peak."""
    activations_after_forward: int
    held: dict[str, int]
    """Parameters, gradients and optimizer state this rank holds at rest, from its shards."""
    flops: float
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per collective kind: count, bytes (the full buffer), wire_bytes (sent per rank, ring), group size."""
    units: int = 1
    zero_partition: list[tuple[int, int]] = field(default_factory=list)
    """zero1: (parameter elements, parameters) whose optimizer state each rank owns."""
    trace_s: float = 0.0
    max_rss_bytes: int = 0


# ---- counting collectives ---------------------------------------------------------------------------------
def _kind(name: str) -> str | None:
    n = name.lower()
    for key, kind in (("all_gather", "all_gather"), ("allgather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
                      ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("broadcast", "broadcast")):
        if key in n:
            return kind
    return None


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends for a collective over n ranks with ring algorithms (nbytes: the full buffer)."""
    if n <= 1:
        return 0.0
    if kind in ("all_gather", "reduce_scatter"):
        return nbytes * (n - 1) / n
    if kind == "all_reduce":
        return 2 * nbytes * (n - 1) / n
    return float(nbytes)


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives a step issues, with their bytes and group sizes (fake or real process group)."""

    def __init__(self, gpus_per_node: int) -> None:
        super().__init__()
        self.gpus_per_node = gpus_per_node
        self.comm: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "bytes": 0.0, "wire_bytes": 0.0,
                                                                    "group": 0, "spans_nodes": False})

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in collective_ops and func not in sync_ops and (kind := _kind(str(func))):
            nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs or {})
            pg = CollectiveOp.get_process_group(func, args)
            ranks = dist.get_process_group_ranks(pg)
            spans = len({r // self.gpus_per_node for r in ranks}) > 1
            rec = self.comm[f"{kind}@{len(ranks)}{'/nodes' if spans else ''}"]
            rec["count"] += 1
            rec["bytes"] += nbytes
            rec["wire_bytes"] += wire_bytes(kind, nbytes, len(ranks))
            rec["group"], rec["spans_nodes"] = len(ranks), spans
        return out


# ---- the fake world -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(world: int, rank: int, gpu_rounding: bool) -> Iterator[Any]:
    """A fake process group of `world` ranks in this process, fake tensors, and the two corrections a trace
    needs: DTensor's sharding propagation gets a private fake mode (else the tracker counts its scratch
    tensors), and storages round up to 512 B as the CUDA caching allocator does (for a GPU target)."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools import mem_tracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimate() needs a process without a process group (it simulates one); call it from "
                           "the notebook or shell, not from inside a launched rank")
    excepthook = sys.excepthook  # init_process_group prefixes later tracebacks with "[rank0]:" otherwise
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    detect, consumed = sharding_prop.detect_fake_mode, mem_tracker._WeakRefInfo._calculate_mem_consumed
    sharding_prop.detect_fake_mode = lambda *a, **k: None
    if gpu_rounding:  # the CUDA caching allocator hands out blocks of 512 bytes
        def rounded(self: Any) -> int:
            return math.ceil(self.size * self.element_size / 512) * 512

        mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    reduce_scatters = {name: getattr(dist, name) for name in ("reduce_scatter_single", "reduce_scatter_tensor")
                       if hasattr(dist, name)}
    if not gpu_rounding:
        for name, fn in reduce_scatters.items():
            setattr(dist, name, _with_gloo_scratch(fn))
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        sharding_prop.detect_fake_mode = detect
        mem_tracker._WeakRefInfo._calculate_mem_consumed = consumed
        for name, fn in reduce_scatters.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()
        sys.excepthook = excepthook
        gc.collect()


def _with_gloo_scratch(reduce_scatter: Any) -> Any:
    """A CPU target runs on gloo, which has no reduce-scatter of its own: it reduces a full-size copy of the
    input and scatters that, so a rank briefly holds one more input's worth. The fake process group doesn't."""

    def call(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scratch = torch.empty_like(input)
        try:
            return reduce_scatter(output, input, *args, **kwargs)
        finally:
            del scratch

    return call


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Give a meta-device model (fake) storage on `device`, keeping tied parameters tied."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store, make in ((module._parameters, lambda p: torch.nn.Parameter(torch.empty_like(p, device=device),
                                                                             requires_grad=p.requires_grad)),
                            (module._buffers, lambda b: torch.empty_like(b, device=device))):
            for name, tensor in list(store.items()):
                if tensor is not None:
                    if id(tensor) not in memo:
                        memo[id(tensor)] = make(tensor)
                    store[name] = memo[id(tensor)]
    return model


def trace_step(cfg: RunConfig, task: Task, *, world: int, rank: int = 0, gpu_target: bool = False,
               gpus_per_node: int | None = None) -> StepTrace:
    """Trace one steady-state training step of `cfg` as rank `rank` of `world` (see the module docstring).

    The trace runs in a forked child: a fake process group and DTensor's caches (keyed by meshes that equal
    the real ones a later launch builds) must not outlive it in this process, or in ranks forked from it.
    """
    import multiprocessing

    # Real batches are built here, not in the child: a forked child that runs the data pipeline can deadlock on
    # a thread pool (OpenMP's, a loader's) inherited mid-use from this process.
    if ABORTED.is_set():
        raise RuntimeError("the estimate was cancelled (a run is launching)")
    real = _real_batches(cfg, task, world, rank)
    with TRACE_LOCK:
        if ABORTED.is_set():
            raise RuntimeError("the estimate was cancelled (a run is launching)")
        reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
        child = multiprocessing.get_context("fork").Process(
            target=_trace_child, args=(writer, cfg, task, real, world, rank, gpu_target, gpus_per_node), daemon=True)
        child.start()
        RUNNING.append(child)
        writer.close()
        try:
            ok, payload = reader.recv()
        except EOFError:
            child.join()
            raise RuntimeError(f"the estimate's trace ended without an answer (exit code {child.exitcode})") from None
        finally:
            RUNNING.remove(child)
        child.join()
    if not ok:
        raise payload
    return payload


RUNNING: list[Any] = []
"""The trace child in flight, if any (abort_trace ends it)."""
ABORTED = threading.Event()
"""Set by abort_trace: traces raise instead of starting, until allow_traces()."""


def abort_trace() -> None:
    """End the trace in flight now, and refuse new ones (a run is launching: its processes must not be forked
    while a trace forks or builds batches)."""
    ABORTED.set()
    for child in list(RUNNING):
        child.kill()


def allow_traces() -> None:
    ABORTED.clear()


def _trace_child(writer: Any, *args: Any) -> None:
    torch.set_num_threads(1)  # fake tensors compute nothing; one thread keeps the child clear of the parent's pool
    try:
        writer.send((True, _trace_here(*args)))
    except BaseException as e:  # noqa: BLE001  (sent to the parent, which raises it)
        try:
            writer.send((False, e))
        except Exception:  # noqa: BLE001  (an exception that doesn't pickle)
            writer.send((False, RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        writer.close()
        os._exit(0)


def _real_batches(cfg: RunConfig, task: Task, world: int, rank: int) -> list[Any]:
    """The micro-batches rank `rank` would see first: their shapes and dtypes are what the trace needs."""
    from workbench.training.batches import ShardedBatches

    train_ds, _ = task.build_datasets(cfg)
    batches = ShardedBatches(train_ds, cfg, rank, world, task.collate_fn(cfg)).iterate(0)
    return [next(batches) for _ in range(cfg.grad_accum_steps)]


def _trace_here(cfg: RunConfig, task: Task, real: list[Any], world: int, rank: int, gpu_target: bool,
                gpus_per_node: int | None) -> StepTrace:
    from torch.utils.flop_counter import FlopCounterMode

    from workbench.config import SHARDED
    from workbench.estimator.flops import EXTRA_FLOP_FORMULAS
    from workbench.training.memory import tracked
    from workbench.training.parallel import parallelize
    from workbench.training.parallel.sharded import data_parallel_mesh
    from workbench.training.step import accumulate

    started = time.perf_counter()
    device = torch.device("cpu")  # a CPU build can't trace CUDA autograd; bytes per tensor are the same
    # On GPUs AdamW defaults to foreach, whose temporaries are a (sharded) model's worth of memory.
    foreach = True if gpu_target else None
    with fake_world(world, rank, gpu_target) as fake:
        mesh = data_parallel_mesh(cfg, "cpu", world) if cfg.parallelism in SHARDED else None
        with fake:
            with torch.device("meta"):
                model = task.build_model(cfg)
            materialize(model, device)
            strategy = parallelize(cfg, Placement(device, world, rank, mesh), model, task,
                                   lambda m: _optimizer(m, cfg, task, foreach))
            fake_batches = [tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, b)
                            for b in real]

            def step() -> None:
                accumulate(strategy, task, iter(fake_batches), cfg.grad_accum_steps, device)
                if cfg.grad_clip > 0:
                    strategy.clip_grad_norm(cfg.grad_clip)
                strategy.step()

            counter = CollectiveCounter(gpus_per_node or world)
            with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as flops, counter:
                step()  # the first step creates the optimizer state; it is counted, not tracked
            gc.collect()
            _, memory = tracked(strategy, step, tuple(fake_batches))
            after_forward = memory.pop("activations_after_forward")
            held = dict(strategy.held_bytes)  # measured at the first update, before the gradients were cleared
            partition = _zero_partition(strategy)
            gc.collect()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    units = 1 + sum(1 for _ in _units_of(task, cfg))
    return StepTrace(rank=rank, world=world, memory=memory, activations_after_forward=after_forward, held=held,
                     flops=float(flops.get_total_flops()), comm={k: dict(v) for k, v in counter.comm.items()},
                     units=units, zero_partition=partition, trace_s=time.perf_counter() - started,
                     max_rss_bytes=rss)


def _optimizer(model: torch.nn.Module, cfg: RunConfig, task: Task, foreach: bool | None) -> torch.optim.Optimizer:
    from workbench.training.optim import build_optimizer

    optimizer = build_optimizer(model, cfg, task)
    if foreach is not None and "foreach" in optimizer.defaults:
        for group in optimizer.param_groups:
            group["foreach"] = foreach
    return optimizer


def _zero_partition(strategy: Any) -> list[tuple[int, int]]:
    partition = getattr(strategy.optimizer, "_partition_parameters", None)
    if partition is None:
        return []
    return [(sum(p.numel() for group in groups for p in group["params"]), sum(len(g["params"]) for g in groups))
            for groups in partition()]


def _units_of(task: Task, cfg: RunConfig) -> Iterator[torch.nn.Module]:
    from workbench.tasks.blocks import shard_units

    with torch.device("meta"):
        model = task.build_model(cfg)
    yield from shard_units(model, task)
