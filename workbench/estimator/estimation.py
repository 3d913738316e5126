"""wb.estimate: trace one step on a fake world of the target size, then price it (memory, time, cost)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.config.mesh import ParallelDims, shards
from workbench.estimator.catalog import NETWORKS, THIS_MACHINE, Accelerator, load_catalog, lookup
from workbench.estimator.model import (
    CPU_OVERHEAD_BYTES,
    GPU_OVERHEAD_BYTES,
    Estimate,
    RankEstimate,
    calibrated_efficiency,
    comm_time,
)
from workbench.estimator.trace import StepTrace, trace_step

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

__all__ = ["estimate", "price"]


def _shard_bytes(shapes: list[tuple[int, ...]], shard: int, group: int) -> int:
    """fp32 bytes FSDP2 gives one rank of a group: dim 0 in torch.chunk pieces."""
    total = 0
    for shape in shapes:
        dim0 = shape[0] if shape else 1
        chunk = -(-dim0 // group)
        rows = max(0, min(chunk, dim0 - shard * chunk))
        total += rows * math.prod(shape[1:]) * 4
    return total


def _ranks(cfg: RunConfig, trace: StepTrace, world: int, overhead: int, buckets: int,
           shapes: list[tuple[int, ...]]) -> list[RankEstimate]:
    """Every rank from rank 0's trace: the same activations; model state from each rank's shard (FSDP2's chunk
    rule), or, for zero1, the optimizer partition scaled from rank 0's."""
    m, held = trace.memory, trace.held
    group = ParallelDims.of(cfg, world).dp_shard
    sharded = shards(cfg.parallelism) and group > 1
    ranks = []
    for r in range(world):
        delta, held = 0, dict(trace.held)
        if sharded:
            # FSDP2 pads every rank's parameter and gradient shards to one size; the optimizer's moments
            # follow the unpadded shard, so rank 0 holds the most.
            mine, first = _shard_bytes(shapes, r % group, group), _shard_bytes(shapes, 0, group)
            delta = 2 * (mine - first)
            held = {"params": mine, "grads": mine, "optimizer": held["optimizer"] + delta}
        ranks.append(RankEstimate(rank=r, params=m["params"], grads=m["grads"], optimizer=m["optimizer"] + delta,
                                  activations=m["activations"], buffers=m["buffers"], temporaries=m["temporaries"],
                                  overhead=overhead, tracked_peak=m["peak"] + delta, extra_buffers=buckets,
                                  held=held))
    if cfg.parallelism == "zero1" and trace.zero_partition:
        (elements0, count0) = trace.zero_partition[0]
        for r, (elements, count) in enumerate(trace.zero_partition[:world]):
            # AdamW: two fp32 moments per element and a 4-byte step per parameter
            extra = 8 * (elements - elements0) + 4 * (count - count0)
            ranks[r].optimizer += extra
            ranks[r].tracked_peak += extra
            ranks[r].held = {**ranks[r].held, "optimizer": held["optimizer"] + extra}
    return ranks


def estimate(cfg: RunConfig, gpu: str | None = None, gpus: int | None = None, nodes: int = 1, *,
             task: Task | None = None, network: str = "infiniband", catalog: str | Path | None = None,
             runs_dir: str | Path | None = None) -> Estimate:
    """Estimate `cfg` per rank on `gpus` x `nodes` of accelerator `gpu` (a catalog name; default: this
    machine). The trace runs here, on the CPU, without allocating the model."""
    from workbench.tasks import get_task

    if cfg.pp > 1:
        raise ValueError(f"pp={cfg.pp}: the estimate does not model pipeline parallelism yet (it traces the "
                         "data-parallel modes only); estimate the same model with pp=1 and parallelism='zero3' for a "
                         "bound")
    if cfg.tp > 1:
        raise ValueError(f"tp={cfg.tp}: the estimate does not model tensor parallelism yet (it traces the "
                         "data-parallel modes only); estimate the same model with tp=1 and parallelism='zero3' "
                         "for a bound")
    target = lookup(gpu or THIS_MACHINE, load_catalog(catalog) if gpu and gpu != THIS_MACHINE else None)
    if network not in NETWORKS:
        raise ValueError(f"network={network!r}: choose one of {', '.join(NETWORKS)}")
    gpus = gpus or cfg.num_processes
    if gpus < 1 or nodes < 1:
        raise ValueError(f"gpus={gpus}, nodes={nodes}: both must be at least 1")
    world = gpus * nodes
    task = task or get_task(cfg.task)
    run = cfg.replace(num_processes=world, oversubscribe=True,
                      device="cuda" if target.kind == "cuda" else "cpu", track_memory=False)
    task.check_options(run)
    trace = trace_step(run, task, world=world, gpu_target=target.kind == "cuda", gpus_per_node=gpus)
    return price(run, task, trace, target, gpus, nodes, network, Path(runs_dir or cfg.runs_dir))


