"""Files that readers can trust while a writer is still going: atomic replaces and whole-line appends.

A JSON or text file is written to a unique temp file beside it, flushed to disk, then renamed over the
old one, so a reader (or a crash) sees the old file or the new one, never half of either. JSONL files grow
by one write() per line on an O_APPEND descriptor, and readers skip a torn last line.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> Any:
    """The parsed file, or None when it is missing or not (yet) valid JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    line = json.dumps(obj, default=str) + "\n"
    # One write() on an O_APPEND file: a crash leaves whole lines plus at most one torn last line.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSONL file as a whole (atomically), e.g. to set rows aside."""
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))
