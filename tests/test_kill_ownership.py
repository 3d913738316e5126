"""kill() acts only on processes it can prove are the run's, and returns once they are gone.

The probes of issue 46, item 2: kill() against a run still starting (its lock names no runner yet),
after its LOCK was truncated, and with a LOCK naming another process group; kill() of a
`workbench train` run, whose ranks run in process groups of their own. The races are repeated
cheaply on a stand-in for a launch (this process holds the lock, as a kernel does, and a child
running `workbench.worker` on the run directory, with a grandchild in a session of its own, plays
torchrun and a rank); the rest runs for real. Every test kills what it started, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_attach import _shell_run
from test_launcher_death import collect, output, process_tree, still_running

import workbench as wb
from workbench.commands.status import describe_run
from workbench.launcher.attached import AttachedRun
from workbench.rundir import RunDir, Status, lock

# The stand-in for torchrun: `workbench.worker RUN_DIR` on its command line, as torchrun's and
# accelerate launch's are; it starts a "rank" in a session of its own (torchrun's way), writes the
# rank's pid and start time to the file named by argv[1] (outside the run directory), and waits.
RUNNER = (
    "import subprocess, sys, time, psutil; "
    "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
    "start_new_session=True); "
    "open(sys.argv[1] + '.tmp', 'w').write(f'{rank.pid} {psutil.Process(rank.pid).create_time()}'); "
    "__import__('os').replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)"
)


def _identity(proc: psutil.Process) -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": proc.pid, "create_time": proc.create_time()}


class Started:
    """Processes started by a test, each in a session of its own; every one of them and of their
    descendants is killed when the block ends, however it ends."""

    def __init__(self) -> None:
        self.procs: list[psutil.Process] = []
        self._popens: list[subprocess.Popen] = []

    def start(self, args: list[str]) -> psutil.Process:
        popen = subprocess.Popen(args, start_new_session=True)
        self._popens.append(popen)
        proc = psutil.Process(popen.pid)
        self.procs.append(proc)
        return proc

    def track(self, proc: psutil.Process) -> None:
        self.procs.append(proc)

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in list(self.procs):
            with contextlib.suppress(psutil.Error):
                self.procs.extend(proc.children(recursive=True))
        for proc in self.procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()  # psutil checks the start time: never another process that got the pid
        for popen in self._popens:
            popen.wait(30)


def _rank_of(pid_file: Path, timeout: float = 30) -> psutil.Process:
    """The stand-in rank, once the stand-in runner has written its pid and start time."""
    deadline = time.monotonic() + timeout
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the stand-in runner started no rank in time"
        time.sleep(0.01)
    pid, started = pid_file.read_text().split()
    rank = psutil.Process(int(pid))
    assert abs(rank.create_time() - float(started)) < 0.01
    return rank


def _running(procs: list[psutil.Process]) -> list[int]:
    """The pids of `procs` still running (a zombie counts as gone: it runs nothing)."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
    return alive


def _starting_run(tmp_path: Path, name: str) -> tuple[RunDir, str]:
    """A run directory as a launch leaves it while it starts: the lock held by this process (the
    kernel), no runner named yet, status 'starting'."""
    run = RunDir(tmp_path / "runs" / name)
    run.path.mkdir(parents=True)
    wb.RunConfig(task="digits", runs_dir=str(tmp_path / "runs"), run_name=name).to_yaml(
        run.config_path
    )
    token = lock.acquire(run)
    run.set_status(Status.STARTING, run_name=name, started_at=time.time(), attempt=1)
    return run, token


def test_kill_of_a_starting_run_waits_for_its_runner_and_ends_it_with_its_ranks(
    tmp_path: Path,
) -> None:
    """The race of the probe (the launch names its runner at any moment from now), five times:
    kill() neither records 'failed' while a rank goes on nor returns before the runner and the rank
    it started in a session of its own are gone."""
    for attempt in range(5):
        run, token = _starting_run(tmp_path, f"starting-{attempt}")
        pid_file = tmp_path / f"rank-{attempt}.pid"
        command = [
            sys.executable, "-c", RUNNER, str(pid_file), "-m", "workbench.worker", str(run.path)
        ]  # fmt: skip
        with Started() as started:
            seen: list[psutil.Process] = []

            def launch(delay: float = random.uniform(0.0, 1.5), run: RunDir = run) -> None:
                time.sleep(delay)
                runner = started.start(command)
                rank = _rank_of(pid_file)
                started.track(rank)
                seen.extend([runner, rank])
                lock.set_runner(run, token, _identity(runner))

            launcher = threading.Thread(target=launch)
            launcher.start()
            try:
                wb.attach(run.path).kill()
            finally:
                launcher.join(60)
            assert len(seen) == 2
            assert _running(seen) == [], f"attempt {attempt}: still running once kill() returned"
            summary = run.summary()
            assert summary.status is Status.FAILED
            assert summary.error["message"].startswith("killed by AttachedRun.kill() from pid")
        lock.release(run, token)


