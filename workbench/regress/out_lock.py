"""One `workbench regress` per report directory: --out is locked for the whole run.

A second run on the same --out would delete the first's case directories while its notebooks run
in them (each case starts by clearing what an earlier report left there). The lock is an flock on
`<out>/.regress.lock`, which holds the owner's pid and host for the message a second run prints.
The file is never deleted: the flock, not the file, says whether a run is going on, so a run killed
with SIGKILL leaves nothing to clean up, and deleting the file could let two runs lock two
different files of the same name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("workbench")

LOCK_NAME = ".regress.lock"
_OWNER_WAIT_S = 1.0  # how long a refused run waits for the owner to have written its pid


class OutInUse(ValueError):
    """Another `workbench regress` holds this --out."""


def _owner(fd: int) -> str:
    """'pid 123 on host' as the lock's owner wrote it; the owner writes it just after taking the
    lock, so an empty file is read again for a moment."""
    deadline = time.monotonic() + _OWNER_WAIT_S
    while True:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text or time.monotonic() > deadline:
            return text or "a process that has not written its pid yet"
        time.sleep(0.02)


@contextlib.contextmanager
def hold_out(out: Path) -> Iterator[None]:
    """Hold the lock of report directory `out` (which exists) until the block ends; OutInUse,
    naming the owner's pid, when another run holds it."""
    path = out / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the owner's pid stays
    except OSError as e:  # another user's report directory, a read-only mount
        raise ValueError(
            f"--out {out}: can't open its lock file {path} ({e.strerror or e}); give this run an "
            "--out of your own"
        ) from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OutInUse(
                    f"--out {out}: another `workbench regress` ({_owner(fd)}) is writing its "
                    f"report there; wait for it to end, or give this run another --out"
                ) from None
            except OSError as e:  # a filesystem without flock (some network mounts)
                log.warning(
                    "--out %s: can't lock %s (%s): a second `workbench regress` on this --out "
                    "would not be refused",
                    out,
                    path,
                    e.strerror or e,
                )
        else:
            log.warning("--out %s: no flock on this platform; runs on it are not exclusive", out)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock
