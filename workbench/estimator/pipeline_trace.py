"""One pipeline stage's step, traced: what a rank of a pp > 1 run holds, computes and sends.

The trainer's pipeline (training/parallel/pipeline.py) runs torch.distributed.pipelining's schedules, whose
point-to-point sends and runtime shape inference can't run on a fake process group. So the trace builds the
trainer's own PipelineParallel strategy for the rank (its stage module, tied-parameter groups, optimizer) and
runs that stage's forwards and backwards in the order the schedule runs them on this stage, as torch's
PipelineStage does them:

- GPipe: every micro-batch's forward, then every backward: all grad_accum_steps micro-batches in flight;
- 1F1B: min(pp - stage, micro-batches) forwards first, then one backward and one forward in turn: the
  activations of at most pp - stage micro-batches held at once.

A stage other than the first receives each micro-batch's activations into buffers made once for all of them,
a stage other than the last receives the output gradients likewise (PipelineStage keeps both for every
micro-batch across steps); they are counted as communication buffers. The loss is taken on the last stage per
micro-batch and kept until its backward. Then the trainer's own after_schedule (tied gradients summed, replicas
averaged), clipping and update run as they do in a real step. The activations and gradients sent
to the neighbouring stages are recorded as point-to-point traffic ('send@2:pp'), one of each per micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from workbench.config.mesh import ParallelDims

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


def schedule_order(schedule: str, micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """The (forward 'F' or backward 'B', micro-batch) order `schedule` runs on `stage`, as torch's ScheduleGPipe
    and Schedule1F1B step through them."""
    if schedule == "gpipe":
        return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
    warmup = min(micro_batches, stages - stage)
    order = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while True:
        order.append(("B", backward))
        backward += 1
        if forward == micro_batches:
            break
        order.append(("F", forward))
        forward += 1
    return order + [("B", i) for i in range(backward, micro_batches)]


def in_flight(order: list[tuple[str, int]]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once in `order`."""
    live = most = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def stage_params(task: Task, cfg: RunConfig) -> list[set[str]]:
    """The parameter names each stage holds (a meta-device model: nothing allocated)."""
    with torch.device("meta"):
        model = task.build_model(cfg)
    return [{n for n, _ in task.pipeline_stages(model, cfg, s, cfg.pp).named_parameters()} for s in range(cfg.pp)]


def trace_stage(cfg: RunConfig, task: Task, real: list[Any], world: int, rank: int, fake: Any, gpu_target: bool,
                gpus_per_node: int) -> dict[str, Any]:
    """StepTrace fields for `rank`'s stage (see the module docstring)."""
    from workbench.estimator.fake_world import (
        CollectiveCounter,
        Placement,
        count_then_track,
        flop_call_rows,
        materialize,
        mesh_groups,
        optimizer_for,
    )
    from workbench.estimator.held import checked_state, state_pieces
    from workbench.training.parallel.pipeline import PipelineParallel
    from workbench.training.parallel.pipeline_parts import pipeline_mesh

    device = torch.device("cpu")  # a CPU build can't trace CUDA autograd; bytes per tensor are the same
    replicas = world // cfg.pp  # ranks per stage: a column each, one whole pipeline
    mesh = pipeline_mesh(cfg, "cpu", world)
    placement = Placement(device, world, rank, mesh, stage_params=stage_params(task, cfg))
    counter = CollectiveCounter(gpus_per_node, mesh_groups(mesh, rank))
    first = CollectiveCounter(gpus_per_node, mesh_groups(mesh, rank))
    with fake:
        with torch.device("meta"):
            model = task.build_model(cfg)
        materialize(model, device)
        micro = [tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, b) for b in real]
        stage = rank // replicas
        received, sent = _boundary_shapes(task, cfg, model, micro[0][0], stage)
        strategy = PipelineParallel(cfg, placement, model, task, optimizer_for(cfg, task, gpu_target))
        run = _StageStep(cfg, strategy, micro, (received, sent), counter, replicas)
        flops, memory = count_then_track(strategy, run, (*micro, *run.buffers), counter, first)
        held = dict(strategy.held_bytes)
        pieces = state_pieces(strategy) + run.grads
    mesh_dims = list(ParallelDims.of(cfg, world).sizes.items())
    # the receive buffers are tracked as inputs (temporaries); they are communication buffers
    moved = min(run.buffer_bytes, memory["temporaries"])
    memory["temporaries"] -= moved
    memory["buffers"] += moved
    after_forward = memory.pop("activations_after_forward")
    return {"memory": memory, "activations_after_forward": after_forward, "held": held, "flops": flops,
            "comm": {k: dict(v) for k, v in counter.comm.items()}, "units": 1, "zero_partition": [],
            "ops": dict(counter.ops), "op_bytes": dict(counter.op_bytes), "first_ops": dict(first.ops),
            "first_op_bytes": dict(first.op_bytes),
            "flop_calls": flop_call_rows(counter.flop_calls), "state": checked_state(pieces, mesh_dims, rank, held),
            "mesh_dims": mesh_dims, "stage": stage,
            "in_flight": in_flight(run.order), "p2p_bytes": max(_nbytes(received), _nbytes(sent))}


def _nbytes(meta: tuple[torch.Size, torch.dtype] | None) -> int:
    if meta is None:
        return 0
    shape, dtype = meta
    return shape.numel() * dtype.itemsize


