"""The hand-written loops `workbench bench overhead` holds the trainer against, one per layout.

Each is the loop a careful user would write: no run directory, no metrics, no stop checks, no
per-step vote, no hang watchdog. Each mirrors the trainer's numerics exactly (init seed, data order,
dropout seed, LR schedule, clipping, AdamW, the layout's own reductions), so its final weights can
be compared with the trainer's bit for bit:

    ddp    Accelerate: prepare (DDP), its backward and clip_grad_norm_
    zero3  FSDP2: fully_shard on each repeated block, then the root (reshard after forward);
           clip_grad_norm_ on the sharded DTensor gradients
    tp     parallelize_module with the task's plan over all ranks; every rank sees the same batches
    pp     one PipelineStage per rank, Schedule1F1B over grad_accum_steps micro-batches; a tied
           parameter's gradients summed between the stages holding it, the norm summed over the
           stages

What a loop takes from workbench is what a user would take from a library: the task (model, data,
loss, TP plan, stages, LR schedule), the optimizer factory, the data-parallel mesh, and for TP the
two helpers no built-in replaces (foreach kernels and clip_grad_norm_ refuse DTensors mixed with
plain tensors; pp sums its stages' squared norms with the same one).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from workbench.config.precision import accelerate_mixed_precision
from workbench.launcher.processes import free_port
from workbench.tasks import Task, get_task
from workbench.training.evaluation import split_loss
from workbench.training.optim import build_optimizer
from workbench.training.weights import state_digest
from workbench.utils.hardware import detect, resolve_device

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig

HAND_MODES = ("ddp", "zero3", "tp", "pp")
HAND_RESULT, HAND_WEIGHTS = "hand.json", "hand-weights.pt"


@dataclass
class HandRun:
    """One rank's loop, set up: the optimizer, what a step does before the update, where its batches
    come from, and how its full weights are gathered."""

    optimizer: torch.optim.Optimizer
    step: Callable[[Iterator[Any]], None]
    """Forward, backward and clipping of one optimizer step (its micro-batches from the
    iterator)."""
    full_weights: Callable[[], dict[str, torch.Tensor]]
    """The full weights on CPU on rank 0 (collective; what other ranks get is not used)."""
    data_rank: int = 0
    data_world: int = 1
    """The data-parallel coordinate and size: which batches this rank sees (a TP group or a pipeline
    shares them)."""


def _loss(task: Task, model: Any, batch: Any) -> torch.Tensor:
    return split_loss(task.loss(model, batch))[0]


def _accumulate(
    cfg: RunConfig,
    task: Task,
    model: torch.nn.Module,
    batches: Iterator[Any],
    device: torch.device,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """Forward and backward over the step's micro-batches, each loss / grad_accum_steps, sync held
    back to the last."""
    from accelerate.utils import send_to_device

    accum = cfg.grad_accum_steps
    for micro in range(accum):
        with no_sync() if no_sync is not None and micro < accum - 1 else nullcontext():
            backward(_loss(task, model, send_to_device(next(batches), device)) / accum)


def _ddp(cfg: RunConfig, task: Task, acc: Accelerator, model: torch.nn.Module) -> HandRun:
    optimizer = build_optimizer(model, cfg, task)
    model, optimizer = acc.prepare(model, optimizer)

    def step(batches: Iterator[Any]) -> None:
        _accumulate(cfg, task, model, batches, acc.device, acc.backward, lambda: acc.no_sync(model))
        if cfg.grad_clip > 0:
            acc.clip_grad_norm_(model.parameters(), cfg.grad_clip)

    def full() -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in acc.unwrap_model(model).state_dict().items()}

    return HandRun(optimizer, step, full, acc.process_index, acc.num_processes)


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Sharded or split parameters made whole on rank 0 (DCP's full state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _zero3(cfg: RunConfig, task: Task, acc: Accelerator, model: torch.nn.Module) -> HandRun:
    from torch.distributed.fsdp import fully_shard

    from workbench.tasks.blocks import shard_units
    from workbench.training.parallel.device_mesh import build_mesh

    mesh = build_mesh(cfg, acc.device.type, acc.num_processes)
    model = model.to(acc.device)
    for block in shard_units(model, task):
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    # after sharding: over the sharded DTensor parameters
    optimizer = build_optimizer(model, cfg, task)

    def step(batches: Iterator[Any]) -> None:
        _accumulate(cfg, task, model, batches, acc.device)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)

    return HandRun(optimizer, step, lambda: _gathered(model), acc.process_index, acc.num_processes)


def _tp(cfg: RunConfig, task: Task, acc: Accelerator, model: torch.nn.Module) -> HandRun:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from workbench.training.parallel.tensor import clip_mixed_grad_norm_, split_groups_by_mesh

    mesh = init_device_mesh(acc.device.type, (acc.num_processes,), mesh_dim_names=("tp",))
    model = model.to(acc.device)
    parallelize_module(model, mesh["tp"], task.tensor_parallel_plan(model, cfg))
    optimizer = build_optimizer(model, cfg, task)
    split_groups_by_mesh(optimizer)
    params = list(model.parameters())

    def step(batches: Iterator[Any]) -> None:
        _accumulate(cfg, task, model, batches, acc.device)
        if cfg.grad_clip > 0:
            clip_mixed_grad_norm_(params, cfg.grad_clip)

    # one TP group: every rank sees the same batches
    return HandRun(optimizer, step, lambda: _gathered(model))


def _tied_copies(
    model: torch.nn.Module, stage: torch.nn.Module
) -> list[tuple[Any, torch.nn.Parameter, bool]]:
    """Per parameter the full model ties (char-gpt's embedding and head) that several stages hold:
    the group of those stages, this stage's copy, and whether this stage counts it in the gradient
    norm (the first holder does). Collective: every rank joins every group."""
    import torch.distributed as dist

    from workbench.training.parallel.pipeline import tied_names

    params = dict(stage.named_parameters())
    copies = []
    for names in tied_names(model):
        mine = [n for n in names if n in params]
        held: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, bool(mine))
        ranks = [r for r, h in enumerate(held) if h]
        if len(ranks) > 1:
            group = dist.new_group(ranks)
            if mine:
                copies.append((group, params[mine[0]], dist.get_rank() == ranks[0]))
    return copies


def _clip_stages(
    stage: torch.nn.Module, tied: list[tuple[Any, torch.nn.Parameter, bool]], max_norm: float
) -> None:
    """Clip to the norm over every stage's gradients, a tied parameter counted once."""
    import torch.distributed as dist

    from workbench.training.parallel.tensor import scale_gradients_, squared_norm

    skip = {id(p) for _, p, counts in tied if not counts}
    squares = squared_norm(
        [p.grad for p in stage.parameters() if p.grad is not None and id(p) not in skip]
    )
    dist.all_reduce(squares)
    scale_gradients_(
        [p.grad for p in stage.parameters() if p.grad is not None], squares.sqrt(), max_norm
    )


def _stages_gathered(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every stage's weights (the full model's names) on rank 0."""
    import torch.distributed as dist

    first = dist.get_rank() == 0
    parts: list[Any] = [None] * dist.get_world_size() if first else []
    dist.gather_object(
        {k: v.detach().cpu() for k, v in stage.state_dict().items()},
        parts if first else None,
        dst=0,
    )
    return {name: tensor for part in parts for name, tensor in part.items()}


def _pp(cfg: RunConfig, task: Task, acc: Accelerator, model: torch.nn.Module) -> HandRun:
    import torch.distributed as dist
    from accelerate.utils import send_to_device
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, stages = acc.process_index, acc.num_processes
    stage = task.pipeline_stages(model, cfg, rank, stages).to(acc.device)
    tied = _tied_copies(model, stage)
    schedule = Schedule1F1B(
        PipelineStage(stage, rank, stages, acc.device),
        n_microbatches=cfg.grad_accum_steps,
        loss_fn=lambda out, target: _loss(task, lambda *_: out, (None, target)),
        scale_grads=True,
    )
    optimizer = build_optimizer(stage, cfg, task)

    def step(batches: Iterator[Any]) -> None:
        micro = [send_to_device(next(batches), acc.device) for _ in range(cfg.grad_accum_steps)]
        if rank == 0:
            schedule.step(torch.cat([m[0] for m in micro]))
        elif rank == stages - 1:
            schedule.step(target=torch.cat([m[1] for m in micro]), return_outputs=False)
        else:
            schedule.step()
        for group, param, _ in tied:
            dist.all_reduce(param.grad, group=group)
        if cfg.grad_clip > 0:
            _clip_stages(stage, tied, cfg.grad_clip)

    # the stages of one pipeline share batches
    return HandRun(optimizer, step, lambda: _stages_gathered(stage))


def _batches(cfg: RunConfig, dataset: Any, rank: int, world: int, collate_fn: Any) -> Iterator[Any]:
    """This rank's micro-batches, epoch after epoch, in the trainer's order (DistributedSampler,
    seed + epoch)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from DataLoader(
            dataset,
            batch_size=cfg.micro_batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=collate_fn,
            generator=torch.Generator().manual_seed(cfg.seed + epoch),
        )
        epoch += 1


def _train(cfg: RunConfig, task: Task, run: HandRun, batches: Iterator[Any]) -> list[float]:
    """max_steps optimizer steps; each step's time from its start to the next one's."""
    times, start = [], time.perf_counter()
    for step in range(cfg.max_steps):
        scale = task.lr_scale(step, cfg)  # lr_at(step) / lr: warm-up, then cosine
        for group in run.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * scale
        run.step(batches)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    return times


SETUPS: dict[str, Callable[[RunConfig, Task, Accelerator, torch.nn.Module], HandRun]] = {
    "ddp": _ddp,
    "zero3": _zero3,
    "tp": _tp,
    "pp": _pp,
}


def hand_loop(cfg: RunConfig, task: Task, out_dir: str, mode: str) -> None:
    """One rank of the hand-written loop of `mode` (started by notebook_launcher); rank 0 writes the
    step times, the full weights and their sha256 into out_dir."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from workbench.training.accelerator import set_cuda_numerics

    if resolve_device(cfg) == "cpu":  # the same thread share the trainer gives each rank
        torch.set_num_threads(detect().threads_per_rank(cfg.num_processes))
    acc = Accelerator(
        cpu=resolve_device(cfg) == "cpu", mixed_precision=accelerate_mixed_precision(cfg.precision)
    )
    if acc.device.type == "cuda":  # the trainer's TF32 setting, or fp32 steps would differ
        set_cuda_numerics(cfg)
    set_seed(cfg.seed)
    model = task.build_model(cfg)
    train_ds, _ = task.build_datasets(cfg)
    run = SETUPS[mode](cfg, task, acc, model)
    # Dropout masks differ between data-parallel ranks, and agree within a TP group or a pipeline.
    torch.manual_seed(cfg.seed + 1000 * (run.data_rank + 1))
    batches = _batches(cfg, train_ds, run.data_rank, run.data_world, task.collate_fn(cfg))
    times = _train(cfg, task, run, batches)
    full = run.full_weights()
    if acc.is_main_process:
        torch.save(full, Path(out_dir, HAND_WEIGHTS))
        Path(out_dir, HAND_RESULT).write_text(
            json.dumps({"step_time_s": times, "weights_sha256": state_digest(full)})
        )
    acc.wait_for_everyone()


HandLoop = Callable[["RunConfig", Task, str, str], None]
"""One rank of a loop: (cfg, task, out_dir, mode); rank 0 writes HAND_RESULT and HAND_WEIGHTS into
out_dir."""


def _notebook_launch(cfg: RunConfig, out_dir: str, mode: str, loop: HandLoop) -> None:
    from accelerate import notebook_launcher

    with contextlib.redirect_stdout(io.StringIO()):  # accelerate says "2 CUDAs" even on a CPU box
        notebook_launcher(
            loop,
            args=(cfg, get_task(cfg.task), out_dir, mode),
            num_processes=cfg.num_processes,
            use_port=str(free_port()),
        )


def run_hand_loop(
    cfg: RunConfig, out_dir: str, mode: str, loop: HandLoop = hand_loop
) -> dict[str, Any]:
    """The hand-written loop (`loop`, default hand_loop: the one of `mode`) on cfg.num_processes
    forked ranks; {'step_time_s', 'weights_sha256', 'weights' (the path of rank 0's full weights,
    torch.save'd)} and whatever else the loop wrote into HAND_RESULT."""
    # On CUDA through a fresh interpreter: the process running the bench may have asked for the GPUs
    # already (torch.cuda.is_available()), and notebook_launcher's ranks forked from it could not
    # use them.
    method = "spawn" if resolve_device(cfg) == "cuda" else "fork"
    proc = multiprocessing.get_context(method).Process(
        target=_notebook_launch, args=(cfg, out_dir, mode, loop)
    )
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"hand-written {mode} loop failed (exit code {proc.exitcode})")
    return {
        **json.loads(Path(out_dir, HAND_RESULT).read_text()),
        "weights": str(Path(out_dir, HAND_WEIGHTS)),
    }
