"""The checks that refuse an impossible rank layout before anything launches: the parallelism fields
agree with each other and with num_processes. Messages name the field, the value and sizes that
work."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.config.mesh import SHARDED

if TYPE_CHECKING:
    from workbench.config.run_config import RunConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_groups(num_processes: int, tp: int = 1) -> list[int]:
    """hsdp's valid dp_shard sizes: divisors of the data-parallel size that leave at least 2
    replicas."""
    dp = num_processes // tp if tp >= 1 and num_processes % tp == 0 else 0
    return [d for d in range(2, dp // 2 + 1) if dp % d == 0]


def default_shard_group(num_processes: int, tp: int = 1) -> int:
    """The dp_shard a switch to hsdp starts from: the largest valid shard group (shard within as
    many ranks as replication allows, as within a node), or 0 when the size can't be split (the
    check then says why)."""
    return max(shard_groups(num_processes, tp), default=0)


def check_layout(cfg: RunConfig) -> None:
    """The parallelism fields agree with each other and with num_processes; ValueError naming the
    fix."""
    p, n, tp = cfg.parallelism, cfg.num_processes, cfg.tp
    if p == "none" and n > 1:
        raise ValueError(
            f"parallelism='none' with num_processes={n}: 'none' runs one process; set "
            "parallelism='ddp' or num_processes=1"
        )
    if tp < 1:
        raise ValueError(
            f"tp={tp}: the tensor-parallel size must be at least 1 (1 turns tensor parallelism off)"
        )
    _check_find_unused(cfg)
    if n % tp:
        raise ValueError(
            f"tp={tp} with num_processes={n}: the tensor-parallel size must divide the number of "
            "ranks (data-parallel size = num_processes / tp); use "
            f"tp={' or '.join(map(str, _divisors(n)))}, or "
            f"num_processes={tp * max(1, n // tp + 1)}"
        )
    if cfg.cp != 1:
        _check_context_parallel(cfg)
    if cfg.pp != 1:
        _check_pipeline(cfg)
        return
    dp = n // (tp * cfg.cp)
    if tp > 1:
        _check_tensor_parallel(cfg, dp)
    _check_shard_group(cfg, dp)
    _check_data_parallel_options(cfg)


def _check_find_unused(cfg: RunConfig) -> None:
    """find_unused_parameters is DDP's: refused where the layout builds no DDP."""
    p, tp = cfg.parallelism, cfg.tp
    if cfg.find_unused_parameters and (p not in ("ddp", "zero1") or tp > 1 or cfg.pp > 1):
        how = (
            f"parallelism={p!r}" + f" with tp={tp}" * (tp > 1) + f" with pp={cfg.pp}" * (cfg.pp > 1)
        )
        raise ValueError(
            f"find_unused_parameters=True with {how}: it is DistributedDataParallel's switch, and "
            "this layout builds no DistributedDataParallel (it reduces gradients through FSDP2, "
            "tensor parallel's replicate or the pipeline's own reduction), so it would do "
            "nothing; set find_unused_parameters=False, or parallelism='ddp' (or 'zero1') with "
            "tp=1 and pp=1"
        )


def _check_shard_group(cfg: RunConfig, dp: int) -> None:
    """dp_shard: with hsdp, a group size that divides the data-parallel size `dp` into at least 2
    groups; 0 with every other mode."""
    p, n, tp, cp = cfg.parallelism, cfg.num_processes, cfg.tp, cfg.cp
    if p == "hsdp":
        ok = shard_groups(n, tp * cp)
        what = (
            "num_processes"
            if tp * cp == 1
            else f"the data-parallel size num_processes/(cp x tp)={dp}"
        )
        hint = (
            f"use dp_shard={' or '.join(map(str, ok))}"
            if ok
            else f"{what} can't be split so; use e.g. num_processes={4 * tp * cp} with dp_shard=2, "
            "or parallelism='zero3' to shard over all data-parallel ranks"
        )
        if cfg.dp_shard < 2 or dp % cfg.dp_shard or dp // cfg.dp_shard < 2:
            raise ValueError(
                f"dp_shard={cfg.dp_shard} with parallelism='hsdp' and "
                f"num_processes={n}{f' (tp={tp})' * (tp > 1)}{f' (cp={cp})' * (cp > 1)}: hsdp "
                "shards within groups of dp_shard ranks and replicates across at least 2 groups, "
                f"so dp_shard must divide {what} and be between 2 and half of it; {hint}"
            )
    elif cfg.dp_shard:
        raise ValueError(
            f"dp_shard={cfg.dp_shard}: only parallelism='hsdp' uses it (parallelism={p!r}); set "
            "dp_shard=0, or parallelism='hsdp'"
        )


