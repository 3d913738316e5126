"""A traced step's time before anything is learnt from runs, op by op against this machine's
measured profile on a CPU target (a GPU target's, from the datasheet, is gpu.py's).

A small model's step is mostly fixed costs, so every ATen op the step dispatches pays the per-op
cost of a training step measured here (views the cost of a bare op, ops on DTensors their sharding
bookkeeping on top); matrix multiplies and attention run at the FLOP/s measured for their size and
dtype; elementwise ops at the seconds per byte measured for their kind and size; each micro-batch
costs a DataLoader fetch; all of it as much slower than its best as the same work runs here on
average. Collectives cost gloo's time measured here for their kind and size, and none of it hides
behind compute: the ranks already use every core, and gloo copies and sums on those cores.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from workbench.estimator.timing.op_kinds import op_kind
from workbench.estimator.trace.step import StepTrace
from workbench.utils.units import fmt_seconds

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.estimator.machine.profile import MachineProfile


@dataclass
class RawStep:
    """One rank's step before learning, in seconds, with its parts."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    efficiency: float
    parts: dict[str, float] = field(default_factory=dict)
    """What compute_s is made of: 'matmul', 'elementwise', 'dispatch', 'data' (CPU); 'matmul',
    'memory', 'launch' (GPU)."""
    assumptions: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def by_kind(trace: Any) -> dict[str, list[tuple[str, int, int]]]:
    """The trace's ops grouped by kind (op_kind): (name, count, bytes written). Views write nothing,
    whatever the trace's op_bytes says of them."""
    out: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for name, count in trace.ops.items():
        kind = op_kind(name)
        if count > 0 and kind != "free":
            out[kind].append(
                (name, count, 0 if kind == "view" else int(trace.op_bytes.get(name, 0)))
            )
    return out


def _collective_kind(key: str) -> str:
    return key.split("@", 1)[0]


@dataclass
class _Kernels:
    """The priced kernels of a step: seconds by part, and the op counts behind them."""

    matmul: float
    elementwise: float
    dispatch: float
    working: int
    views: int
    sharded: int
    flops_words: str

    @property
    def total(self) -> float:
        return self.matmul + self.elementwise + self.dispatch


def _kernels(
    counts: Any, dtype: str, profile: MachineProfile, dtensor_s: float | None = None
) -> _Kernels:
    """The ops of `counts` (a StepTrace, or anything with its ops, op_bytes, flops and flop_calls),
    each at its best measured here; an op on DTensors at `dtensor_s` more (dtensor_op_cost() unless
    given)."""
    ops = by_kind(counts)
    matmul, flops_words = _flop_time(counts, ops.get("flop", []), dtype, profile)
    elementwise = sum(
        nbytes * profile.seconds_per_byte(kind, nbytes / count)
        for kind, rows in ops.items()
        if kind not in ("flop", "view", "dtensor")
        for _, count, nbytes in rows
        if nbytes
    )
    views = sum(count for _, count, _ in ops.get("view", []))
    sharded = sum(count for _, count, _ in ops.get("dtensor", []))
    working = sum(
        count
        for kind, rows in ops.items()
        if kind not in ("view", "dtensor")
        for _, count, _ in rows
    )
    if dtensor_s is None:
        dtensor_s = dtensor_op_cost(profile)
    dispatch = views * profile.op_s + working * profile.step_op_s + sharded * dtensor_s
    return _Kernels(matmul, elementwise, dispatch, working, views, sharded, flops_words)


def _counts(ref: dict[str, Any]) -> SimpleNamespace:
    """A measured reference step's op counts, in the shape of a StepTrace's."""
    return SimpleNamespace(**{key: ref[key] for key in ("ops", "op_bytes", "flops", "flop_calls")})


