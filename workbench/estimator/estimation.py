"""wb.estimate itself: trace one step on a fake world of the target size, then price it (memory,
time, cost) into the Estimate it returns (report.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.config.mesh import ParallelDims, shards
from workbench.estimator import progress
from workbench.estimator.catalog import NETWORKS, THIS_MACHINE, Accelerator
from workbench.estimator.precision_speed import other_precisions
from workbench.estimator.report import (
    CPU_OVERHEAD_BYTES,
    CUBLAS_WORKSPACE_BYTES,
    GPU_OVERHEAD_BYTES,
    Estimate,
    RankEstimate,
)
from workbench.estimator.target import Target, check_plan
from workbench.estimator.timing.parallel import ParallelTime, parallel_time
from workbench.estimator.timing.step import COMPRESSION, replicated_comm
from workbench.estimator.trace.cache import cached_trace
from workbench.estimator.trace.held import held_for
from workbench.estimator.trace.step import StepTrace

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

log = logging.getLogger("workbench")
__all__ = ["estimate", "price"]


def _ranks(
    cfg: RunConfig, traces: list[StepTrace], world: int, overhead: int, buckets: int
) -> list[RankEstimate]:
    """Every rank from its stage's trace (one trace without a pipeline): the same activations; its
    own model state from the trace's shapes and placements (trace/held.py), or, for zero1, the
    optimizer partition scaled from the traced rank's. FSDP2 pads every rank's parameter and
    gradient shards to one size, so there only the optimizer state (which follows the unpadded
    shard) differs at the peak."""
    dims = ParallelDims.of(cfg, world)
    padded = cfg.pp == 1 and (shards(cfg.parallelism) or cfg.tp > 1) and world // cfg.tp > 1
    ranks = []
    for r in range(world):
        trace = traces[dims.coordinates(r)["pp"]] if cfg.pp > 1 else traces[0]
        m = trace.memory
        held = held_for(trace.state, trace.mesh_dims, r) if trace.state else dict(trace.held)
        delta = {k: held[k] - trace.held.get(k, 0) for k in held}
        at_peak = {
            "params": 0 if padded else delta["params"],
            "grads": 0 if padded or not m["grads"] else delta["grads"],
            "optimizer": delta["optimizer"],
        }
        ranks.append(
            RankEstimate(
                rank=r,
                params=m["params"] + at_peak["params"],
                grads=m["grads"] + at_peak["grads"],
                optimizer=m["optimizer"] + at_peak["optimizer"],
                activations=m["activations"],
                buffers=m["buffers"],
                temporaries=m["temporaries"],
                overhead=overhead,
                tracked_peak=m["peak"] + sum(at_peak.values()),
                extra_buffers=buckets,
                held=held,
            )
        )
    trace = traces[0]
    if cfg.parallelism == "zero1" and trace.zero_partition:
        (elements0, count0) = trace.zero_partition[0]
        for r, (elements, count) in enumerate(trace.zero_partition[:world]):
            # AdamW: two fp32 moments per element and a 4-byte step per parameter
            extra = 8 * (elements - elements0) + 4 * (count - count0)
            ranks[r].optimizer += extra
            ranks[r].tracked_peak += extra
            ranks[r].held = {**ranks[r].held, "optimizer": ranks[r].held["optimizer"] + extra}
    return ranks


def stage_traces(
    cfg: RunConfig, task: Task, trace: StepTrace, gpu_target: bool, gpus: int
) -> list[StepTrace]:
    """A pipeline's stages, one trace each (`trace` is rank 0's: stage 0); [trace] without a
    pipeline."""
    if cfg.pp == 1:
        return [trace]
    replicas = trace.world // cfg.pp
    return [
        trace,
        *(
            cached_trace(
                cfg,
                task,
                world=trace.world,
                rank=s * replicas,
                gpu_target=gpu_target,
                gpus_per_node=gpus,
            )
            for s in range(1, cfg.pp)
        ),
    ]


def _refuse_context_parallel(cfg: RunConfig) -> None:
    """cp > 1 is traced through PyTorch's ring-attention templates (trace/ring.py), which are
    private: where this torch has moved them, the estimate says so rather than tracing attention as
    if the sequences were whole."""
    if cfg.cp == 1:
        return
    try:
        import workbench.estimator.trace.ring  # noqa: F401
    except ImportError as e:
        import torch

        raise ValueError(
            f"cp={cfg.cp}: the estimate traces ring attention through PyTorch's own templates, "
            f"which torch {torch.__version__} doesn't have where expected ({e}); estimate the "
            "layout with cp=1 (each rank then runs whole sequences), or measure a short cp run"
        ) from e


def estimate(
    cfg: RunConfig,
    gpu: str | None = None,
    gpus: int | None = None,
    nodes: int = 1,
    *,
    task: Task | None = None,
    network: str = "infiniband",
    catalog: str | Path | None = None,
    runs_dir: str | Path | None = None,
    partition: str | None = None,
    cpus_per_node: int = 0,
) -> Estimate:
    """Estimate `cfg` per rank on `gpus` x `nodes` of accelerator `gpu` (a catalog name; default:
    this machine). `partition`: the Slurm partition the run goes to (with no gpu: its CPU nodes, of
    `cpus_per_node` cores, taken to be like this machine). The trace runs here, on the CPU, without
    allocating the model."""
    from workbench.tasks import get_task

    if network not in NETWORKS:
        raise ValueError(f"network={network!r}: choose one of {', '.join(NETWORKS)}")
    if (gpus is not None and gpus < 1) or nodes < 1:
        raise ValueError(f"gpus={gpus}, nodes={nodes}: both must be at least 1")
    local = not gpu or gpu == THIS_MACHINE
    cpu_partition = partition if local else None
    plan = Target(
        gpu=gpu or THIS_MACHINE,
        gpus_per_node=gpus or cfg.num_processes,
        nodes=nodes,
        catalog=str(catalog) if catalog else None,
        partition=partition,
        cpus_per_node=cpus_per_node,
    )
    target = _accelerator(plan, cpu_partition)
    gpus = plan.gpus_per_node
    world = gpus * nodes
    task = task or get_task(cfg.task)
    # One world size: the estimate is of the run on its target, whatever num_processes said.
    run = cfg.replace(
        num_processes=world,
        oversubscribe=True,
        track_memory=False,
        device="cpu" if local and target.kind == "cpu" else cfg.device if local else "auto",
    )
    _refuse_context_parallel(run)
    progress.phase(f"checking the plan against {plan.describe(run)}")
    warned = check_plan(run, plan, task)
    run = run.replace(device="cuda" if target.kind == "cuda" else "cpu")
    trace = cached_trace(
        run, task, world=world, gpu_target=target.kind == "cuda", gpus_per_node=gpus
    )
    est = price(run, task, trace, target, gpus, nodes, network, Path(runs_dir or cfg.runs_dir))
    est.assumptions += [f"as planned: {w}" for w in warned]
    est.other_precisions = other_precisions(run, trace, est, network)  # for est.time_verdict()
    _note_the_plan(est, cfg, run, plan, cpu_partition)
    return est


def _accelerator(plan: Target, cpu_partition: str | None) -> Accelerator:
    """The accelerator `plan` runs on; a Slurm partition's CPU nodes (`cpu_partition`) are this
    machine's, named for the partition."""
    target = plan.accelerator()
    if cpu_partition:
        target = replace(
            target, name=f"Slurm partition {cpu_partition}: CPU nodes taken as this machine's"
        )
    return target


