"""Files that readers can trust while a writer is still going: atomic replaces and whole-line
appends.

A JSON or text file is written to a unique temp file beside it, flushed to disk, then renamed over
the old one, so a reader (or a crash) sees the old file or the new one, never half of either. JSONL
files grow by one write() per line on an O_APPEND descriptor; a line torn by a crash is ended before
the next one is appended, and readers skip (and name) a line they can't parse.

Reading JSONL files of any length (a long run's metrics): workbench/utils/jsonl.py.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

from workbench.utils.jsonl import JSON_TYPES as _JSON_TYPES
from workbench.utils.jsonl import JsonlRows

_UMASK_LOCK = threading.Lock()
log = logging.getLogger("workbench")


class DamagedFileError(ValueError):
    """A file that is there but can't be read as what it should hold; the message names it and says
    why."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


def umask() -> int:
    """This process's umask, read without changing it where the OS allows (Linux), else set and
    restored under a lock (os.umask has no read-only form)."""
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
    """The mode open() gives a new file: 0o666 less the umask (0644 under umask 022, 0664 under
    002)."""
    return 0o666 & ~umask()


def mkstemp_like_open(directory: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """tempfile.mkstemp, but with the mode open() would give: mkstemp's 0600 would survive the
    rename and hide shared run directories and caches from the rest of the team."""
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
    """The parsed file, or None when it is missing or not (yet) valid JSON (UTF-8 text, as JSON must
    be)."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def read_json_checked(path: Path, expect: type = dict) -> Any:
    """The parsed file, or None when it is missing; DamagedFileError naming the file when it can't
    be read, isn't UTF-8 JSON, or holds something other than `expect` (a JSON object: dict)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:  # a directory in its place, no permission
        raise DamagedFileError(path, f"can't be read ({e.strerror or e})") from None
    return parse_json(data, path, expect)


def parse_json(data: bytes, path: Path, expect: type = dict) -> Any:
    """`data` (read from `path`) parsed; DamagedFileError naming `path` when it isn't UTF-8 JSON of
    type `expect`."""
    if not data.strip():
        raise DamagedFileError(path, "empty")
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DamagedFileError(
            path, f"not UTF-8 text (byte {e.start} is {data[e.start : e.start + 1]!r}), so not JSON"
        ) from None
    except json.JSONDecodeError as e:
        raise DamagedFileError(
            path, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    if not isinstance(value, expect):
        raise DamagedFileError(
            path,
            f"holds {_JSON_TYPES.get(type(value), type(value).__name__)}, not "
            f"{_JSON_TYPES.get(expect, expect.__name__)}",
        )
    return value


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    line = (json.dumps(obj, default=str) + "\n").encode("utf-8")
    # One write() on an O_APPEND file: a crash leaves whole lines plus at most one torn last line.
    try:  # read too: the last byte tells whether a crash tore the last line
        # less the umask
        fd, readable = (os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666), True)
    except PermissionError:  # a file we may only append to
        fd, readable = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666), False
    try:
        os.write(fd, (_end_torn_line(fd, path) if readable else b"") + line)
    finally:
        os.close(fd)


def _end_torn_line(fd: int, path: Path) -> bytes:
    """b"\\n" when the file's last line has no end (a writer crashed mid-line), else b"".

    Appended onto that line, the next one would be unreadable too; ended, only the torn line is
    lost, and readers skip it. (A newline more than needed, should another writer end it at the same
    moment, is an empty line, which readers skip.)"""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return b""
    tail = os.pread(fd, min(size, 1 << 16), max(0, size - (1 << 16)))
    start = tail.rfind(b"\n")
    torn = f"{len(tail) - start - 1:,} bytes" if start >= 0 else f"over {len(tail) - 1:,} bytes"
    log.warning(
        "%s: its last line (%s) has no end: a writer crashed mid-line; ended it so that new lines "
        "stay readable (readers skip the torn one)",
        path,
        torn,
    )
    return b"\n"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line; a line that isn't one is skipped with a warning
    naming the file and line (a last line without its end is skipped silently: it may be being
    written). jsonl.py reads."""
    return JsonlRows(path).read()


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a JSONL file as a whole (atomically), e.g. to set rows aside."""
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


MAX_YAML_NODES = 100_000
"""A workbench YAML file is small; one that expands (through aliases) past this many nodes is
refused."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents whose aliases expand past MAX_YAML_NODES: a few
    hundred bytes of nested aliases (a 'billion laughs' file) stand for billions of nodes, and
    whatever walks them later (validation, printing, saving) would never finish. Aliases in ordinary
    files (yaml.safe_dump writes them for repeated objects) are fine."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def size(n: Any) -> int:
            if id(n) not in sizes:
                sizes[id(n)] = 0  # a recursive alias counts once
                children = n.value if isinstance(n.value, list) else []
                pairs = [
                    part
                    for child in children
                    for part in (child if isinstance(child, tuple) else (child,))
                ]
                sizes[id(n)] = 1 + sum(size(c) for c in pairs)
                if sizes[id(n)] > MAX_YAML_NODES:
                    raise yaml.composer.ComposerError(
                        None,
                        None,
                        f"the document expands (through aliases) to more than {MAX_YAML_NODES:,} "
                        "nodes; write the values out",
                        n.start_mark,
                    )
            return sizes[id(n)]

        if node is not None:
            size(node)
            self._refuse_duplicate_keys(node)
        return node

    def _refuse_duplicate_keys(self, root: Any) -> None:
        """PyYAML keeps the last of two equal keys without a word, so 'lr: 1e-3 ... lr: 1e-2' would
        train with whichever came last; refuse it. Merge keys ('<<: *base') may still be
        overridden."""
        todo, seen = [root], set()
        while todo:
            node = todo.pop()
            if id(node) in seen or not isinstance(node.value, list):
                continue
            seen.add(id(node))
            firsts: dict[Any, Any] = {}
            for item in node.value:
                key_node, value_node = item if isinstance(item, tuple) else (None, item)
                todo.append(value_node)
                if (
                    not isinstance(key_node, yaml.ScalarNode)
                    or key_node.tag == "tag:yaml.org,2002:merge"
                ):
                    continue
                key = self.construct_object(key_node)
                if key in firsts:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first on line {firsts[key].start_mark.line + 1}); "
                        "YAML would keep only the last value, so write each key once",
                        key_node.start_mark,
                    )
                firsts[key] = key_node


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML text safely (no aliases); ValueError naming `source`, line and column for any
    problem."""
    try:
        # a SafeLoader subclass: as safe as yaml.safe_load
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{source}: not valid YAML{where}: {problem}") from None


def read_yaml(path: Path) -> Any:
    """Read and parse a YAML file; ValueError naming the file when it is missing, unreadable or
    invalid."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: can't be read ({e})") from None
    return load_yaml(text, str(path))
