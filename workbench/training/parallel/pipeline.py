"""Pipeline parallelism (torch.distributed.pipelining): each rank runs one stage of the task's model.

The mesh is ('pp', 'dp_replicate'), pp outermost: rank = stage x dp + replica, every replica a whole pipeline
holding stage `stage` (Task.pipeline_stages, parameter names as in the full model). Replicas see different batches;
after the schedule their gradients are averaged in one all-reduce (DDP's result; DDP itself breaks under the
schedules' repeated backward passes). A step is one schedule run (GPipe or 1F1B) over the step's
grad_accum_steps micro-batches, concatenated and split again by the schedule into the same micro-batches;
scale_grads divides the gradients by their number, as accumulate's `loss / accum` does. The loss is computed on
the last stage (the task's `loss` with the stage output standing in for the model); the trainer's per-step vote
carries it to the replica's other stages (agreement.CarriedLoss).

Parameters tied across stages (char-gpt's embedding and head) become one copy per stage; their gradients are
summed between the stages holding them within a replica (Megatron's embedding group), so the copies stay equal and
the model trains as the tied one does. Gradient clipping sums squares over all stages, each tied parameter once.

Checkpoints are saved in the one-process format, so they load under any layout: model keys are the full model's
names; a tied parameter's optimizer state is saved once, under the name the full model gives it (the first of its
names), and the param groups are merged over the stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from accelerate.utils import send_to_device
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from workbench.tasks.blocks import shard_units
from workbench.training.agreement import CarriedLoss
from workbench.training.compiling import compile_blocks
from workbench.training.evaluation import split_loss
from workbench.training.parallel.strategy import DTYPES, Strategy, on_device
from workbench.utils.distributed import single_process_dcp

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.tasks import Task

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
    """One stage per rank, a GPipe or 1F1B schedule over the step's micro-batches; replicas average gradients."""

    sharded = True
    pipelined = True

    def __init__(self, cfg: RunConfig, accelerator: Accelerator, model: torch.nn.Module, task: Task,
                 make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        super().__init__(cfg, accelerator)
        self.task, self.stages, self.replicas = task, cfg.pp, cfg.dp_size
        # A traced estimate builds its mesh before entering fake mode, as DeviceMesh needs real tensors.
        self.mesh = getattr(accelerator, "mesh", None) or init_device_mesh(
            self.device.type, (self.stages, self.replicas), mesh_dim_names=("pp", "dp_replicate"))
        self.stage_index = self.mesh.get_local_rank("pp")
        self.replica = self.mesh.get_local_rank("dp_replicate")
        self.pp_group, self.dp_group = self.mesh.get_group("pp"), self.mesh.get_group("dp_replicate")
        self.name = f"pp{cfg.pp} {cfg.pp_schedule}" + (f" x ddp{self.replicas}" if self.replicas > 1 else "")
        tied = tied_names(model)
        self._canonical = {name: names[0] for names in tied for name in names}
        module = task.pipeline_stages(model, cfg, self.stage_index, self.stages)
        if module is None:
            raise ValueError(f"pp={cfg.pp}: task {task.name!r} has no pipeline stages")
        self.model = self.module = on_device(module, accelerator)
        # the stage's share of the model's blocks (the task's stage holds the same block objects)
        held = {id(m) for m in module.modules()}
        compile_blocks(cfg, [u for u in shard_units(model, task) if id(u) in held],
                       tracing=getattr(accelerator, "tracing", False))
        self._tied = self._tied_groups(tied)
        self.stage = PipelineStage(self.module, self.stage_index, self.stages, self.device, group=self.pp_group)
        self.schedule = SCHEDULES[cfg.pp_schedule](self.stage, n_microbatches=cfg.grad_accum_steps,
                                                   loss_fn=self.stage_loss, scale_grads=True)
        self.optimizer = make_optimizer(self.module)

    def stage_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The task's loss on the last stage's output: the output stands in for the model."""
        loss, _ = split_loss(self.task.loss(lambda *_: output, (None, target)))  # type: ignore[arg-type]
        return loss

    def _tied_groups(self, tied: list[list[str]]) -> list[tuple[Any, torch.nn.Parameter | None, bool]]:
        """Per tied parameter held by several stages of this replica: (process group of those stages, this rank's
        copy or None, whether this rank counts it in the gradient norm and saves its optimizer state).
        Collective: every rank creates every group (one per tied parameter and replica)."""
        params = dict(self.module.named_parameters())
        mine = [[n for n in names if n in params] for names in tied]
        everyone = self._holdings(tied, (self.replica, [bool(m) for m in mine]))
        groups = []
        for i, names in enumerate(mine):
            for replica in range(self.replicas):
                ranks = [r for r, (rep, held) in enumerate(everyone) if rep == replica and held[i]]
                if len(ranks) < 2:
                    continue
                group = dist.new_group(ranks)
                if replica == self.replica:
                    groups.append((group, params[names[0]] if names else None, dist.get_rank() == ranks[0]))
        return groups

    def _holdings(self, tied: list[list[str]], mine: tuple[int, list[bool]]) -> list[tuple[int, list[bool]]]:
        """Every rank's (replica, which tied parameters its stage holds), gathered; a traced estimate, whose fake
        process group can't gather, names every stage's parameters instead (its Placement's stage_params)."""
        stage_params = getattr(self.accelerator, "stage_params", None)
        if stage_params is None:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            return everyone
        return [(rank % self.replicas, [any(n in stage_params[rank // self.replicas] for n in names) for names in tied])
                for rank in range(self.stages * self.replicas)]

    # ---- the step ------------------------------------------------------------------------------------
    def forward_context(self) -> Any:
        dtype = DTYPES.get(self.cfg.precision)
        return torch.autocast(self.device.type, dtype=dtype) if dtype else super().forward_context()

    @property
    def last_stage(self) -> bool:
        return self.stage_index == self.stages - 1

    def pipeline_step(self, batches: Iterator[Any], accum: int, at: Callable[[str], None] | None = None,
                      before_last_backward: Callable[[torch.Tensor], torch.Tensor | None] | None = None
                      ) -> torch.Tensor:
        """The step's micro-batches through the schedule; the replica's mean micro-batch loss on its last stage, a
        zero elsewhere that `before_last_backward` (the vote) fills in by the end of the step."""
        if at is not None:
            at("data")
        micro = [send_to_device(next(batches), self.device, non_blocking=True) for _ in range(accum)]
        inputs = torch.cat([m[0] for m in micro])
        target = torch.cat([m[1] for m in micro])
        if at is not None:
            at("pipeline schedule (Task.loss on the last stage)")
        losses: list[torch.Tensor] = []
        with self.forward_context():
            if self.stage_index == 0:
                self.schedule.step(inputs)
            elif self.last_stage:
                self.schedule.step(target=target, losses=losses, return_outputs=False)
            else:
                self.schedule.step()
        loss = torch.stack(losses).mean().detach().float() if self.last_stage else torch.zeros((), device=self.device)
        if before_last_backward is not None:
            before_last_backward(loss)  # the vote: started now, it overlaps the gradients' all-reduces
        self.after_schedule()
        return loss

    def carried_loss(self) -> CarriedLoss:
        """The loss the vote carries: from the last stage of each replica to its other stages."""
        return CarriedLoss(slots=self.replicas, slot=self.replica, writer=self.last_stage)

    def after_schedule(self) -> None:
        """The step's communication after the schedule (a traced estimate runs it after its own schedule): tied
        gradients summed between their stages, gradients averaged over the replicas."""
        for group, param, _ in self._tied:
            if param is not None and param.grad is not None:
                dist.all_reduce(param.grad, group=group)
        if self.replicas > 1:
            self._average_replicas()

    def _average_replicas(self) -> None:
        """DDP's result without DDP: every gradient averaged over the replicas in one flat all-reduce."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.replicas)
        for g, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(averaged)

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
        dist.all_reduce(squares, group=self.pp_group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total

    # ---- evaluation: a forward-only pass through the stages --------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The batch through every stage of this replica (activations sent point-to-point); the task's loss and
        metrics on the last stage, None on the others."""
        inputs, target = batch[0], batch[1]
        if self.stage_index == 0:
            x = inputs
        else:
            shape = torch.zeros(3, dtype=torch.int64)
            dist.recv(shape, group=self.pp_group, group_src=self.stage_index - 1)
            x = torch.empty(*[int(d) for d in shape if d > 0], device=self.device)
            dist.recv(x, group=self.pp_group, group_src=self.stage_index - 1)
        with self.forward_context():
            out = self.module(x)
        if not self.last_stage:
            out = out.float().contiguous()
            dims = list(out.shape) + [0] * (3 - out.dim())
            dist.send(torch.tensor(dims, dtype=torch.int64), group=self.pp_group, group_dst=self.stage_index + 1)
            dist.send(out, group=self.pp_group, group_dst=self.stage_index + 1)
            return None
        return split_loss(self.task.loss(lambda *_: out, (None, target)))  # type: ignore[arg-type]

    # ---- what this rank holds ------------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        """This rank's stage and replica, and the modules it holds (blocks by their index in the full model)."""
        return {"pp_stage": self.stage_index, "pp_stages": self.stages, "pp_schedule": self.cfg.pp_schedule,
                "dp_replica": self.replica, "pp_holds": held_prefixes(self.module),
                "pp_params": sorted(name for name, _ in self.module.named_parameters())}

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every stage's weights (full names), gathered on rank 0 (other ranks get {})."""
        mine = {k: v.detach().cpu() for k, v in self.module.state_dict().items()} if self.replica == 0 else {}
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full

    # ---- checkpoints: the one-process format -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Model keyed by full names; optimizer state under canonical names (a tied parameter once); the param
        groups merged over the stages (collective)."""
        model, optim = get_state_dict(self.module, self.optimizer)
        saves = {id(p) for _, p, counts in self._tied if p is not None and counts}
        params = dict(self.module.named_parameters())
        state = {self._canonical.get(name, name): value for name, value in optim["state"].items()
                 if name not in self._canonical or id(params[name]) in saves}
        mine = [{**g, "params": [self._canonical.get(n, n) for n in g["params"]]} for g in optim["param_groups"]]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {"model": model, "optim": {"state": state, "param_groups": merge_param_groups(everyone)}}

    def load(self, path: Path) -> None:
        """Read this stage's parameters and their optimizer state from a checkpoint of any layout."""
        model, optim = get_state_dict(self.module, self.optimizer)
        template = {"state": {self._canonical.get(n, n): v for n, v in optim["state"].items()},
                    "param_groups": optim["param_groups"]}
        with single_process_dcp():
            dcp.load({"model": model}, checkpoint_id=str(path / "model"))
            dcp.load({"optim": template}, checkpoint_id=str(path / "optim"))
        local = {self._canonical.get(n, n): n for n, _ in self.module.named_parameters()}
        state = {local[c]: v for c, v in template["state"].items()}
        groups = [{**g, "params": [local[c] for c in g["params"] if c in local]} for g in template["param_groups"]]
        set_state_dict(self.module, self.optimizer, model_state_dict=model,
                       optim_state_dict={"state": state, "param_groups": groups})


def merge_param_groups(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The stages' param groups as the full model's optimizer has them: group i holds every stage's group-i
    parameters (each name once), with the hyperparameters the stages share."""
    counts = {len(groups) for groups in per_rank}
    if len(counts) != 1:
        raise ValueError(f"pipeline stages built different numbers of optimizer param groups ({sorted(counts)}); "
                         "Task.configure_optimizers must make the same groups on every stage (empty ones included)")
    merged = [dict(g, params=[]) for g in per_rank[0]]
    for groups in per_rank:
        for target, group in zip(merged, groups):
            target["params"] += [n for n in group["params"] if n not in target["params"]]
    return merged
