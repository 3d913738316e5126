"""Input pipeline: can the DataLoader feed the model? Samples/s of the task's loader (the run's
batch size and num_workers) against the model's forward+backward samples/s in one process on this
device.

Data is resolved offline, as the trainer's pre-launch check does: a dataset that isn't in the cache
or a mirror becomes a finding that names the fetch command, never a download.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from workbench import data
from workbench.commands.doctor.findings import Finding, Section
from workbench.tasks import get_task
from workbench.utils.hardware import detect, resolve_device

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


@dataclass(frozen=True)
class Rate:
    """Samples per second measured over `samples` samples in `seconds`."""

    samples: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")


def offline_problem(task: Task, cfg: RunConfig) -> Finding | None:
    """A finding for the first dataset of the task that isn't available offline, or None when all
    are."""
    for name in task.datasets(cfg):
        try:
            data.resolve(name, offline=True, progress=False)
        except data.DataUnavailableError as e:
            return Finding(
                "error",
                f"task {task.name!r}: dataset {name!r} is not available offline "
                f"({str(e).splitlines()[0]})",
                f"workbench data fetch {name} (or point WORKBENCH_DATA_MIRROR at a copy)",
            )
    return None


def loader_rate(
    dataset: Any, cfg: RunConfig, collate_fn: Any, max_batches: int, max_seconds: float
) -> Rate:
    """The DataLoader's throughput after its first batch (worker start-up is not the steady
    state)."""
    loader = DataLoader(
        dataset,
        batch_size=cfg.micro_batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=collate_fn,
        num_workers=cfg.num_workers,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    batches = iter(loader)
    next(batches)
    samples, start = 0, time.perf_counter()
    for i, _ in enumerate(batches):
        samples += cfg.micro_batch_size
        if i + 1 >= max_batches or time.perf_counter() - start > max_seconds:
            break
    return Rate(samples, time.perf_counter() - start)


def model_rate(
    task: Task, cfg: RunConfig, batch: Any, device: torch.device, steps: int, max_seconds: float
) -> Rate:
    """Forward + backward samples/s of one process (fp32, no optimizer step), after two warm-up
    steps."""
    model = task.build_model(cfg).to(device).train()
    batch = send_to_device(batch, device)

    def step() -> None:
        out = task.loss(model, batch)
        (out[0] if isinstance(out, tuple) else out).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    _sync(device)
    done, start = 0, time.perf_counter()
    while done < steps and time.perf_counter() - start < max_seconds:
        step()
        done += 1
    _sync(device)
    return Rate(done * cfg.micro_batch_size, time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_input_pipeline(section: Section, cfg: RunConfig, quick: bool, cpu_ranks: int = 1) -> None:
    """cpu_ranks: on CPU, measure as one of that many ranks does, with its share of the cores (the
    trainer gives each rank cores // ranks threads; on a busy box, more threads than that can be
    many times slower)."""
    task = get_task(cfg.task)
    device = torch.device(resolve_device(cfg))
    threads = (
        detect().threads_per_rank(cpu_ranks) if device.type == "cpu" else torch.get_num_threads()
    )
    section.data.update(
        task=cfg.task,
        micro_batch_size=cfg.micro_batch_size,
        num_workers=cfg.num_workers,
        device=device.type,
        threads=threads,
    )
    problem = offline_problem(task, cfg)
    if problem is not None:
        section.error = problem.text
        section.lines.append(f"skipped: {problem.text}")
        section.findings.append(problem)
        return
    train, _ = task.build_datasets(cfg)
    batch = next(
        iter(DataLoader(train, batch_size=cfg.micro_batch_size, collate_fn=task.collate_fn(cfg)))
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loader = loader_rate(
            train,
            cfg,
            task.collate_fn(cfg),
            max_batches=20 if quick else 200,
            max_seconds=1.0 if quick else 5.0,
        )
        model = model_rate(
            task, cfg, batch, device, steps=5 if quick else 30, max_seconds=2.0 if quick else 10.0
        )
    finally:
        torch.set_num_threads(before)
    section.data.update(loader_samples_per_s=loader.per_s, model_samples_per_s=model.per_s)
    section.lines.append(
        f"task {cfg.task}, micro-batch {cfg.micro_batch_size}, num_workers={cfg.num_workers}, "
        f"on {device.type}"
        + (
            f" with {threads} thread(s), as one of {cpu_ranks} CPU ranks"
            if device.type == "cpu"
            else ""
        )
    )
    section.lines.append(f"DataLoader: {loader.per_s:,.0f} samples/s ({loader.samples} samples)")
    section.lines.append(
        f"model forward+backward (fp32, 1 process): {model.per_s:,.0f} samples/s "
        f"({model.samples} samples)"
    )
    _verdict(section, loader, model, cfg, device.type)


def _verdict(section: Section, loader: Rate, model: Rate, cfg: RunConfig, device: str) -> None:
    if loader.per_s < model.per_s:
        verdict = (
            f"the DataLoader is slower than the model ({loader.per_s:,.0f} < {model.per_s:,.0f} "
            f"samples/s): the {device} will wait for data"
        )
        section.findings.append(
            Finding(
                "warn",
                verdict,
                f"raise num_workers (now {cfg.num_workers}; e.g. --set num_workers=4), or make "
                "__getitem__/collate cheaper (pre-tokenise, cache decoded samples)",
            )
        )
    else:
        verdict = f"the DataLoader keeps up ({loader.per_s / model.per_s:.1f}x the model's rate)"
    section.data["verdict"] = verdict
    section.lines.append(f"verdict: {verdict}")
