"""All-reduce bandwidth sweep over local ranks, reported the way nccl-tests does.

For each message size: warm-up iterations, then the mean time of one all-reduce (the slowest
rank's), algbw = bytes / time and busbw = algbw x 2(n-1)/n, the bandwidth each link carries in a
ring all-reduce, comparable across rank counts. Ranks are real processes with a real process group
(NCCL on GPUs, gloo on CPU), started with torch.multiprocessing under a deadline: a rank that hangs
or dies is killed and reported, never waited on.
"""

from __future__ import annotations

import logging
import queue as queue_module
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.commands.doctor.findings import Finding, Section
from workbench.utils.units import fmt_bytes

log = logging.getLogger("workbench")

KiB, MiB = 1024, 1024 * 1024
FULL_SIZES = tuple(4 * KiB * 4**i for i in range(8))  # 4 KiB, 16 KiB, ... 64 MiB
CPU_FULL_SIZES = FULL_SIZES[:6]  # gloo over shared memory: up to 4 MiB keeps the sweep to seconds
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)
CPU_QUICK_SIZES = QUICK_SIZES[:3]
GB = 1e9  # nccl-tests reports GB/s in powers of ten


@dataclass
class SweepResult:
    """One sweep: a row per message size that completed, and the error that stopped it, if any."""

    backend: str
    ranks: int
    device: str
    start_method: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def bus_factor(ranks: int) -> float:
    """busbw / algbw for all-reduce: each rank sends and receives 2(n-1)/n of the buffer in a
    ring."""
    return 2 * (ranks - 1) / ranks


def sweep_sizes(device: str, quick: bool) -> tuple[int, ...]:
    if device == "cuda":
        return QUICK_SIZES if quick else FULL_SIZES
    return CPU_QUICK_SIZES if quick else CPU_FULL_SIZES


def iterations(size: int) -> int:
    """Timed all-reduces per size, the same on every rank; few enough that repeated sums of ones
    stay finite."""
    return 20 if size <= MiB else 10 if size <= 16 * MiB else 5


def row(size: int, seconds: float, ranks: int, iters: int) -> dict[str, Any]:
    """One line of the report: size, time per all-reduce, algbw and busbw in GB/s."""
    algbw = size / seconds / GB
    return {
        "size_bytes": size,
        "count": size // 4,
        "type": "float32",
        "iters": iters,
        "time_us": seconds * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * bus_factor(ranks),
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_size(
    size: int, rank: int, world: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    t = torch.empty(max(1, size // 4), dtype=torch.float32, device=device)
    t.fill_(rank + 1)
    dist.all_reduce(t)  # a real collective: every element must hold 1 + 2 + ... + world
    expected = world * (world + 1) / 2
    if t[0].item() != expected or t[-1].item() != expected:
        raise RuntimeError(
            f"all-reduce of {fmt_bytes(size)} returned {t[0].item()}, expected {expected}"
        )
    for _ in range(warmup):
        dist.all_reduce(t)
    iters = iterations(size)
    t.fill_(1.0)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    _sync(device)
    elapsed = torch.tensor(
        [(time.perf_counter() - start) / iters], dtype=torch.float64, device=device
    )
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective is as slow as its slowest rank
    return row(size, float(elapsed.item()), world, iters)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(
    rank: int,
    world: int,
    init_method: str,
    device_type: str,
    sizes: tuple[int, ...],
    warmup: int,
    timeout_s: float,
    results: Any,
) -> None:
    """One rank: join the group, time every size, send rows (rank 0) and 'done' or the error to the
    parent."""
    try:
        # A forked rank must not enter the parent's OpenMP pool (see rank.py); one thread each also
        # keeps n ranks from oversubscribing the cores while they measure.
        torch.set_num_threads(1)
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        for size in sizes:
            measured = _time_size(size, rank, world, warmup, device)
            if rank == 0:
                results.put(("row", rank, measured))
        dist.destroy_process_group()
        results.put(("done", rank, None))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which decides)
        results.put(("error", rank, f"{type(e).__name__}: {e}".splitlines()[0]))


def default_start_method(device: str) -> str:
    """fork on CPU (fast: no fresh interpreter importing torch); spawn for CUDA, which doesn't
    survive a fork once the parent has initialised it (the doctor reads device properties through
    CUDA)."""
    return "fork" if device == "cpu" and sys.platform.startswith("linux") else "spawn"


def run_sweep(
    ranks: int,
    device: str = "cpu",
    sizes: tuple[int, ...] = CPU_QUICK_SIZES,
    warmup: int = 2,
    deadline_s: float = 60.0,
    start_method: str | None = None,
) -> SweepResult:
    """All-reduce sweep over `ranks` local processes; never takes much longer than `deadline_s`."""
    method = start_method or default_start_method(device)
    result = SweepResult("nccl" if device == "cuda" else "gloo", ranks, device, method)
    ctx = mp.get_context(method)
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, ranks, init, device, sizes, warmup, deadline_s, results),
            name=f"doctor-allreduce-{r}",
            daemon=True,
        )
        for r in range(ranks)
    ]
    try:
        for p in procs:
            p.start()
        _collect(result, procs, results, time.monotonic() + deadline_s, deadline_s)
    finally:
        # Ranks that reported 'done' only need to exit; after an error or the deadline, don't wait
        # on them.
        _stop(procs, grace_s=2.0 if result.error is None else 0.0)
        results.close()
        results.join_thread()
    result.rows.sort(key=lambda r: r["size_bytes"])
    return result