def _note_the_plan(
    est: Estimate, cfg: RunConfig, run: RunConfig, plan: Target, cpu_partition: str | None
) -> None:
    """Add to `est` what the estimate of `cfg` assumed of its plan beyond the step: ranks other
    than the config's count (said first), compile, a Slurm partition's CPU nodes."""
    world = run.num_processes
    # said first: every figure is for the target's ranks, not the config's count
    if world != cfg.num_processes:
        est.assumptions.insert(
            0,
            f"ranks: {world}, the target's {plan.describe(run)} (the config has "
            f"num_processes={cfg.num_processes})",
        )
        log.info(
            "estimate: planned for %d ranks on %s; the config has num_processes=%d",
            world,
            plan.describe(run),
            cfg.num_processes,
        )
    if cfg.compile != "off":
        est.assumptions.append(
            f"compile={cfg.compile!r}: the step is priced as eager's (compiled steps measured "
            "0.84-1.23x eager's on a 2-core CPU: the docs' Compile guide); the first step also "
            "compiles, 15-26 s with an empty cache and 3-5 s warm there, outside the step time"
        )
    if cpu_partition:
        est.assumptions.append(
            f"Slurm partition {cpu_partition}: CPU nodes, priced as this machine's cores and its "
            "gloo collectives (between nodes, the cluster's network decides)"
        )


