"""Files that readers can trust while a writer is still going: atomic replaces and whole-line appends.

A JSON or text file is written to a unique temp file beside it, flushed to disk, then renamed over the
old one, so a reader (or a crash) sees the old file or the new one, never half of either. JSONL files grow
by one write() per line on an O_APPEND descriptor, and readers skip a torn last line.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """This process's umask, read without changing it where the OS allows (Linux), else set and restored
    under a lock (os.umask has no read-only form)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def regular_file_mode() -> int:
    """The mode open() gives a new file: 0o666 less the umask (0644 under umask 022, 0664 under 002)."""
    return 0o666 & ~umask()


def mkstemp_like_open(directory: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """tempfile.mkstemp, but with the mode open() would give: mkstemp's 0600 would survive the rename and
    hide shared run directories and caches from the rest of the team."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    os.fchmod(fd, regular_file_mode())
    return fd, tmp


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp_like_open(path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # less the umask
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


MAX_YAML_NODES = 100_000
"""A workbench YAML file is small; one that expands (through aliases) past this many nodes is refused."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents whose aliases expand past MAX_YAML_NODES: a few hundred bytes
    of nested aliases (a 'billion laughs' file) stand for billions of nodes, and whatever walks them later
    (validation, printing, saving) would never finish. Aliases in ordinary files (yaml.safe_dump writes them
    for repeated objects) are fine."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def size(n: Any) -> int:
            if id(n) not in sizes:
                sizes[id(n)] = 0  # a recursive alias counts once
                children = n.value if isinstance(n.value, list) else []
                pairs = [part for child in children for part in (child if isinstance(child, tuple) else (child,))]
                sizes[id(n)] = 1 + sum(size(c) for c in pairs)
                if sizes[id(n)] > MAX_YAML_NODES:
                    raise yaml.composer.ComposerError(
                        None, None, f"the document expands (through aliases) to more than {MAX_YAML_NODES:,} "
                        "nodes; write the values out", n.start_mark)
            return sizes[id(n)]

        if node is not None:
            size(node)
        return node


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML text safely (no aliases); ValueError naming `source`, line and column for any problem."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{source}: not valid YAML{where}: {problem}") from None


def read_yaml(path: Path) -> Any:
    """Read and parse a YAML file; ValueError naming the file when it is missing, unreadable or invalid."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: can't be read ({e})") from None
    return load_yaml(text, str(path))
