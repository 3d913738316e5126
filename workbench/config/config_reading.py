"""Reading a config file the user names (a RunConfig YAML, an accelerate or DeepSpeed config):
only a regular file of a config's size is read. `workbench check /dev/zero` would otherwise read
forever, a FIFO would block the open until someone writes to it, and a multi-gigabyte file named by
mistake would be loaded whole before YAML said anything."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

MAX_CONFIG_BYTES = 1 << 20
"""A RunConfig YAML is a few kilobytes, an accelerate or DeepSpeed config less; a megabyte is far
past any real one, and small enough to read and parse at once."""


def _kind_of(mode: int) -> str:
    """What a file that isn't a regular one is, in words."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse_mode(path: Path, mode: int, kind: str) -> None:
    if not stat.S_ISREG(mode):
        raise ValueError(
            f"{path}: is {_kind_of(mode)}, not a file; pass the path of {kind} (a regular file)"
        )


def read_config_bytes(path: str | os.PathLike[str], kind: str = "a RunConfig YAML") -> bytes:
    """The content of the config file at `path`; ValueError naming the file when it is missing, is
    not a regular file (a device, a FIFO, a directory: refused before it is opened for reading), or
    is over MAX_CONFIG_BYTES. `kind` says what was expected, for the message."""
    path = Path(path).expanduser()
    try:
        # stat first: opening a FIFO for reading blocks until a writer comes
        _refuse_mode(path, os.stat(path).st_mode, kind)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; pass the path of {kind}") from None
    except OSError as e:
        if e.errno == errno.ENOTDIR:
            raise ValueError(f"{path}: no such file; pass the path of {kind}") from None
        raise ValueError(f"{path}: can't be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        # the file may have been replaced between the stat and the open
        st = os.fstat(f.fileno())
        _refuse_mode(path, st.st_mode, kind)
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{path}: is {max(st.st_size, len(data)):,} bytes, more than the "
            f"{MAX_CONFIG_BYTES:,} a config file can be ({kind} is a few kilobytes); pass the "
            "path of the config itself"
        )
    return data


def read_config_text(path: str | os.PathLike[str], kind: str = "a RunConfig YAML") -> str:
    """read_config_bytes as UTF-8 text; ValueError naming the file when it isn't."""
    data = read_config_bytes(path, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{Path(path).expanduser()}: not UTF-8 text (byte {e.start}); pass the path of {kind}"
        ) from None
