"""One training step traced under fake tensors and a fake process group: what a rank of a run would
hold, compute and send, without a GPU, without the other ranks, and without allocating the model.

The model is built on the meta device, given fake storage, and made parallel by the trainer's own
strategies (training/parallel) for a fake world of the target size (fake_world.py); then the
trainer's own step runs twice: once with FLOPs and collectives counted, once under PyTorch's memory
tracker (FSDPMemTracker for sharded modes, MemTracker otherwise), after the optimizer state exists,
so the peak is the steady state's. This is torchtitan's recipe (scripts/estimate), extended to every
mode workbench runs: data parallel, tensor parallel and FSDP x TP here; a pipeline's stages, whose
schedule can't run on a fake process group, in pipeline.py.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from workbench.estimator import cancel, progress
from workbench.estimator.trace.fake_world import Placement, wire_bytes
from workbench.estimator.trace.held import StatePiece

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

__all__ = ["Placement", "StepTrace", "abort_trace", "allow_traces", "trace_step", "wire_bytes"]

TRACE_LOCK = threading.Lock()
"""One trace at a time per process (each forks a child that holds the fake process group)."""


@dataclass
class StepTrace:
    """What one rank holds (bytes by category at the step's peak), computes and sends in one
    step."""

    rank: int
    world: int
    memory: dict[str, int]
    """params, grads, optimizer, activations, buffers, temporaries, peak: the tracked step's
    peak."""
    activations_after_forward: int
    held: dict[str, int]
    """Parameters, gradients and optimizer state this rank holds at rest, from its shards."""
    flops: float
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per collective kind: count, bytes (the full buffer), wire_bytes (sent per rank, ring), group
    size."""
    units: int = 1
    zero_partition: list[tuple[int, int]] = field(default_factory=list)
    """zero1: (parameter elements, parameters) whose optimizer state each rank owns."""
    ops: dict[str, int] = field(default_factory=dict)
    """ATen ops the step dispatches, by name ('aten.mm', 'aten.add_', ...): a step's fixed cost per
    op."""
    op_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes of the tensors each ATen op returns, by name: the memory traffic of ops that aren't
    FLOP-bound."""
    first_ops: dict[str, int] = field(default_factory=dict)
    """`ops` of the first step (the optimizer creating its state, FSDP initializing): what the GPU
    host-time constants (timing/gpu.py) were fitted to, until a GPU session fits them to the steady
    step's."""
    first_op_bytes: dict[str, int] = field(default_factory=dict)
    flop_calls: list[list[Any]] = field(default_factory=list)
    """[op name, FLOPs per call, calls]: the FLOP-bound ops by size, each priced at the rate of its
    own size."""
    trace_s: float = 0.0
    max_rss_bytes: int = 0
    state: list[StatePiece] = field(default_factory=list)
    """Each tensor of model state once, with its placements: any rank's held bytes follow (held.py);
    [] when they didn't reproduce this rank's (every rank then holds what this one does)."""
    mesh_dims: list[tuple[str, int]] = field(default_factory=list)
    """The run's device mesh, outermost first ([] without one): where each rank sits."""
    stage: int | None = None
    """Pipeline: the stage this rank runs (its trace stands for the ranks of that stage)."""
    in_flight: int = 0
    """Pipeline: micro-batches whose activations the stage held at once in its schedule."""
    p2p_bytes: int = 0
    """Pipeline: bytes the stage sends to a neighbour per micro-batch (activations forward,
    gradients back)."""


def trace_step(
    cfg: RunConfig,
    task: Task,
    *,
    world: int,
    rank: int = 0,
    gpu_target: bool = False,
    gpus_per_node: int | None = None,
) -> StepTrace:
    """Trace one steady-state training step of `cfg` as rank `rank` of `world` (see the module
    docstring).

    The trace runs in a forked child: a fake process group and DTensor's caches (keyed by meshes
    that equal the real ones a later launch builds) must not outlive it in this process, or in ranks
    forked from it.
    """
    import multiprocessing

    # Real batches are built here, not in the child: a forked child that runs the data pipeline can
    # deadlock on a thread pool (OpenMP's, a loader's) inherited mid-use from this process.
    cancel.check("a trace")
    progress.phase("building the first micro-batches")
    real = _real_batches(cfg, task, world, rank)
    with TRACE_LOCK:
        cancel.check("a trace")
        progress.phase(
            f"tracing one step on a fake {world}-rank world"
            + (f" (rank {rank}, pipeline stage {rank * cfg.pp // world})" if cfg.pp > 1 else "")
        )
        reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
        child = multiprocessing.get_context("fork").Process(
            target=_trace_child,
            args=(writer, cfg, task, real, world, rank, gpu_target, gpus_per_node),
            daemon=True,
        )
        with cancel.started([child]):
            writer.close()
            try:
                ok, payload = reader.recv()
            except EOFError:
                child.join()
                cancel.check("the trace's answer")  # killed by cancel(): said as such
                raise RuntimeError(
                    f"the estimate's trace ended without an answer (exit code {child.exitcode})"
                ) from None
        child.join()
    if not ok:
        raise payload
    return payload


def abort_trace() -> None:
    """End the trace in flight now, and refuse new ones (a run is launching: its processes must not
    be forked while a trace forks or builds batches). The estimator's cancel(), under its old
    name."""
    cancel.cancel()


def allow_traces() -> None:
    cancel.allow()


def _without_cuda() -> None:
    """The trace runs on CPU fake tensors, but the optimizer's step asks the current CUDA stream
    whether it is capturing a graph, straight through the C API: in a fork of a process that
    initialised CUDA (a notebook that ran a GPU job), that call fails. Nothing in the child needs
    CUDA, so it sees none."""
    torch.cuda.is_available = lambda: False
    for name in ("_accelerator_graph_capture_health_check", "_cuda_graph_capture_health_check"):
        if hasattr(torch.optim.Optimizer, name):
            setattr(torch.optim.Optimizer, name, lambda self: None)


def _trace_child(writer: Any, *args: Any) -> None:
    import logging
    import warnings

    # fake tensors compute nothing; one thread keeps the child clear of the parent's pool
    torch.set_num_threads(1)
    _without_cuda()
    # What torch says about the traced step (DTensor's redistribution advice, the scaler's scalar
    # warning) is for a run's log, not the notebook cell that asked for an estimate.
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
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
    """The micro-batches rank `rank` would see first: their shapes and dtypes are what the trace
    needs."""
    from workbench.training.batches import ShardedBatches

    train_ds, _ = task.build_datasets(cfg)
    batches = ShardedBatches(train_ds, cfg, rank, world, task.collate_fn(cfg)).iterate(0)
    return [next(batches) for _ in range(cfg.grad_accum_steps)]


def _trace_here(
    cfg: RunConfig,
    task: Task,
    real: list[Any],
    world: int,
    rank: int,
    gpu_target: bool,
    gpus_per_node: int | None,
) -> StepTrace:
    from workbench.estimator.trace.fake_world import fake_world

    started = time.perf_counter()
    ring = contextlib.nullcontext()
    # attention as a GPU run's ring over the CP group, on the CPU kernel (ring.py)
    if cfg.cp > 1:
        from workbench.estimator.trace.ring import installed

        ring = installed()
    with ring, fake_world(world, rank, gpu_target) as fake:
        if cfg.pp > 1:
            from workbench.estimator.trace.pipeline import trace_stage

            fields = trace_stage(
                cfg, task, real, world, rank, fake, gpu_target, gpus_per_node or world
            )
        else:
            fields = _trace_strategy(
                cfg, task, real, world, rank, fake, gpu_target, gpus_per_node or world
            )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024
    )
    return StepTrace(
        rank=rank, world=world, **fields, trace_s=time.perf_counter() - started, max_rss_bytes=rss
    )