def price(
    cfg: RunConfig,
    task: Task,
    trace: StepTrace,
    target: Accelerator,
    gpus: int,
    nodes: int,
    network: str,
    runs_dir: Path,
) -> Estimate:
    """Memory, time and cost of a traced step on the target, with the assumption behind each figure
    (a pipeline's other stages are traced here, from the cache when they were traced before)."""
    world = gpus * nodes
    dims = ParallelDims.of(cfg, world)
    traces = stage_traces(cfg, task, trace, target.kind == "cuda", gpus)
    assumptions: list[str] = [f"layout: {dims.sizes_line()} over {world} rank(s)"]
    # DDP's buckets and all-reduce live in C++, out of the trace's sight; TP and PP average their
    # own gradients
    extra_comm = replicated_comm(cfg, trace, world, nodes)
    grads = trace.held["grads"]
    buckets = grads if extra_comm else 0
    if extra_comm:
        assumptions.append(_bucket_note(cfg, grads))
    overhead = GPU_OVERHEAD_BYTES if target.kind == "cuda" else CPU_OVERHEAD_BYTES
    workspace = CUBLAS_WORKSPACE_BYTES if target.kind == "cuda" else 0
    ranks = _ranks(cfg, traces, world, overhead, buckets + workspace)
    assumptions += _layout_memory_notes(cfg, traces, dims)
    assumptions += _gathered_note(cfg, ranks[0])
    assumptions += _runtime_memory_notes(target, overhead)
    global_batch = dims.global_batch(cfg.micro_batch_size, cfg.grad_accum_steps)
    progress.memory_known(
        lambda: Estimate(
            config=cfg.to_dict(),
            target=target,
            gpus=gpus,
            nodes=nodes,
            ranks=ranks,
            flops_per_step=0.0,
            compute_s=0.0,
            comm_s=0.0,
            exposed_comm_s=0.0,
            step_s=0.0,
            global_batch=global_batch,
            tokens_per_sample=task.tokens_per_sample(cfg),
            efficiency=0.0,
            assumptions=list(assumptions),
        )
    )
    progress.phase(f"pricing the step on {target.name}")
    timing = parallel_time(cfg, traces, extra_comm, target, nodes, network, runs_dir)
    assumptions += _closing_notes(timing, target)
    return Estimate(
        config=cfg.to_dict(),
        target=target,
        gpus=gpus,
        nodes=nodes,
        ranks=ranks,
        flops_per_step=timing.flops,
        compute_s=timing.compute_s,
        comm_s=timing.comm_s,
        exposed_comm_s=timing.exposed_comm_s,
        step_s=timing.step_s,
        global_batch=global_batch,
        tokens_per_sample=task.tokens_per_sample(cfg),
        efficiency=timing.efficiency,
        assumptions=assumptions,
        trace_s=sum(t.trace_s for t in traces),
        max_rss_bytes=max(t.max_rss_bytes for t in traces),
    )


