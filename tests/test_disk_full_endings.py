"""A full disk while a checkpoint is written ends the same way whichever rank fails first: ENOSPC
named as such, with the file that could not be written. torch's writers hide the ENOSPC in an
exception's chain ('unexpected pos' from the zip writer) and the rank that cleans up first frees
room the other rank then sees; neither may change the ending. /dev/full stands in for a full disk
(its writes fail with ENOSPC)."""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import RunDir
from workbench.training.checkpoint import failures
from workbench.training.checkpoint.failures import write_error
from workbench.training.checkpoint.rank_state import save_rank_state

FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")


def zip_writer_failure() -> RuntimeError:
    """What torch.save into a stream raises on a full disk: the zip writer's RuntimeError, the
    ENOSPC only in its chain."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    except RuntimeError as e:
        return e


class Failures(Exception):
    """DCP's CheckpointException: each rank's failure as (exception, traceback), the other
    ranks' pickled (their chains lost)."""

    def __init__(self, failures: dict[int, Any]) -> None:
        super().__init__("CheckpointException")
        self.failures = failures


@pytest.mark.parametrize("first", [0, 1], ids=["rank-0-first", "rank-1-first"])
def test_enospc_anywhere_in_the_failures_is_named_whatever_the_order_and_the_room_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: int
) -> None:
    # the other rank removed its partial files: room again, which once made this errno 5
    monkeypatch.setattr(
        failures.shutil, "disk_usage", lambda _: type("U", (), {"free": 50 << 30})()
    )
    pickled = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    ranks = [zip_writer_failure(), pickled]
    error = Failures({r: (ranks[(r + first) % 2], None) for r in range(2)})
    made = write_error(error, tmp_path)
    assert made.errno == errno.ENOSPC
    assert made.strerror.startswith("No space left on device (ENOSPC, the disk is full)")


@needs_dev_full
def test_a_rank_file_that_does_not_fit_is_named(tmp_path: Path) -> None:
    with pytest.raises(OSError) as info:
        save_rank_state(FULL, torch.device("cpu"), None)
    made = write_error(info.value, tmp_path)
    assert made.errno == errno.ENOSPC
    assert re.fullmatch(
        r"No space left on device \(ENOSPC, the disk is full\) writing /dev/full; "
        r"[\d.]+ GiB free there",
        made.strerror,
    ), made.strerror


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcps_writer_on_a_full_disk_names_the_file_it_had_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real DCP save whose file writes fail with ENOSPC (as on a full disk): the error names
    ENOSPC and the .distcp file DCP's writer was writing (its write() errors name no file)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import filesystem

    class FullStream:
        def __init__(self, real: Any) -> None:
            self.real = real

        def write(self, data: Any) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    real_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def full_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with real_stream(self, path, mode) as stream:
            yield FullStream(stream) if str(path).endswith(".distcp") and "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full_stream)
    target = tmp_path / "ckpt" / "model"
    with pytest.raises(BaseException) as info:  # noqa: PT011  (DCP's CheckpointException)
        dcp.save({"model": {"w": torch.ones(1000)}}, checkpoint_id=str(target), no_dist=True)
    made = write_error(info.value, tmp_path / "ckpt")
    assert made.errno == errno.ENOSPC
    assert re.search(
        rf"ENOSPC, the disk is full\) writing {re.escape(str(target))}/__0_0\.distcp", made.strerror
    ), made.strerror


# ---- the whole ending, on 2 forked gloo CPU ranks ------------------------------------------------
@pytest.mark.slow
@needs_dev_full
@pytest.mark.parametrize("full_rank", [0, 1])
def test_a_full_disk_ends_the_run_naming_enospc_and_the_file_whichever_rank_hits_it(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch, full_rank: int
) -> None:
    """The disk is full for one rank's file of checkpoint step 2 (its writes go to /dev/full):
    whichever rank that is, the run fails with ENOSPC naming that rank's file."""
    real_open = builtins.open

    def full_for_one_rank(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if Path(path).name == f"rank_{full_rank}.pt" and os.environ.get("RANK") == str(full_rank):
            return real_open(FULL, mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(failures, "open", full_for_one_rank, raising=False)  # the forked ranks'
    cfg = wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=4,
        checkpoint_every=2,
        runs_dir=str(runs_dir),
        run_name=f"full-{full_rank}",
        seed=3,
    )
    run = RunDir(runs_dir / cfg.run_name)
    file = re.escape(str(run.checkpoints_path / ".tmp-step_2" / f"rank_{full_rank}.pt"))
    ending = (
        rf"\[Errno 28\] could not write checkpoint step 2 \(.*\) in run directory .*: "
        rf"No space left on device \(ENOSPC, the disk is full\) writing {file}; "
    )
    with pytest.raises(wb.RunFailedError, match=rf"rank {full_rank} failed with .*{ending}"):
        wb.launch(cfg, task=TinyRegression())
    assert re.search(ending, run.summary().error["message"])
    assert not list(run.checkpoints_path.glob(".tmp-step_*"))


def test_a_full_disk_met_by_the_loop_ends_as_the_background_write_that_filled_it() -> None:
    """checkpoint_async: training goes on while a checkpoint fills the disk, and the rank's next
    metrics or tracker write may meet the full disk first. The ending is then the checkpoint's
    write failure (naming its file), the same as when that write fails first; a failure that is no
    ENOSPC stays the loop's own."""
    from types import SimpleNamespace

    from workbench.training.checkpoint.background import Pending
    from workbench.training.checkpoint.checkpointer import Checkpointer

    written = OSError(errno.ENOSPC, "could not write checkpoint step 2: ... writing rank_0.pt")

    def fails() -> None:
        raise written

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("writing metrics to TensorBoard failed")  # noqa: B904
    except RuntimeError as e:
        met_by_the_loop = e  # the ENOSPC only in its context, as the tracker raised it
    holder = SimpleNamespace(pending=Pending(2, fails))
    assert Checkpointer.filled_the_disk(holder, met_by_the_loop) is written
    assert holder.pending is None, "the write's failure is taken once"
    other = SimpleNamespace(pending=Pending(2, fails))
    assert Checkpointer.filled_the_disk(other, ValueError("a bug in the task")) is None
    idle = SimpleNamespace(pending=None)
    assert Checkpointer.filled_the_disk(idle, met_by_the_loop) is None
