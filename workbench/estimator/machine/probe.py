"""What a machine profile (profile.py) measures, run in each of its children: the kernels a small
model's step is made of, and gloo's collectives. The per-op figures follow the classes an ATen op of
a traced step is priced by (timing/op_kinds.py).

Every compute figure is the best of many short rounds: other processes only ever add time, so the
best round is what the machine itself does. Collectives are a call that didn't stall, plus the mean
stall of all of them: every step pays its share of their stalls. Real steps (a reference model,
plain and in each layout family) are their mean, as a run's log reports its steps.

Each child reports every part it finishes (`report`), so the parent's deadline is on progress, not
on the whole: on a machine loaded by other work the parts take longer but keep coming. More ranks
than cores take turns on them, each timed sample then costs ranks / cores times as long, so the
samples that need every rank (collectives, layout steps) are cut by as much (`samples`): the probe
takes about as long at 8 ranks as at 2.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from workbench.estimator.machine.reference import PAIRS, layout_references, reference_step
from workbench.estimator.timing.op_kinds import op_kind

VERSION = 4
"""Bumped when what is measured changes: stored profiles of another version are measured again."""
KINDS = ("copy", "inplace", "math", "random")
"""Elementwise kinds: out-of-place arithmetic, in-place arithmetic, transcendental (gelu, exp),
random (dropout)."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")
MATMUL_SIZES = (16, 32, 64, 128, 256, 512)
ATTENTION_SHAPES = ((2, 2, 64, 32), (8, 4, 128, 64))
"""(batch, heads, sequence, head size) of the attention measured forward and backward."""
ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
ELEMENTWISE_BYTES = (16 * 1024, 256 * 1024, 4 * 1024 * 1024)
COLLECTIVE_BYTES = (64, 4 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024)
"""Full-buffer sizes each collective is timed at: gloo's time is no straight line in bytes (it
changes algorithm and chunking with size), so a step's collectives are priced between measured
sizes."""
COLLECTIVE_ITERS = 30
MIN_SAMPLES = 8
"""The fewest timed calls per collective size or layout step, however many ranks share the cores."""
JITTER_BURSTS = 60
ROUND_S = 0.001
ROUNDS = 12
"""Short rounds, many: on a busy machine the best of them still fits between other processes'
turns."""


def best(fn: Callable[[], Any], round_s: float = ROUND_S, rounds: int = ROUNDS) -> float:
    """Seconds per call: the fastest of `rounds` rounds of about `round_s` each (after one call to
    warm up)."""
    fn()
    fastest = float("inf")
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed >= round_s:
                break
        fastest = min(fastest, elapsed / n)
    return fastest


# ---- compute -------------------------------------------------------------------------------------
def samples(full: int, ranks: int, threads: int = 1) -> int:
    """`full` timed calls where the ranks' threads fit the cores; fewer, by the ranks' share of the
    cores, where they take turns on them (each call then takes that many times longer), and never
    under MIN_SAMPLES."""
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    return max(MIN_SAMPLES, min(full, round(full * cores / (ranks * threads))))


def compute_figures(report: Callable[[str], None] = lambda part: None) -> dict[str, Any]:
    """The kernels one rank reaches, measured part by part (`report` hears each part's name once it
    is done)."""
    tiny = torch.ones(1)
    out: dict[str, Any] = {"op_s": best(lambda: torch.add(tiny, tiny))}
    parts: dict[str, Callable[[], Any]] = {
        "matmul": _matmul,
        "attention": _attention,
        "step_op_s": lambda: _step_op_s(out["op_s"]),
        "elementwise": _elementwise,
        "batch": _batch,
        "jitter": _jitter,
        "reference": reference_step,
    }
    for name, part in parts.items():
        out[name] = part()
        report(name)
    return out


