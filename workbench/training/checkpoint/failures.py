"""A checkpoint write that fails: what it leaves behind and what it says. Its unfinished
.tmp-step_<N> folder is removed (on a full disk, its partial files hold the room that recording the
failure needs), and whatever torch's writers raised becomes an OSError naming what failed and how
much room is left where it was written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

FULL_BELOW_BYTES = 1 << 20
"""Less room than this left where a write failed: the disk is taken to be full, whatever the writer
raised."""


# A rank whose checkpoint write fails removes the whole unfinished checkpoint (removed_on_failure)
# while another rank may still be writing into it: that rank's error is fallout of the first
# (rundir's is_fallout knows it).
SWEPT = "its folder was removed as another rank's write failed"


def write_error(error: BaseException, where: Path) -> OSError:
    """An I/O failure inside torch's writers, as an OSError saying what failed and how much room is
    left.

    DCP collects each rank's failure as (exception, traceback) in CheckpointException.failures, and
    torch.save on a full disk raises a RuntimeError from its zip writer ('unexpected pos'), not
    ENOSPC."""
    failures = [
        f[0] if isinstance(f, tuple) and f else f
        for f in (getattr(error, "failures", None) or {}).values()
    ]
    cause = next(
        (f for f in failures if isinstance(f, OSError)), failures[0] if failures else error
    )
    try:
        free: int | None = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    code = getattr(cause, "errno", None) or errno.EIO
    if code == errno.ENOENT and not where.exists():
        return OSError(code, SWEPT)
    if isinstance(cause, OSError):
        text = cause.strerror or str(cause)
    elif free is not None and free < FULL_BELOW_BYTES:
        code, text = (
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)} ({type(cause).__name__} in torch's writer)",
        )
    else:
        text = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
    room = f"; {free / 2**30:.1f} GiB free there" if free is not None else ""
    return OSError(code, f"{text}{room}")


@contextlib.contextmanager
def removed_on_failure(tmp: Path) -> Iterator[None]:
    """A checkpoint whose writing failed leaves no .tmp-step_<N> behind: on a full disk, its partial
    files hold the room that recording the failure (the rank's error, summary.json) needs."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def explained_write_failures(tmp: Path) -> Iterator[None]:
    """Writing into `tmp`: a failure raised as an OSError that says what went wrong (write_error); a
    missing file in a folder another rank removed is that rank's fallout (SWEPT)."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOENT and not tmp.exists():
            raise OSError(errno.ENOENT, SWEPT) from e
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # torch's writers turn a full disk into a RuntimeError in a CheckpointException
        raise write_error(e, tmp) from e
