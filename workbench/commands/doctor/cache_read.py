"""Data cache read speed: MB/s reading the cache directory's files, or a temporary file written
there when the cache holds too little, bounded in bytes and seconds.

Files are dropped from the page cache first where the OS allows it (posix_fadvise DONTNEED, no root
needed for clean pages), so the number is the storage's, not RAM's; where it can't, the report says
the reads were warm.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from workbench.commands.doctor.findings import Finding, Section
from workbench.data import cache_dir
from workbench.utils.units import MiB

_CHUNK = 4 * MiB
_TMP_PREFIX = (
    ".wb-tmp-doctor-"  # the data cache's temp prefix: leftovers of a killed process are recognised
)


@dataclass(frozen=True)
class ReadSpeed:
    bytes_read: int
    seconds: float
    files: int
    source: str
    """'cache files' or 'temporary file'."""
    cold: bool
    """True when the page cache was dropped for these files before reading."""

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.seconds if self.seconds > 0 else float("inf")


def _drop_from_page_cache(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False


def read_files(paths: list[Path], max_bytes: int, max_seconds: float) -> tuple[int, float, bool]:
    """(bytes read, seconds, all dropped from the page cache first) reading `paths` in order, within
    bounds."""
    total, cold, elapsed = 0, True, 0.0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            cold = _drop_from_page_cache(f.fileno()) and cold
            start = time.perf_counter()
            while total < max_bytes and (chunk := f.read(_CHUNK)):
                total += len(chunk)
                if elapsed + time.perf_counter() - start > max_seconds:
                    break
            elapsed += time.perf_counter() - start
        if total >= max_bytes or elapsed > max_seconds:
            break
    return total, elapsed, cold


def cache_files(root: Path) -> list[Path]:
    """Regular files in the cache, largest first (big sequential reads are what a loader does at
    start)."""
    files = [
        p
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".")
    ]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def measure(root: Path, *, max_bytes: int, max_seconds: float, min_bytes: int) -> ReadSpeed:
    """Read the cache's files; when they hold fewer than `min_bytes`, write and read a temporary
    file there."""
    root.mkdir(parents=True, exist_ok=True)  # what the first `workbench data fetch` would do
    files = cache_files(root)
    if sum(p.stat().st_size for p in files) >= min_bytes:
        n, secs, cold = read_files(files, max_bytes, max_seconds)
        return ReadSpeed(n, secs, len(files), "cache files", cold)
    fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=root)
    try:
        block = os.urandom(MiB)
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, min_bytes // MiB)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())  # only written-back pages can be dropped from the page cache
        n, secs, cold = read_files([Path(name)], max_bytes, max_seconds)
        return ReadSpeed(n, secs, 1, "temporary file", cold)
    finally:
        Path(name).unlink(missing_ok=True)


def build_cache_read(section: Section, quick: bool) -> None:
    root = cache_dir()
    speed = measure(
        root,
        max_bytes=(64 if quick else 512) * MiB,
        max_seconds=1.0 if quick else 3.0,
        min_bytes=(8 if quick else 64) * MiB,
    )
    section.data.update(
        cache_dir=str(root),
        bytes_read=speed.bytes_read,
        seconds=speed.seconds,
        mb_per_s=speed.mb_per_s,
        source=speed.source,
        files=speed.files,
        cold=speed.cold,
    )
    section.lines.append(f"cache: {root}")
    section.lines.append(
        f"read {speed.bytes_read / 1e6:.1f} MB from {speed.files} {speed.source} in "
        f"{speed.seconds * 1e3:.0f} ms: {speed.mb_per_s:,.0f} MB/s "
        f"({'page cache dropped first' if speed.cold else 'warm: may be RAM, not the disk'})"
    )
    if speed.mb_per_s < 100:
        section.findings.append(
            Finding(
                "warn",
                f"the data cache reads at {speed.mb_per_s:.0f} MB/s ({root}): a network or "
                "throttled disk",
                "point WORKBENCH_DATA_DIR at local disk (e.g. NVMe scratch) and fetch the "
                "datasets there",
            )
        )