def test_kill_of_a_starting_run_whose_launch_names_no_runner_refuses_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("workbench.launcher.attached.START_WAIT_S", 1.0)
    run, token = _starting_run(tmp_path, "stuck")
    before = run.summary_path.read_bytes()
    started = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"kill\(\): stuck is still starting 1 s on: its launch \(pid \d+\) has not started "
        r"the process that runs the ranks; nothing was signalled",
    ):
        wb.attach(run.path).kill()
    assert time.monotonic() - started < 10
    assert run.summary_path.read_bytes() == before, "no ending is recorded for a run still starting"
    lock.release(run, token)


def test_kill_after_the_lock_was_truncated_refuses_and_leaves_the_run_as_it_is(
    tmp_path: Path,
) -> None:
    run, token = _starting_run(tmp_path, "truncated")
    pid_file = tmp_path / "rank.pid"
    command = [
        sys.executable, "-c", RUNNER, str(pid_file), "-m", "workbench.worker", str(run.path)
    ]  # fmt: skip
    with Started() as started:
        runner = started.start(command)
        rank = _rank_of(pid_file)
        started.track(rank)
        lock.set_runner(run, token, _identity(runner))
        run.set_status(Status.RUNNING)
        with open(run.lock_path, "w"):  # the probe: LOCK truncated under a live run
            pass
        before = run.summary_path.read_bytes()
        with pytest.raises(
            RuntimeError,
            match=r"kill\(\): truncated: its lock can't be read \(.*LOCK: empty\), so the process "
            r"that runs its ranks can't be proven; nothing was signalled and its status is left",
        ):
            wb.attach(run.path).kill()
        assert _running([runner, rank]) == [runner.pid, rank.pid]
        assert run.summary_path.read_bytes() == before, "no 'failed' while the ranks run"
        attached = wb.attach(run.path)
        assert not attached.done()
        attached.stop()  # still works: through the directory
        assert run.stop_requested()


@pytest.mark.parametrize("forged", ["start time", "no start time"])
def test_a_forged_lock_naming_another_process_group_gets_nothing_signalled(
    tmp_path: Path, forged: str
) -> None:
    """The probe: a LOCK whose runner is a stranger's `sleep`, leading its own group. With the
    sleep's true start time it is refused as not the run's (it runs no workbench.worker on this
    directory and is no fork of the launch); without one, as unproven."""
    run, token = _starting_run(tmp_path, "forged")
    run.set_status(Status.RUNNING)
    with Started() as started:
        sleep = started.start(["sleep", "120"])
        identity = _identity(sleep)
        if forged == "no start time":
            del identity["create_time"]
        lock.set_runner(run, token, identity)
        before = run.summary_path.read_bytes()
        why = "not the run's" if forged == "start time" else "without the start time"
        with pytest.raises(
            RuntimeError, match=rf"kill\(\): forged: .*{why}.*nothing was signalled"
        ):
            wb.attach(run.path).kill()
        time.sleep(0.2)
        assert _running([sleep]) == [sleep.pid], "the forged lock's group was signalled"
        assert run.summary_path.read_bytes() == before
    lock.release(run, token)


def test_an_unknown_status_is_reported_as_such_and_kill_never_rewrites_it(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "runs" / "newer")
    run.path.mkdir(parents=True)
    wb.RunConfig(task="digits", runs_dir=str(tmp_path / "runs"), run_name="newer").to_yaml(
        run.config_path
    )
    run.summary_path.write_text(json.dumps({"status": "paused-by-v9", "steps": 3}))
    before = run.summary_path.read_bytes()
    attached = wb.attach(run.path)
    assert attached.status is Status.UNKNOWN
    report, code = describe_run(run.path)
    assert code == 1
    assert report.startswith(
        "newer: unknown (summary.json says 'paused-by-v9', which this version of workbench "
        "doesn't know"
    )
    attached.kill()
    assert run.summary_path.read_bytes() == before
    assert attached.done()
    with pytest.raises(wb.RunFailedError, match=r"says status 'paused-by-v9'"):
        attached.wait(timeout=5)


def test_attach_names_the_missing_config_when_the_summary_is_there(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "runs" / "half")
    run.path.mkdir(parents=True)
    run.set_status(Status.COMPLETED, run_name="half")
    with pytest.raises(
        ValueError,
        match=r"^attach: .*half has a summary.json but no config.yaml, the config the run was "
        r"launched with \(deleted or moved\?\); put it back",
    ):
        wb.attach(run.path)


