"""Machine profiles (profile.py), measured once: kept in memory, and on disk at
~/.cache/workbench/machine-<hash>.json, keyed by the CPU model, its cores and the torch version, one
profile per rank layout (ranks x threads). The file is replaced atomically; a damaged one is
measured again and rewritten, never trusted. A profile measured while other processes kept the cores
busy is stored but measured again once it is an hour old, and the quieter of the two is kept: other
processes only ever slow a measurement down.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workbench.estimator import cancel, progress
from workbench.estimator.machine.probe import KINDS, VERSION
from workbench.estimator.machine.profile import MachineProfile, measure
from workbench.utils.files import DamagedFileError, read_json_checked, write_json

log = logging.getLogger("workbench")

BUSY_CORES = 0.25
"""Other processes' CPU use (cores, on average) above which a profile was measured on a busy
machine."""
REMEASURE_BUSY_S = 3600.0
"""Age after which a profile measured on a busy machine is measured again."""
STALL_S = 90.0
"""A measurement none of whose children finishes a part for this long has hung (a part takes
seconds)."""
LOCK_WAIT_S = 600.0
"""How long to wait for another process's measurement (minutes on a loaded machine) before measuring
anyway."""
_MEMORY: dict[tuple[int, int], MachineProfile] = {}
_LOCK = threading.Lock()


def machine_id() -> dict[str, str]:
    """What makes a stored profile this machine's: the CPU model, the cores, torch and Python."""
    import torch

    from workbench.utils.hardware import detect

    return {
        "cpu": _cpu_model(),
        "cores": str(detect().cpu_count),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(ident: dict[str, str] | None = None) -> Path:
    """~/.cache/workbench/machine-<hash>.json (the folder: WORKBENCH_CACHE_DIR when set)."""
    import platformdirs

    key = json.dumps(ident or machine_id(), sort_keys=True).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    folder = Path(
        os.environ.get("WORKBENCH_CACHE_DIR") or platformdirs.user_cache_dir("workbench")
    ).expanduser()
    return folder / f"machine-{digest}.json"


def machine_profile(ranks: int, threads: int, *, refresh: bool = False) -> MachineProfile:
    """The profile of `ranks` local ranks of `threads` threads each: from memory, from the file, or
    measured now (in forked children for one thread each; spawned ones for more, as OpenMP does not
    survive a fork). One process measures at a time (a lock beside the file): another that wants the
    same profile reads it after."""
    if ranks < 1 or threads < 1:
        raise ValueError(f"ranks={ranks}, threads={threads}: both must be at least 1")
    key = (ranks, threads)
    with _LOCK:
        if not refresh and key in _MEMORY:
            return _MEMORY[key]
        ident = machine_id()
        path = cache_path(ident)
        with _measuring_alone(path):
            stored = {} if refresh else _read(path, ident)
            found = stored.get(f"{ranks}x{threads}")
            if found is None or (
                found.busy_cores > BUSY_CORES and time.time() - found.measured_at > REMEASURE_BUSY_S
            ):
                progress.phase(
                    f"measuring this machine for {ranks} rank(s) x {threads} thread(s) (once; "
                    "kept on disk)"
                )
                new = measure(ranks, threads, ident, fork=threads == 1, stall_s=STALL_S)
                if new.busy_cores > BUSY_CORES:
                    log.info(
                        "this machine's profile was measured while other processes used %.1f "
                        "core(s); it is measured again in an hour",
                        new.busy_cores,
                    )
                if found is None or new.busy_cores <= found.busy_cores:
                    found = new
                _write(path, ident, {**_read(path, ident), f"{ranks}x{threads}": found})
        _MEMORY[key] = found
        return found


@contextlib.contextmanager
def _measuring_alone(path: Path) -> Iterator[None]:
    """Hold `path`.lock while measuring: two processes measuring side by side would each slow the
    other's figures. Where the lock can't be made (a read-only folder) or is held past LOCK_WAIT_S,
    measure anyway."""
    import filelock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(f"{path}.lock", timeout=LOCK_WAIT_S)
        deadline = time.monotonic() + LOCK_WAIT_S
        # in slices, so that a cancelled estimate (a launch, Python's exit) stops waiting at once
        while True:
            cancel.check("waiting for another process's measurement of this machine")
            try:
                lock.acquire(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except filelock.Timeout:
                if time.monotonic() >= deadline:
                    raise
    except (OSError, filelock.Timeout) as e:
        log.info("measuring this machine without the profile's lock (%s)", e)
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _read(path: Path, ident: dict[str, str]) -> dict[str, MachineProfile]:
    """The profiles stored for this machine; {} when there are none, and when the file is damaged or
    of another version or machine (then it is measured again, and rewritten)."""
    try:
        data = read_json_checked(path)
    except DamagedFileError as e:
        log.warning("%s: measuring this machine again", e)
        return {}
    if data is None or data.get("version") != VERSION or data.get("machine") != ident:
        return {}
    try:
        return {key: from_dict(value) for key, value in data["profiles"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        log.warning("%s: damaged machine profile (%s): measuring this machine again", path, e)
        return {}


def _write(path: Path, ident: dict[str, str], profiles: dict[str, MachineProfile]) -> None:
    try:
        write_json(
            path,
            {
                "version": VERSION,
                "machine": ident,
                "profiles": {k: asdict(v) for k, v in profiles.items()},
            },
        )
    except OSError as e:  # a read-only home: the profile still serves this process
        log.warning("this machine's profile was not stored at %s: %s", path, e)


def from_dict(data: dict[str, Any]) -> MachineProfile:
    """A profile from its JSON; ValueError when a table or figure is missing, or a figure isn't a
    positive number."""
    p = MachineProfile(**data)
    numbers: list[Any] = [
        p.op_s,
        p.step_op_s,
        p.dtensor_op_s,
        p.collective_stall_s,
        p.ranks,
        p.threads,
        p.busy_cores,
        p.measured_at,
        *p.batch,
        *p.jitter,
    ]
    for table in (p.matmul, p.attention, p.elementwise):
        numbers += [x for points in table.values() for point in points for x in point]
    numbers += [x for points in p.collectives.values() for point in points for x in point]
    if (
        not p.matmul.get("fp32")
        or not p.attention.get("fp32")
        or set(p.elementwise) != set(KINDS)
        or len(p.batch) != 2
        or len(p.jitter) != 2
        or (p.ranks > 1 and "all_reduce" not in p.collectives)
        or any(
            len(points) < 2 or any(len(point) != 2 for point in points)
            for points in p.collectives.values()
        )
    ):
        raise ValueError("a table is missing")
    if (
        not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in numbers
        )
        or p.step_op_s <= 0
        or not all(rate > 0 for rate in _rates(p))
    ):
        raise ValueError("a figure is not a positive number")
    return p


def _rates(p: MachineProfile) -> list[float]:
    """The figures that divide: FLOP/s, seconds per byte, bandwidths."""
    tables = (p.matmul, p.attention, p.elementwise)
    return [point[1] for table in tables for points in table.values() for point in points] + [
        x for points in p.collectives.values() for point in points for x in point
    ]


def forget() -> None:
    """Drop the profiles held in memory (the file stays)."""
    with _LOCK:
        _MEMORY.clear()
