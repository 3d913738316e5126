"""What a traced step runs in: a fake process group of the target's size, fake tensors, a Placement
standing in for accelerate's Accelerator, and a dispatch mode that counts the step's collectives and
ATen ops. Shared by the data- and tensor-parallel trace (step.py) and the pipeline stage's
(pipeline.py)."""

from __future__ import annotations

import contextlib
import gc
import math
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.training.parallel.placement import Placement as RankPlacement

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


@dataclass
class Placement(RankPlacement):
    """One simulated rank of a fake world: the trainer's Placement, tracing."""

    tracing: bool = True


# ---- counting collectives ------------------------------------------------------------------------
def _kind(name: str) -> str | None:
    n = name.lower()
    for key, kind in (
        ("all_gather", "all_gather"),
        ("allgather", "all_gather"),
        ("reduce_scatter", "reduce_scatter"),
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("broadcast", "broadcast"),
    ):
        if key in n:
            return kind
    return None


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends for a collective over n ranks with ring algorithms (nbytes: the full
    buffer)."""
    if n <= 1:
        return 0.0
    if kind in ("all_gather", "reduce_scatter"):
        return nbytes * (n - 1) / n
    if kind == "all_reduce":
        return 2 * nbytes * (n - 1) / n
    return float(nbytes)


def mesh_groups(mesh: Any, rank: int) -> dict[frozenset[int], str]:
    """The groups `rank` belongs to along each dimension of `mesh`, named by the dimension ('tp',
    'pp', ...)."""
    if mesh is None:
        return {}
    ranks = mesh.mesh
    where = [int(i) for i in (ranks == rank).nonzero()[0]]
    groups = {}
    for dim, name in enumerate(mesh.mesh_dim_names or ()):
        index = list(where)
        index[dim] = slice(None)
        groups[frozenset(int(r) for r in ranks[tuple(index)].flatten())] = name
    return groups


def comm_key(kind: str, group: int, spans_nodes: bool, dim: str | None) -> str:
    """'all_reduce@8', with '/nodes' when the group crosses nodes and ':tp' or ':pp' for the
    model-parallel groups (their collectives sit on the critical path; data-parallel ones overlap
    compute)."""
    return (
        f"{kind}@{group}{'/nodes' if spans_nodes else ''}{f':{dim}' if dim in ('tp', 'pp') else ''}"
    )


def new_record() -> dict[str, Any]:
    return {
        "count": 0,
        "bytes": 0.0,
        "wire_bytes": 0.0,
        "group": 0,
        "spans_nodes": False,
        "dim": None,
    }


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives a step issues, with their bytes, group sizes and mesh dimension (fake
    or real process group), and the ATen ops it dispatches."""

    def __init__(self, gpus_per_node: int, groups: dict[frozenset[int], str] | None = None) -> None:
        super().__init__()
        self.gpus_per_node = gpus_per_node
        self.groups = groups or {}
        self.comm: dict[str, dict[str, Any]] = defaultdict(new_record)
        self.ops: dict[str, int] = defaultdict(int)
        self.op_bytes: dict[str, int] = defaultdict(int)
        self.flop_calls: dict[tuple[str, float], int] = defaultdict(int)
        """(op name, FLOPs of one call) -> calls: a matmul's rate depends on its size, not the
        step's mean."""
        self.formulas = flop_formulas()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            # DTensor handles it (and dispatches its local ops back here); its Python overhead is
            # counted too
            self.ops[f"dtensor.{func.overloadpacket}"] += 1
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops[name] += 1
        # views return no new memory; everything else writes its output once
        self.op_bytes[name] += sum(
            t.numel() * t.element_size() for t in _tensors(out) if t._base is None
        )
        if (formula := self.formulas.get(func.overloadpacket)) is not None:
            self.flop_calls[name, float(formula(*args, **(kwargs or {}), out_val=out))] += 1
        if func in collective_ops and func not in sync_ops and (kind := _kind(str(func))):
            nbytes = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs or {})
            pg = CollectiveOp.get_process_group(func, args)
            ranks = dist.get_process_group_ranks(pg)
            self.record(kind, nbytes, ranks, self.groups.get(frozenset(ranks)))
        return out

    def record(
        self, kind: str, nbytes: float, ranks: list[int], dim: str | None, wire: float | None = None
    ) -> None:
        spans = len({r // self.gpus_per_node for r in ranks}) > 1
        rec = self.comm[comm_key(kind, len(ranks), spans, dim)]
        rec["count"] += 1
        rec["bytes"] += nbytes
        rec["wire_bytes"] += wire_bytes(kind, nbytes, len(ranks)) if wire is None else wire
        rec["group"], rec["spans_nodes"], rec["dim"] = len(ranks), spans, dim


def flop_formulas() -> dict[Any, Any]:
    """FlopCounterMode's formulas, by op, with the ones it lacks (flops.py)."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    from workbench.estimator.trace.flops import EXTRA_FLOP_FORMULAS

    return {
        **flop_registry,
        **{
            op.overloadpacket if hasattr(op, "overloadpacket") else op: shape_wrapper(f)
            for op, f in EXTRA_FLOP_FORMULAS.items()
        },
    }


def flop_call_rows(calls: dict[tuple[str, float], int]) -> list[list[Any]]:
    """[op name, FLOPs per call, calls] for each counted size with FLOPs (for a StepTrace)."""
    return [[name, flops, n] for (name, flops), n in sorted(calls.items()) if flops > 0]


def _tensors(out: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


# ---- the fake world ------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(world: int, rank: int, gpu_rounding: bool) -> Iterator[Any]:
    """A fake process group of `world` ranks in this process, fake tensors, and the two corrections
    a trace needs: DTensor's sharding propagation gets a private fake mode (else the tracker counts
    its scratch tensors), and storages round up to 512 B as the CUDA caching allocator does (for a
    GPU target)."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools import mem_tracker
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "estimate() needs a process without a process group (it simulates one); call it from "
            "the notebook or shell, not from inside a launched rank"
        )
    # init_process_group prefixes later tracebacks with "[rank0]:" otherwise
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    detect, consumed = (
        sharding_prop.detect_fake_mode,
        mem_tracker._WeakRefInfo._calculate_mem_consumed,
    )
    sharding_prop.detect_fake_mode = lambda *a, **k: None
    if gpu_rounding:  # the CUDA caching allocator hands out blocks of 512 bytes

        def rounded(self: Any) -> int:
            return math.ceil(self.size * self.element_size / 512) * 512

        mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    mesh_init = DeviceMesh.__init__
    # FSDP x TP joins its meshes inside fake mode
    DeviceMesh.__init__ = _with_real_tensors(mesh_init)
    reduce_scatters = {
        name: getattr(dist, name)
        for name in ("reduce_scatter_single", "reduce_scatter_tensor")
        if hasattr(dist, name)
    }
    if not gpu_rounding:
        for name, fn in reduce_scatters.items():
            setattr(dist, name, _with_gloo_scratch(fn))
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        sharding_prop.detect_fake_mode = detect
        DeviceMesh.__init__ = mesh_init
        mem_tracker._WeakRefInfo._calculate_mem_consumed = consumed
        for name, fn in reduce_scatters.items():
            setattr(dist, name, fn)
        dist.destroy_process_group()
        sys.excepthook = excepthook
        gc.collect()


