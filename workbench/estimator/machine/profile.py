"""This machine, measured: what one rank of a local CPU run reaches while its peers run beside it.
Matrix multiplies (FLOP/s by size and dtype), the fixed cost of an ATen op (alone, and inside a tiny
training step, where autograd, modules and the optimizer's Python add to it), elementwise ops
(seconds per byte by size and kind), fetching a batch, gloo's collectives between the local ranks
(by size, and their stalls), and a small model's real training step, plain and in each layout family
(reference.py).

Measured in short-lived children of this process, never in a rank: as many children as the run has
local ranks, each with the threads a rank will have, all measuring at once, as the ranks will
compute at once; about seven seconds on 2 cores, for 2 ranks or 8. Each child reports every part it
finishes; the measurement fails only when no part ends for `stall_s` (a hung child), so a machine
that other work slows down is measured, more slowly. cache.py keeps the result in memory and
on disk.
"""

from __future__ import annotations

import bisect
import importlib
import math
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from workbench.estimator import cancel
from workbench.estimator.machine.probe import VERSION, compute_figures, distributed_figures
from workbench.utils.units import fmt_bytes, fmt_seconds


@dataclass(frozen=True)
class MachineProfile:
    """What one rank reaches on this machine with `ranks` local ranks of `threads` threads each."""

    machine: dict[str, str]
    ranks: int
    threads: int
    matmul: dict[str, list[list[float]]]
    """dtype ('fp32', 'bf16') -> [FLOPs per call, FLOP/s reached] for square matmuls of a few
    sizes."""
    attention: dict[str, list[list[float]]]
    """dtype -> [FLOPs per call, FLOP/s reached] for causal scaled dot-product attention, forward
    and backward."""
    op_s: float
    """One tiny ATen op, alone (a view costs about this)."""
    step_op_s: float
    """Per op of a tiny training step (forward, backward, clipping, AdamW): the op with the Python,
    autograd and optimizer bookkeeping around it."""
    elementwise: dict[str, list[list[float]]]
    """kind (KINDS) -> [bytes written per call, seconds per byte written]."""
    batch: list[float]
    """[seconds per batch, seconds per sample] of a DataLoader over an in-memory dataset."""
    jitter: list[float] = field(default_factory=lambda: [1.0, 0.0])
    """[mean / best, standard deviation / mean] of a burst of work timed repeatedly: a step's
    typical slowdown from its best here, and the spread of the ranks' steps."""
    dtensor_op_s: float = 0.0
    """What an op on DTensors costs beyond its local op (sharding propagation, in Python)."""
    reference: dict[str, Any] = field(default_factory=dict)
    """A small model's real training step here: its ATen ops as a trace counts them ('ops',
    'op_bytes', 'flop_calls', 'flops') and its median time ('step_s'); {} in profiles from before it
    was measured."""
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """'ddp', 'zero1', 'fsdp', 'tp' -> the reference step in that layout, counted and timed as
    `reference` is, with its collectives ('comm') and the plain reference step timed in turn with it
    ('plain_s'); {} for one rank."""
    collectives: dict[str, list[list[float]]] = field(default_factory=dict)
    """kind -> [[bytes each rank sends per call (ring wire bytes), seconds of a call that didn't
    stall], ...] at a few sizes; {} for one rank."""
    collective_stall_s: float = 0.0
    """What a collective waits beyond that on average (for a peer's thread to be scheduled),
    measured over every collective timed."""
    measured_s: float = 0.0
    busy_cores: float = 0.0
    """Other processes' CPU use while this was measured, in cores on average."""
    measured_at: float = 0.0
    """Unix time of the measurement."""
    version: int = VERSION

    def matmul_rate(self, dtype: str, flops_per_call: float) -> float:
        return _interpolate(self.matmul.get(dtype) or self.matmul["fp32"], flops_per_call)

    def attention_rate(self, dtype: str, flops_per_call: float) -> float:
        return _interpolate(self.attention.get(dtype) or self.attention["fp32"], flops_per_call)

    def seconds_per_byte(self, kind: str, bytes_per_call: float) -> float:
        return _interpolate(self.elementwise[kind], bytes_per_call)

    def batch_s(self, samples: int) -> float:
        return self.batch[0] + self.batch[1] * samples

    def collective_s(self, kind: str, count: float, wire_bytes: float) -> float:
        """`count` calls sending `wire_bytes` in all: each call's typical time between the sizes
        measured (log-log), the smallest's below them, and the largest's plus the last interval's
        bandwidth beyond them; plus the mean stall each."""
        if not count:
            return 0.0
        points = self.collectives.get(kind) or self.collectives["all_reduce"]
        per_call = wire_bytes / count
        (x0, t0), (x1, t1) = points[-2], points[-1]
        if per_call > x1:
            bandwidth = (x1 - x0) / (t1 - t0) if t1 > t0 else x1 / t1
            return count * (t1 + (per_call - x1) / bandwidth + self.collective_stall_s)
        return count * (_interpolate(points, max(per_call, 1.0)) + self.collective_stall_s)

    def rates_line(self) -> str:
        """The measured rates in one line (ranks and threads, matmul, memory and collectives),
        for an estimate's assumptions."""
        fp32 = max(rate for _, rate in self.matmul["fp32"])
        parts = [
            (
                f"{self.ranks} rank(s) x {self.threads} thread(s), measured side by side: matmul "
                f"up to {fp32 / 1e9:.0f} GFLOP/s fp32"
            ),
            f"{1e6 * self.step_op_s:.1f} us per op of a training step ({1e6 * self.op_s:.1f} us "
            "alone)",
            f"elementwise {1 / self.seconds_per_byte('copy', 2**20) / 1e9:.1f} GB/s written at 1 "
            "MiB",
        ]
        if self.collectives:
            sizes = ", ".join(
                f"{fmt_seconds(t)} for {fmt_bytes(int(x))}"
                for x, t in self.collectives["all_reduce"]
            )
            parts.append(
                f"gloo all-reduce {sizes} sent per rank without a stall, and "
                f"{fmt_seconds(self.collective_stall_s)} of stalls per collective on average"
            )
        return ", ".join(parts)


