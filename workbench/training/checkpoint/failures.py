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

from workbench.storage.store_path import Location, StorePath

FULL_BELOW_BYTES = 1 << 20
"""Less room than this left where a write failed: the disk is taken to be full, whatever the writer
raised."""


# A rank whose checkpoint write fails removes the whole unfinished checkpoint (removed_on_failure)
# while another rank may still be writing into it: that rank's error is fallout of the first
# (rundir's is_fallout knows it).
SWEPT = "its folder was removed as another rank's write failed"


def write_error(error: BaseException, where: Location) -> OSError:
    """An I/O failure while writing a checkpoint into `where`, as an OSError saying what failed,
    which file, and how much room is left; the same whichever rank fails first.

    DCP collects each rank's failure as (exception, traceback) in CheckpointException.failures, and
    its writers turn a full disk into a RuntimeError ('unexpected pos') whose OSError, when there is
    one, is only in the exception's chain. Any ENOSPC in the failures or their chains makes it
    ENOSPC: a rank that hit the full disk after another rank's partial files were removed may see
    only the RuntimeError, or a disk with room again."""
    failures = [
        f[0] if isinstance(f, tuple) and f else f
        for f in (getattr(error, "failures", None) or {}).values()
    ] or [error]
    chained = [e for f in failures for e in _chain(f)]
    os_errors = [e for e in chained if isinstance(e, OSError) and e.errno]
    if isinstance(where, StorePath):
        return _store_error(failures[0], os_errors, chained, where)
    try:
        free: int | None = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    full = next((e for e in os_errors if e.errno == errno.ENOSPC), None)
    cause = full or (os_errors[0] if os_errors else failures[0])
    if isinstance(cause, OSError) and cause.errno == errno.ENOENT and not where.exists():
        return OSError(errno.ENOENT, SWEPT)
    if isinstance(cause, OSError) and cause.errno:
        code, text = cause.errno, cause.strerror or str(cause)
    elif free is not None and free < FULL_BELOW_BYTES:
        code, text = errno.ENOSPC, os.strerror(errno.ENOSPC)
    else:
        code, text = errno.EIO, f"{type(cause).__name__}: {str(cause).strip()[:300]}"
    if code == errno.ENOSPC:
        text = f"{text} (ENOSPC, the disk is full)"
    file = _failing_file(chained)
    written = f" writing {file}" if file else ""
    room = f"; {free / 2**30:.1f} GiB free there" if free is not None else ""
    return OSError(code, f"{text}{written}{room}")


def _store_error(
    first: BaseException, os_errors: list[OSError], chained: list[BaseException], where: StorePath
) -> OSError:
    """write_error on an object store: no disk to measure, and a store that went away raises
    botocore's connection errors (no OSError): EIO naming the store, the cause and the file."""
    cause: BaseException = os_errors[0] if os_errors else first
    # the innermost error says what the store did (DCP wraps it, s3fs wraps botocore's)
    for e in chained:
        if type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp"):
            cause = e
            break
    code = cause.errno if isinstance(cause, OSError) and cause.errno else errno.EIO
    file = _failing_file(chained)
    written = f" writing {file}" if file else ""
    text = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
    return OSError(code, f"the store at {where} failed{written}: {text}")


def disk_full(error: BaseException) -> bool:
    """Whether `error`, or what it was raised from or while handling, is ENOSPC."""
    return any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _chain(error))


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and what it was raised from or while handling (its __cause__ and __context__)."""
    found: list[BaseException] = []
    todo = [error]
    while todo and len(found) < 32:
        e = todo.pop(0)
        if e is None or any(e is seen for seen in found):
            continue
        found.append(e)
        todo += [e.__cause__, e.__context__]
    return found


def _failing_file(errors: list[BaseException]) -> str | None:
    """The file a failed write was writing: an OSError's filename, else the file DCP's writer had
    open (`file_name` in its frame: its OSErrors from write() name none); None when neither is
    known (a failure that reached this rank from another, pickled without its traceback)."""
    for e in errors:
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
    for e in errors:
        tb = e.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "_write_files_from_queue" and "file_name" in frame.f_locals:
                return str(frame.f_locals["file_name"])
            tb = tb.tb_next
    return None


def write_file(path: Location, data: bytes) -> None:
    """`data` written into `path` (a checkpoint's own file), a failure naming the file."""
    if isinstance(path, StorePath):
        path.write_bytes(data)  # a failure names the store: explained_write_failures
        return
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


@contextlib.contextmanager
def removed_on_failure(tmp: Location) -> Iterator[None]:
    """A checkpoint whose writing failed leaves no .tmp-step_<N> behind: on a full disk, its partial
    files hold the room that recording the failure (the rank's error, summary.json) needs. On an
    object store nothing is removed here: the store that failed the write is likely unreachable,
    and a prefix without its manifest is never used and is swept by the next seal."""
    if isinstance(tmp, StorePath):
        yield
        return
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def explained_write_failures(tmp: Location) -> Iterator[None]:
    """Writing into `tmp`: a failure raised as an OSError that says what went wrong (write_error); a
    missing file in a folder another rank removed is that rank's fallout (SWEPT)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # torch's writers turn a full disk into a RuntimeError in a CheckpointException; an OSError
        # of our own writes is named with its file and the room left, as theirs are
        raise write_error(e, tmp) from e