def _boundary_shapes(task: Task, cfg: RunConfig, model: torch.nn.Module, first_input: Any, stage: int
                     ) -> tuple[tuple[torch.Size, torch.dtype] | None, tuple[torch.Size, torch.dtype] | None]:
    """(shape, dtype) of one micro-batch's activations this stage receives (None on the first) and sends (None
    on the last): the earlier stages' outputs, run forward without autograd as the schedule's shape inference
    does."""
    from workbench.training.parallel.strategy import DTYPES

    dtype = DTYPES.get(cfg.precision)
    x = first_input
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        for s in range(min(stage + 1, cfg.pp - 1)):
            x = task.pipeline_stages(model, cfg, s, cfg.pp)(x)
            shapes.append((x.shape, x.dtype))
    received = shapes[stage - 1] if stage > 0 else None
    sent = shapes[stage] if stage < cfg.pp - 1 else None
    return received, sent


class _StageStep:
    """One step of a stage, as the trainer's pipeline_step runs it: callable, for count_then_track."""

    def __init__(self, cfg: RunConfig, strategy: Any, micro: list[Any], boundary: tuple[Any, Any], counter: Any,
                 replicas: int) -> None:
        self.cfg, self.strategy, self.micro, self.counter = cfg, strategy, micro, counter
        received, sent = boundary
        rank = strategy.accelerator.process_index
        self.first, self.last = strategy.stage_index == 0, strategy.last_stage
        m = cfg.grad_accum_steps
        self.order = schedule_order(cfg.pp_schedule, m, cfg.pp, strategy.stage_index)
        # made once for every micro-batch and kept across steps, as PipelineStage's receive infrastructure is
        self.inputs = [torch.empty(received[0], dtype=received[1]) for _ in range(m)] if received else []
        self.output_grads = [torch.empty(sent[0], dtype=sent[1]) for _ in range(m)] if sent else []
        self.buffers = (*self.inputs, *self.output_grads)
        self.buffer_bytes = sum(t.numel() * t.element_size() for t in self.buffers)
        # per micro-batch: activations to the next stage's rank, gradients to the previous one's
        self.sends = {"F": (_nbytes(sent), [rank, rank + replicas]), "B": (_nbytes(received), [rank, rank - replicas])}
        self.grads: list[Any] = []
        self.steps = 0

    def __call__(self) -> None:
        from workbench.estimator.fake_world import update

        strategy, m = self.strategy, self.cfg.grad_accum_steps
        # pipeline_step concatenates the step's micro-batches; the schedule splits them again (views)
        inputs = torch.cat([b[0] for b in self.micro]).tensor_split(m)
        targets = torch.cat([b[1] for b in self.micro]).tensor_split(m)
        losses: dict[int, torch.Tensor] = {}
        with strategy.forward_context():
            self._schedule(inputs, targets, losses)
        for p in strategy.module.parameters():  # the schedule's scale_grads: the mean over micro-batches
            if p.grad is not None:
                p.grad.div_(m)
        strategy.after_schedule()
        update(strategy, self.cfg, self.grads)
        self.steps += 1

    def _schedule(self, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...],
                  losses: dict[int, torch.Tensor]) -> None:
        """The stage's forwards and backwards in the schedule's order. A tensor being sent stays alive while
        torch's schedule holds its send: GPipe holds every send to the end of the step; 1F1B the latest
        forward's (until the next forward), the warm-up's last one fired on its own (until the 1F1B phase ends)
        and the latest backward's (until the next backward)."""
        from workbench.training.memory import next_micro_batch

        gpipe, m = self.cfg.pp_schedule == "gpipe", self.cfg.grad_accum_steps
        warmup = min(m, self.cfg.pp - self.strategy.stage_index)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        sends: dict[str, list[torch.Tensor]] = {"F": [], "B": [], "warm-up": []}
        forwards = 0
        for kind, i in self.order:
            if kind == "F":
                if i > 0:
                    next_micro_batch()  # the memory tracker takes each forward of the stage on its own
                x = inputs[i] if self.first else self.inputs[i].requires_grad_(True)
                out = self.strategy.module[0](x)  # one chunk per rank: the layouts the estimate traces
                cache[i], forwards = (out, x), forwards + 1
                if self.last:
                    losses[i] = self.strategy.stage_loss(out, targets[i])
                else:
                    self._send("F")
                    sends["F"] = [*sends["F"], out] if gpipe else [out]
                    if not gpipe and i == warmup - 2:
                        sends["warm-up"] = [out]
                continue
            out, x = cache.pop(i)
            if self.last:
                torch.autograd.backward(losses[i])
                losses[i] = losses[i].detach()
                out.detach_()
            else:
                torch.autograd.backward(out, grad_tensors=self.output_grads[i])
            del out
            if not self.first:
                sends["B"] = [*sends["B"], x.grad] if gpipe else [x.grad]
                x.grad = None
                self._send("B")
            if forwards == m:  # the first backward after the last forward ends 1F1B's steady phase
                sends["warm-up"] = []
        sends.clear()

    def _send(self, kind: str) -> None:
        if self.steps == 0:  # the counted step (the tracked one sends the same)
            nbytes, ranks = self.sends[kind]
            self.counter.record("send", nbytes, ranks, "pp", wire=float(nbytes))