def _check_data_parallel_options(cfg: RunConfig) -> None:
    """Gradient compression is DDP's, CPU offload FSDP2's sharded parameters'."""
    p = cfg.parallelism
    if cfg.grad_compression != "none" and p not in ("ddp", "zero1"):
        raise ValueError(
            f"grad_compression={cfg.grad_compression!r} with parallelism={p!r}: compression hooks "
            "apply to DDP's gradient all-reduce (ddp, zero1); sharded modes reduce-scatter "
            "instead. Set grad_compression='none', or parallelism='ddp'"
        )
    if cfg.cpu_offload and p not in ("zero3", "fsdp", "hsdp"):
        raise ValueError(
            f"cpu_offload=True with parallelism={p!r}: offloading sharded parameters and optimizer "
            "state needs parallelism='zero3' (or 'hsdp'); set cpu_offload=False or change "
            "parallelism"
        )


def _check_tensor_parallel(cfg: RunConfig, dp: int) -> None:
    """tp > 1 without a pipeline: TP composes with ddp (FSDP2's replicate), zero2/zero3 and hsdp;
    what it can't take is refused with PyTorch's reason and the nearest layout that runs."""
    p, n, tp = cfg.parallelism, cfg.num_processes, cfg.tp
    if dp > 1 and p == "zero1":
        raise ValueError(
            f"tp={tp} with parallelism='zero1' on num_processes={n} (data-parallel size {dp}): "
            "ZeRO-1's ZeroRedundancyOptimizer broadcasts each rank's updated parameters, and "
            "PyTorch has no rule for broadcasting the DTensors TP makes ('c10d.broadcast_.default "
            "does not have a sharding strategy registered'); set parallelism='zero2' (FSDP2 "
            "shards the optimizer state and the gradients and keeps the parameters gathered from "
            "forward to backward), or 'ddp'"
        )
    if cfg.grad_compression != "none":
        raise ValueError(
            f"grad_compression={cfg.grad_compression!r} with tp={tp}: compression hooks are "
            "DistributedDataParallel's, which refuses the DTensor parameters TP makes ('got mixed "
            "torch.Tensor and DTensor'); ddp x tp all-reduces through FSDP2's replicate, which "
            "takes no hooks. Set grad_compression='none', or tp=1"
        )
    if cfg.cpu_offload and dp == 1 and cfg.cp == 1:  # under cp FSDP2 shards over the CP group
        raise ValueError(
            f"cpu_offload=True with tp={tp} on num_processes={n} (pure tensor parallelism): "
            "offloading is FSDP2's (CPUOffloadPolicy), which needs a data-parallel dimension to "
            f"shard over; set num_processes={2 * tp} with parallelism='zero3', or "
            "cpu_offload=False"
        )


