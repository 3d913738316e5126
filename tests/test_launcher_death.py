"""When the process that launched a run dies, whatever killed it, the run's processes end with it and the run
directory can be launched into again. Produced for real: `workbench train` and a Python caller of `wb.start`
(forked and spawned ranks) are killed while 2 gloo CPU ranks train; every test kills what it started, however
it ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import workbench as wb
from workbench.rundir import RunDir

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1"}
CALLER = """
import sys, threading, time
import workbench as wb

cfg = wb.RunConfig.from_yaml(sys.argv[1])
runs = []
# Started from a thread that ends at once (a widget callback's, a pool's): the run must outlive the thread.
starter = threading.Thread(target=lambda: runs.append(wb.start(cfg)))
starter.start()
starter.join()
print("started by", runs[0].start_method, flush=True)
time.sleep(600)
"""


def default_signals() -> None:
    """In the child: the signals the tests send act by default, whatever this process left them as."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


@contextlib.contextmanager
def process_tree(
    args: list[str], cwd: Path
) -> Iterator[tuple[subprocess.Popen, list[psutil.Process]]]:
    """A process in its own session, its output in cwd/output.txt (a pipe would fill up, or hold the test until
    every process sharing it is gone), and the list its descendants are collected into: all of them are killed
    however the test ends."""
    tree: list[psutil.Process] = []
    with open(cwd / "output.txt", "w") as output:
        # noqa: PLW1509
        proc = subprocess.Popen(
            args,
            cwd=cwd,
            env=ENV,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_signals,
        )
    try:
        yield proc, tree
    finally:
        with contextlib.suppress(psutil.Error):
            tree += psutil.Process(proc.pid).children(recursive=True)
        if proc.poll() is None:
            proc.kill()
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the start time: never another process that got the pid
        proc.wait(30)


def collect(proc: subprocess.Popen, tree: list[psutil.Process]) -> None:
    tree += psutil.Process(proc.pid).children(recursive=True)


def output(cwd: Path) -> str:
    return (cwd / "output.txt").read_text()[-3000:]


def wait_until_training(run: RunDir, proc: subprocess.Popen, cwd: Path, steps: int = 2) -> None:
    deadline = time.time() + 120
    while (
        len([r for r in run.metrics() if "loss" in r]) < steps
        or len(list(run.ranks_path.glob("rank_*"))) < 2
    ):
        assert proc.poll() is None, f"the launcher ended early:\n{output(cwd)}"
        assert run.observed_status()[0] != "failed", f"the run failed:\n{output(cwd)}"
        assert time.time() < deadline, f"no {steps} steps trained within 120 s:\n{output(cwd)}"
        time.sleep(0.1)


def still_running(tree: list[psutil.Process], timeout: float = 20) -> list[str]:
    """The processes of `tree` still running after `timeout` seconds (zombies count as gone). The ranks take a
    second or two to checkpoint and exit; within 20 s, not by torch elastic's SIGKILL 30 s after its SIGTERM
    to ranks that kept catching it."""
    deadline = time.time() + timeout
    while True:
        left = []
        for p in tree:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


def assert_launchable_again(config: Path, run: RunDir) -> None:
    """The lock names a launcher and a runner that are gone: a new launch into the run directory takes it over
    (the real lock code decides, through `workbench train --prepare-only`: the shell's entry point, called in
    this process, as an interpreter's start adds nothing to what is checked)."""
    import io

    from workbench.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", str(config), "--prepare-only", "--set", "resume=auto"])
    assert code == 0 and out.getvalue().strip() == str(run.path), err.getvalue()[-3000:]
    assert "in use by" not in err.getvalue()


@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, signal.SIGUSR1], ids=["SIGKILL", "SIGUSR1-unhandled"]
)
def test_a_killed_workbench_train_takes_its_ranks_along_and_frees_the_run(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # SIGUSR1 without preempt_signal: nothing handles it, so it ends the launcher like SIGKILL, unannounced.
    config = tmp_path / "run.yaml"
    wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=100_000,
        log_every=1,
        runs_dir=str(tmp_path / "runs"),
        run_name="orphans",
        task_options={"slow_s": 0.03},
    ).to_yaml(config)
    run = RunDir(tmp_path / "runs" / "orphans")
    train = [sys.executable, "-m", "workbench.cli", "train", str(config), "--no-progress"]
    with process_tree(train, tmp_path) as (proc, tree):
        wait_until_training(run, proc, tmp_path)
        collect(proc, tree)
        assert len(tree) >= 3, f"torchrun and 2 ranks expected: {tree}"
        os.kill(proc.pid, sig)
        assert proc.wait(30) == -sig
        assert still_running(tree) == [], (
            f"left running after the launcher died:\n{output(tmp_path)}"
        )
    # torchrun got SIGTERM when its launcher died and passed it on: the ranks checkpointed and exited.
    summary = run.summary()
    assert summary.status == "preempted" and summary.ending["signal"] == "SIGTERM", summary
    assert run.latest_checkpoint() is not None
    assert_launchable_again(config, run)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_run_outlives_the_thread_that_started_it_and_ends_with_its_caller(
    tmp_path: Path, start_method: str
) -> None:
    # The kernel's parent-death signal follows the thread that forked the child, not its process: before, the
    # run died as soon as the starting thread ended.
    config = tmp_path / "run.yaml"
    wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=100_000,
        log_every=1,
        runs_dir=str(tmp_path / "runs"),
        run_name="caller",
        start_method=start_method,
        task_options={"slow_s": 0.03},
    ).to_yaml(config)
    (tmp_path / "caller.py").write_text(CALLER)
    run = RunDir(tmp_path / "runs" / "caller")
    with process_tree([sys.executable, "caller.py", str(config)], tmp_path) as (proc, tree):
        wait_until_training(run, proc, tmp_path, steps=5)
        assert f"started by {start_method}" in output(tmp_path)
        collect(proc, tree)
        assert len(tree) >= 3, f"a launcher process and 2 ranks expected: {tree}"
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
        assert still_running(tree) == [], f"left running after the caller died:\n{output(tmp_path)}"
    summary = run.summary()
    assert summary.status == "preempted" and run.latest_checkpoint() is not None, summary
    assert_launchable_again(config, run)