@pytest.mark.slow
def test_kill_of_a_shell_run_while_it_starts_returns_after_its_ranks_are_gone(
    tmp_path: Path,
) -> None:
    """The probes on a real `workbench train` (2 gloo ranks, each in a session of its own): kill()
    from this interpreter while the run still says 'starting'; when it returns, no process of the
    launch runs, no rank trains on, and the launching process and the summary tell one story."""
    train, run = _shell_run(tmp_path, "starting")
    with process_tree(train, tmp_path) as (proc, tree):
        deadline = time.monotonic() + 60
        while not (run.summary_path.exists() and run.config_path.exists()):
            assert proc.poll() is None, output(tmp_path)
            assert time.monotonic() < deadline, output(tmp_path)
            time.sleep(0.02)
        attached = wb.attach(run.path)
        assert isinstance(attached, AttachedRun)
        attached.kill()
        seen = [p for p in tree if p.pid != proc.pid]
        with contextlib.suppress(psutil.Error):
            seen += psutil.Process(proc.pid).children(recursive=True)
        left = [p for p in seen if _running([p])]
        assert left == [], f"still running once kill() returned: {left}\n{output(tmp_path)}"
        assert proc.wait(30) == 1, output(tmp_path)
        summary = run.summary()
        assert summary.status is Status.FAILED
        message = summary.error["message"]
        assert message.startswith("killed by AttachedRun.kill() from pid"), message
        assert message in output(tmp_path), "the launching process tells another story"
        rows = len(run.metrics())
        time.sleep(1.0)
        assert len(run.metrics()) == rows, "a rank trained on after kill()"


@pytest.mark.slow
def test_kill_of_a_training_shell_run_returns_only_after_its_ranks_are_gone(tmp_path: Path) -> None:
    train, run = _shell_run(tmp_path, "training")
    with process_tree(train, tmp_path) as (proc, tree):
        from test_launcher_death import wait_until_training

        wait_until_training(run, proc, tmp_path)
        collect(proc, tree)
        ranks = [p for p in tree if "workbench.worker" in " ".join(p.cmdline())]
        assert len(ranks) >= 3, "torchrun and its 2 ranks"
        wb.attach(run.path).kill()
        assert [p.pid for p in ranks if _running([p])] == [], output(tmp_path)
        assert proc.wait(30) == 1, output(tmp_path)
        assert still_running(tree, timeout=5) == []
        assert run.summary().error["message"].startswith("killed by AttachedRun.kill()")


@pytest.mark.slow
def test_run_kill_of_forked_ranks_returns_after_they_are_gone_and_names_the_kill(
    tmp_path: Path,
) -> None:
    """The launching kernel's own kill() (fork mode: the supervisor leads its ranks' group)."""
    from tasks_for_tests import TinyRegression

    cfg = wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=100_000,
        log_every=1,
        runs_dir=str(tmp_path / "runs"),
        task_options={"slow_s": 0.03},
    )
    run = wb.start(cfg, task=TinyRegression())
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len([r for r in run.metrics if "loss" in r]) < 2:
            assert not run.done() and time.monotonic() < deadline, "no 2 steps trained in time"
            time.sleep(0.05)
        tree = [psutil.Process(run._process.pid)]
        tree += tree[0].children(recursive=True)
        assert len(tree) >= 3, "the supervisor and its 2 ranks"
        run.kill()
        assert _running(tree) == []
        assert run.done()
        assert run.summary["error"]["message"].startswith("killed by Run.kill() from pid")
    finally:
        if not run.done():
            run.kill()
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.mark.slow
def test_attach_kill_of_forked_ranks_proves_the_supervisor_a_fork_of_the_launch(
    tmp_path: Path,
) -> None:
    """A kernel (`wb.start`, fork mode) runs the ranks; another interpreter (this one) attaches and
    kills: the supervisor, a fork of the kernel that holds the lock, is proven and ended with its
    ranks, and the kernel lives on."""
    from test_launcher_death import CALLER, wait_until_training

    config, run = _shell_run(tmp_path, "forked")
    caller = [sys.executable, "-c", CALLER, config[4]]
    with process_tree(caller, tmp_path) as (proc, tree):
        wait_until_training(run, proc, tmp_path)
        collect(proc, tree)
        assert "started by fork" in output(tmp_path)
        ranks = [p for p in tree if p.pid != proc.pid]
        assert len(ranks) >= 3, "the supervisor and its 2 ranks"
        wb.attach(run.path).kill()
        assert _running(ranks) == [], output(tmp_path)
        assert proc.poll() is None, "the kernel that launched the run is not the run's to kill"
        assert run.summary().error["message"].startswith("killed by AttachedRun.kill()")
