"""Real training steps a machine profile (profile.py) times, beside the kernels probe.py times
at their best: a small model's step, plain and in each layout family, with its ATen ops
counted as a trace counts them, so the estimate can price them like a traced step and learn how much
slower a real one runs here (timing/cpu.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

REFERENCE_STEPS = 40
PAIRS = 30
"""Layout reference steps, each timed in turn with a plain one."""


def typical(times: list[float]) -> float:
    """A real step's time as a run's log reports it: the mean (a run's windows average their steps,
    stalls included), the slowest twentieth left out as accidents."""
    kept = sorted(times)[: max(1, len(times) - len(times) // 20)]
    return statistics.fmean(kept)


def _reference_model() -> tuple[Any, Any]:
    """The reference step's model and batch (profile.py's `reference`)."""
    from torch import nn

    torch.manual_seed(0)
    width = 384
    # layers 0 and 3 are a Megatron MLP: tensor parallel splits 0 by columns and 3 by rows
    model = nn.Sequential(
        nn.Linear(128, 2 * width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(2 * width, width),
        nn.LayerNorm(width),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(width, 16),
    )
    return model, (torch.randn(32, 128), torch.randint(0, 16, (32,)))


def _train_step(
    model: Any, batch: tuple[Any, Any], optimizer_of: Any = torch.optim.AdamW, clip: bool = True
) -> Callable[[], None]:
    """A training step of `model` (AdamW, clipping, the loss read back), as the trainer's (torch's
    clipping can't mix DTensors with plain tensors: `clip` False for a model tensor parallel splits
    in part)."""
    optimizer = optimizer_of(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step


def _counted_and_timed(
    step: Callable[[], None], comm: bool = False, steps: int = REFERENCE_STEPS
) -> dict[str, Any]:
    """One steady step's ATen ops as a trace counts them (and its collectives, `comm`), then `steps`
    steps timed (typical())."""
    from workbench.estimator.trace.fake_world import CollectiveCounter, flop_call_rows

    for _ in range(3):
        step()
    counter = CollectiveCounter(gpus_per_node=1 << 30)  # one node
    with counter:
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    calls = flop_call_rows(counter.flop_calls)
    out = {
        "ops": dict(counter.ops),
        "op_bytes": dict(counter.op_bytes),
        "flop_calls": calls,
        "flops": sum(flops * n for _, flops, n in calls),
        "step_s": typical(times) if times else 0.0,
    }
    if comm:
        out["comm"] = {key: dict(rec) for key, rec in counter.comm.items()}
    return out


def reference_step() -> dict[str, Any]:
    """A small model's whole training step as it runs here (beside the other ranks), with its ATen
    ops counted as a trace counts them: the estimate prices these ops like a traced step's and
    scales every step by how much slower the real one ran than its price (timing/cpu.py). Each
    figure above is a kernel at its best; a real step also pays for allocating its outputs, caches
    its kernels evict, the Python between ops and peers that share the cores."""
    model, batch = _reference_model()
    return _counted_and_timed(_train_step(model, batch))


def layout_references(
    ranks: int, pairs: int = PAIRS, report: Callable[[str], None] = lambda part: None
) -> dict[str, dict[str, Any]]:
    """The reference step under each family of layouts, side by side with the other ranks, counted
    and timed as `reference` is, with their collectives (DDP's buckets too: on a real process group
    they pass the dispatcher): how much slower each runs here than its ops and collectives priced
    alone. DDP's buckets fire during backward on the cores backward uses; ZeRO-1 adds its
    optimizer's broadcasts; FSDP2 its hooks, copy-in and copy-out in Python; tensor parallel is
    where DTensor's cost per op is measured (timing/cpu.py's dtensor_op_cost). Each is timed `pairs`
    times (_paired); `report` hears each family's name once it is done."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    plain = _train_step(*_reference_model())
    out = {}
    model, batch = _reference_model()
    out["ddp"] = _paired(plain, _train_step(DistributedDataParallel(model), batch), pairs)
    report("ddp")
    model, batch = _reference_model()
    out["zero1"] = _paired(
        plain,
        _train_step(
            DistributedDataParallel(model),
            batch,
            lambda params, **kw: ZeroRedundancyOptimizer(
                params, optimizer_class=torch.optim.AdamW, **kw
            ),
        ),
        pairs,
    )
    report("zero1")
    mesh = init_device_mesh("cpu", (ranks,))
    model, batch = _reference_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out["fsdp"] = _paired(plain, _train_step(model, batch), pairs)
    report("fsdp")
    model, batch = _reference_model()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "3": RowwiseParallel()})
    out["tp"] = _paired(
        _train_step(*_reference_model(), clip=False), _train_step(model, batch, clip=False), pairs
    )
    report("tp")
    return out


def _paired(
    plain: Callable[[], None], layout: Callable[[], None], pairs: int = PAIRS
) -> dict[str, Any]:
    """`layout`'s step counted, then it and the `plain` reference step timed in turn, `pairs` times,
    so both see the same moments of a shared machine: 'step_s' and 'plain_s' (typical())."""
    plain()
    out = _counted_and_timed(layout, comm=True, steps=0)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(pairs):
        for fn, into in ((plain, times[0]), (layout, times[1])):
            start = time.perf_counter()
            fn()
            into.append(time.perf_counter() - start)
    out["plain_s"], out["step_s"] = typical(times[0]), typical(times[1])
    return out
