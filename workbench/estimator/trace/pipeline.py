"""One pipeline stage's step, traced: what a rank of a pp > 1 run holds, computes and sends.

The trainer's pipeline (training/parallel/pipeline.py) runs torch.distributed.pipelining's
schedules, whose point-to-point sends and runtime shape inference can't run on a fake process group.
So the trace builds the trainer's own PipelineParallel strategy for the rank (its stage module,
tied-parameter groups, optimizer) and runs that stage's forwards and backwards in the order the
schedule runs them on this stage, as torch's PipelineStage does them:

- GPipe: every micro-batch's forward, then every backward: all grad_accum_steps micro-batches in
  flight;
- 1F1B: min(pp - stage, micro-batches) forwards first, then one backward and one forward in turn:
  the activations of at most pp - stage micro-batches held at once.

A stage other than the first receives each micro-batch's activations into buffers made once for all
of them, a stage other than the last receives the output gradients likewise (PipelineStage keeps
both for every micro-batch across steps); they are counted as communication buffers. The loss is
taken on the last stage per micro-batch and kept until its backward. Then the trainer's own
after_schedule (tied gradients summed, replicas averaged), clipping and update run as they do in a
real step. The activations and gradients sent to the neighbouring stages are recorded as
point-to-point traffic ('send@2:pp'), one of each per micro-batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from workbench.config.mesh import ParallelDims, virtual_stages

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task
    from workbench.tasks.model_plans import ModelPlan


def schedule_order(
    schedule: str, micro_batches: int, stages: int, stage: int
) -> list[tuple[str, int]]:
    """The (forward 'F' or backward 'B', micro-batch) order `schedule` runs on `stage`, as torch's
    ScheduleGPipe and Schedule1F1B step through them."""
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


def in_flight(order: list[tuple[str, int, int]]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once in `order` (over the rank's
    chunks)."""
    live = most = 0
    for kind, _, _ in order:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def rank_order(cfg: RunConfig, strategy: Any) -> list[tuple[str, int, int]]:
    """(forward 'F' or backward 'B', chunk, micro-batch) in the order this rank's schedule runs
    them: GPipe's and 1F1B's as schedule_order, the interleaved schedules' from the schedule's own
    pipeline_order (zero bubble's input-gradient pass stands for its whole backward: its weight
    pass, later, is taken with it)."""
    if strategy.chunks_per_rank == 1:
        return [
            (kind, 0, i)
            for kind, i in schedule_order(
                cfg.pp_schedule, cfg.grad_accum_steps, cfg.pp, strategy.stage_index
            )
        ]
    order = []
    for action in strategy.schedule.pipeline_order[strategy.stage_index]:
        kind = getattr(getattr(action, "computation_type", None), "value", None)
        if action is None or kind not in ("F", "B", "I"):
            continue
        order.append(
            (
                "F" if kind == "F" else "B",
                strategy.stage_ids.index(action.stage_index),
                action.microbatch_index,
            )
        )
    return order


def stage_params(task: Task, cfg: RunConfig) -> list[set[str]]:
    """The parameter names each stage holds (a meta-device model: nothing allocated), virtual stages
    included, cut as the recipe cuts them (ModelPlan: the Task's hook, then the model's own
    pipeline plan)."""
    from workbench.tasks.model_plans import ModelPlan

    total, plan = cfg.pp * virtual_stages(cfg), ModelPlan(task)
    with torch.device("meta"):
        model = task.build_model(cfg)
    return [
        {n for n, _ in _stage(plan, model, cfg, s, total).named_parameters()} for s in range(total)
    ]


def _stage(
    plan: ModelPlan, model: torch.nn.Module, cfg: RunConfig, s: int, total: int
) -> torch.nn.Module:
    """Stage `s` of `total` by `plan` (preflight refused a layout without one before a trace)."""
    chunk = plan.pipeline_stages(model, cfg, s, total)
    if chunk is None:
        raise ValueError(f"pp={cfg.pp}: " + plan.missing(model, "pipeline stages"))
    return chunk


