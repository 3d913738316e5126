"""The Estimate that wb.estimate returns (made in estimation.py), and its RankEstimate per rank:
memory against the target's capacity, step time from FLOPs and collective volumes, time and cost to
max_steps, shown as text, a table and HTML. Every figure says what it rests on."""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workbench.estimator.catalog import Accelerator
from workbench.utils.units import GiB, fmt_bytes, fmt_duration, fmt_money, fmt_seconds, fmt_span

if TYPE_CHECKING:
    from workbench.estimator.precision_speed import PrecisionSpeed

GPU_OVERHEAD_BYTES = int(0.75 * GiB)
"""CUDA context and NCCL's buffers: about 0.5-1 GiB per GPU that no tensor accounts for."""
CUBLAS_WORKSPACE_BYTES = 65 * 2**20
"""cuBLAS's and cuBLASLt's workspaces, which PyTorch takes from its caching allocator at the first
matmul, so torch.cuda.max_memory_allocated counts them: 65 MiB measured on an H100 (digits: 65.0 MiB
above its tensors)."""
CPU_OVERHEAD_BYTES = int(0.35 * GiB)
"""A rank's Python, torch and accelerate before any tensor (this machine: about 300-400 MiB of
RSS)."""
HEADROOM = 0.08
"""A run 'fits' when its peak stays under 92% of the device: the caching allocator fragments the
rest."""
SLOW_RUN_S = 24 * 3600.0
"""A plan whose run to max_steps takes longer than this (a day) gets a time warning beside its
memory verdict (Estimate.time_verdict): rarely what a user meant, and a day's wait before finding
out."""
SLOW_RUN_WORDS = "a day"
"""SLOW_RUN_S in words, for the warning."""
SLOWER_FACTOR = 10.0
"""A plan whose step is this many times slower than the same plan in another precision its target
supports gets a time warning naming that precision (bf16 on a CPU without a bf16 matrix unit runs
~200x slower than fp32)."""
TIME_WARNING_COLOR = "#a15c00"
"""Amber: a warning, neither the green of a plan that fits nor the red of one that doesn't."""
CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers", "temporaries")
COLUMNS = (
    "params",
    "grads held",
    "grads at peak",
    "optimizer",
    "activations",
    "buffers",
    "temporaries",
    "overhead",
    "peak",
)
"""A rank's row: bytes by category at the step's peak, with the gradients it holds beside those at
the peak."""
GRADS_LEGEND = (
    "grads held: the gradients a rank keeps for the optimizer step (its shard under zero2, zero3 "
    "and hsdp); grads at peak: those alive at the moment of the step's memory peak (0 when none "
    "are then: the peak comes before backward makes them, or after they are freed)"
)


@dataclass
class RankEstimate:
    """What one rank holds at its peak, by category (bytes)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    """Communication buffers: FSDP all-gather/reduce-scatter, DDP gradient buckets."""
    temporaries: int
    overhead: int
    """Runtime memory no tensor accounts for (CUDA context, NCCL's buffers; the interpreter on
    CPU)."""
    tracked_peak: int
    """The traced step's peak (tensors only; without DDP's buckets, which the trace leaves out)."""

    extra_buffers: int = 0
    """Buffers the trace leaves out, added from their known size: DDP's gradient buckets, cuBLAS's
    workspaces on a GPU."""
    held: dict[str, int] = field(default_factory=dict)
    """Parameters, gradients and optimizer state the rank holds at rest (its shards), by name."""

    @property
    def tensors(self) -> int:
        """Bytes of tensors at the peak: what PyTorch's memory tracker measures in the real run."""
        return self.tracked_peak + self.extra_buffers

    @property
    def peak(self) -> int:
        return self.tensors + self.overhead

    def row(self) -> list[int | None]:
        """Bytes by COLUMNS (grads held: None when the trace didn't measure it)."""
        return [
            self.params,
            self.held.get("grads"),
            self.grads,
            self.optimizer,
            self.activations,
            self.buffers + self.extra_buffers,
            self.temporaries,
            self.overhead,
            self.peak,
        ]


