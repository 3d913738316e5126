"""Step time of a layout: step.py's step_time() of each traced rank, and what model parallelism
adds on top of it.

- Tensor parallel: the TP group's all-reduces sit between the matrix multiplies that need their
  result, so none of their time hides behind compute (data-parallel collectives still overlap as
  step_time() says).
- Pipeline: every stage works through the step's m micro-batches at the pace of the slowest stage;
  the schedule's fill and drain leave each stage idle for pp - 1 micro-batch slots (the bubble,
  (pp - 1) / (m + pp - 1) of the schedule, the same for GPipe and 1F1B). Activations go forward
  and gradients back across each stage boundary per micro-batch; those sends overlap compute
  except on the fill and drain, where 2 x (pp - 1) of them are on the critical path. After the
  schedule, the tied parameters' gradients and the replicas' gradients are summed in plain
  all-reduces that nothing overlaps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.config.mesh import virtual_stages
from workbench.estimator.catalog import Accelerator
from workbench.estimator.timing.step import step_time
from workbench.estimator.trace.step import StepTrace
from workbench.utils.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from workbench.config import RunConfig


@dataclass
class ParallelTime:
    """One step of the layout, in seconds, and what each figure rests on."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    efficiency: float
    flops: float
    """FLOPs of the rank that sets the pace (the slowest pipeline stage; any rank otherwise)."""
    assumptions: list[str] = field(default_factory=list)


def parallel_time(
    cfg: RunConfig,
    traces: list[StepTrace],
    extra_comm: dict[str, dict[str, Any]],
    target: Accelerator,
    nodes: int,
    network: str,
    runs_dir: Path,
) -> ParallelTime:
    """The step time of `traces` (one per pipeline stage, or the one rank of other layouts) on
    `target`."""
    if cfg.pp > 1:
        return _pipeline_time(cfg, traces, target, nodes, network, runs_dir)
    trace = traces[0]
    full = step_time(cfg, trace, extra_comm, target, nodes, network, runs_dir)
    tp = {k: v for k, v in trace.comm.items() if v.get("dim") == "tp"}
    if not tp:
        return ParallelTime(
            full.compute_s,
            full.comm_s,
            full.exposed_comm_s,
            full.step_s,
            full.efficiency,
            trace.flops,
            list(full.assumptions),
        )
    tp_s = _comm_s(cfg, trace, tp, target, nodes, network, runs_dir)
    rest = step_time(
        cfg,
        dataclasses.replace(trace, comm={k: v for k, v in trace.comm.items() if k not in tp}),
        extra_comm,
        target,
        nodes,
        network,
        runs_dir,
    )
    exposed = tp_s + rest.exposed_comm_s
    count, nbytes = sum(v["count"] for v in tp.values()), sum(v["bytes"] for v in tp.values())
    why = (
        f"tensor parallel: the TP group's {count} collectives per step ({fmt_bytes(int(nbytes))}) "
        f"wait for the matrix multiplies around them: all {fmt_seconds(tp_s)} of them on the "
        "critical path"
    )
    return ParallelTime(
        full.compute_s,
        full.comm_s,
        exposed,
        full.compute_s + exposed,
        full.efficiency,
        trace.flops,
        [*full.assumptions, why],
    )


def _comm_s(
    cfg: RunConfig,
    trace: StepTrace,
    comm: dict[str, dict[str, Any]],
    target: Accelerator,
    nodes: int,
    network: str,
    runs_dir: Path,
) -> float:
    """step_time()'s seconds for just these collectives of the trace."""
    only = dataclasses.replace(trace, comm=comm, flops=0.0)
    return step_time(cfg, only, {}, target, nodes, network, runs_dir).comm_s


def _pipeline_time(
    cfg: RunConfig,
    traces: list[StepTrace],
    target: Accelerator,
    nodes: int,
    network: str,
    runs_dir: Path,
) -> ParallelTime:
    """The step time of a pipeline, from its stages' traces: the slowest stage's pace, the bubble,
    and the sends of the fill and drain (see the module docstring)."""
    stages = [step_time(cfg, t, {}, target, nodes, network, runs_dir) for t in traces]
    p2p = [{k: v for k, v in t.comm.items() if k.startswith("send@")} for t in traces]
    p2p_s = [
        _comm_s(cfg, t, sends, target, nodes, network, runs_dir) for t, sends in zip(traces, p2p)
    ]
    after_s = [max(0.0, s.comm_s - p) for s, p in zip(stages, p2p_s)]
    per_send = max(
        (p / max(1, sum(v["count"] for v in sends.values())) for p, sends in zip(p2p_s, p2p)),
        default=0.0,
    )
    slowest = max(range(len(stages)), key=lambda s: stages[s].compute_s)
    m, pp, v = cfg.grad_accum_steps, cfg.pp, virtual_stages(cfg)
    compute = stages[slowest].compute_s
    bubble = compute / (m * v) * (pp - 1)  # a chunk's share of a micro-batch, per stage boundary
    fill_drain = 2 * (pp - 1) * per_send
    exposed = fill_drain + max(after_s)
    activations = max(t.p2p_bytes for t in traces)
    # step_time()'s overlap rule is for collectives issued during compute; a pipeline's are priced
    # here
    assumptions = [
        *(a for a in stages[slowest].assumptions if not a.startswith("overlap:")),
        _schedule_note(cfg, slowest, compute, bubble),
        (
            f"pipeline sends: each micro-batch's activations ({fmt_bytes(activations)}) go forward "
            f"and its gradients back across each of the {pp - 1} stage boundaries; they overlap "
            f"compute except on the fill and drain: 2 x {pp - 1} of them "
            f"({fmt_seconds(fill_drain)}) on the critical path"
        ),
        (
            "the stage's other collectives (tied parameters' gradients summed between their "
            "stages, replicas averaged, and any FSDP or TP collectives inside the stage), not "
            f"overlapped: {fmt_seconds(max(after_s))}"
        ),
    ]
    return ParallelTime(
        compute,
        max(s.comm_s for s in stages),
        exposed,
        compute + bubble + exposed,
        stages[slowest].efficiency,
        traces[slowest].flops,
        assumptions,
    )


def _schedule_note(cfg: RunConfig, slowest: int, compute: float, bubble: float) -> str:
    """What the pipeline's schedule rests on: the slowest stage (its `compute` seconds a step) sets
    the pace, and the bubble leaves each stage idle for `bubble` seconds a step."""
    m, pp, v = cfg.grad_accum_steps, cfg.pp, virtual_stages(cfg)
    return (
        f"pipeline: {pp} stages, {cfg.pp_schedule.upper()} over {m} micro-batches"
        + (f", {v} chunks per rank" if v > 1 else "")
        + f"; the slowest stage (stage {slowest}, {fmt_seconds(compute / m)} per micro-batch "
        "forward and backward) sets the pace for all; the bubble, "
        + (
            f"(pp - 1) / (v x m + pp - 1) = {(pp - 1) / (v * m + pp - 1):.0%}"
            if v > 1
            else f"(pp - 1) / (m + pp - 1) = {(pp - 1) / (m + pp - 1):.0%}"
        )
        + f" of the schedule, leaves each stage idle for {fmt_seconds(bubble)} per step"
        + (
            " (zero bubble fills part of it with weight gradients: not counted)"
            if cfg.pp_schedule == "zero_bubble"
            else ""
        )
    )