def _interpolate(points: list[list[float]], x: float) -> float:
    """Log-log interpolation between measured points; the nearest end beyond them."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


# ---- measuring -----------------------------------------------------------------------------------
def measure(
    ranks: int, threads: int, machine: dict[str, str], *, fork: bool, stall_s: float
) -> MachineProfile:
    """Measure in `ranks` children at once (forked, or spawned: fresh interpreters for more than one
    thread, as OpenMP does not survive a fork), while some child finishes a part at least every
    `stall_s`. RuntimeError saying why when a child fails or none progresses for that long (the
    children are killed)."""
    import psutil

    cancel.check("measuring this machine")
    if fork:
        # what the children run imports these once here, not in each child (AdamW pulls in dynamo:
        # ~1.3 s)
        for name in ("torch._dynamo", "torch.distributed.tensor", "torch.utils.data"):
            importlib.import_module(name)
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    tracker_was_running = resource_tracker_pid() is not None
    started, busy_before, own_before = time.perf_counter(), _busy_s(psutil), time.process_time()
    with tempfile.TemporaryDirectory(prefix="workbench-machine-") as tmp:
        barrier = ctx.Barrier(ranks)
        pipes = [ctx.Pipe(duplex=False) for _ in range(ranks)]
        children = [
            ctx.Process(
                target=_child,
                args=(r, ranks, threads, os.path.join(tmp, "store"), barrier, w),
                daemon=True,
                name=f"workbench-machine-{r}",
            )
            for r, (_, w) in enumerate(pipes)
        ]
        try:
            # cancel() (a launch, Python's exit) kills them: _collect then raises Cancelled
            with cancel.started(children):
                for _, writer in pipes:
                    writer.close()
                answers = _collect([reader for reader, _ in pipes], children, stall_s)
        finally:
            for child in children:
                if child.pid is None:  # never started (cancelled first)
                    continue
                child.join(timeout=2.0)
                if child.is_alive():
                    child.kill()
                    child.join(timeout=5.0)
            del barrier
            if not fork:
                stop_resource_tracker(tracker_was_running)
    wall = time.perf_counter() - started
    ours = sum(a["cpu_s"] for a in answers) + time.process_time() - own_before
    busy = max(0.0, (_busy_s(psutil) - busy_before - ours) / wall)
    return _profile(answers[0], machine, ranks, threads, wall, busy)


def _profile(
    figures: dict[str, Any],
    machine: dict[str, str],
    ranks: int,
    threads: int,
    wall: float,
    busy: float,
) -> MachineProfile:
    """The profile of a measurement that took `wall` seconds while `busy` cores did other work,
    from the first child's `figures`."""
    return MachineProfile(
        machine=machine,
        ranks=ranks,
        threads=threads,
        matmul=figures["matmul"],
        attention=figures["attention"],
        op_s=figures["op_s"],
        step_op_s=figures["step_op_s"],
        elementwise=figures["elementwise"],
        batch=figures["batch"],
        jitter=figures["jitter"],
        dtensor_op_s=figures["dtensor_op_s"],
        collectives=figures.get("collectives", {}),
        reference=figures["reference"],
        layouts=figures.get("layouts", {}),
        collective_stall_s=figures.get("collective_stall_s", 0.0),
        measured_s=wall,
        busy_cores=busy,
        measured_at=time.time(),
    )


def resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def stop_resource_tracker(was_running: bool) -> None:
    """Spawned children start multiprocessing's resource tracker, a process that otherwise outlives
    the measurement for the life of this one (a stray child of the notebook's kernel, or of a test):
    stop it when the measurement started it. It watched only the measurement's barrier, gone by
    now."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if not was_running and resource_tracker_pid() is not None and stop is not None:
        stop()


def _busy_s(psutil: Any) -> float:
    """CPU seconds all cores spent busy so far (steal included: time the hypervisor gave to
    others)."""
    t = psutil.cpu_times()
    return (
        sum(t)
        - t.idle
        - getattr(t, "iowait", 0.0)
        - getattr(t, "guest", 0.0)
        - getattr(t, "guest_nice", 0.0)
    )


def _collect(readers: list[Any], children: list[Any], stall_s: float) -> list[dict[str, Any]]:
    """Each child's figures, read as they come: ("part", name) as it finishes each part, then
    ("done", figures) or ("failed", why). RuntimeError when a child fails, or when no message
    arrives for `stall_s`."""
    answers: dict[int, dict[str, Any]] = {}
    done: dict[int, str] = {}
    pending = dict(enumerate(readers))
    heard = time.perf_counter()
    while pending:
        left = heard + stall_s - time.perf_counter()
        if left <= 0:
            where = ", ".join(
                f"child {r} after {done[r]!r}" if r in done else f"child {r} in its first part"
                for r in sorted(pending)
            )
            raise RuntimeError(
                f"measuring this machine stalled: no part ended for {stall_s:.0f} s ({where})"
            )
        for reader in wait(list(pending.values()), timeout=left):
            rank = next(r for r, c in pending.items() if c is reader)
            try:
                kind, payload = reader.recv()
            except EOFError:
                cancel.check("this machine's measurement ended")  # its children were killed
                raise RuntimeError(
                    f"measuring this machine: child {rank} ended without an answer (exit code "
                    f"{children[rank].exitcode})"
                ) from None
            heard = time.perf_counter()
            if kind == "failed":
                raise RuntimeError(f"measuring this machine: child {rank} failed: {payload}")
            if kind == "part":
                done[rank] = payload
            else:
                answers[rank] = payload
                del pending[rank]
    return [answers[r] for r in range(len(readers))]


def _child(rank: int, ranks: int, threads: int, store: str, barrier: Any, writer: Any) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
        barrier.wait(60.0)  # all at once: the ranks of a run compute side by side

        def report(part: str) -> None:
            writer.send(("part", part))

        figures = {
            **compute_figures(report),
            **distributed_figures(rank, ranks, store, threads, report),
        }
        figures["cpu_s"] = time.process_time()
        writer.send(("done", figures))
    except BaseException as e:  # noqa: BLE001  (sent to the parent, which raises it)
        writer.send(("failed", f"{type(e).__name__}: {e}"))
    finally:
        writer.close()
        os._exit(0)  # a forked child must not run the parent's exit handlers
