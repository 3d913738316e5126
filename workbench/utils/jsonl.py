"""Reading JSONL files of any length: a long run's metrics.jsonl holds hundreds of thousands of
lines, and each reader costs what it shows. JsonlRows parses whole chunks at once and, asked again,
only what was appended; tail_jsonl reads from the end, as far back as its caller goes; sample_lines
picks the lines a picture of the whole file needs, parsing none of the others. All of them follow
files.py's rules: a line that isn't a JSON object is skipped (and named, where it is parsed in
order), a last line without its end may be being written.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

log = logging.getLogger("workbench")

JSON_TYPES = {
    dict: "a JSON object",
    list: "a JSON list",
    str: "a JSON string",
    int: "a JSON number",
    float: "a JSON number",
    bool: "a JSON boolean",
    type(None): "JSON null",
}
"""What a JSON value is called in a message about a file holding the wrong one."""

_WARNED: set[tuple[str, int, bytes]] = set()
"""Damaged lines already reported: a reader that polls a file (a dashboard) warns about each line
once."""


JSONL_CHUNK = 4 << 20
"""How much of a JSONL file one parse takes. Its whole lines are parsed by one json.loads, as one
JSON list: the keys every line repeats are then one string per chunk rather than per line (half the
memory of a big file's rows), and the parse runs in C from end to end. Small beside the rows it
becomes, so the text in flight costs little."""

_GC_LOCK = threading.Lock()
_gc_pauses = [0, False]
"""Parses pausing the cyclic garbage collector now, and whether it was enabled before the first of
them."""


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while rows are built. Parsed JSON holds no cycles, and with
    it on, a collection every few hundred new lists and dicts walks the growing heap again and
    again: a third of a big file's parse. Pauses in several threads at once end with the last; the
    collector is left as the first found it."""
    with _GC_LOCK:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


def _parse_object(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(the line's JSON object, None), or (None, what is wrong with it)."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg})"
    if isinstance(row, dict):
        return row, None
    return None, f"{JSON_TYPES.get(type(row), 'a value')}, not a JSON object"


def _parse_whole_lines(
    data: bytes, cut: int, lines: int, first: int, path: Path
) -> list[dict[str, Any]]:
    """The JSON objects of data[:cut]: `lines` whole lines, each ending in a newline, the first of
    them line `first` of `path`. One json.loads of them all as a list when every line holds one
    object (almost always); else line by line, each line that doesn't skipped with a warning naming
    it."""
    if not lines:
        return []
    try:
        # as few copies of the text as can be (no slice of it): they are most of the parse after
        # json's own work
        rows = json.loads(
            b"".join((b"[", memoryview(data.replace(b"\n", b","))[: cut - 1], b"]")).decode("utf-8")
        )
    except (UnicodeDecodeError, json.JSONDecodeError):
        rows = None
    # As many objects as lines: a line of two values ('{...}, {...}') or one split in two would
    # shift the count.
    if rows is not None and len(rows) == lines and set(map(type, rows)) == {dict}:
        return rows
    out = []
    for number, line in enumerate(data[:cut].split(b"\n")[:-1], first):
        if not line.strip():
            continue
        row, problem = _parse_object(line)
        if row is not None:
            out.append(row)
        else:
            _warn_once(path, number, line, str(problem))
    return out


class JsonlRows:
    """The JSON objects of one JSONL file, parsed once and kept: each `read()` parses only the whole
    lines appended since the one before, so a reader that asks again (RunResult.metrics of a run
    that is still going) pays for the new rows, not the file. A file replaced (a new inode), shorter
    than what was read, or rewritten in place (the same size, a new mtime) is read again from its
    start. A last line without its end is parsed at each read and not kept: it may be being written
    (read_jsonl's rule).

    `shared`: keys whose values are lists of strings that repeat row after row (a metrics row's
    verdicts: the same sentences for thousands of rows); each distinct string is then kept once, not
    once per row.
    """

    def __init__(self, path: str | os.PathLike[str], shared: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.shared = shared
        self._strings: dict[str, str] = {}
        self._lock = threading.Lock()
        self._forget(None)

    def _forget(self, file_id: tuple[int, int] | None) -> None:
        self._rows: list[dict[str, Any]] = []
        self._offset = self._lines = 0
        self._file_id = file_id
        self._seen: tuple[int, int] | None = None  # (size, mtime_ns) at the last read
        self._torn: dict[str, Any] | None = None  # the unended last line, when it parsed

    def __getstate__(self) -> dict[str, Any]:
        # the rows are read again where it is unpickled (and a lock
        return {"path": self.path, "shared": self.shared}
        # does not pickle)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["shared"])  # type: ignore[misc]

    def read(self) -> list[dict[str, Any]]:
        """Every row so far: the list kept (don't change it: copy it), plus the unended last line
        when it parsed."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    st = os.fstat(f.fileno())
                    file_id = (st.st_dev, st.st_ino)
                    if (
                        file_id != self._file_id
                        or st.st_size < self._offset
                        or (
                            self._seen is not None
                            and st.st_size == self._seen[0]
                            and st.st_mtime_ns != self._seen[1]
                        )
                    ):
                        self._forget(file_id)
                    if (st.st_size, st.st_mtime_ns) != self._seen:
                        self._seen = (st.st_size, st.st_mtime_ns)
                        f.seek(self._offset)
                        self._read_on(f)
            except FileNotFoundError:
                self._forget(None)
            return self._rows if self._torn is None else [*self._rows, self._torn]

    def _read_on(self, f: BinaryIO) -> None:
        """Parse the whole lines from _offset on, a chunk at a time; each chunk starts where the
        last one's whole lines ended (read again from there, rather than joined to what is left of
        it: a copy less)."""
        with _gc_paused():
            while True:
                f.seek(self._offset)
                data = f.read(JSONL_CHUNK)
                while b"\n" not in data and (more := f.read(JSONL_CHUNK)):
                    # a line longer than a chunk
                    data += more
                cut = data.rfind(b"\n") + 1
                if cut:
                    lines = data.count(b"\n", 0, cut)
                    rows = _parse_whole_lines(data, cut, lines, self._lines + 1, self.path)
                    self._share(rows)
                    self._rows.extend(rows)
                    self._offset += cut
                    self._lines += lines
                if len(data) < JSONL_CHUNK or not cut:
                    # the end of the file: what is left has no end yet
                    rest = data[cut:]
                    break
        self._torn = _parse_object(rest)[0] if rest.strip() else None

    def _share(self, rows: list[dict[str, Any]]) -> None:
        same = self._strings.setdefault
        for key in self.shared:
            for row in rows:
                value = row.get(key)
                if type(value) is list and value:
                    with contextlib.suppress(TypeError):
                        # not strings (a hand-made row): left as they are
                        value[:] = map(same, value, value)


def tail_jsonl(
    path: str | os.PathLike[str], block: int = 64 * 1024, limit: int | None = None
) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file from its last line back, read from the end `block` bytes at
    a time as they are asked for: the newest rows of a file of any length cost what is taken of
    them. `limit`: no further back than that many bytes from the end (a line that begins before is
    left out). Lines that aren't objects (a torn last line, one being written) are skipped."""
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed with the generator)
    except FileNotFoundError:
        return
    with f:
        end, cut = os.fstat(f.fileno()).st_size, b""
        stop = 0 if limit is None else max(0, end - limit)
        while end > stop:
            start = max(stop, end - block)
            f.seek(max(0, start - 1))  # the byte before too: whether the block begins with a line
            before = f.read(1) if start > 0 else b"\n"
            lines = (f.read(end - start) + cut).split(b"\n")
            cut = b""
            if before != b"\n":
                # begins inside a line: joined to the block before, or left out at the limit
                cut = lines.pop(0)
            for line in reversed(lines):
                row = _parse_object(line)[0] if line.strip() else None
                if row is not None:
                    yield row
            end = start


class SampledLines(NamedTuple):
    """Whole lines of a JSONL file picked to picture all of it (sample_lines)."""

    lines: list[tuple[int, bytes]]
    """(offset, line without its end), in file order."""
    end: int
    """The offset past the last whole line: where a reader goes on from."""
    complete: bool
    """Every line up to `end` is in `lines` (a file no longer than the whole tail)."""


def sample_lines(
    f: BinaryIO, most: int, *, whole_tail: int, keep: bytes | None = None
) -> SampledLines:
    """From an open JSONL file, the whole lines a picture of all of it needs: every line of its last
    `whole_tail` bytes, and of the lines before them, `most` spread evenly over their bytes (the
    first included), plus those holding `keep` (eval rows, say; thinned to `most`, the newest kept).
    What is read beyond those lines is a byte search, so a file of any length costs about what is
    shown: no line outside the sample is parsed."""
    end = _last_line_end(f)
    tail_start = 0 if end <= whole_tail else _line_start_at(f, end - whole_tail, end)
    picked: dict[int, bytes] = {}
    marked: list[tuple[int, bytes]] = []
    if tail_start:
        targets, pos, take_first = [tail_start * i // most for i in range(most)], 0, False
        while pos < tail_start:
            f.seek(pos)
            data = f.read(min(JSONL_CHUNK, tail_start - pos))
            # A line longer than a chunk: read on to its end ([pos, tail_start) ends with a line's).
            while b"\n" not in data and (
                more := f.read(min(JSONL_CHUNK, tail_start - pos - len(data)))
            ):
                data += more
            cut = data.rfind(b"\n") + 1  # the chunk's whole lines: data[:cut]
            if not cut:
                # the file was cut short meanwhile (it is replaced, never truncated, by workbench)
                break
            if take_first:
                # an even point fell on the previous chunk's last line end: this chunk's first line
                picked[pos], take_first = data[: data.find(b"\n")], False
            while targets and targets[0] < pos + cut:
                at = targets.pop(0) - pos
                start = 0 if at <= 0 else data.find(b"\n", at - 1) + 1
                if start < cut:
                    picked.setdefault(pos + start, data[start : data.find(b"\n", start)])
                else:
                    take_first = True
            hit = data.find(keep, 0, cut) if keep else -1
            while hit >= 0:
                start, stop = data.rfind(b"\n", 0, hit) + 1, data.find(b"\n", hit)
                marked.append((pos + start, data[start:stop]))
                hit = data.find(keep, stop, cut)  # type: ignore[arg-type]
            pos += cut
        if len(marked) > most:
            stride = -(-len(marked) // max(1, most - 1))
            marked = [*marked[:-1:stride], marked[-1]]
        picked.update(marked)
    f.seek(tail_start)
    offset = tail_start
    for line in f.read(end - tail_start).split(b"\n")[:-1]:
        picked[offset] = line
        offset += len(line) + 1
    return SampledLines(sorted(picked.items()), end, tail_start == 0)


def sample_jsonl(
    path: str | os.PathLike[str], most: int, *, whole_tail: int, keep: bytes | None = None
) -> list[dict[str, Any]]:
    """The JSON objects of sample_lines' lines of the file at `path`, in file order ([] when it is
    missing); lines that aren't objects are skipped."""
    try:
        with open(path, "rb") as f:
            sampled = sample_lines(f, most, whole_tail=whole_tail, keep=keep)
    except FileNotFoundError:
        return []
    with _gc_paused():
        rows = [_parse_object(line)[0] for _, line in sampled.lines if line.strip()]
    return [row for row in rows if row is not None]


def _last_line_end(f: BinaryIO, block: int = 64 * 1024) -> int:
    """The offset just past the file's last newline (0 without one)."""
    end = os.fstat(f.fileno()).st_size
    while end > 0:
        start = max(0, end - block)
        f.seek(start)
        at = f.read(end - start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def _line_start_at(f: BinaryIO, pos: int, limit: int, block: int = 64 * 1024) -> int:
    """The offset of the first line that starts at or after `pos` (`limit` when none does before
    it)."""
    if pos <= 0:
        return 0
    f.seek(pos - 1)
    while (at := pos - 1) < limit:
        data = f.read(block)
        if not data:
            break
        found = data.find(b"\n")
        if found >= 0:
            return min(limit, at + found + 1)
        pos += len(data)
    return limit


def count_lines(path: str | os.PathLike[str], offset: int) -> int:
    """How many newlines the file holds before `offset`: the number of the line starting there, less
    one (for messages about a line found by its offset)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0 and (data := f.read(min(JSONL_CHUNK, offset))):
            count += data.count(b"\n")
            offset -= len(data)
    return count


def _warn_once(path: Path, number: int, line: bytes, problem: str) -> None:
    key = (str(path), number, line[:64])
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s, line %d: skipped, %s: %r", path, number, problem, line[:80])
