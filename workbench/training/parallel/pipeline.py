"""Pipeline parallelism (torch.distributed.pipelining), with the other mesh dimensions inside each
stage.

The mesh is ('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp'), pp outermost: rank = stage x (ranks per
stage) + column, a column being one data-parallel, context-parallel and tensor-parallel coordinate,
i.e. one whole pipeline. Each rank holds one model chunk (gpipe, 1f1b) or several (interleaved_1f1b,
zero_bubble: virtual stages), cut by Task.pipeline_stages under the full model's parameter names and
made parallel in torchtitan's order by the recipe (apply.py) before this strategy receives them.
The data-parallel ranks of a stage see different batches: FSDP2 reduces their gradients itself
(zero2, zero3, hsdp; PipelineStage holds its gradient sync back to the last micro-batch); replicated
pipelines ('ddp') average theirs in one flat all-reduce after the schedule (DDP breaks under the
schedules' repeated backward passes).

A step is one schedule run over the step's grad_accum_steps micro-batches, concatenated and split
again by the schedule into the same micro-batches; scale_grads divides the gradients by their
number, as accumulate's `loss / accum` does. The loss is computed on the last stage (the task's
`loss` with the stage output standing in for the model), and only the last stage's ranks report it
(loss_ranks); a non-finite one is noted on the device and read at the next read point, with every
rank's (nonfinite.py). fp16 scales the loss in the stage's loss function; ShardedGradScaler agrees
on overflows over every rank. With cp > 1 the whole schedule runs inside PyTorch's context_parallel
(context.SequenceSplit, torchtitan's way): the first stage's inputs, the last stage's targets and
the position buffers are split along the sequence before the schedule cuts them into micro-batches,
so activations travel between the stages already split, and every stage's attention is ring
attention over its CP group; FSDP2 shards each chunk over dp_shard x cp.

Parameters tied across stages (char-gpt's embedding and head) become one copy per stage, their
gradients summed between the stages holding them (pipeline_parts.TiedCopies). Gradient clipping sums
squares over all stages, each tied parameter once. Checkpoints are in the one-process format
(pipeline_state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from workbench.config.mesh import INTERLEAVED, shards, virtual_stages
from workbench.training.evaluation import split_loss
from workbench.training.observe.memory import next_micro_batch, stage_point
from workbench.training.parallel.context import SequenceSplit
from workbench.training.parallel.param_groups import split_groups_by_mesh
from workbench.training.parallel.pipeline_parts import (
    TiedCopies,
    dim_size,
    held_prefixes,
    local_grad,
    local_rank,
    tied_names,
)
from workbench.training.parallel.pipeline_state import PipelineCheckpoints
from workbench.training.parallel.strategy import DTYPES
from workbench.training.parallel.tensor import (
    LocalShardGradScaler,
    placement_facts,
    scale_gradients_,
    squared_norm,
)

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task
    from workbench.training.parallel.apply import ParallelModel
    from workbench.training.parallel.placement import Placement

SCHEDULES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}

__all__ = ["PipelineParallel", "tied_names"]


class _TrackedStage(PipelineStage):
    """A PipelineStage that tells the memory tracker (track_memory) where the schedule is: PyTorch's
    MemTracker refuses a root module forwarded again in the same step unless its module counts
    restart before each micro-batch; the zero-bubble schedule's tracker samples after each forward
    and backward (training/observe/stage_memory.py)."""

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        next_micro_batch(self.submod)
        out = super().forward_maybe_with_nosync(*args, **kwargs)
        stage_point()
        return out

    def backward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_maybe_with_nosync(*args, **kwargs)
        stage_point()
        return out


class PipelineParallel(PipelineCheckpoints):
    """This rank's chunks of the pipeline, the schedule over the step's micro-batches, and the
    reductions the schedule leaves to us (tied copies, replicated pipelines, the norm over
    stages)."""

    sharded = True
    pipelined = True

    @classmethod
    def around(
        cls,
        cfg: RunConfig,
        where: Placement,
        parallel: ParallelModel,
        task: Task,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> PipelineParallel:
        """The stages, their ids and the full model's tied names come from the recipe; the loss on
        the last stage from the task."""
        return cls(cfg, where, parallel, task, make_optimizer)

    def __init__(
        self,
        cfg: RunConfig,
        where: Placement,
        parallel: ParallelModel,
        task: Task,
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    ) -> None:
        super().__init__(cfg, where)
        self.task, self.stages, self.chunks_per_rank = task, cfg.pp, virtual_stages(cfg)
        self.columns = self.accelerator.num_processes // self.stages
        self.stage_index = local_rank(self.mesh, "pp")
        self.column = self.accelerator.process_index % self.columns
        self.replicas = dim_size(self.mesh, "dp_replicate") if not shards(cfg.parallelism) else 1
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp_replicate") if self.replicas > 1 else None
        self.total_stages = self.stages * self.chunks_per_rank
        # zero-bubble splits each backward into autograd.grad calls that MemTracker's hooks can't
        # follow
        self.split_backward = cfg.pp_schedule == "zero_bubble"
        self.stage_ids = parallel.stage_ids
        self.name = self._schedule_name()
        tied = parallel.tied
        self._canonical = {name: names[0] for names in tied for name in names}
        self.model = self.module = parallel.module
        self._tied = TiedCopies(
            self.module,
            tied,
            self.column,
            self.columns,
            self.accelerator.stage_params,
            self.stages_of_rank,
        )
        self.split = (
            SequenceSplit(self.mesh["cp"], task, cfg.cp, pipelined=True) if cfg.cp > 1 else None
        )
        self.fresh_schedule()
        self.optimizer = make_optimizer(self.module)
        if any(isinstance(p, DTensor) for p in self.module.parameters()):
            self._origin = split_groups_by_mesh(self.optimizer)
        if cfg.precision == "fp16":
            # overflows agreed over every rank, DTensor shards unscaled where they are
            self.scaler = LocalShardGradScaler(device=self.device.type)
            # Only the last stage scales a loss; every stage unscales the gradients that flow back
            # from it.
            self.scaler.scale(torch.ones((), device=self.device))

    def fresh_schedule(self) -> None:
        """New stages and schedule over this rank's chunks. PipelineStage infers the micro-batch's
        shapes at its first step and keeps them: after micro_batch_size='auto' has tried other
        sizes, the run starts afresh."""
        cfg = self.cfg
        self.pipeline_stages = [
            _TrackedStage(chunk, s, self.total_stages, self.device, group=self.pp_group)
            for chunk, s in zip(self.module, self.stage_ids)
        ]
        stages = self.pipeline_stages if cfg.pp_schedule in INTERLEAVED else self.pipeline_stages[0]
        self.schedule = SCHEDULES[cfg.pp_schedule](
            stages, n_microbatches=cfg.grad_accum_steps, loss_fn=self.stage_loss, scale_grads=True
        )

    def _schedule_name(self) -> str:
        cp, tp = dim_size(self.mesh, "cp"), dim_size(self.mesh, "tp")
        inner = (
            [f"{self.cfg.parallelism}{self.columns // (cp * tp)}"]
            if self.columns // (cp * tp) > 1
            else []
        )
        inner += [f"{name}{size}" for name, size in (("cp", cp), ("tp", tp)) if size > 1]
        chunks = f", {self.chunks_per_rank} chunks/rank" if self.chunks_per_rank > 1 else ""
        return f"pp{self.stages} {self.cfg.pp_schedule}{chunks}" + "".join(f" x {d}" for d in inner)

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stage ids `rank` holds (loop placement)."""
        return [rank // self.columns + k * self.stages for k in range(self.chunks_per_rank)]

    @property
    def first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last_stage(self) -> bool:
        return self.total_stages - 1 in self.stage_ids

    def forward_context(self) -> Any:
        """Autocast without FSDP; FSDP2 casts the parameters itself (MixedPrecisionPolicy)."""
        dtype = DTYPES.get(self.cfg.precision)
        return (
            torch.autocast(self.device.type, dtype=dtype)
            if dtype and not shards(self.cfg.parallelism)
            else nullcontext()
        )

    def stage_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The task's loss on the last stage's output (the output stands in for the model); scaled
        under fp16."""
        stand_in = lambda *_: output  # noqa: E731
        loss, _ = split_loss(self.task.loss(stand_in, (None, target)))  # type: ignore[arg-type]
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _step_loss(self, losses: list[torch.Tensor] | None) -> torch.Tensor:
        """The mean of the schedule's micro-batch losses (unscaled) on the last stage, a zero
        elsewhere."""
        if losses is None:
            return torch.zeros((), device=self.device)
        loss = torch.stack(losses).detach().float().mean()
        # the scale as a device tensor (None until an enabled scaler scales): get_scale() would read
        # it on the host
        scale = self.scaler._get_scale_async() if self.scaler is not None else None
        return loss / scale if scale is not None else loss

    def pipeline_step(
        self,
        batches: Iterator[Any],
        accum: int,
        at: Callable[[str], None] | None = None,
        before_last_backward: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The step's micro-batches through the schedule; the mean micro-batch loss on the last
        stage, a zero elsewhere. `before_last_backward` (the vote, when due) runs before the
        gradients' all-reduces."""
        if at is not None:
            at("data")
        micro = [
            send_to_device(next(batches), self.device, non_blocking=True) for _ in range(accum)
        ]
        if at is not None:
            at("pipeline schedule (Task.loss on the last stage)")
        args = (torch.cat([m[0] for m in micro]),) if self.first_stage else ()
        kwargs = (
            {"target": torch.cat([m[1] for m in micro]), "losses": []} if self.last_stage else {}
        )
        with (
            self.sequence_split(args[0] if args else None, kwargs.get("target")),
            self.forward_context(),
        ):
            self.schedule.step(*args, **kwargs, return_outputs=False)
        loss = self._step_loss(kwargs.get("losses"))
        if before_last_backward is not None:
            before_last_backward()
        self.after_schedule()
        return loss

    def sequence_split(
        self, inputs: torch.Tensor | None, target: Any
    ) -> AbstractContextManager[Any]:
        """cp > 1: the sequences this rank's stages take split over its CP group, and attention made
        ring attention, for the schedule's forwards and backwards."""
        return (
            self.split(self.module, (inputs, target)) if self.split is not None else nullcontext()
        )

    @property
    def loss_ranks(self) -> range:
        """The ranks whose loss is the run's: the last stage's (pp outermost), one per pipeline
        column."""
        world = self.stages * self.columns
        return range(world - self.columns, world)

    def after_schedule(self) -> None:
        """The step's communication after the schedule (a traced estimate runs it after its own
        schedule): tied gradients summed between their stages, gradients averaged over replicated
        pipelines."""
        self._tied.sum_gradients()
        if self.replicas > 1:
            self._average_replicas()

    def _average_replicas(self) -> None:
        """DDP's result without DDP: every gradient averaged over the replicas in one flat
        all-reduce."""
        grads = [g for p in self.module.parameters() if (g := local_grad(p)) is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.replicas)
        for g, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(averaged)

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(
            "pipeline parallel: the schedule runs backward (pipeline_step), not Strategy.backward"
        )

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over all stages; a tied parameter counts once."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        skip = self._tied.uncounted()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squares = squared_norm(
            [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip],
            self.device,
        )
        dist.all_reduce(squares, group=self.pp_group)
        total = squares.sqrt()
        scale_gradients_(grads, total, max_norm)
        return total

    # ---- what this rank holds --------------------------------------------------------------------
    def receive_buffers(self) -> list[torch.Tensor]:
        """The buffers PipelineStage receives activations and their gradients into, one per
        micro-batch, made at the first step and kept across steps (empty before it): communication
        buffers for the memory tracker."""
        infos = [
            info
            for stage in self.pipeline_stages
            for table in (stage.args_recv_info, stage.grad_recv_info)
            for infos in table.values()
            for info in infos
        ]
        return [b for info in infos if isinstance(b := getattr(info, "buffer", None), torch.Tensor)]

    def facts(self) -> dict[str, Any]:
        """This rank's stages and place in the mesh, and the modules it holds (blocks by their
        index)."""
        where, split = placement_facts(self.mesh, self.named_full_parameters())
        return {
            "pp_stage": self.stage_index,
            "pp_stages": self.stages,
            "pp_schedule": self.cfg.pp_schedule,
            "pp_stage_ids": self.stage_ids,
            "dp_replica": local_rank(self.mesh, "dp_replicate"),
            **where,
            "pp_holds": held_prefixes(self.module),
            "pp_params": sorted(n for n, _ in self.named_full_parameters()),
            "split_params": split,
            **({"cp_sequence": dict(self.split.sequence)} if self.split is not None else {}),
        }

    # ---- evaluation: a forward-only pass through the stages --------------------------------------
    @torch.no_grad()
    def eval_loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """The batch through every stage of this column in order (activations sent point-to-point
        between the ranks holding consecutive stages); the task's loss and metrics on the last
        stage, None elsewhere."""
        inputs, target = batch[0], batch[1]
        with self.sequence_split(
            inputs if self.first_stage else None, target if self.last_stage else None
        ):
            return self._eval_through_stages(inputs, target)

    def _eval_through_stages(
        self, inputs: torch.Tensor, target: Any
    ) -> tuple[torch.Tensor, dict[str, Any]] | None:
        x = inputs if self.first_stage else None
        for chunk, s in zip(self.module, self.stage_ids):
            if s > 0:  # consecutive stages sit on different ranks (pp > 1, loop placement)
                x = self._receive(s)
            with self.forward_context():
                x = chunk(x)
            if s < self.total_stages - 1:
                self._send(x, s)
        if not self.last_stage:
            return None
        out = x
        return split_loss(self.task.loss(lambda *_: out, (None, target)))  # type: ignore[arg-type]

    def _receive(self, stage: int) -> torch.Tensor:
        src = (stage - 1) % self.stages
        shape = torch.zeros(3, dtype=torch.int64)
        dist.recv(shape, group=self.pp_group, group_src=src)
        x = torch.empty(*[int(d) for d in shape if d > 0], device=self.device)
        dist.recv(x, group=self.pp_group, group_src=src)
        return x

    def _send(self, out: torch.Tensor, stage: int) -> None:
        dst = (stage + 1) % self.stages
        out = out.float().contiguous()
        dims = list(out.shape) + [0] * (3 - out.dim())
        dist.send(torch.tensor(dims, dtype=torch.int64), group=self.pp_group, group_dst=dst)
        dist.send(out, group=self.pp_group, group_dst=dst)