def trace_stage(
    cfg: RunConfig,
    task: Task,
    real: list[Any],
    world: int,
    rank: int,
    fake: Any,
    gpu_target: bool,
    gpus_per_node: int,
) -> dict[str, Any]:
    """StepTrace fields for `rank`'s stage (see the module docstring)."""
    from workbench.estimator.trace.fake_world import Placement, count_then_track, optimizer_for
    from workbench.estimator.trace.held import checked_state, state_pieces
    from workbench.estimator.trace.parts import (
        counted_fields,
        fake_batches,
        fake_model,
        step_counters,
    )
    from workbench.training.parallel import parallelize
    from workbench.training.parallel.device_mesh import build_mesh

    # a CPU build can't trace CUDA autograd; bytes per tensor are the same
    device = torch.device("cpu")
    columns = world // cfg.pp  # ranks per stage: a column each, one whole pipeline
    mesh = build_mesh(cfg, "cpu", world)
    placement = Placement(device, world, rank, mesh, stage_params=stage_params(task, cfg))
    counter, first = step_counters(gpus_per_node, mesh, rank)
    with fake:
        model = fake_model(cfg, task, device)
        micro = fake_batches(fake, real)
        outputs = _stage_outputs(task, cfg, model, micro[0][0])
        make_optimizer = optimizer_for(cfg, task, gpu_target)
        strategy = parallelize(cfg, placement, model, task, make_optimizer)
        run = _StageStep(cfg, strategy, micro, outputs, counter, columns)
        flops, memory = count_then_track(strategy, run, (*micro, *run.buffers), counter, first)
        held = dict(strategy.held_bytes)
        pieces = state_pieces(strategy) + run.grads
    mesh_dims = list(ParallelDims.of(cfg, world).sizes.items())
    _count_receive_buffers(memory, run.buffer_bytes)
    after_forward = memory.pop("activations_after_forward")
    return {
        "memory": memory,
        "activations_after_forward": after_forward,
        "held": held,
        "flops": flops,
        "units": 1,
        "zero_partition": [],
        "state": checked_state(pieces, mesh_dims, rank, held),
        "mesh_dims": mesh_dims,
        "stage": strategy.stage_index,
        "in_flight": in_flight(run.order),
        "p2p_bytes": run.p2p_bytes,
        **counted_fields(counter, first),
    }


def _count_receive_buffers(memory: dict[str, int], buffer_bytes: int) -> None:
    """The receive buffers are tracked as inputs (temporaries), but they are communication
    buffers: their bytes move from temporaries to buffers in `memory`."""
    moved = min(buffer_bytes, memory["temporaries"])
    memory["temporaries"] -= moved
    memory["buffers"] += moved


def _nbytes(meta: tuple[torch.Size, torch.dtype] | None) -> int:
    if meta is None:
        return 0
    shape, dtype = meta
    return shape.numel() * dtype.itemsize


