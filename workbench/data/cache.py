"""The data cache on disk: its layout, per-dataset state and locks, temp files and hashing.

A dataset version lives in ``<cache>/<name>/<version>/<path>``; beside it,
``<cache>/<name>/.<version>.state.json`` remembers what was generated and extracted there,
and ``<cache>/<name>.lock`` serialises processes resolving it. :class:`DatasetCache` is
the only code that knows this layout; resolution and verification both go through it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import filelock
import platformdirs
from tqdm import tqdm

from workbench.data.manifest import FileSpec
from workbench.utils.files import mkstemp_like_open

__all__ = [
    "TMP_PREFIX",
    "Copied",
    "DatasetCache",
    "cache_dir",
    "copy_to_temp",
    "dataset_lock",
    "sha256_file",
]

log = logging.getLogger("workbench")

_CHUNK = 1 << 20
#: Every temporary file or directory we create starts with this, so leftovers of
#: a killed process can be recognised and removed under the dataset lock.
TMP_PREFIX = ".wb-tmp-"
_STATE_VERSION = 1


def cache_dir() -> Path:
    """The data cache: ``WORKBENCH_DATA_DIR``, else ``user_cache_dir("workbench")/data``."""
    env = os.environ.get("WORKBENCH_DATA_DIR")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("workbench")) / "data"


def sha256_file(path: Path) -> str:
    """The hex sha256 of the file at ``path``, read in chunks so large files fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Copied:
    """A stream copied into a temp file next to its destination."""

    tmp: Path | None  # None when the stream exceeded the expected size
    sha256: str
    size: int


def copy_to_temp(
    src: BinaryIO, dest_dir: Path, *, limit: int | None, desc: str, progress: bool
) -> Copied:
    """Copy ``src`` into a temp file in ``dest_dir``, hashing as it goes.

    Copy and hash in one pass, so what is verified is exactly what was written. Reading
    stops past ``limit`` bytes, and the temp file is then removed (``tmp`` is None).
    """
    fd, name = mkstemp_like_open(dest_dir, prefix=TMP_PREFIX)
    tmp = Path(name)
    h, size, too_big = hashlib.sha256(), 0, False
    try:
        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=limit,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                disable=not progress,
                file=sys.stderr,
            ) as bar,
        ):
            while chunk := src.read(_CHUNK):
                size += len(chunk)
                if limit is not None and size > limit:
                    too_big = True  # stop rather than fill the disk with what a wrong URL serves
                    break
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if too_big:
        tmp.unlink()
        return Copied(None, "", size)
    return Copied(tmp, h.hexdigest(), size)


QUIET_WAIT_S = 1.0
"""How long a wait for another process's resolution goes unannounced."""


@contextmanager
def dataset_lock(cache: Path, name: str) -> Iterator[None]:
    """Hold dataset ``name``'s lock in ``cache``, saying so in the log if another process has it."""
    lock = filelock.FileLock(str(cache / f"{name}.lock"))
    # The ranks of a launch resolve together and hold the lock for milliseconds when the data is
    # cached: filelock's default 50-ms poll would be a third of a 1-step launch, and a line a launch
    # only noise.
    try:
        lock.acquire(timeout=QUIET_WAIT_S, poll_interval=0.005)
    except filelock.Timeout:
        log.info(
            "data %s: waiting for another process resolving it (lock %s)", name, lock.lock_file
        )
        lock.acquire(poll_interval=0.05)
    try:
        yield
    finally:
        lock.release()


def _jsonable(value: Any) -> Any:
    # Compare specs as they read back from the state file (tuples become lists, and so on).
    return json.loads(json.dumps(value))


class DatasetCache:
    """One dataset version's directory in the cache, and what was generated or extracted there.

    The state file is read once, when this is made; change the cache only while holding
    :func:`dataset_lock`.
    """

    def __init__(self, cache: Path, name: str, version: str) -> None:
        self.cache = cache
        self.root = cache / name / version
        self.state_path = cache / name / f".{version}.state.json"
        self._state = self._load_state()

    def _load_state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text())
            if state.get("state_version") == _STATE_VERSION:
                return state
        except (OSError, ValueError):
            pass
        return {"state_version": _STATE_VERSION, "generated": {}, "extracted": {}}

    def _save_state(self) -> None:
        fd, name = mkstemp_like_open(self.state_path.parent, prefix=TMP_PREFIX)
        with os.fdopen(fd, "w") as f:
            json.dump(self._state, f, indent=1, sort_keys=True)
        os.replace(name, self.state_path)

    def expected_sha256(self, spec: FileSpec) -> str | None:
        """The sha256 the cached ``spec.path`` must have; None when nothing says yet.

        The manifest's, else (synthetic files) that of the file last generated from
        exactly this generator spec.
        """
        if spec.sha256 or not spec.generator:
            return spec.sha256
        record = self._state["generated"].get(spec.path)
        # A record made from other params (manifest edited in place) says nothing about this spec.
        if record and record["spec"] == _jsonable(spec.generator_spec()):
            return record["sha256"]
        return None

    def record_generated(self, spec: FileSpec, sha256: str) -> None:
        """Remember that ``spec.path`` was generated from ``spec``'s generator spec."""
        self._state["generated"][spec.path] = {
            "sha256": sha256,
            "spec": _jsonable(spec.generator_spec()),
        }
        self._save_state()

    def is_extracted(self, path: str, sha256: str) -> bool:
        """Whether the archive ``path`` with this sha256 was already extracted."""
        return self._state["extracted"].get(path) == sha256

    def record_extracted(self, path: str, sha256: str) -> None:
        """Remember that the archive ``path`` with this sha256 has been extracted."""
        self._state["extracted"][path] = sha256
        self._save_state()

    def remove_stale_temps(self, paths: Iterable[str]) -> None:
        """Remove temp files left where the state and the files ``paths`` are written."""
        # Only a killed process leaves these; the caller holds the lock, so none is in use.
        dirs = {self.state_path.parent, self.root, *((self.root / p).parent for p in paths)}
        for d in dirs:
            if not d.is_dir():
                continue
            for p in d.glob(TMP_PREFIX + "*"):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
