"""What to change when a run doesn't fit, and which accelerator to rent for it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.estimator.catalog import load_catalog

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.estimator.report import Estimate
    from workbench.tasks import Task

LIMIT = 5


def _candidates(
    cfg: RunConfig, est: Estimate, has_blocks: bool
) -> list[tuple[str, RunConfig, int, int]]:
    """(what changes, the changed config, gpus, nodes): one change at a time, then all memory savers
    at once."""
    out: list[tuple[str, RunConfig, int, int]] = []
    gpus, nodes = est.gpus, est.nodes
    savers: dict[str, object] = {}
    if cfg.precision == "fp32" and est.target.peak("bf16"):
        savers["precision"] = "bf16"
        out.append(("precision bf16", cfg.replace(precision="bf16"), gpus, nodes))
    if cfg.activation_checkpointing == "none" and has_blocks:
        savers["activation_checkpointing"] = "full"
        out.append(
            ("activation checkpointing", cfg.replace(activation_checkpointing="full"), gpus, nodes)
        )
    if cfg.parallelism in ("ddp", "zero1", "none") and gpus * nodes > 1:
        for mode in ("zero2", "zero3"):
            out.append(
                (
                    f"parallelism {mode}",
                    cfg.replace(parallelism=mode, grad_compression="none"),
                    gpus,
                    nodes,
                )
            )
        savers["parallelism"] = "zero3"
    if cfg.micro_batch_size > 1:
        m, a = cfg.micro_batch_size // 2, cfg.grad_accum_steps * 2
        if m * a == cfg.micro_batch_size * cfg.grad_accum_steps:
            out.append(
                (
                    f"micro-batch {m} x accumulation {a} (same global batch)",
                    cfg.replace(micro_batch_size=m, grad_accum_steps=a),
                    gpus,
                    nodes,
                )
            )
    if est.target.kind == "cuda":
        more = (gpus * 2, nodes) if gpus < 8 else (gpus, nodes * 2)
        sharded = (
            cfg
            if cfg.parallelism not in ("ddp", "zero1", "none")
            else cfg.replace(parallelism="zero3", grad_compression="none")
        )
        out.append((f"{more[1]} x {more[0]} GPUs with {sharded.parallelism}", sharded, *more))
    if len(savers) > 1:
        extra = {"grad_compression": "none"} if "parallelism" in savers else {}
        names = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in savers.items())
        out.append((f"all of: {names}", cfg.replace(**savers, **extra), gpus, nodes))
    return out


def alternatives(
    cfg: RunConfig,
    est: Estimate,
    task: Task,
    *,
    network: str = "infiniband",
    runs_dir: str | Path | None = None,
    catalog: str | Path | None = None,
    progress: Callable[[list[tuple[str, Estimate]]], None] | None = None,
) -> list[tuple[str, Estimate]]:
    """Changes that make a run fit, each with its own estimate, cheapest first (cost, else
    GPU-time), those that make it slow (Estimate.slow) last. Each is a new trace: `progress`, when
    given, gets the list found so far after each one (a box can show them as they come); `catalog`
    is the file the target's accelerator came from, if not the built-in catalog."""
    import torch

    from workbench.estimator import estimate
    from workbench.tasks.blocks import shard_units
    from workbench.tasks.model_plans import ModelPlan

    with torch.device("meta"):
        has_blocks = bool(shard_units(task.build_model(cfg), ModelPlan(task)))
    found: list[tuple[str, Estimate]] = []
    gpu = est.target.name if est.target.kind == "cuda" else None
    for what, changed, gpus, nodes in _candidates(cfg, est, has_blocks):
        try:
            alt = estimate(
                changed.replace(num_processes=gpus * nodes),
                gpu,
                gpus,
                nodes,
                task=task,
                network=network,
                runs_dir=runs_dir,
                catalog=catalog if gpu else None,
            )
        except ValueError:
            continue  # a change this config can't take (e.g. hsdp sizes)
        if alt.fits:
            found.append((what, alt))
            # a change that makes the plan slow (bf16 on a CPU without a bf16 unit) comes last
            found.sort(
                key=lambda item: (
                    item[1].slow,
                    item[1].cost if item[1].cost is not None else item[1].gpu_hours,
                )
            )
            if progress is not None:
                progress(found[:LIMIT])
    return found[:LIMIT]


def compare(
    cfg: RunConfig,
    task: Task,
    *,
    gpus: int,
    nodes: int = 1,
    network: str = "infiniband",
    catalog: str | Path | None = None,
    runs_dir: str | Path | None = None,
) -> list[Estimate]:
    """The same run priced on every catalog accelerator (one trace: the step is the same, only the
    device differs), the ones that fit first, cheapest first."""
    from workbench.estimator.estimation import price
    from workbench.estimator.trace.cache import cached_trace

    world = gpus * nodes
    run = cfg.replace(num_processes=world, oversubscribe=True, device="cuda", track_memory=False)
    trace = cached_trace(run, task, world=world, gpu_target=True, gpus_per_node=gpus)
    rows = []
    for accel in load_catalog(catalog).values():
        try:
            rows.append(
                price(run, task, trace, accel, gpus, nodes, network, Path(runs_dir or cfg.runs_dir))
            )
        except ValueError:
            continue  # no peak for this precision (fp8 on an A100, say)
    return sorted(rows, key=lambda e: (not e.fits, e.cost if e.cost is not None else e.gpu_hours))


def compare_table(rows: list[Estimate]) -> str:
    from workbench.utils.units import fmt_bytes, fmt_money, fmt_span

    lines = [
        f"  {'accelerator':16} {'fits':>5} {'peak/rank':>10} {'capacity':>9} {'step':>9} "
        f"{'run':>12} {'cost':>10}"
    ]
    for e in rows:
        cost = fmt_money(e.cost) if e.cost is not None else "-"
        lines.append(
            f"  {e.target.name:16} {'yes' if e.fits else 'NO':>5} {fmt_bytes(e.peak):>10} "
            f"{fmt_bytes(e.capacity):>9} {1e3 * e.step_s:7.1f}ms {fmt_span(e.run_s):>12} {cost:>10}"
        )
    return "\n".join(lines)