def _stage_outputs(
    task: Task, cfg: RunConfig, model: torch.nn.Module, first_input: Any
) -> list[tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of one micro-batch's output of every stage but the last (what stage s sends
    and stage s + 1 receives), run forward without autograd as the schedule's shape inference does
    (on a CP rank's share of the sequence)."""
    from workbench.tasks.model_plans import ModelPlan
    from workbench.training.parallel.strategy import DTYPES

    dtype, total = DTYPES.get(cfg.precision), cfg.pp * virtual_stages(cfg)
    plan = ModelPlan(task)
    x = first_input
    if cfg.cp > 1:  # a CP rank's stages run its share of each sequence
        (_, dim), *_ = task.context_parallel_buffers(model, (x, None)) or [(x, 1)]
        x = x.narrow(dim, 0, x.shape[dim] // cfg.cp)
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        for s in range(total - 1):
            x = _stage(plan, model, cfg, s, total)(x)
            shapes.append((x.shape, x.dtype))
    return shapes


class _StageStep:
    """One step of a rank's chunks, as the trainer's pipeline_step runs it: callable, for
    count_then_track."""

    def __init__(
        self,
        cfg: RunConfig,
        strategy: Any,
        micro: list[Any],
        outputs: list[Any],
        counter: Any,
        columns: int,
    ) -> None:
        self.cfg, self.strategy, self.micro, self.counter = cfg, strategy, micro, counter
        rank, m, pp = strategy.accelerator.process_index, cfg.grad_accum_steps, cfg.pp
        self.ids, self.total = strategy.stage_ids, strategy.total_stages
        self.order = rank_order(cfg, strategy)
        # made once for every micro-batch and kept across steps, as PipelineStage's receive
        # infrastructure is
        self.inputs = [
            [torch.empty(outputs[s - 1][0], dtype=outputs[s - 1][1]) for _ in range(m)] if s else []
            for s in self.ids
        ]
        self.output_grads = [
            [torch.empty(outputs[s][0], dtype=outputs[s][1]) for _ in range(m)]
            if s < self.total - 1
            else []
            for s in self.ids
        ]
        self.buffers = tuple(
            t for per_chunk in (*self.inputs, *self.output_grads) for t in per_chunk
        )
        self.buffer_bytes = sum(t.numel() * t.element_size() for t in self.buffers)
        self.p2p_bytes = max((_nbytes(o) for o in outputs), default=0)
        # per micro-batch: activations to the next stage's rank, gradients to the previous one's
        # (loop placement)
        pp_rank, column = divmod(rank, columns)
        ahead, behind = (
            ((pp_rank + 1) % pp) * columns + column,
            ((pp_rank - 1) % pp) * columns + column,
        )
        self.sends = [
            {
                "F": (_nbytes(outputs[s]) if s < self.total - 1 else 0, [rank, ahead]),
                "B": (_nbytes(outputs[s - 1]) if s else 0, [rank, behind]),
            }
            for s in self.ids
        ]
        self.grads: list[Any] = []
        self.steps = 0

    def __call__(self) -> None:
        from workbench.estimator.trace.fake_world import update

        strategy, m = self.strategy, self.cfg.grad_accum_steps
        # pipeline_step concatenates the step's micro-batches (split over the CP group in place, cp
        # > 1); the schedule cuts them again (views)
        whole = torch.cat([b[0] for b in self.micro]), torch.cat([b[1] for b in self.micro])
        split = (
            whole[0] if strategy.first_stage else None,
            whole[1] if strategy.last_stage else None,
        )
        with strategy.sequence_split(*split), strategy.forward_context():
            self._schedule(whole[0].tensor_split(m), whole[1].tensor_split(m))
        for p in strategy.module.parameters():
            # the schedule's scale_grads: the mean over micro-batches
            if p.grad is not None:
                p.grad.div_(m)
        strategy.after_schedule()
        update(strategy, self.cfg, self.grads)
        self.steps += 1

    def _schedule(
        self, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]
    ) -> None:
        """The rank's forwards and backwards in the schedule's order. A tensor being sent stays
        alive while torch's schedule holds its send: GPipe holds every send to the end of the step;
        1F1B the latest forward's (until the next forward), the warm-up's last one fired on its own
        (until the 1F1B phase ends) and the latest backward's (until the next backward); the
        interleaved schedules, taken like 1F1B, the latest of each per chunk."""
        from workbench.training.observe.memory import next_micro_batch

        gpipe, m = self.cfg.pp_schedule == "gpipe", self.cfg.grad_accum_steps
        # 1F1B's last warm-up forward is sent on its own (one chunk per rank only)
        warmup = (
            0 if gpipe or len(self.ids) > 1 else min(m, self.cfg.pp - self.strategy.stage_index)
        )
        cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        losses: dict[tuple[int, int], torch.Tensor] = {}
        sends: dict[Any, list[torch.Tensor]] = {"warm-up": []}
        forwards, forwarded = 0, set()
        for kind, k, i in self.order:
            first, last = self.ids[k] == 0, self.ids[k] == self.total - 1
            if kind == "F":
                # the memory tracker takes each forward of a chunk on its own
                if len(self.ids) == 1 and forwards:
                    next_micro_batch()
                elif k in forwarded:
                    next_micro_batch(self.strategy.module[k])
                forwarded.add(k)
                x = inputs[i] if first else self.inputs[k][i].requires_grad_(True)
                out = self.strategy.module[k](x)
                cache[(k, i)], forwards = (out, x), forwards + 1
                if last:
                    losses[(k, i)] = self.strategy.stage_loss(out, targets[i])
                else:
                    self._send("F", k)
                    sends[("F", k)] = [*sends.get(("F", k), []), out] if gpipe else [out]
                    if warmup and i == warmup - 2:
                        sends["warm-up"] = [out]
                continue
            out, x = cache.pop((k, i))
            if last:
                torch.autograd.backward(losses[(k, i)])
                losses[(k, i)] = losses[(k, i)].detach()
                out.detach_()
            else:
                torch.autograd.backward(out, grad_tensors=self.output_grads[k][i])
            del out
            if not first:
                sends[("B", k)] = [*sends.get(("B", k), []), x.grad] if gpipe else [x.grad]
                x.grad = None
                self._send("B", k)
            if forwards == m * len(self.ids):
                # the first backward after the last forward ends the steady phase
                sends["warm-up"] = []
        sends.clear()

    def _send(self, kind: str, chunk: int) -> None:
        if self.steps == 0:  # the counted step (the tracked one sends the same)
            nbytes, ranks = self.sends[chunk][kind]
            self.counter.record("send", nbytes, ranks, "pp", wire=float(nbytes))