def dtensor_op_cost(profile: MachineProfile) -> float:
    """What an op on DTensors costs beyond its local op inside a real step: from the tensor-parallel
    reference step (its time less its other ops, at the slowdown of the plain step timed in turn
    with it, and less its collectives, over its ops on DTensors); the pointwise ops measured alone
    where there is none. A real step's DTensor ops (matmuls, transposes, views, sharding propagation
    with autograd around it) cost 5x those here."""
    ref = profile.layouts.get("tp")
    if not ref:
        return profile.dtensor_op_s
    k = _kernels(_counts(ref), "fp32", profile, dtensor_s=0.0)
    here = _slowdown_beside(profile, ref)
    left = ref["step_s"] - k.total * here - _reference_comm_s(profile, ref)
    return max(profile.dtensor_op_s, left / here / k.sharded) if k.sharded else profile.dtensor_op_s


def _slowdown_beside(profile: MachineProfile, ref: dict[str, Any]) -> float:
    """How much slower than its price the plain reference step ran while timed in turn with layout
    reference `ref` (its 'plain_s'): the slowdown of those same moments, never below 1."""
    plain = _kernels(_counts(profile.reference), "fp32", profile, dtensor_s=0.0).total
    return max(1.0, ref["plain_s"] / plain) if plain > 0 else 1.0


def _reference_comm_s(profile: MachineProfile, ref: dict[str, Any]) -> float:
    return sum(
        profile.collective_s(_collective_kind(key), rec["count"], rec["wire_bytes"])
        for key, rec in ref["comm"].items()
        if rec["count"]
    )


def slowdown(profile: MachineProfile) -> tuple[float, str]:
    """How much slower a real step runs here than its kernels at their best: the measured reference
    step over its own price (machine/reference.py's reference_step), never below 1; the jitter
    burst's mean over best in profiles without one."""
    ref = profile.reference
    if not ref:
        why = "as much slower than its best as the same work runs here on average (measured)"
        return profile.jitter[0], why
    priced = _kernels(_counts(ref), "fp32", profile).total
    factor = max(1.0, ref["step_s"] / priced) if priced > 0 else 1.0
    return factor, (
        f"as much slower than their best as a small model's real training step runs here "
        f"({fmt_seconds(ref['step_s'])} against {fmt_seconds(priced)} priced alike, measured)"
    )


def layout_family(cfg: RunConfig) -> str | None:
    """Which of the machine's layout references (MachineProfile.layouts) a run's step is like."""
    from workbench.config import SHARDED

    if cfg.tp > 1 or cfg.pp > 1:
        # tensor parallel's reference sets the cost of an op on DTensors instead (dtensor_op_cost):
        # as a factor on the whole step it overshot char-gpt's tp step by 25-45%; a pipeline has
        # none
        return None
    if cfg.parallelism in SHARDED:
        return "fsdp"
    return cfg.parallelism if cfg.parallelism in ("ddp", "zero1") else None


def layout_factor(profile: MachineProfile, family: str | None) -> float:
    """How much slower the reference step runs in `family`'s layout here than its ops and
    collectives priced alike, its ops at the slowdown of the plain step timed in turn with it: 1.0
    without one."""
    ref = profile.layouts.get(family or "")
    if not ref:
        return 1.0
    kernels = _kernels(_counts(ref), "fp32", profile).total
    priced = kernels * _slowdown_beside(profile, ref) + _reference_comm_s(profile, ref)
    return min(MAX_FACTOR, max(1 / MAX_FACTOR, ref["step_s"] / priced)) if priced > 0 else 1.0


MAX_FACTOR = 10.0
"""A measured correction beyond this is taken as a measuring accident, and capped."""


