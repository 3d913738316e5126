"""A traced step's time on a catalog GPU before anything is learnt from runs, from the datasheet
(cpu.py prices a CPU target against this machine's measured profile).

FLOPs at the fraction of the datasheet peak published runs reach on that accelerator, for the
precision and the model's size (the catalog's efficiency, efficiency.py), elementwise bytes at the
datasheet memory bandwidth, never less than the host's time to launch the step's kernels;
collectives at a per-collective latency plus ring bytes over the datasheet link; data-parallel ones
overlap compute.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from workbench.estimator.catalog import NETWORKS, Accelerator
from workbench.estimator.efficiency import matmul_efficiency
from workbench.estimator.timing.cpu import RawStep, by_kind
from workbench.estimator.trace.step import StepTrace

if TYPE_CHECKING:
    from workbench.config import RunConfig

GPU_LAUNCH_S = 33e-6
"""Host time per working op of an eager step (module call, autograd, dispatch, cudaLaunchKernel): a
step is never shorter. Measured on an H100 server (16 cores, torch 2.11, 2026-11-24): a hand-written
loop and the trainer ran digits, char-gpt small and GPT-2 small at 24-41 us per op, with the GPU
mostly idle."""
GPU_STEP_S = 1.3e-3
"""Host time per step that no op accounts for (the loss read back, clipping's norm, the loader):
same runs."""
GPU_VIEW_S = 8e-6
"""Host time per view op: free in plain eager code, but FSDP2's sharded modules make thousands of
them (copy-in and copy-out views per parameter), in Python. Fitted to the same server's zero2/zero3
runs."""
GPU_DTENSOR_S = 65e-6
"""Host time DTensor's sharding propagation adds to an op on DTensors (the optimizer's foreach ops,
clipping): fitted to the same runs."""
NCCL_LATENCY_S = {False: 20e-6, True: 50e-6}
"""Per-collective latency within a node (NVLink/PCIe) and across nodes, as nccl-tests show for small
messages."""


def matmul_precision(cfg: RunConfig, target: Accelerator) -> str:
    """The catalog peak a step's matmuls run at: fp32 on TF32 tensor cores when cfg.tf32 (and the
    accelerator lists a TF32 peak); fp8 as bf16 where the accelerator has no fp8."""
    if cfg.precision == "fp32" and cfg.tf32 and target.peak("tf32"):
        return "tf32"
    return "bf16" if cfg.precision == "fp8" and target.peak("fp8") is None else cfg.precision


def gpu_step(
    cfg: RunConfig,
    trace: StepTrace,
    extra_comm: dict[str, dict[str, Any]],
    target: Accelerator,
    nodes: int,
    network: str,
) -> RawStep:
    """The step on a catalog GPU, from its datasheet."""
    precision = matmul_precision(cfg, target)
    peak = target.peak(precision)
    if peak is None:
        raise ValueError(
            f"precision={cfg.precision!r}: {target.name} lists no peak for it "
            f"(it lists {', '.join(target.peak_flops)})"
        )
    memory, kernels, views, sharded = _host_ops(trace)
    efficiency, why = matmul_efficiency(target, precision, model_params(cfg, trace))
    matmul = trace.flops / (peak * efficiency)
    device = matmul + memory / target.memory_bandwidth
    host = GPU_STEP_S + kernels * GPU_LAUNCH_S + views * GPU_VIEW_S + sharded * GPU_DTENSOR_S
    compute = max(device, host)
    comm = _nccl_s(trace, extra_comm, target, network)
    exposed = max(comm - compute, comm / max(1, trace.units)) if comm else 0.0
    assumptions = [
        _compute_note(target, precision, peak, why, kernels, views, sharded),
        _comm_note(target, nodes, network),
        "overlap: collectives run during compute (FSDP prefetch, DDP buckets in backward); "
        "exposed is what exceeds compute, and never less than one shard unit's share (the first "
        "all-gather or last bucket)",
    ]
    return RawStep(
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        efficiency=efficiency,
        parts={"matmul": matmul, "memory": memory / target.memory_bandwidth, "host": host},
        assumptions=assumptions,
    )


def _host_ops(trace: StepTrace) -> tuple[int, int, int, int]:
    """The step's elementwise bytes written, and the kernels, views and ops on DTensors the host
    launches (views counted only beside DTensor ops)."""
    # the host constants were fitted on an H100 to the first step's op counts (see
    # StepTrace.first_ops)
    ops = by_kind(
        SimpleNamespace(
            ops=trace.first_ops or trace.ops, op_bytes=trace.first_op_bytes or trace.op_bytes
        )
    )
    memory = sum(
        nbytes
        for kind, rows in ops.items()
        if kind not in ("flop", "view", "dtensor")
        for _, _, nbytes in rows
    )
    kernels = sum(
        count
        for kind, rows in ops.items()
        if kind not in ("view", "dtensor")
        for _, count, _ in rows
    )
    sharded = sum(count for _, count, _ in ops.get("dtensor", []))
    # plain views cost ~nothing
    views = sum(count for _, count, _ in ops.get("view", [])) if sharded else 0
    return memory, kernels, views, sharded


def _nccl_s(
    trace: StepTrace, extra_comm: dict[str, dict[str, Any]], target: Accelerator, network: str
) -> float:
    """Seconds of the step's collectives: each at NCCL's latency plus its ring bytes over the link
    (over the network too when it spans nodes)."""
    comm = 0.0
    for rec in [*trace.comm.values(), *extra_comm.values()]:
        bandwidth = (
            min(target.link_bandwidth, NETWORKS[network])
            if rec["spans_nodes"]
            else target.link_bandwidth
        )
        comm += (
            rec["count"] * NCCL_LATENCY_S[bool(rec["spans_nodes"])] + rec["wire_bytes"] / bandwidth
        )
    return comm


def _compute_note(
    target: Accelerator,
    precision: str,
    peak: float,
    why: str,
    kernels: int,
    views: int,
    sharded: int,
) -> str:
    return (
        f"compute: FLOPs at {why} of {target.name}'s {peak / 1e12:g} TFLOP/s {precision} datasheet "
        f"peak, elementwise bytes at its {target.memory_bandwidth / 1e9:g} GB/s; never less than "
        f"the host's time to launch {kernels} kernels at {1e6 * GPU_LAUNCH_S:g} us (eager PyTorch, "
        f"measured on an H100 server) plus {1e3 * GPU_STEP_S:g} ms a step"
        + (
            f", {views} views at {1e6 * GPU_VIEW_S:g} us and {sharded} DTensor ops at "
            f"{1e6 * GPU_DTENSOR_S:g} us"
            if sharded
            else ""
        )
    )


def _comm_note(target: Accelerator, nodes: int, network: str) -> str:
    return (
        f"communication: {1e6 * NCCL_LATENCY_S[False]:g} us per collective "
        f"({1e6 * NCCL_LATENCY_S[True]:g} us between nodes) plus ring bytes at "
        f"{target.link_bandwidth / 1e9:g} GB/s per GPU over {target.link}"
        + (f", {NETWORKS[network] / 1e9:g} GB/s over {network} between nodes" if nodes > 1 else "")
    )


def model_params(cfg: RunConfig, trace: StepTrace) -> int:
    """The model's parameter count, the size the catalog's efficiency bands go by: the traced
    rank's tensors at their global shapes (a DTensor's shape is the whole tensor's), times the
    stages under a pipeline (a stage's trace holds its own); the rank's own fp32 bytes / 4 where
    the trace kept no shapes."""
    pieces = [p for p in trace.state if p.category == "params"]
    if not pieces:
        return trace.held.get("params", 0) // 4
    count = sum(p.count * math.prod(p.shape) for p in pieces)
    return count * (cfg.pp if cfg.pp > 1 else 1)
