"""The data cache on disk: where it is, temp files, hashing, per-dataset state and locks."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import filelock
import platformdirs
from tqdm import tqdm

from workbench.utils.files import mkstemp_like_open
log = logging.getLogger("workbench")

_CHUNK = 1 << 20
# Every temporary file or directory we create starts with this, so leftovers of
# a killed process can be recognised and removed under the dataset lock.
_TMP_PREFIX = ".wb-tmp-"


def cache_dir() -> Path:
    """The data cache: ``WORKBENCH_DATA_DIR``, else ``user_cache_dir("workbench")/data``."""
    env = os.environ.get("WORKBENCH_DATA_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("workbench")) / "data"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _Copied:
    """A stream copied into a temp file next to its destination."""

    tmp: Path | None  # None when the stream exceeded the expected size
    sha256: str
    size: int


def _copy_to_temp(src: BinaryIO, dest_dir: Path, *, limit: int | None, desc: str, progress: bool) -> _Copied:
    """Copy and hash in one pass, so what is verified is exactly what was written."""
    fd, name = mkstemp_like_open(dest_dir, prefix=_TMP_PREFIX)
    tmp = Path(name)
    h, size, too_big = hashlib.sha256(), 0, False
    try:
        with os.fdopen(fd, "wb") as out, tqdm(total=limit, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                              disable=not progress, file=sys.stderr) as bar:
            while chunk := src.read(_CHUNK):
                size += len(chunk)
                if limit is not None and size > limit:
                    too_big = True  # stop rather than fill the disk with whatever a wrong URL serves
                    break
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if too_big:
        tmp.unlink()
        return _Copied(None, "", size)
    return _Copied(tmp, h.hexdigest(), size)


_STATE_VERSION = 1


def _load_state(path: Path) -> dict[str, Any]:
    """What was generated and extracted in a dataset's cache directory."""
    try:
        state = json.loads(path.read_text())
        if state.get("state_version") == _STATE_VERSION:
            return state
    except (OSError, ValueError):
        pass
    return {"state_version": _STATE_VERSION, "generated": {}, "extracted": {}}


def _save_state(path: Path, state: dict[str, Any]) -> None:
    fd, name = mkstemp_like_open(path.parent, prefix=_TMP_PREFIX)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(name, path)


@contextmanager
def _dataset_lock(cache: Path, name: str) -> Iterator[None]:
    lock = filelock.FileLock(str(cache / f"{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        log.info("data %s: waiting for another process resolving it (lock %s)", name, lock.lock_file)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
