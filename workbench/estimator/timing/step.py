"""Step time of a traced step on a target: the step op by op against what the target does
(cpu.py: this machine's measured profile on a CPU; gpu.py: the datasheet on a GPU), then scaled
by what completed runs of the same kind measured against the same model (learning.py). Every
figure says what it rests on."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.estimator.catalog import Accelerator
from workbench.estimator.machine.cache import machine_profile
from workbench.estimator.timing.cpu import RawStep, cpu_step
from workbench.estimator.timing.gpu import gpu_step
from workbench.estimator.timing.learning import fingerprint, learn
from workbench.estimator.trace.fake_world import wire_bytes
from workbench.estimator.trace.step import StepTrace

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.estimator.machine.profile import MachineProfile

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
"""DDP's default buckets (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_mb=25): the
first is small so the first all-reduce starts early in backward."""
MODEL_VERSION = 4
"""Bumped when the step-time model changes: past runs are then estimated again before they teach."""


@dataclass
class StepTime:
    """One rank's step, in seconds, and what each figure rests on."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    efficiency: float
    """FLOPs per second of compute over the best the target reaches (measured here; the datasheet on
    a GPU)."""
    assumptions: list[str] = field(default_factory=list)
    raw_step_s: float = 0.0
    """The step before learning from runs."""
    correction: float = 1.0
    """Measured / estimated of comparable completed runs: the factor applied (1.0: nothing
    learnt)."""
    learned_from: list[str] = field(default_factory=list)
    """The runs the correction comes from."""
    parts: dict[str, float] = field(default_factory=dict)
    """What compute_s is made of (cpu.py's RawStep.parts), corrected."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def step_time(
    cfg: RunConfig,
    trace: StepTrace,
    extra_comm: dict[str, dict[str, Any]],
    target: Accelerator,
    nodes: int,
    network: str,
    runs_dir: Path,
) -> StepTime:
    """The traced step's time on `target` (`extra_comm`: collectives the trace can't see, DDP's
    all-reduce), corrected by the completed runs in `runs_dir` most like it."""
    raw, key = raw_step(cfg, trace, extra_comm, target, nodes, network)
    lesson = learn(
        cfg,
        trace.world,
        device_class(target),
        Path(runs_dir),
        key,
        past_run_estimator(target, network),
    )
    c = lesson.ratio
    return StepTime(
        compute_s=raw.compute_s * c,
        comm_s=raw.comm_s * c,
        exposed_comm_s=raw.exposed_comm_s * c,
        efficiency=raw.efficiency / c,
        assumptions=[*raw.assumptions, lesson.note],
        raw_step_s=raw.step_s,
        correction=c,
        learned_from=list(lesson.runs),
        parts={k: v * c for k, v in raw.parts.items()},
    )


def raw_step(
    cfg: RunConfig,
    trace: StepTrace,
    extra_comm: dict[str, dict[str, Any]],
    target: Accelerator,
    nodes: int,
    network: str,
) -> tuple[RawStep, str]:
    """The step before learning, and a key for what it rests on (model version, profile or
    datasheet)."""
    if target.kind != "cpu":
        raw = gpu_step(cfg, trace, extra_comm, target, nodes, network)
        return raw, fingerprint(MODEL_VERSION, dataclasses.asdict(target))
    profile = cpu_profile(cfg, trace.world)
    raw = cpu_step(cfg, trace, extra_comm, profile)
    threads = (
        "one thread each (forked ranks)"
        if profile.threads == 1 and cfg.start_method != "spawn"
        else f"{profile.threads} thread(s) each"
    )
    raw.assumptions.insert(
        0, f"ranks: {trace.world} on this machine's {_cores()} core(s), {threads}"
    )
    return raw, fingerprint(MODEL_VERSION, dataclasses.asdict(profile))


def cpu_profile(cfg: RunConfig, world: int, refresh: bool = False) -> MachineProfile:
    """This machine's profile for the run's ranks, with the threads a rank will have: forked ranks
    (the notebook's launches) run one thread each, as OpenMP does not survive a fork; spawned ones
    their share of the cores. `refresh`: measure it again now, whatever is stored."""
    from workbench.utils.hardware import detect

    threads = detect().threads_per_rank(world) if cfg.start_method == "spawn" else 1
    return machine_profile(world, threads, refresh=refresh)


def _cores() -> int:
    from workbench.utils.hardware import detect

    return detect().cpu_count


def device_class(target: Accelerator) -> str:
    """The class completed runs record (Summary.device_class): 'cpu', or 'cuda-<model>'."""
    from workbench.utils.hardware import gpu_model

    return "cpu" if target.kind == "cpu" else f"cuda-{gpu_model(target.name)}"


COMPRESSION = {"fp16": 0.5, "bf16": 0.5, "powersgd": 0.05}
"""Bytes DDP's compression hooks send, as a fraction of the gradients' (powersgd: its low rank,
roughly)."""


def replicated_comm(
    cfg: RunConfig, trace: StepTrace, world: int, nodes: int
) -> dict[str, dict[str, Any]]:
    """DDP's gradient all-reduce, which the trace can't see (its buckets live in C++), for
    replicated modes."""
    if not (cfg.parallelism in ("ddp", "zero1") and world > 1 and cfg.tp == 1 and cfg.pp == 1):
        return {}
    volume = trace.held["grads"] * COMPRESSION.get(cfg.grad_compression, 1.0)
    buckets = 1 + max(
        0, math.ceil((trace.held["grads"] - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_CAP_BYTES)
    )
    return {
        "all_reduce@ddp": {
            "count": buckets,
            "bytes": volume,
            "group": world,
            "spans_nodes": nodes > 1,
            "wire_bytes": wire_bytes("all_reduce", volume, world),
            "dim": "dp_replicate",
        }
    }


def past_run_estimator(
    target: Accelerator, network: str
) -> Callable[[RunConfig, int, bool], float]:
    """Today's step time, before learning, of a past run's config on `world` ranks: its trace (from
    the cache when made before), priced as an estimate of it would be."""

    def estimate_of(run_cfg: RunConfig, world: int, may_trace: bool) -> float:
        from workbench.estimator.trace.cache import cache_only, cached_trace
        from workbench.tasks import get_task

        gpu = target.kind == "cuda"
        run = run_cfg.replace(
            num_processes=world,
            oversubscribe=True,
            track_memory=False,
            device="cuda" if gpu else "cpu",
        )
        # a past run is taken to have run on one node of the target
        with cache_only() if not may_trace else contextlib.nullcontext():
            trace = cached_trace(
                run, get_task(run.task), world=world, gpu_target=gpu, gpus_per_node=world
            )
        comm = replicated_comm(run, trace, world, 1)
        return raw_step(run, trace, comm, target, 1, network)[0].step_s

    return estimate_of
