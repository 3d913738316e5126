"""`wb.attach(run_dir)` for a local run: the handle a new kernel (or any other process) builds from the run
directory alone. Produced for real: `workbench train` trains 2 gloo CPU ranks in its own session, as from a
shell, and this process attaches to it; every test kills what it started, however it ends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_launcher_death import collect, output, process_tree, still_running, wait_until_training

import workbench as wb
from workbench.launcher.attached import AttachedRun
from workbench.rundir import RunDir, Status

pytestmark = pytest.mark.slow


def _shell_run(tmp_path: Path, name: str) -> tuple[list[str], RunDir]:
    config = tmp_path / f"{name}.yaml"
    wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=100_000,
        log_every=1,
        runs_dir=str(tmp_path / "runs"),
        run_name=name,
        task_options={"slow_s": 0.03},
    ).to_yaml(config)
    return [sys.executable, "-m", "workbench.cli", "train", str(config), "--no-progress"], RunDir(
        tmp_path / "runs" / name
    )


def test_attach_follows_a_shell_run_stops_it_and_returns_its_result(tmp_path: Path) -> None:
    train, run = _shell_run(tmp_path, "followed")
    with process_tree(train, tmp_path) as (proc, tree):
        wait_until_training(run, proc, tmp_path)
        collect(proc, tree)
        attached = wb.attach(run.path)
        assert isinstance(attached, AttachedRun) and attached.config.run_name == "followed"
        assert attached.status is Status.RUNNING and not attached.done()
        with pytest.raises(
            TimeoutError, match=r"run followed still running after 0.5s; call wait\(\) again"
        ):
            attached.wait(timeout=0.5)
        attached.stop()
        result = attached.wait(timeout=60)
        assert result.status is Status.STOPPED, output(tmp_path)
        # done() waited for the process that ran the ranks: the shell's command ends on its own, and the run
        # directory is free for the next launch.
        assert proc.wait(30) == 0, output(tmp_path)
    steps = result.summary["steps"]
    assert steps >= 2 and run.latest_checkpoint() is not None
    assert run.lock_owner() is None
    # Attached again once it has ended (a kernel opened the next day): the result at once, the same one.
    again = wb.attach(str(run.path))
    assert again.done() and again.wait(timeout=1).summary["steps"] == steps
    assert again.result().status is Status.STOPPED


def test_attach_kill_ends_the_ranks_and_the_run_reads_failed(tmp_path: Path) -> None:
    train, run = _shell_run(tmp_path, "killed")
    with process_tree(train, tmp_path) as (proc, tree):
        wait_until_training(run, proc, tmp_path)
        collect(proc, tree)
        attached = wb.attach(run.path)
        attached.kill()
        assert still_running(tree, timeout=30) == [], output(tmp_path)
        with pytest.raises(wb.RunFailedError):
            attached.wait(timeout=30)
        assert attached.status is Status.FAILED and attached.done()
        proc.wait(30)  # the shell's command saw its ranks end, and ends too


def test_attach_refuses_what_is_not_a_run_naming_the_runs_there(tmp_path: Path) -> None:
    (tmp_path / "runs" / "one").mkdir(parents=True)
    wb.RunConfig(task="digits", runs_dir=str(tmp_path / "runs"), run_name="one").to_yaml(
        tmp_path / "runs" / "one" / "config.yaml"
    )
    with pytest.raises(
        ValueError,
        match=r"^attach: not a run directory: .*runs has no config.yaml or summary.json: "
        r"it is a runs_dir; its runs are one. Load one, e.g. wb.attach\(",
    ):
        wb.attach(tmp_path / "runs")
    with pytest.raises(
        ValueError,
        match=r"^attach: not a run directory: .*onr does not exist \(did you mean 'one'\?\)",
    ):
        wb.attach(tmp_path / "runs" / "onr")
    # written, never started: attachable
    assert isinstance(wb.attach(tmp_path / "runs" / "one"), AttachedRun)