def _jitter() -> list[float]:
    """[mean / best, standard deviation / mean] of the same burst of work timed again and again (the
    slowest twentieth left out): how much slower than its best a rank's step runs here on average
    (about ranks / cores when the ranks outnumber the cores), and how far apart the ranks' steps
    end."""
    a = torch.randn(128, 128)
    times = []
    for _ in range(JITTER_BURSTS):
        start = time.perf_counter()
        for _ in range(20):
            torch.mm(a, a)
        times.append(time.perf_counter() - start)
    kept = sorted(times)[: len(times) - len(times) // 20]
    mean = statistics.fmean(kept)
    return [mean / kept[0], statistics.pstdev(kept) / mean]


def _matmul() -> dict[str, list[list[float]]]:
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        points = []
        for n in MATMUL_SIZES:
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            points.append([2.0 * n**3, 2.0 * n**3 / best(lambda a=a, b=b: torch.mm(a, b))])
        out[name] = points
    return out


def _attention() -> dict[str, list[list[float]]]:
    """[FLOPs per call, FLOP/s] of scaled dot-product attention, forward and backward (FLOPs counted
    in full, as FlopCounterMode counts them: 4 x B x H x T^2 x D forward, twice that backward)."""
    from torch.nn.functional import scaled_dot_product_attention

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        points = []
        for b, h, t, d in ATTENTION_SHAPES:
            q, k, v = (torch.randn(b, h, t, d, dtype=dtype, requires_grad=True) for _ in range(3))

            def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

            flops = 3 * 4.0 * b * h * t * t * d
            points.append([flops / 3, flops / best(step)])  # per call: a forward or a backward
        out[name] = points
    return out


def _elementwise() -> dict[str, list[list[float]]]:
    out: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    for nbytes in ELEMENTWISE_BYTES:
        a, b = torch.rand(nbytes // 4) + 0.5, torch.rand(nbytes // 4) + 0.5
        # math: a transcendental op forward and its backward, which reads twice as much, on average
        kernels = {
            "copy": lambda a=a, b=b: torch.mul(a, b),
            "inplace": lambda a=a, b=b: a.add_(b),
            "math": lambda a=a, b=b: (
                torch.nn.functional.gelu(a),
                torch.ops.aten.gelu_backward(b, a),
            ),
            "random": lambda b=b: b.bernoulli_(0.5),
        }
        for kind, fn in kernels.items():
            out[kind].append([float(nbytes), best(fn) / nbytes / (2 if kind == "math" else 1)])
    return out


def _batch() -> list[float]:
    """[seconds per batch, seconds per sample] of the DataLoader the trainer uses, over an in-memory
    dataset."""
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.randn(1 << 14, 64), torch.randint(0, 10, (1 << 14,)))
    per_batch = []
    for size in (1, 64):
        batches = iter(DataLoader(dataset, batch_size=size, shuffle=True))
        per_batch.append(best(lambda batches=batches: next(batches), rounds=6))
    per_sample = max(0.0, (per_batch[1] - per_batch[0]) / 63)
    return [max(0.0, per_batch[0] - per_sample), per_sample]


def _step_op_s(op_s: float) -> float:
    """Seconds per op of a tiny training step (an MLP of width 8: its kernels do next to nothing),
    the op's views at `op_s` each: what every op of a real step pays before its kernel does any
    work."""
    from torch import nn

    model = nn.Sequential(
        nn.Linear(8, 8),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(8, 8),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(8, 4),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    from workbench.estimator.trace.fake_world import CollectiveCounter

    step()  # the optimizer's state exists from here on
    with CollectiveCounter(gpus_per_node=1) as counter:
        step()
    kinds = Counter({kind: 0 for kind in ("free", "view")})
    for name, n in counter.ops.items():
        kinds[op_kind(name)] += n
    views, working = kinds["view"], sum(kinds.values()) - kinds["view"] - kinds["free"]
    return max(op_s, (best(step, round_s=0.002) - views * op_s) / working)


# ---- gloo and DTensor ----------------------------------------------------------------------------
def distributed_figures(
    rank: int,
    ranks: int,
    store: str,
    threads: int = 1,
    report: Callable[[str], None] = lambda part: None,
) -> dict[str, Any]:
    """What needs the ranks' process group (each child calls it): the extra cost of an op on
    DTensors (FSDP2's parameters, tensor parallel's activations), and, for two ranks or more, gloo's
    collectives and the reference step in each layout family."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=60),
    )
    try:
        out: dict[str, Any] = {"dtensor_op_s": _dtensor_op_s(ranks)}
        report("dtensor_op_s")
        if ranks > 1:
            calls = samples(COLLECTIVE_ITERS, ranks, threads)
            out["collectives"], out["collective_stall_s"] = _collectives(
                dist, rank, ranks, calls, report
            )
            out["layouts"] = layout_references(ranks, samples(PAIRS, ranks, threads), report)
        return out
    finally:
        dist.destroy_process_group()


def _dtensor_op_s(ranks: int) -> float:
    """Seconds a pointwise op on sharded DTensors takes beyond the same op on their local tensors:
    the optimizer's ops of a sharded run, as AdamW issues them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ranks,))
    a, b = (distribute_tensor(torch.rand(8 * ranks, 8) + 0.5, mesh, [Shard(0)]) for _ in range(2))
    la, lb = a.to_local(), b.to_local()

    def ops(x: torch.Tensor, y: torch.Tensor) -> None:
        x.lerp_(y, 0.1)
        x.mul_(0.999).addcmul_(y, y, value=0.001)
        x.addcdiv_(y, y.sqrt().add_(1.0), value=-0.001)

    return max(0.0, (best(lambda: ops(a, b)) - best(lambda: ops(la, lb))) / 6)


def _collectives(
    dist: Any, rank: int, ranks: int, calls: int, report: Callable[[str], None]
) -> tuple[dict[str, list[list[float]]], float]:
    """kind -> [[wire bytes each rank sends per call (ring), seconds of a call that didn't stall],
    ...] at COLLECTIVE_BYTES, between this machine's `ranks` processes; and the mean stall, over
    every call timed (`calls` calls of each size up to 1 MiB, fewer of the larger ones).

    gloo's times here are two populations: some calls take their own time, and others wait
    milliseconds for a peer's thread to be scheduled (a quarter to over half of them on a shared
    2-core box, about a scheduler tick each). The lower quartile of each size is a call that didn't
    stall, and stable; the stall each call pays on average is measured over all of them pooled,
    which a few dozen calls of one size can't tell from luck."""
    from workbench.estimator.trace.fake_world import wire_bytes

    table: dict[str, list[list[float]]] = {}
    excess: list[float] = []
    for kind in COLLECTIVES:
        table[kind] = []
        for nbytes in COLLECTIVE_BYTES:
            times = sorted(_collective_times(dist, kind, nbytes, rank, ranks, calls))
            typical = times[len(times) // 4]  # the lower quartile: a call that didn't stall
            table[kind].append([wire_bytes(kind, nbytes, 2 if kind == "send" else ranks), typical])
            excess += [t - typical for t in times]
        report(kind)
    # the slowest fiftieth: accidents
    kept = sorted(excess)[: max(1, len(excess) - len(excess) // 50)]
    return table, max(0.0, statistics.fmean(kept))


def _collective_times(
    dist: Any, kind: str, nbytes: int, rank: int, ranks: int, calls: int
) -> list[float]:
    """Rank 0's times of one collective of `nbytes` (the full buffer), each started together (a
    barrier before it); a send is half its round trip."""
    part = torch.ones(max(1, nbytes // 4 // ranks))
    full = torch.ones(part.numel() * ranks)
    # the flat-tensor collectives, by their `_single` names where torch has those
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather(full, part),
        "reduce_scatter": lambda: reduce_scatter(part, full),
        "broadcast": lambda: dist.broadcast(full, 0),
        "send": lambda: _ping(dist, full, rank),
    }
    times = []
    for i in range(
        max(MIN_SAMPLES, calls * COLLECTIVE_BYTES[3] // max(nbytes, COLLECTIVE_BYTES[3])) + 2
    ):
        dist.barrier()
        start = time.perf_counter()
        ops[kind]()
        if i >= 2:  # two to warm up
            times.append((time.perf_counter() - start) / (2 if kind == "send" else 1))
    return times


def _ping(dist: Any, tensor: torch.Tensor, rank: int) -> None:
    """Rank 0 sends to rank 1 and back: a round trip, two sends (other ranks wait at the next
    barrier)."""
    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    elif rank == 1:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)