def price(cfg: RunConfig, task: Task, trace: StepTrace, target: Accelerator, gpus: int, nodes: int, network: str,
          runs_dir: Path) -> Estimate:
    """Memory, time and cost of a traced step on the target, with the assumption behind each figure."""
    world = gpus * nodes
    dims = ParallelDims.of(cfg, world)
    assumptions: list[str] = []
    replicated = cfg.parallelism in ("ddp", "zero1") and world > 1
    grads = trace.held["grads"]
    factor = {"fp16": 0.5, "bf16": 0.5, "powersgd": 0.05}.get(cfg.grad_compression, 1.0)
    buckets = grads if replicated else 0
    extra_comm: dict[str, dict[str, Any]] = {}
    if replicated:
        from workbench.estimator.trace import wire_bytes

        volume = grads * factor
        extra_comm["all_reduce@ddp"] = {"count": 1, "bytes": volume, "group": world, "spans_nodes": nodes > 1,
                                        "wire_bytes": wire_bytes("all_reduce", volume, world)}
        assumptions.append(f"DDP: gradient buckets hold one more copy of the gradients ({grads:,} bytes); they are "
                           f"all-reduced once per step ({factor:g} x their bytes with {cfg.grad_compression} "
                           "compression)" if cfg.grad_compression != "none" else
                           f"DDP: gradient buckets hold one more copy of the gradients ({grads:,} bytes), all-reduced "
                           "once per step")
    overhead = GPU_OVERHEAD_BYTES if target.kind == "cuda" else CPU_OVERHEAD_BYTES
    assumptions.append(f"runtime overhead {overhead / 2**30:.2f} GiB per rank: " +
                       ("CUDA context and cuBLAS/NCCL workspaces" if target.kind == "cuda" else
                        "the Python interpreter, torch and accelerate before any tensor"))
    shapes = _param_shapes(task, cfg)
    ranks = _ranks(cfg, trace, world, overhead, buckets, shapes)
    efficiency, why = calibrated_efficiency(target, runs_dir)
    assumptions.append(why)
    peak_flops = target.peak("bf16" if cfg.precision == "fp8" and target.peak("fp8") is None else cfg.precision)
    if peak_flops is None:
        raise ValueError(f"precision={cfg.precision!r}: {target.name} lists no peak for it "
                         f"(it lists {', '.join(target.peak_flops)})")
    compute = trace.flops / (peak_flops * efficiency)
    comm = comm_time(trace, extra_comm, target, network)
    exposed = max(comm - compute, comm / max(1, trace.units)) if comm else 0.0
    assumptions += [f"FLOPs per rank counted from the traced step ({trace.flops:.3g}; attention counted in full, "
                    "as FlopCounterMode does)",
                    f"communication: ring collectives at {target.link_bandwidth / 1e9:g} GB/s per GPU over "
                    f"{target.link}" + (f", {NETWORKS[network] / 1e9:g} GB/s over {network} between nodes"
                                        if nodes > 1 else ""),
                    "overlap: collectives run during compute (FSDP prefetch, DDP buckets in backward); exposed is "
                    "what exceeds compute, and never less than one shard unit's share (the first all-gather or "
                    "last bucket)",
                    "fits: the peak stays under 92% of device memory (the caching allocator fragments the rest)",
                    *target.notes]
    if target.price_per_hour is not None:
        assumptions.append(f"price ${target.price_per_hour:.2f} per GPU-hour: {target.price_source}")
    return Estimate(config=cfg.to_dict(), target=target, gpus=gpus, nodes=nodes, ranks=ranks,
                    flops_per_step=trace.flops, compute_s=compute, comm_s=comm, exposed_comm_s=exposed,
                    step_s=compute + exposed,
                    global_batch=dims.global_batch(cfg.micro_batch_size, cfg.grad_accum_steps),
                    tokens_per_sample=task.tokens_per_sample(cfg), efficiency=efficiency, assumptions=assumptions,
                    trace_s=trace.trace_s, max_rss_bytes=trace.max_rss_bytes)


def _param_shapes(task: Task, cfg: RunConfig) -> list[tuple[int, ...]]:
    import torch

    with torch.device("meta"):
        model = task.build_model(cfg)
    return [tuple(p.shape) for p in model.parameters()]