def _collect(
    result: SweepResult, procs: list[Any], results: Any, deadline: float, deadline_s: float
) -> None:
    done: set[int] = set()
    while len(done) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [str(r) for r in range(len(procs)) if r not in done]
            result.error = (
                f"rank(s) {', '.join(late)} still running after the {deadline_s:.0f} s deadline "
                f"({len(result.rows)} of the sizes done): killed"
            )
            return
        try:
            kind, rank, payload = results.get(timeout=min(remaining, 0.2))
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode not in (None, 0)]
            if dead:
                result.error = (
                    f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without reporting"
                )
                return
            continue
        if kind == "row":
            result.rows.append(payload)
        elif kind == "done":
            done.add(rank)
        else:
            result.error = _first_cause(procs, done, rank, f"rank {rank} failed: {payload}")
            return


def _first_cause(procs: list[Any], done: set[int], rank: int, error: str) -> str:
    """A rank that died without a word is the cause; its peers' 'connection reset' errors are the
    effect."""
    time.sleep(0.2)  # let the exit of a rank that just died be seen
    dead = [
        r
        for r, p in enumerate(procs)
        if r not in done and r != rank and p.exitcode not in (None, 0)
    ]
    if dead:
        return (
            f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without reporting (then "
            f"{error})"
        )
    return error


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join for up to `grace_s`, then kill whatever is left (a rank stuck in a collective whose peer
    died)."""
    end = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            log.debug("doctor: killing all-reduce rank %s (pid %s)", p.name, p.pid)
            p.kill()
            p.join(5.0)


def format_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The nccl-tests table: size, count, time, algbw, busbw."""
    lines = [
        f"{'size':>10} {'count':>10} {'time':>10} {'algbw':>9} {'busbw':>9}",
        f"{'(B)':>10} {'(elements)':>10} {'(us)':>10} {'(GB/s)':>9} {'(GB/s)':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['size_bytes']:>10} {r['count']:>10} {r['time_us']:>10.1f} {r['algbw_GBps']:>9.3f} "
            f"{r['busbw_GBps']:>9.3f}"
        )
    return lines


def build_allreduce(
    section: Section,
    *,
    ranks: int,
    device: str,
    quick: bool,
    deadline_s: float,
    nvlink: bool = False,
) -> None:
    if ranks < 2:
        section.lines.append(
            f"skipped: {ranks} {'GPU' if device == 'cuda' else 'rank'} on this machine; an "
            "all-reduce needs 2 or more local ranks"
        )
        section.data.update(ranks=ranks, device=device, rows=[])
        return
    result = run_sweep(
        ranks, device, sweep_sizes(device, quick), warmup=2 if quick else 5, deadline_s=deadline_s
    )
    section.data.update(
        backend=result.backend,
        ranks=ranks,
        device=device,
        start_method=result.start_method,
        bus_factor=bus_factor(ranks),
        rows=result.rows,
        error=result.error,
    )
    section.lines.append(
        f"{ranks} ranks, {result.backend} on {device}, float32 sum, busbw = algbw x "
        f"2({ranks}-1)/{ranks}"
    )
    section.lines += format_rows(result.rows)
    if result.rows:
        peak = max(r["busbw_GBps"] for r in result.rows)
        section.data["peak_busbw_GBps"] = peak
        section.lines.append(f"peak bus bandwidth: {peak:.2f} GB/s")
        if device == "cuda" and nvlink and peak < 50:
            section.findings.append(
                Finding(
                    "warn",
                    f"GPUs are linked by NVLink but all-reduce peaks at {peak:.1f} GB/s bus "
                    "bandwidth",
                    "NVLink is probably unused: check NCCL_P2P_DISABLE/NCCL_P2P_LEVEL, and run "
                    "containers with --ipc=host (or a large --shm-size)",
                )
            )
    if result.error:
        section.findings.append(
            Finding(
                "error",
                f"all-reduce sweep: {result.error}",
                "rerun with -v; check NCCL_*/GLOO_* variables and that no firewall blocks "
                "127.0.0.1",
            )
        )