@dataclass
class Estimate:
    """An estimate of a run per rank: memory, time and cost, for a target accelerator x count x
    nodes."""

    config: dict[str, Any]
    target: Accelerator
    gpus: int
    nodes: int
    ranks: list[RankEstimate]
    flops_per_step: float
    """Per rank, counted from the trace (attention counted in full, as FlopCounterMode does)."""
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    global_batch: int
    tokens_per_sample: int | None
    efficiency: float
    assumptions: list[str] = field(default_factory=list)
    trace_s: float = 0.0
    max_rss_bytes: int = 0
    other_precisions: list[PrecisionSpeed] = field(default_factory=list)
    """The same plan's step in the other precisions the target supports, fastest first
    (precision_speed.py): what the time verdict compares against."""

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return (
            self.target.memory_bytes
            if self.target.kind == "cuda"
            else self.target.memory_bytes // self.gpus
        )

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    @property
    def usable(self) -> int:
        return int(self.capacity * (1 - HEADROOM))

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable

    @property
    def short_by(self) -> int:
        return max(0, self.peak - self.usable)

    @property
    def run_s(self) -> float:
        return self.step_s * int(self.config["max_steps"])

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s if self.step_s else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        return self.samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None

    @property
    def gpu_hours(self) -> float:
        return self.run_s / 3600 * self.gpus * self.nodes

    @property
    def cost(self) -> float | None:
        price = self.target.price_per_hour
        return None if price is None else price * self.gpu_hours

    # ---- words -----------------------------------------------------------------------------------
    @property
    def where(self) -> str:
        """'8 x H100-SXM-80GB', '2 x 8 x H100-SXM-80GB' (nodes x GPUs per node x accelerator: the
        panel's and Slurm's way); on a CPU, its processes."""
        if self.target.kind == "cpu":
            nodes = f"{self.nodes} nodes x " if self.nodes > 1 else ""
            return f"{self.target.name}, {nodes}{self.gpus} process" + "es" * (self.gpus != 1)
        return (
            f"{self.nodes} x {self.gpus} x {self.target.name}"
            if self.nodes > 1
            else f"{self.gpus} x {self.target.name}"
        )

    def settings(self) -> str:
        """Which settings these figures are for: task, layout, precision, micro-batch x
        accumulation, world."""
        return settings_line(self.config, self.gpus * self.nodes)

    def verdict(self) -> str:
        """The memory verdict: 'fits: ...', or 'fits in memory: ...' when the plan is slow (the
        time verdict then says why), or 'short by ...'."""
        peak, usable = fmt_bytes(self.peak), fmt_bytes(self.usable)
        if self.fits:
            fits = "fits in memory" if self.slow else "fits"
            return f"{fits}: {peak} per rank of {usable} usable on {self.target.name}"
        return (
            f"short by {fmt_bytes(self.short_by)}: {peak} per rank, {usable} usable on "
            f"{self.target.name}"
        )

    @property
    def slow(self) -> bool:
        """The plan is slow: its time verdict warns (time_verdict())."""
        return self.time_verdict() is not None

    def faster_precision(self) -> PrecisionSpeed | None:
        """Another precision the target supports in which the same step is at least SLOWER_FACTOR
        times faster: the fastest such, or None."""
        fastest = self.other_precisions[0] if self.other_precisions else None
        if fastest is None or fastest.step_s <= 0:
            return None
        return fastest if self.step_s >= SLOWER_FACTOR * fastest.step_s else None

    def time_verdict(self) -> str | None:
        """None when the plan's time is unremarkable; else one sentence naming why it is slow (a
        step SLOWER_FACTOR times slower than in another precision the target supports; a run to
        max_steps over SLOW_RUN_S) and the faster choice: 'bf16 on this CPU runs 200x slower than
        fp32 (...): use fp32 (step 221 ms, 100 steps in 22.1 s)'."""
        steps = int(self.config["max_steps"])
        causes = []
        faster = self.faster_precision()
        if faster is not None:
            where = "this CPU" if self.target.kind == "cpu" else self.target.name
            causes.append(
                f"{self.config['precision']} on {where} runs "
                f"{_factor(self.step_s / faster.step_s)} slower than {faster.precision} "
                f"({faster.why}): use {faster.precision} (step {step_text(faster.step_s)}, "
                f"{steps} steps in {fmt_span(faster.step_s * steps)})"
            )
        if self.run_s > SLOW_RUN_S:
            in_precision = f" in {self.config['precision']}" if faster is not None else ""
            took = f"{steps} steps{in_precision} take {fmt_span(self.run_s)}, over {SLOW_RUN_WORDS}"
            causes.append(took if faster is not None else f"{took}: {self._faster_plan()}")
        return "; ".join(causes) or None

    def _slow_words(self) -> str:
        """The time verdict in a few words, for the one-line repr: 'bf16 130x slower than fp32,
        over a day'."""
        words = []
        faster = self.faster_precision()
        if faster is not None:
            factor = _factor(self.step_s / faster.step_s)
            words.append(f"{self.config['precision']} {factor} slower than {faster.precision}")
        if self.run_s > SLOW_RUN_S:
            words.append(f"over {SLOW_RUN_WORDS}")
        return ", ".join(words)

    def _faster_plan(self) -> str:
        """What shortens a long run that no precision fixes."""
        if self.target.kind == "cpu":
            return "fewer max_steps, a smaller model, or a GPU target"
        return "fewer max_steps, more GPUs or nodes, or a faster accelerator"

    def cost_text(self) -> str:
        """'$12.30', '< $0.01', or 'no price' when the target has none."""
        return fmt_money(self.cost) if self.cost is not None else "no price"

    def step_line(self) -> str:
        """'step 26.2 ms (compute ...), 1,220 samples/s, 156,160 tokens/s': tokens/s only for a
        task of tokens, small rates to their significant digits."""
        tokens = f", {_rate(self.tokens_per_s)} tokens/s" if self.tokens_per_s is not None else ""
        return (
            f"step {step_text(self.step_s)} (compute "
            f"{step_text(self.compute_s)}{self._comm_text()}), {_rate(self.samples_per_s)} "
            f"samples/s{tokens}"
        )

    def _comm_text(self) -> str:
        """How much of the communication the step waits for: none, all, or part of it."""
        comm, exposed = self.comm_s, self.exposed_comm_s
        if comm <= 0:
            return ""
        if exposed <= 0.005 * comm:
            return f", communication {fmt_seconds(comm)} hidden behind it"
        if exposed >= 0.995 * comm:
            return f", then communication {fmt_seconds(comm)}"
        return f", communication {fmt_seconds(comm)} of which {fmt_seconds(exposed)} not hidden"

    def run_line(self) -> str:
        """'400 steps: 50.2 s, 0.03 GPU-hours, $0.12'; a CPU plan has no GPU-hours (and no
        price)."""
        line = f"{self.config['max_steps']} steps: {fmt_span(self.run_s)}"
        if self.target.kind == "cpu":
            return line
        hours = (
            f"{self.gpu_hours:.2f}" if self.gpu_hours >= 0.01 or self.gpu_hours == 0 else "< 0.01"
        )
        cost = f", {fmt_money(self.cost)}" if self.cost is not None else ""
        return f"{line}, {hours} GPU-hours{cost}"

    def __repr__(self) -> str:
        fits = "fits" if self.fits else f"short by {fmt_bytes(self.short_by)}"
        slow = f"; slow: {self._slow_words()}" if self.slow else ""
        return (
            f"<Estimate {self.config['task']} {layout_name(self.config)} on {self.where}: {fits}, "
            f"peak {fmt_bytes(self.peak)} of {fmt_bytes(self.usable)} usable; step "
            f"{step_text(self.step_s)}; {self.config['max_steps']} steps {fmt_span(self.run_s)}"
            f"{slow}; {self.cost_text()}>"
        )

    def table(self) -> str:
        """The estimate as plain text: memory per group of identical ranks, the verdict, time, cost,
        assumptions."""
        groups = self.rank_groups()
        width = max(5, *(len(label) for label, _ in groups))
        lines = [
            f"estimate: {self.settings()} on {self.where}, global batch {self.global_batch}",
            f"  {'ranks':>{width}} " + " ".join(f"{k:>14}" for k in COLUMNS),
        ]
        for label, values in groups:
            lines.append(f"  {label:>{width}} " + " ".join(f"{fmt_bytes(v):>14}" for v in values))
        lines += [
            *textwrap.wrap(GRADS_LEGEND, 116, initial_indent="  ", subsequent_indent="  "),
            f"  {self.verdict()}",
            *([f"  slow: {warning}"] if (warning := self.time_verdict()) else []),
            f"  {self.step_line()}",
            f"  {self.run_line()}",
            "  assumptions:",
            *(f"    - {a}" for a in self.assumptions),
        ]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The estimate in a notebook: a table of rank groups by category, the verdict, time and
        cost."""
        cell = "style='text-align:right;padding:0 8px;white-space:nowrap'"
        head = "".join(f"<th {cell}>{html.escape(k)}</th>" for k in ("ranks", *COLUMNS))
        body = "".join(
            f"<tr class='wb-rank-group' data-ranks='{html.escape(label)}'><td "
            f"{cell}>{html.escape(label)}</td>"
            + "".join(f"<td {cell}>{fmt_bytes(v)}</td>" for v in values)
            + "</tr>"
            for label, values in self.rank_groups()
        )
        color = "#2e7d32" if self.fits else "#b00020"
        assumptions = "".join(f"<li>{html.escape(a)}</li>" for a in self.assumptions)
        return (
            f"<div class='wb-estimate-view'><b>Estimate</b> for {html.escape(self.settings())} on "
            f"{html.escape(self.where)}, global batch {self.global_batch}"
            f"<table class='wb-estimate-table'><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>"
            f"<small>{html.escape(GRADS_LEGEND)}</small>"
            f"<div class='wb-estimate-verdict' style='color:{color}'>"
            f"<b>{html.escape(self.verdict())}</b></div>{time_warning_html(self)}"
            f"<div>{html.escape(self.step_line())}</div>"
            f"<div>{html.escape(self.run_line())}</div>"
            f"<details><summary><small>assumptions ({len(self.assumptions)})</small></summary>"
            f"<small><ul>{assumptions}</ul></small></details></div>"
        )

    def rank_groups(self) -> list[tuple[str, list[int | None]]]:
        """Ranks whose rows read the same as shown, one row each, labelled compactly: ('0-6, 8',
        [...]). A byte count that differs below the shown precision doesn't split a group; to_dict()
        has the exact figures of every rank."""
        groups: dict[tuple[str, ...], tuple[list[int], list[int | None]]] = {}
        for r in self.ranks:
            row = r.row()
            groups.setdefault(tuple(fmt_bytes(v) for v in row), ([], row))[0].append(r.rank)
        return [(compact_ranks(ranks), row) for ranks, row in groups.values()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "settings": self.settings(),
            "fits": self.fits,
            "short_by_bytes": self.short_by,
            "peak_bytes": self.peak,
            "capacity_bytes": self.capacity,
            "ranks": [{**vars(r), "tensors": r.tensors, "peak": r.peak} for r in self.ranks],
            "flops_per_step": self.flops_per_step,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "step_s": self.step_s,
            "run_s": self.run_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "gpu_hours": self.gpu_hours,
            "cost": self.cost,
            "efficiency": self.efficiency,
            "time_verdict": self.time_verdict(),
            "slow": self.slow,
            "other_precisions": [vars(p) for p in self.other_precisions],
            "assumptions": self.assumptions,
        }


def compact_ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 5, 7, 8] -> '0-3, 5, 7-8'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def layout_name(config: dict[str, Any]) -> str:
    """'ddp', 'hsdp 2 x 4', 'zero3 x tp 2', 'pp 2 x ddp': the parallel layout in a few words."""
    name = str(config["parallelism"])
    tp, pp, cp = int(config.get("tp", 1)), int(config.get("pp", 1)), int(config.get("cp", 1))
    if name == "hsdp" and config.get("dp_shard"):
        dp = int(config["num_processes"]) // (tp * pp * cp)
        name += f" {dp // int(config['dp_shard'])} x {config['dp_shard']}"
    if cp > 1:
        name += f" x cp {cp}"
    if tp > 1:
        name += f" x tp {tp}"
    return f"pp {pp} x {name}" if pp > 1 else name


def settings_line(config: dict[str, Any], world: int) -> str:
    """The settings an estimate is for, in one line: 'char-gpt (preset=tiny), zero3 x tp 2, bf16,
    micro-batch 8 x 2 accumulation, 8 ranks'."""
    options = ", ".join(f"{k}={v}" for k, v in (config.get("task_options") or {}).items())
    task = f"{config['task']} ({options})" if options else str(config["task"])
    return (
        f"{task}, {layout_name({**config, 'num_processes': world})}, {config['precision']}, "
        f"micro-batch {config['micro_batch_size']} x {config['grad_accum_steps']} accumulation, "
        f"{world} rank" + "s" * (world != 1)
    )


def time_warning_html(est: Estimate) -> str:
    """The time verdict as an amber line (class wb-time-warning) to sit beside the memory verdict;
    '' when the plan isn't slow."""
    warning = est.time_verdict()
    if warning is None:
        return ""
    return (
        f"<div class='wb-time-warning' style='color:{TIME_WARNING_COLOR}'>"
        f"<b>slow</b>: {html.escape(warning)}</div>"
    )


def step_text(seconds: float) -> str:
    """A step's time: '164 µs', '26.2 ms', '3.1 s' under a minute, a duration above one ('12 h 17
    min')."""
    return fmt_seconds(seconds) if seconds < 60 else fmt_duration(seconds)


def _factor(ratio: float) -> str:
    """'200x', '12x', '9.5x'."""
    return f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _rate(per_s: float) -> str:
    """A rate to the significant digits it means, never rounded to 0 when it isn't: '63,063',
    '12.3', '0.412', '0.000362'."""
    if per_s >= 100:
        return f"{per_s:,.0f}"
    if per_s <= 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(per_s)))
    return f"{per_s:.{decimals}f}" if decimals <= 9 else f"{per_s:.3g}"