def cpu_step(
    cfg: RunConfig, trace: StepTrace, extra_comm: dict[str, dict[str, Any]], profile: MachineProfile
) -> RawStep:
    """The step on this machine's CPU, from its measured profile."""
    dtype = "bf16" if cfg.precision == "bf16" else "fp32"
    k = _kernels(trace, dtype, profile)
    batch = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else 0
    data = cfg.grad_accum_steps * profile.batch_s(batch)
    comm = sum(
        profile.collective_s(_collective_kind(key), rec["count"], rec["wire_bytes"])
        for key, rec in [*trace.comm.items(), *extra_comm.items()]
        if rec["count"]
    )
    factor, why = slowdown(profile)
    family = layout_family(cfg) if trace.world > 1 else None
    in_layout = layout_factor(profile, family)
    compute, comm = (k.total + data) * factor * in_layout, comm * in_layout
    peak = max(r for _, r in profile.matmul.get(dtype) or profile.matmul["fp32"])
    on_dtensors = (
        f", {k.sharded} ops on DTensors at {1e6 * dtensor_op_cost(profile):.1f} us more"
        if k.sharded
        else ""
    )
    assumptions = [
        f"this machine measured ({profile.rates_line()})",
        f"compute {fmt_seconds(compute)}: {k.flops_words}, {fmt_seconds(k.matmul)}; elementwise "
        "writes at the measured seconds per byte of their kind and size, "
        f"{fmt_seconds(k.elementwise)}; {k.working} ops at {1e6 * profile.step_op_s:.1f} us and "
        f"{k.views} views at {1e6 * profile.op_s:.1f} us each{on_dtensors}, "
        f"{fmt_seconds(k.dispatch)}; {cfg.grad_accum_steps} batch fetch(es) of {batch}, "
        f"{fmt_seconds(data)}; all of it x {factor:.2f}, {why}",
        f"communication {fmt_seconds(comm)}: each collective at gloo's time measured here for its "
        "kind and size (a call that didn't stall, interpolated between the sizes measured, plus "
        "the mean stall); none of it hides behind compute (the ranks use every core, and gloo "
        "copies and sums on them)",
    ]
    if in_layout != 1.0:
        assumptions.append(
            f"layout ({family}): the step x {in_layout:.2f}, as much slower as a small model's "
            f"{family} step runs here than its ops and collectives priced alike (measured)"
        )
    return RawStep(
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=comm,
        efficiency=trace.flops / compute / peak if compute else 0.0,
        parts={
            "matmul": k.matmul,
            "elementwise": k.elementwise,
            "dispatch": k.dispatch,
            "data": data,
            "slowdown": compute - (k.total + data),
        },
        assumptions=assumptions,
    )


def _flop_time(
    trace: Any, rows: list[tuple[str, int, int]], dtype: str, profile: MachineProfile
) -> tuple[float, str]:
    """Seconds of the FLOP-bound ops, and how they were priced: each call at the rate measured for
    its own size (attention at attention's) when the trace counts FLOPs per call
    (StepTrace.flop_calls), else all FLOPs at the matmul rate of the mean call."""
    from workbench.estimator.machine.probe import ATTENTION_OPS

    calls = sum(count for _, count, _ in rows)
    if not calls or not trace.flops:
        return 0.0, "no matrix multiplies"
    if not trace.flop_calls:
        rate = profile.matmul_rate(dtype, trace.flops / calls)
        return trace.flops / rate, (
            f"{calls} matrix multiplies and attentions ({trace.flops:.3g} FLOPs) at "
            f"{rate / 1e9:.0f} GFLOP/s {dtype}, the matmul rate measured for their mean size"
        )
    seconds = 0.0
    for name, flops, count in trace.flop_calls:
        attention = name.split(".", 1)[-1].startswith(ATTENTION_OPS)
        seconds += (
            count
            * flops
            / (profile.attention_rate if attention else profile.matmul_rate)(dtype, flops)
        )
    return seconds, (
        f"{calls} matrix multiplies and attentions ({trace.flops:.3g} FLOPs), each call at the "
        f"{dtype} rate measured for its size (attention at attention's), "
        f"{trace.flops / seconds / 1e9:.0f} GFLOP/s on average"
    )
