"""A launch leaves nothing in TMPDIR (issue 35): torch elastic's `torchelastic_*` log folders and the error files of
failed ranks go into the launch's own temporary folder, which is removed once its processes are gone, whether the
run completed or failed, with forked ranks and with ranks the shell launcher (torchrun) started."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

# Imported before TMPDIR changes: importing dynamo makes torchinductor_<user> in the temporary directory, once per
# process (a launch imports it in the caller before it forks): this test process's doing, not a launch's.
import torch._dynamo  # noqa: F401
from tasks_for_tests import TinyRegression
from test_launch_returns import SlowToExit, alive, tree

import workbench as wb
from workbench.launcher.scratch import PREFIX


@pytest.fixture
def fresh_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR set to an empty folder, for this process (tempfile reads it again) and what it starts."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return folder


@pytest.fixture
def started() -> Iterator[list[wb.Run]]:
    """The runs a test started: killed if still going when it ends, whatever it asserted."""
    runs: list[wb.Run] = []
    yield runs
    for run in runs:
        if not run.done():
            run.kill()
        for pid in tree(run._process.pid):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def listing(folder: Path) -> list[str]:
    """Everything under `folder`; a folder removed while it is walked (the launcher's cleanup
    racing the look) means a fresh look."""
    for _ in range(99):
        try:
            return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        except FileNotFoundError:
            continue
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def left_in(folder: Path, deadline_s: float) -> list[str]:
    """What is still in `folder` after waiting up to `deadline_s` for it to empty."""
    deadline = time.monotonic() + deadline_s
    while (left := listing(folder)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def config(runs_dir: Path, start_method: str, fails: bool) -> wb.RunConfig:
    return wb.RunConfig(
        task="tiny-regression",
        num_processes=2,
        max_steps=3,
        micro_batch_size=8,
        runs_dir=str(runs_dir),
        trackers=[],
        monitor_interval_s=0.0,
        start_method=start_method,
        task_options={"fail_rank": 1, "fail_at_call": 2} if fails else {},
    )


@pytest.mark.parametrize("start_method", ["fork", "spawn"], ids=["forked", "torchrun"])
@pytest.mark.parametrize("fails", [False, True], ids=["completed", "failed"])
def test_a_launch_leaves_nothing_in_tmpdir(
    fresh_tmpdir: Path, runs_dir: Path, started: list[wb.Run], start_method: str, fails: bool
) -> None:
    run = wb.start(config(runs_dir, start_method, fails), TinyRegression())
    started.append(run)
    during = [p.name for p in fresh_tmpdir.iterdir()]
    assert len(during) == 1 and during[0].startswith(f"{PREFIX}{run.run_dir.name[:40]}-"), during
    if fails:
        with pytest.raises(wb.RunFailedError, match="injected failure"):
            run.wait(timeout=120)
    else:
        assert run.wait(timeout=120).summary["status"] == "completed"
    assert left_in(fresh_tmpdir, 20) == []


def test_the_folder_outlives_the_processes_of_a_run_answered_before_they_exit(
    fresh_tmpdir: Path, runs_dir: Path, started: list[wb.Run]
) -> None:
    """A forked run is answered when its ranks returned, before they exit (forked.py): its folder is removed only
    once they have (by their supervisor, or by the reaper once it exited), never from under them."""
    run = wb.start(config(runs_dir, "fork", fails=False), SlowToExit(exit_s=2.0))
    started.append(run)
    assert run.wait(timeout=120).summary["status"] == "completed"
    ranks = [pid for pid in tree(run._process.pid) if alive(pid) and pid != run._process.pid]
    assert len(ranks) == 2, "answered before the ranks exited"
    assert [p.name for p in fresh_tmpdir.iterdir()], "the folder stays while they run"
    assert left_in(fresh_tmpdir, 30) == []
    assert not [pid for pid in ranks if alive(pid)], "removed once they were gone"


def test_a_caller_that_exits_once_its_run_is_answered_leaves_nothing(
    fresh_tmpdir: Path, runs_dir: Path, tmp_path: Path
) -> None:
    """A script that launches and exits at once (its run answered before the ranks exited, the reaper thread gone
    with the interpreter): the supervisor removes the folder itself once its ranks are gone."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import workbench as wb
        from tasks_for_tests import TinyRegression
        cfg = wb.RunConfig(task="tiny-regression", num_processes=2, max_steps=3, micro_batch_size=8,
                           runs_dir={str(runs_dir)!r}, trackers=[], monitor_interval_s=0.0)
        print(wb.launch(cfg, TinyRegression(), progress=False).summary["status"])
    """)
    # Its own dynamo import would make torchinductor_<user> in TMPDIR: the script's doing, not the launch's.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("completed"), done.stderr[-2000:]
    assert left_in(fresh_tmpdir, 20) == []