def _check_context_parallel(cfg: RunConfig) -> None:
    """cp != 1: the CP groups divide the ranks, and the layout around them is one that shards the
    parameters over dp_shard x cp (FSDP2, torchtitan's dp_shard_cp): the ranks of a CP group hold
    the same weights and each computes gradients of its slice of the sequence. What the task and the
    machine allow is preflight's."""
    cp, n, tp, p = cfg.cp, cfg.num_processes, cfg.tp, cfg.parallelism
    if cp < 1:
        raise ValueError(
            f"cp={cp}: the context-parallel size must be at least 1 (1 turns context parallelism "
            "off)"
        )
    if n % (cp * tp):
        ok = [d for d in _divisors(n // tp if n % tp == 0 else n) if d > 1]
        raise ValueError(
            f"cp={cp} with num_processes={n}{f' and tp={tp}' * (tp > 1)}: cp x tp must divide the "
            "number of ranks (data-parallel size = num_processes / (cp x tp)); use "
            f"cp={' or '.join(map(str, ok)) or 1}, or "
            f"num_processes={cp * tp * max(1, n // (cp * tp))}"
        )
    if p not in SHARDED:
        raise ValueError(
            f"cp={cp} with parallelism={p!r}: the ranks of a CP group hold the same parameters, "
            "which FSDP2 shards over dp_shard x cp together (as torchtitan does); set "
            "parallelism='zero2' (parameters kept gathered through the step) or 'zero3' (or "
            "'hsdp'), or cp=1"
        )


def _check_pipeline(cfg: RunConfig) -> None:
    """pp > 1: the stages split the ranks evenly, and inside each stage the other dimensions must be
    a layout that works without a pipeline; micro-batches enough for the schedule."""
    pp, n, tp, p = cfg.pp, cfg.num_processes, cfg.tp, cfg.parallelism
    if pp < 1:
        raise ValueError(
            f"pp={pp}: the number of pipeline stages must be at least 1 (1 turns pipelining off)"
        )
    if n % (pp * tp):
        raise ValueError(
            f"pp={pp} with tp={tp} and num_processes={n}: pp x tp must divide the number of ranks; "
            f"use num_processes={pp * tp * max(1, n // (pp * tp))}, or "
            f"pp={' or '.join(str(d) for d in _divisors(n // tp or 1) if d > 1) or 1}"
        )
    per_stage = n // pp
    if p == "none" or (p == "zero1" and per_stage // tp > 1):
        raise ValueError(
            f"parallelism={p!r} with pp={pp}: "
            + (
                "a pipeline runs several processes; set parallelism='ddp' (or a sharded mode)"
                if p == "none"
                else "ZeRO-1's ZeroRedundancyOptimizer needs DDP, which breaks under a pipeline "
                "schedule's repeated backward passes; use parallelism='zero2' (FSDP2: "
                "optimizer state and gradients sharded within each stage) or 'ddp'"
            )
        )
    _check_inside_stage(cfg, per_stage)
    _check_schedule(cfg)
    _refuse_unsupported(
        cfg,
        f"pp={pp}",
        "pipeline parallelism",
        "pp=1",
        {
            "grad_compression": (cfg.grad_compression != "none", "set grad_compression='none'"),
            "cpu_offload": (
                cfg.cpu_offload and p not in ("zero3", "fsdp", "hsdp"),
                "offloading needs FSDP2's sharded parameters: set parallelism='zero3', or "
                "cpu_offload=False",
            ),
        },
    )


def _check_inside_stage(cfg: RunConfig, per_stage: int) -> None:
    """The ranks of one stage (num_processes / pp) take a layout that works as a whole run; 'ddp'
    takes tp too (the pipeline averages its replicas itself: DDP is never built under a
    schedule)."""
    import dataclasses

    dp = per_stage // cfg.tp
    if cfg.parallelism == "hsdp" and dp < 4:
        raise ValueError(
            f"parallelism='hsdp' with pp={cfg.pp}, tp={cfg.tp} and "
            f"num_processes={cfg.num_processes}: each stage has {dp} data-parallel rank(s), too "
            "few for hsdp's groups (at least 2 groups of 2); use parallelism='zero3' or 'ddp', or "
            "more processes"
        )
    if dp == 1 or cfg.parallelism == "ddp":
        return
    try:
        dataclasses.replace(
            cfg, num_processes=per_stage, pp=1, pp_schedule="1f1b", pp_virtual_stages=0
        )
    except ValueError as e:
        raise ValueError(
            f"pp={cfg.pp} on num_processes={cfg.num_processes} leaves {per_stage} rank(s) per "
            f"stage, and there: {e}"
        ) from None


def _check_schedule(cfg: RunConfig) -> None:
    from workbench.config.mesh import INTERLEAVED, virtual_stages

    pp, accum, schedule, v = cfg.pp, cfg.grad_accum_steps, cfg.pp_schedule, virtual_stages(cfg)
    if cfg.pp_virtual_stages < 0:
        raise ValueError(
            f"pp_virtual_stages={cfg.pp_virtual_stages}: chunks per rank must be at least 1 (0 "
            "picks the schedule's own)"
        )
    if schedule in INTERLEAVED:
        if v < 2:
            raise ValueError(
                f"pp_virtual_stages={v} with pp_schedule={schedule!r}: an interleaved schedule "
                "runs several model chunks per rank; set pp_virtual_stages=2 or more (or 0), or "
                "pp_schedule='1f1b'"
            )
        rounds = max(1, accum // pp)
        if accum % rounds:
            raise ValueError(
                f"pp_schedule={schedule!r} with pp={pp} and grad_accum_steps={accum}: PyTorch's "
                f"interleaved schedules need the micro-batches in whole rounds of pp; set "
                f"grad_accum_steps={pp * rounds} (or another multiple of pp)"
            )
    elif v != 1:
        raise ValueError(
            f"pp_virtual_stages={v} with pp_schedule={schedule!r}: {schedule} runs one chunk per "
            "rank; use pp_schedule='interleaved_1f1b' or 'zero_bubble', or pp_virtual_stages=0"
        )
    if schedule == "zero_bubble" and cfg.parallelism in ("zero3", "fsdp", "hsdp"):
        raise ValueError(
            f"pp_schedule='zero_bubble' with parallelism={cfg.parallelism!r}: the zero-bubble "
            "schedule runs each weight-gradient pass after FSDP2 has resharded the parameters it "
            "needs (reshard after forward), and the ranks hang (PyTorch 2.13); use "
            "parallelism='zero2' (parameters kept gathered through the step, as torchtitan does "
            "under a pipeline), or pp_schedule='interleaved_1f1b'"
        )
    if schedule == "1f1b" and accum < pp:
        raise ValueError(
            f"pp_schedule='1f1b' with pp={pp} and grad_accum_steps={accum}: 1F1B needs at least as "
            f"many micro-batches per step (grad_accum_steps) as stages; set grad_accum_steps={pp} "
            "or more, or pp_schedule='gpipe'"
        )


def _common_unsupported(cfg: RunConfig) -> dict[str, tuple[bool, str]]:
    """Settings tensor and pipeline parallelism don't take yet: {field: (set to something refused,
    the fix)}."""
    return {
        "grad_compression": (cfg.grad_compression != "none", "set grad_compression='none'"),
        "cpu_offload": (cfg.cpu_offload, "set cpu_offload=False"),
        "precision": (cfg.precision == "fp16", "use precision='bf16' or 'fp32'"),
    }


def _refuse_unsupported(
    cfg: RunConfig, setting: str, mode: str, off: str, checks: dict[str, tuple[bool, str]]
) -> None:
    for name, (bad, fix) in checks.items():
        if bad:
            raise ValueError(
                f"{name}={getattr(cfg, name)!r} with {setting}: not supported with {mode} yet; "
                f"{fix}, or {off}"
            )
