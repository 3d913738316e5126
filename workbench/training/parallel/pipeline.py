"""Pipeline parallelism (torch.distributed.pipelining): each rank runs one stage of the task's model.

Pure pipeline parallel for now (data-parallel size 1, tp = 1): rank i holds stage i (Task.pipeline_stages,
parameter names as in the full model). A step is one schedule run (GPipe or 1F1B) over the step's
grad_accum_steps micro-batches, concatenated and split again by the schedule into the same micro-batches;
scale_grads divides the gradients by their number, as accumulate's `loss / accum` does. The loss is computed on
the last stage (the task's `loss` with the stage output standing in for the model) and broadcast to every rank.

Parameters tied across stages (char-gpt's embedding and head) become one copy per stage; their gradients are
summed between the stages holding them (Megatron's embedding group), so the copies stay equal and the model
trains as the tied one does. Gradient clipping sums squares over all stages, each tied parameter once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..evaluation import split_loss
from .base import DTYPES, Strategy, on_device

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ...config import RunConfig
    from ...tasks import Task

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of names that share one parameter in the full model (e.g. ['tok.weight', 'head.weight'])."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


def held_prefixes(stage: torch.nn.Module) -> list[str]:
    """What a stage holds, by module: 'blocks.3' for a repeated block, 'tok' for a top-level module."""
    held = set()
    for name, _ in stage.named_parameters():
        parts = name.split(".")
        held.add(".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0])
    return sorted(held, key=lambda s: (s.split(".")[0], int(s.split(".")[1]) if "." in s else -1))


class PipelineParallel(Strategy):
    """One stage per rank, a GPipe or 1F1B schedule over the step's micro-batches."""

    sharded = True
    pipelined = True

    def __init__(self, cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module, task: Task,
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        super().__init__(cfg, accelerator)
        self.task, self.stages = task, cfg.pp
        self.stage_index = accelerator.process_index
        self.name = f"pp{cfg.pp} {cfg.pp_schedule}"
        tied = tied_names(model)
        module = task.pipeline_stages(model, cfg, self.stage_index, self.stages)
        if module is None:
            raise ValueError(f"pp={cfg.pp}: task {task.name!r} has no pipeline stages")
        self.model = self.module = on_device(module, accelerator)
        self.group = dist.group.WORLD
        self._tied = self._tied_groups(tied)
        self.stage = PipelineStage(self.module, self.stage_index, self.stages, self.device, group=self.group)
        loss_fn = self._loss_fn
        self.schedule = SCHEDULES[cfg.pp_schedule](self.stage, n_microbatches=cfg.grad_accum_steps,
                                                   loss_fn=loss_fn, scale_grads=True)
        self.optimizer = make_optimizer(self.module)

    def _loss_fn(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The task's loss on the last stage's output: the output stands in for the model."""
        loss, _ = split_loss(self.task.loss(lambda *_: output, (None, target)))  # type: ignore[arg-type]
        return loss

    def _tied_groups(self, tied: list[list[str]]) -> list[tuple[Any, torch.nn.Parameter | None, bool]]:
        """Per tied parameter held by several stages: (process group of those stages, this rank's copy or None,
        whether this rank counts it in the gradient norm). Collective: every rank creates every group."""
        params = dict(self.module.named_parameters())
        mine = [[n for n in names if n in params] for names in tied]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [bool(m) for m in mine])
        groups = []
        for i, names in enumerate(mine):
            ranks = [r for r, held in enumerate(everyone) if held[i]]
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks)
            groups.append((group, params[names[0]] if names else None, dist.get_rank() == ranks[0]))
        return groups

    # ---- the step ------------------------------------------------------------------------------------
    def forward_context(self) -> Any:
        dtype = DTYPES.get(self.cfg.precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else super().forward_context()

    def pipeline_step(self, batches: Iterator[Any], accum: int, at: Callable[[str], None] | None = None,
                      before_last_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The step's micro-batches through the schedule; the mean micro-batch loss on every rank."""
        if at is not None:
            at("data")
        micro = [send_to_device(next(batches), self.device, non_blocking=True) for _ in range(accum)]
        inputs = torch.cat([m[0] for m in micro])
        target = torch.cat([m[1] for m in micro])
        if at is not None:
            at("pipeline schedule (Task.loss on the last stage)")
        losses: list[torch.Tensor] = []
        last = self.stage_index == self.stages - 1
        with self.forward_context():
            if self.stage_index == 0:
                self.schedule.step(inputs)
            elif last:
                self.schedule.step(target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.step()
        loss = torch.stack(losses).mean().detach().float() if last else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.stages - 1, group=self.group)
        for group, param, _ in self._tied:
            if param is not None and param.grad is not None:
                dist.all_reduce(param.grad, group=group)
        if before_last_backward is not None:
            before_last_backward(loss)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("pipeline parallel: the schedule runs backward (pipeline_step), not Strategy.backward")

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over all stages; a tied parameter counts once (on the first stage holding it)."""
        skip = {id(param) for _, param, counts in self._tied if param is not None and not counts}
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.module.parameters():
            if p.grad is not None and id(p) not in skip:
                squares = squares + p.grad.float().pow(2).sum()
        dist.all_reduce(squares, group=self.group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    def facts(self) -> dict[str, Any]:
        """This rank's stage and the modules it holds (blocks by their index in the full model)."""
        return {"pp_stage": self.stage_index, "pp_stages": self.stages, "pp_schedule": self.cfg.pp_schedule,
                "pp_holds": held_prefixes(self.module),
                "pp_params": sorted(name for name, _ in self.module.named_parameters())}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every stage's weights (full names), gathered on rank 0 (other ranks get {})."""
        mine = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0, group=self.group)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full