def _bucket_note(cfg: RunConfig, grads: int) -> str:
    """What DDP's gradient buckets add: one more copy of the gradients, all-reduced once a step."""
    factor = COMPRESSION.get(cfg.grad_compression, 1.0)
    return (
        f"DDP: gradient buckets hold one more copy of the gradients ({grads:,} bytes); they "
        f"are all-reduced once per step ({factor:g} x their bytes with {cfg.grad_compression} "
        "compression)"
        if cfg.grad_compression != "none"
        else f"DDP: gradient buckets hold one more copy of the gradients ({grads:,} bytes), "
        "all-reduced once per step"
    )


def _closing_notes(timing: ParallelTime, target: Accelerator) -> list[str]:
    """What the step time rests on, when the peak fits, the target's own notes, and its price."""
    notes = [
        *timing.assumptions,
        "fits: the peak stays under 92% of device memory (the caching allocator fragments the "
        "rest)",
        *target.notes,
    ]
    if target.price_per_hour is not None:
        notes.append(f"price ${target.price_per_hour:.2f} per GPU-hour: {target.price_source}")
    return notes


def _runtime_memory_notes(target: Accelerator, overhead: int) -> list[str]:
    """What a rank holds beside its tensors: the runtime's `overhead`, and cuBLAS's workspaces on a
    GPU."""
    notes = [
        f"runtime overhead {overhead / 2**30:.2f} GiB per rank: "
        + (
            "CUDA context and NCCL's buffers"
            if target.kind == "cuda"
            else "the Python interpreter, torch and accelerate before any tensor"
        )
    ]
    if target.kind == "cuda":
        notes.append(
            f"cuBLAS workspaces {CUBLAS_WORKSPACE_BYTES / 2**20:.0f} MiB per rank, counted with "
            "the tensors (they come from PyTorch's caching allocator; measured on an H100)"
        )
    return notes


def _gathered_note(cfg: RunConfig, rank: RankEstimate) -> list[str]:
    """Why a sharded rank's parameters at the peak exceed its shards: FSDP2 gathers a unit's
    parameters whole while it computes. The root unit holds what no block holds (a transformers
    model's embeddings, final norm and head), and its forward and backward span the model's: it is
    gathered through the whole forward, and again through the whole backward (the head's gradient
    comes first, the embeddings' last), so the peak holds it whole beside the shards, with the
    block computing then. For a small model whose embeddings and head are a large share, params at
    the peak read well above the shard (1.6-2.3x for a 2-layer Llama at width 64 on 2 ranks, by
    whether a block is gathered at that moment), as PyTorch's tracker measures the real run too."""
    gathered = rank.params - rank.held.get("params", rank.params)
    if not shards(cfg.parallelism) or gathered <= 0:
        return []
    kept = (
        "zero2 keeps every unit's gathered from forward through backward"
        if cfg.parallelism == "zero2"
        else "the root unit's (what no block holds: a transformers model's embeddings, final norm "
        "and head) stay gathered through the whole forward and backward, whose work spans the "
        "model, and each block's while it computes"
    )
    return [
        f"params at the peak: rank {rank.rank}'s shards ({rank.held['params']:,} bytes) and "
        f"{gathered:,} bytes of parameters gathered whole at that moment: {kept}"
    ]


def _layout_memory_notes(cfg: RunConfig, traces: list[StepTrace], dims: ParallelDims) -> list[str]:
    """What the memory of a model-parallel layout rests on."""
    notes = []
    if cfg.tp > 1:
        notes.append(
            f"tensor parallel: each rank holds 1/{cfg.tp} of every matrix the task's plan splits, "
            "the rest whole"
            + (
                f"; FSDP2 then shards that over the {dims.dp} data-parallel ranks"
                if dims.dp > 1
                else ""
            )
        )
    if cfg.pp > 1:
        flight = ", ".join(f"stage {t.stage}: {t.in_flight}" for t in traces)
        notes.append(
            "pipeline: each rank holds its stage's parameters, gradients and optimizer state; "
            f"{cfg.pp_schedule.upper()} keeps the activations of several micro-batches at once "
            f"({flight} of {cfg.grad_accum_steps}), and PipelineStage keeps receive buffers for "
            "every micro-batch's activations and output gradients (counted as buffers)"
        )
    return notes