def _with_real_tensors(init: Any) -> Any:
    """A DeviceMesh computes its ranks' coordinates from real tensors, even when made inside fake
    mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def call(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    return call


def _with_gloo_scratch(reduce_scatter: Any) -> Any:
    """A CPU target runs on gloo, which has no reduce-scatter of its own: it reduces a full-size
    copy of the input and scatters that, so a rank briefly holds one more input's worth. The fake
    process group doesn't."""

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
        for store, make in (
            (
                module._parameters,
                lambda p: torch.nn.Parameter(
                    torch.empty_like(p, device=device), requires_grad=p.requires_grad
                ),
            ),
            (module._buffers, lambda b: torch.empty_like(b, device=device)),
        ):
            for name, tensor in list(store.items()):
                if tensor is not None:
                    if id(tensor) not in memo:
                        memo[id(tensor)] = make(tensor)
                    store[name] = memo[id(tensor)]
    return model


def optimizer_for(cfg: RunConfig, task: Task, gpu_target: bool) -> Any:
    """The run's optimizer factory; on a GPU target AdamW runs foreach (its default there), whose
    temporaries are a (sharded) model's worth of memory."""
    from workbench.training.optim import build_optimizer

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = build_optimizer(model, cfg, task)
        if gpu_target and "foreach" in optimizer.defaults:
            for group in optimizer.param_groups:
                group["foreach"] = True
        return optimizer

    return make


def steady_scaler(strategy: Any) -> None:
    """fp16's loss scaler reads its overflow flag and scale as Python numbers, which fake tensors
    don't have: the traced step is one that doesn't overflow (the steady state), so the update
    always applies and the scale is left as it starts. Its tensors (unscaling, the overflow check,
    its all-reduce) are still traced."""
    scaler = strategy.scaler
    if scaler is None:
        return

    def opt_step(
        optimizer: torch.optim.Optimizer, optimizer_state: Any, *args: Any, **kwargs: Any
    ) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(
        new_scale: Any = None,
    ) -> None:  # the scale stays; the per-step bookkeeping starts over
        scaler._per_optimizer_states = defaultdict(scaler._per_optimizer_states.default_factory)

    scaler._maybe_opt_step = opt_step
    scaler.get_scale = lambda: scaler._init_scale
    scaler.update = update


def update(strategy: Any, cfg: RunConfig, grads: list[Any]) -> None:
    """The end of the trainer's step (training/loop.py): the gradient norm (clipping, or with
    clipping off still taken, unless fp16's scaler checks for overflow), then the update; `grads`
    gets the gradients' shapes and placements on the first call (the update clears them)."""
    from workbench.estimator.trace.held import grad_pieces

    if cfg.grad_clip > 0 or strategy.scaler is None:
        strategy.clip_grad_norm(cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
    if not grads:
        grads.extend(grad_pieces(strategy))
    strategy.step()


def count_then_track(
    strategy: Any, step: Any, inputs: tuple[Any, ...], counter: Any, first: Any = None
) -> tuple[float, dict[str, int]]:
    """Run `step` twice: first (it creates the optimizer state; `first`, a second counter, counts
    its ATen ops), then the steady state under PyTorch's memory tracker (its peak), with its
    collectives, ATen ops and FLOPs counted by `counter`: the first step's extra ops (AdamW creating
    its state, FSDP's lazy initialization) are not what every step pays. The FLOPs are the
    counter's, by FlopCounterMode's formulas (flop_formulas): a FlopCounterMode around the first
    step counted the same total, at the price of its module hooks."""
    from workbench.training.observe.memory import tracked

    with first if first is not None else contextlib.nullcontext():
        step()
    gc.collect()

    def counted() -> None:
        with counter:
            # inside the tracker's mode: the counter sees ops on DTensors before DTensor handles
            # them
            step()

    _, memory = tracked(strategy, counted, inputs)
    gc.collect()
    return sum(flops * calls for (_, flops), calls in counter.flop_calls.items()), memory