def _trace_strategy(
    cfg: RunConfig,
    task: Task,
    real: list[Any],
    world: int,
    rank: int,
    fake: Any,
    gpu_target: bool,
    gpus_per_node: int,
) -> dict[str, Any]:
    """The data-parallel and tensor-parallel modes: the trainer's strategy and its own step
    (accumulate)."""
    from workbench.estimator.trace.fake_world import count_then_track, update
    from workbench.estimator.trace.held import checked_state, state_pieces
    from workbench.estimator.trace.parts import counted_fields, fake_batches, step_counters
    from workbench.training.parallel.device_mesh import build_mesh
    from workbench.training.step import accumulate

    # a CPU build can't trace CUDA autograd; bytes per tensor are the same
    device = torch.device("cpu")
    # A DeviceMesh needs real tensors: it is built before fake mode, and the strategy takes it from
    # the Placement.
    mesh = build_mesh(cfg, "cpu", world)
    counter, first = step_counters(gpus_per_node, mesh, rank)
    with fake:
        strategy = _fake_strategy(cfg, task, Placement(device, world, rank, mesh), gpu_target)
        batches = fake_batches(fake, real)
        grads: list[Any] = []

        def step() -> None:
            accumulate(strategy, task, iter(batches), cfg.grad_accum_steps, device)
            update(strategy, cfg, grads)

        flops, memory = count_then_track(strategy, step, tuple(batches), counter, first)
        mesh_dims = list(zip(mesh.mesh_dim_names, mesh.mesh.shape)) if mesh is not None else []
        # measured at the first update, before the gradients were cleared
        held = dict(strategy.held_bytes)
        pieces = state_pieces(strategy) + grads
        partition = _zero_partition(strategy)
    state = checked_state(pieces, mesh_dims, rank, held)
    after_forward = memory.pop("activations_after_forward")
    return {
        "memory": memory,
        "activations_after_forward": after_forward,
        "held": held,
        "flops": flops,
        "units": 1 + sum(1 for _ in _units_of(task, cfg)),
        "zero_partition": partition,
        "state": state,
        "mesh_dims": [(n, int(s)) for n, s in mesh_dims],
        **counted_fields(counter, first),
    }


def _fake_strategy(cfg: RunConfig, task: Task, placement: Placement, gpu_target: bool) -> Any:
    """The trainer's strategy for `placement`'s rank, over a model with fake storage, its loss
    scaler taken as steady (fake_world.steady_scaler): call it under the fake mode."""
    from workbench.estimator.trace.fake_world import optimizer_for, steady_scaler
    from workbench.estimator.trace.parts import fake_model
    from workbench.training.parallel import parallelize

    model = fake_model(cfg, task, placement.device)
    strategy = parallelize(cfg, placement, model, task, optimizer_for(cfg, task, gpu_target))
    steady_scaler(strategy)
    return strategy


def _zero_partition(strategy: Any) -> list[tuple[int, int]]:
    partition = getattr(strategy.optimizer, "_partition_parameters", None)
    if partition is None:
        return []
    return [
        (
            sum(p.numel() for group in groups for p in group["params"]),
            sum(len(g["params"]) for g in groups),
        )
        for groups in partition()
    ]


def _units_of(task: Task, cfg: RunConfig) -> Iterator[torch.nn.Module]:
    """The model's shard units as the recipe finds them: the Task's hook, then what the model
    declares (a transformers model's decoder layers), then its repeated blocks."""
    from workbench.tasks.blocks import shard_units
    from workbench.tasks.model_plans import ModelPlan

    with torch.device("meta"):
        model = task.build_model(cfg)
    yield from shard_units(model, ModelPlan(task))
