"""Each launch's own temporary folder: the TMPDIR of its launcher process and ranks, removed once
they are gone.

torch elastic writes under tempfile.gettempdir() and never cleans up: a `torchelastic_*` log folder
per launch (torch/distributed/elastic/multiprocessing/api.py, DefaultLogsSpecs), and when a rank
fails, its error.json there and, for forked ranks, `pytorch-errorfile-*.pickle`
(torch/multiprocessing/spawn.py). A machine that launches all day would fill its /tmp with them; and
anything else the ranks put in a temporary file goes the same way. So each launch gets a folder of
its own under the caller's temporary directory, set as TMPDIR for the processes that run its ranks,
and removes it when they are known to be gone: forked, by the caller once the supervisor has exited
or the reaper has waited for it (forked.py), and by the supervisor once notebook_launcher has
returned well (elastic has waited for the ranks), whichever comes first: a caller that exits as soon
as its run is answered leaves nothing; started by the shell launcher, when that process has been
waited for (its ranks are its children, which elastic waits for first). Removed also when the run
fails. A launch whose caller and launcher are killed outright leaves its folder (`wb-<run name>-*`
in the temporary directory), as it leaves its run directory's lock.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("workbench")

PREFIX = "wb-"
"""A launch's folder is `wb-<run name>-<random>` in the caller's temporary directory."""


def make_scratch(run_name: str) -> Path:
    """A new, empty folder for one launch's temporary files, under this process's temporary
    directory."""
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{run_name[:40]}-"))


def use_scratch(path: str | os.PathLike[str] | None) -> None:
    """In a launch's supervisor, before it starts the ranks: temporary files go to `path` (None:
    where they went), for it and for every process it starts. tempfile reads TMPDIR once and caches
    the answer, and a fork inherits that cache: both are set."""
    if path is None:
        return
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)


def remove_scratch(path: str | os.PathLike[str] | None) -> None:
    """Remove a launch's folder and what is in it (nothing when `path` is None or already gone)."""
    if path is None:
        return
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        # removed already, or being removed: a forked launch's supervisor and its caller both remove
        # it
        pass
    except OSError as e:
        log.warning(
            "could not remove the launch's temporary folder %s (%s); delete it by hand", path, e
        )


class ScratchProcess(subprocess.Popen):  # type: ignore[type-arg]
    """The shell launcher of a launch (torchrun, `accelerate launch`), started with
    TMPDIR=`scratch`, which is removed once the launcher has been waited for (poll() or wait() found
    its exit code): elastic waits for its ranks before it exits, and a launcher killed with its
    process group takes them with it."""

    def __init__(
        self, args: list[str], *, scratch: Path | None, env: dict[str, str], **kwargs: Any
    ) -> None:
        self.scratch = scratch
        super().__init__(args, env={**env, "TMPDIR": str(scratch)} if scratch else env, **kwargs)

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None:
            self._drop_scratch()
        return code

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        self._drop_scratch()
        return code

    def _drop_scratch(self) -> None:
        path, self.scratch = self.scratch, None
        remove_scratch(path)
