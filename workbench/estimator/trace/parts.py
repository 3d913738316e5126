"""What the two tracers of a step share: step.py's, for the data-parallel and tensor-parallel
modes, and pipeline.py's, for one pipeline stage. Both build the model on the meta device and
give it fake storage, turn the real micro-batches into fake tensors, count the step with two
collective counters (the steady step's and the first step's, whose op counts the GPU host-time
constants were fitted to), and report what those counters hold as StepTrace fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from workbench.estimator.trace.fake_world import (
    CollectiveCounter,
    flop_call_rows,
    materialize,
    mesh_groups,
)

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task


def fake_model(cfg: RunConfig, task: Task, device: torch.device) -> torch.nn.Module:
    """The task's model, built on the meta device, with (fake) storage on `device`: call it under
    the fake mode."""
    with torch.device("meta"):
        model = task.build_model(cfg)
    materialize(model, device)
    return model


def fake_batches(fake: Any, real: list[Any]) -> list[Any]:
    """The real micro-batches, their tensors made fake by `fake` (the fake tensor mode)."""
    return [
        tree_map(lambda t: fake.from_tensor(t) if isinstance(t, torch.Tensor) else t, b)
        for b in real
    ]


def step_counters(
    gpus_per_node: int, mesh: Any, rank: int
) -> tuple[CollectiveCounter, CollectiveCounter]:
    """The counters of the steady step and of the first one, over `rank`'s groups of `mesh`."""
    counter = CollectiveCounter(gpus_per_node, mesh_groups(mesh, rank))
    first = CollectiveCounter(gpus_per_node, mesh_groups(mesh, rank))
    return counter, first


def counted_fields(counter: CollectiveCounter, first: CollectiveCounter) -> dict[str, Any]:
    """The StepTrace fields the counters hold: the steady step's collectives, ops and FLOP-bound
    calls, and the first step's ops."""
    return {
        "comm": {k: dict(v) for k, v in counter.comm.items()},
        "ops": dict(counter.ops),
        "op_bytes": dict(counter.op_bytes),
        "first_ops": dict(first.ops),
        "first_op_bytes": dict(first.op_bytes),
        "flop_calls": flop_call_rows(counter.flop_calls),
    }
