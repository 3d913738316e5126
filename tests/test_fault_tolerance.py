"""Runs that survive: preemption signals, restarts, damaged checkpoints, divergence, hangs, one writer per run
directory, I/O errors. Each failure is produced for real on 2 gloo CPU ranks (signals sent, files damaged,
NaN injected, a rank put to sleep), and every test that starts processes kills them however it ends."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from own_session import ENV, spawned
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import RunDir
from workbench.utils import files

pytestmark = pytest.mark.slow


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=12,
        log_every=1,
        lr=5e-2,
        runs_dir=str(runs_dir),
        seed=3,
    )
    return wb.RunConfig(**{**base, **fields})


def losses(run: RunDir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.metrics() if "loss" in r}


def run_pids(run: RunDir) -> list[int]:
    """Every process the run directory knows of: the ranks (heartbeats) and the launcher (lock)."""
    return [files.read_json(p)["pid"] for p in sorted(run.ranks_path.glob("rank_*.json"))]


def alive(pids: list[int]) -> list[int]:
    deadline = time.time() + 15
    while time.time() < deadline:
        left = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not left:
            return []
        time.sleep(0.2)
    return left


def wait_for_steps(run: RunDir, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(losses(run)) < n:
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.time() < deadline, f"no {n} metrics rows within {timeout} s"
        time.sleep(0.1)


# ---- preemption ----------------------------------------------------------------------------------
def test_sigterm_to_workbench_train_preempts_and_resume_auto_continues_the_curve(
    tmp_path: Path,
) -> None:
    cfg = cfg_for(tmp_path / "runs", run_name="pre", max_steps=30, task_options={"slow_s": 0.03})
    cfg.to_yaml(tmp_path / "run.yaml")
    run = RunDir(tmp_path / "runs" / "pre")
    train = [sys.executable, "-m", "workbench.cli", "train", "run.yaml", "--no-progress"]
    with spawned(train, tmp_path) as proc:
        wait_for_steps(run, 3, proc)
        pids = run_pids(run)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "preempted: SIGTERM at step" in err and "Traceback" not in err
    summary = run.summary()
    assert summary.status == "preempted" and summary.ending["signal"] == "SIGTERM"
    assert (
        run.latest_checkpoint().name == f"step_{summary.ending['step']}" == f"step_{summary.steps}"
    )
    assert len(pids) == 2 and alive(pids) == [], "no process of the run may be left"

    with spawned([*train, "--set", "resume=auto"], tmp_path) as proc:
        _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    straight = wb.launch(cfg.replace(run_name="straight", task_options={}), task=TinyRegression())
    expected = losses(RunDir(straight.run_dir))
    assert sorted(losses(run)) == list(range(1, 31))
    assert list(losses(run).values()) == pytest.approx(list(expected.values()), rel=1e-6)
    assert [e["event"] for e in run.events()].count("resumed") == 1
    assert len(run.config_paths()) == 2, "each attempt keeps its config"


def test_sigterm_to_the_launch_caller_checkpoints_then_ends_the_caller(tmp_path: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(
        "import workbench as wb\nfrom tasks_for_tests import TinyRegression\n"
        f"cfg = wb.RunConfig.from_yaml({str(tmp_path / 'run.yaml')!r})\n"
        "wb.launch(cfg, task=TinyRegression())\nprint('launch returned')\n"
    )
    cfg_for(
        tmp_path / "runs", run_name="caller", max_steps=10_000, task_options={"slow_s": 0.03}
    ).to_yaml(tmp_path / "run.yaml")
    run = RunDir(tmp_path / "runs" / "caller")
    with spawned([sys.executable, str(script)], tmp_path) as proc:
        wait_for_steps(run, 3, proc)
        pids = run_pids(run)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, (
        "the caller ends by the signal it got, once the ranks are safe"
    )
    assert "launch returned" not in out
    summary = run.summary()
    assert summary.status == "preempted" and run.latest_checkpoint().name == f"step_{summary.steps}"
    assert not run.lock_path.exists() and alive(pids) == []


@pytest.mark.parametrize(
    "target",
    [
        "the launcher, before it starts the ranks",
        "the launcher, while the ranks start",
        "one rank, while the ranks start",
    ],
)
def test_sigterm_before_training_starts_is_a_preemption(tmp_path: Path, target: str) -> None:
    # The run is held (HeldAtStart) in the launcher's checks, or in every rank before its trainer exists, until
    # the signal is sent: no heartbeat, no step. Before, the signal killed whoever got it by default, and the
    # run ended failed ('may have been killed (out of memory?)') or the launcher just died.
    hold = tmp_path / "hold"
    hold.mkdir()
    cfg_for(tmp_path / "runs", task="tasks_for_tests:HeldAtStart", run_name="early").to_yaml(
        tmp_path / "run.yaml"
    )
    run = RunDir(tmp_path / "runs" / "early")
    where = "launcher" if "before it starts" in target else "ranks"
    held = ["held-launcher"] if where == "launcher" else ["held-rank_0", "held-rank_1"]
    train = [sys.executable, "-m", "workbench.cli", "train", "run.yaml", "--no-progress"]
    with spawned(train, tmp_path, WB_TEST_HOLD=where, WB_TEST_HOLD_DIR=str(hold)) as proc:
        deadline = time.time() + 120
        while not all((hold / name).exists() for name in held):
            assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
            assert time.time() < deadline, f"{held} not held within 120 s"
            time.sleep(0.05)
        assert not list(run.ranks_path.glob("rank_*.json")), "held before any heartbeat"
        os.kill(
            int((hold / "held-rank_1").read_text()) if target.startswith("one rank") else proc.pid,
            signal.SIGTERM,
        )
        (hold / "go").touch()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "preempted: SIGTERM" in err and "Traceback" not in err, err[-3000:]
    summary = run.summary()
    assert summary.status == "preempted" and summary.ending["signal"] == "SIGTERM", summary
    assert summary.ending["step"] == 0 and summary.error is None
    assert run.metrics() == [] and run.latest_checkpoint() is None, (
        "nothing trained, nothing to save"
    )
    if where == "launcher":
        assert (
            not run.ranks_path.exists()
            and "before the ranks were started" in summary.ending["message"]
        )


# ---- restarts ------------------------------------------------------------------------------------
def test_sigterm_during_the_restart_backoff_ends_the_run_preempted_without_restarting(
    tmp_path: Path,
) -> None:
    # Before, the back-off's sleep resumed after the signal's handler and the run restarted regardless.
    cfg_for(
        tmp_path / "runs",
        run_name="backoff",
        max_restarts=2,
        restart_backoff_s=600,
        task_options={
            "fail_rank": 1,
            "fail_at_call": 2,
            "crash_marker": str(tmp_path / "crashed-once"),
        },
    ).to_yaml(tmp_path / "run.yaml")
    run = RunDir(tmp_path / "runs" / "backoff")
    train = [sys.executable, "-m", "workbench.cli", "train", "run.yaml", "--no-progress"]
    with spawned(train, tmp_path) as proc:
        deadline = time.time() + 120
        while not any(e["event"] == "restarting" for e in run.events()):
            assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
            assert time.time() < deadline, "no 'restarting' event within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # the back-off alone would take 600 s
    assert proc.returncode == 75, err[-3000:]
    summary = run.summary()
    assert summary.status == "preempted" and summary.ending["signal"] == "SIGTERM", summary
    assert "injected failure on call 2" in summary.ending["failure"]["message"]
    events = [e["event"] for e in run.events()]
    assert events.count("started") == 1 and "resumed" not in events and events[-1] == "preempted", (
        events
    )
    assert len(run.config_paths()) == 1, "no second attempt was prepared"


def test_max_restarts_recovers_a_crash_and_continues_the_same_curve(
    runs_dir: Path, tmp_path: Path
) -> None:
    common = dict(max_steps=10, checkpoint_every=3, task_options={"dropout": 0.2})
    straight = wb.launch(cfg_for(runs_dir, run_name="straight", **common), task=TinyRegression())
    crashing = cfg_for(
        runs_dir,
        run_name="restarted",
        max_restarts=2,
        restart_backoff_s=0.2,
        **{
            **common,
            "task_options": {
                "dropout": 0.2,
                "fail_rank": 1,
                "fail_at_call": 8,
                "crash_marker": str(tmp_path / "crashed-once"),
            },
        },
    )
    result = wb.launch(crashing, task=TinyRegression())
    assert result.status == "completed" and (tmp_path / "crashed-once").exists()
    events = [e["event"] for e in result.events]
    assert events.count("restarting") == 1 and "resumed" in events
    restart = next(e for e in result.events if e["event"] == "restarting")
    assert restart["after"] == "failed" and "injected failure on call 8" in restart["error"]
    assert losses(result.dir) == pytest.approx(losses(straight.dir), rel=1e-6)


# ---- damaged checkpoints -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage", ["truncated weights", "empty optimizer file", "broken trainer state"]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    runs_dir: Path, damage: str
) -> None:
    common = dict(max_steps=6, checkpoint_every=3, keep_checkpoints=5)
    first = wb.launch(cfg_for(runs_dir, run_name="damaged", **common), task=TinyRegression())
    newest = RunDir(first.run_dir).latest_checkpoint()
    assert newest.name == "step_6"
    if damage == "truncated weights":
        shard = next((newest / "model").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "empty optimizer file":
        next((newest / "optim").glob("*.distcp")).write_bytes(b"")
    else:  # same size, different content: only the checksum can tell
        state = newest / "trainer_state.json"
        state.write_text(state.read_text().replace('"step": 6', '"step": 0'))
    resumed = wb.launch(
        cfg_for(runs_dir, run_name="damaged", resume=True, **common), task=TinyRegression()
    )
    skipped = [e for e in resumed.events if e["event"] == "checkpoint_skipped"]
    assert [e["step"] for e in skipped] == [6]
    expected = {
        "truncated weights": "truncated",
        "empty optimizer file": "truncated",
        "broken trainer state": "does not match its sha256",
    }[damage]
    assert any(expected in p for p in skipped[0]["problems"]), skipped
    resumed_event = [e for e in resumed.events if e["event"] == "resumed"][-1]
    assert resumed_event["step"] == 3 and resumed_event["checkpoint"].endswith("step_3")
    assert losses(resumed.dir)[6] == pytest.approx(losses(first.dir)[6], rel=1e-6)


def test_every_damaged_checkpoint_means_a_loud_failure_not_a_fresh_start(runs_dir: Path) -> None:
    first = wb.launch(cfg_for(runs_dir, run_name="ruined", max_steps=3), task=TinyRegression())
    ckpt = RunDir(first.run_dir).latest_checkpoint()
    for rank_state in ckpt.glob("rank_*.pt"):
        rank_state.write_bytes(b"not a torch file")
    with pytest.raises(
        wb.RunFailedError, match=r"no checkpoint in .* can be used: step_3: rank_0.pt is 16 bytes"
    ):
        wb.launch(
            cfg_for(runs_dir, run_name="ruined", max_steps=3, resume=True), task=TinyRegression()
        )


# ---- divergence ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "grad_clip,every_step",
    [(1.0, False), (0.0, False), (1.0, True)],
    ids=["told-by-the-clipped-norm", "told-by-the-unclipped-norm", "voted-every-step"],
)
def test_nan_at_step_k_stops_the_run_at_step_k_as_diverged(
    runs_dir: Path, grad_clip: float, every_step: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each rank notes its loss and the norm (clipped or not) on the device; the step's read point
    # (log_every=1) gathers every rank's notes and names rank 1. Voting on stops and signals every
    # step (forced here, in the forked ranks) changes nothing about it.
    from workbench.training import stop_vote

    if every_step:
        monkeypatch.setattr(stop_vote, "VOTE_EVERY_S", 0.0)
    cfg = cfg_for(
        runs_dir,
        run_name="nan",
        max_steps=20,
        checkpoint_every=4,
        grad_clip=grad_clip,
        task_options={"nan_rank": 1, "nan_at_call": 7},
    )
    message = r"diverged at step 7: the loss was not finite \(NaN or inf\) on rank 1; last good checkpoint: .*step_4"
    with pytest.raises(wb.RunDivergedError, match=message) as info:
        wb.launch(cfg, task=TinyRegression())
    assert info.value.step == 7
    run = RunDir(info.value.run_dir)
    summary = run.summary()
    assert summary.status == "diverged" and summary.steps == 6, "the diverged step is never applied"
    assert [s for s, _ in run.checkpoints()] == [4], "nothing is checkpointed after the divergence"
    assert max(losses(run)) == 6 and all(v == v for v in losses(run).values())
    votes = [r["agreement_votes"] for r in summary.ranks]
    if every_step:
        assert votes == [7, 7]
    else:  # stop and signals wait for a vote about every 0.5 s; these steps take milliseconds
        assert votes[0] == votes[1] < 7, votes


# ---- hangs ---------------------------------------------------------------------------------------
def test_a_rank_stuck_in_its_step_is_named_with_its_stack(runs_dir: Path) -> None:
    cfg = cfg_for(
        runs_dir,
        run_name="hung",
        max_steps=50,
        dist_timeout_s=5,
        preempt_grace_s=2,
        task_options={"hang_rank": 1, "hang_at_call": 3},
    )
    started = time.time()
    with pytest.raises(
        wb.RunFailedError,
        match=r"rank 1 failed with Hung: rank 1 hung: still in "
        r"'forward/backward \(Task.loss\)' of step 3",
    ) as info:
        wb.launch(cfg, task=TinyRegression())
    assert time.time() - started < 90
    stack = (info.value.run_dir / "stacks" / "rank_1.txt").read_text()
    assert "time.sleep(10**6)" in stack and "in loss" in stack
    assert "time.sleep(10**6)" in info.value.rank_traceback
    others = wb.RunResult.load(info.value.run_dir).summary["error"]["other_ranks"]
    assert [o["rank"] for o in others] == [0], "rank 0 only timed out waiting for rank 1"


class CallersDeadline(Exception):
    """What a caller's own deadline raises in the thread blocked in launch() (pytest-timeout's Failed, say)."""


def test_an_exception_that_ends_the_blocking_launch_kills_the_run(runs_dir: Path) -> None:
    cfg = cfg_for(runs_dir, run_name="abandoned", max_steps=100_000, task_options={"slow_s": 0.02})
    run = RunDir(runs_dir / "abandoned")

    def deadline(signum: int, frame: Any) -> None:
        raise CallersDeadline

    def interrupt_once_training() -> None:
        limit = time.time() + 120
        while time.time() < limit and not losses(run):
            time.sleep(0.1)
        # runs `deadline` in the main thread, inside launch()
        _thread.interrupt_main(signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, deadline)
    watcher = threading.Thread(target=interrupt_once_training, daemon=True)
    try:
        watcher.start()
        with pytest.raises(CallersDeadline):
            wb.launch(cfg, task=TinyRegression())
    finally:
        signal.signal(signal.SIGUSR2, previous)
        watcher.join(130)
    assert losses(run), "the run was interrupted before it trained: the test proves nothing"
    pids = run_pids(run)
    assert len(pids) == 2 and alive(pids) == [], (
        "a run abandoned by its caller must not keep training unseen"
    )
    assert wb.RunResult.load(run.path).status == "failed"


# ---- resume safety -------------------------------------------------------------------------------
def test_a_resume_that_changes_the_trajectory_is_refused_with_the_differences(
    runs_dir: Path,
) -> None:
    first = wb.launch(cfg_for(runs_dir, run_name="safe", max_steps=4), task=TinyRegression())
    original = first.dir.config_path.read_text()
    with pytest.raises(
        ValueError,
        match=r"from step 4: the config changes the training trajectory: seed: 3 -> 4; "
        r"global batch: 32 \(16 x 1 x 2\) -> 64 .*resume_allow=\['global_batch_size', "
        r"'seed'\]",
    ):
        wb.launch(
            cfg_for(
                runs_dir,
                run_name="safe",
                max_steps=8,
                seed=4,
                micro_batch_size=32,
                resume=True,
                resume_allow=["max_steps"],
            ),
            task=TinyRegression(),
        )
    with pytest.raises(ValueError, match=r"max_steps=2 is below the checkpoint's step 4"):
        wb.launch(
            cfg_for(
                runs_dir, run_name="safe", max_steps=2, resume=True, resume_allow=["max_steps"]
            ),
            task=TinyRegression(),
        )
    # The same global batch on another layout is the same trajectory: 1 rank x 32.
    again = wb.launch(
        cfg_for(
            runs_dir,
            run_name="safe",
            max_steps=6,
            num_processes=1,
            micro_batch_size=32,
            resume=True,
            resume_allow=["max_steps"],
        ),
        task=TinyRegression(),
    )
    assert again.summary["world_size"] == 1 and again.summary["steps"] == 6
    assert first.dir.config_path.read_text() == original, (
        "the first attempt's config is never overwritten"
    )
    assert [p.name for p in again.dir.config_paths()] == ["config.yaml", "config.attempt-2.yaml"]
    assert again.dir.config().num_processes == 1


# ---- one writer ----------------------------------------------------------------------------------
def test_a_second_launch_into_a_running_run_is_refused_naming_the_holder(runs_dir: Path) -> None:
    run = wb.start(
        cfg_for(
            runs_dir,
            run_name="busy",
            max_steps=10_000,
            checkpoint_every=2,
            task_options={"slow_s": 0.01},
        ),
        task=TinyRegression(),
    )
    try:
        deadline = time.time() + 120
        while not run.dir.checkpoints() and time.time() < deadline:
            time.sleep(0.1)
        with pytest.raises(
            wb.RunDirLocked, match=rf"run directory .*busy is in use by pid {os.getpid()} on "
        ):
            wb.launch(cfg_for(runs_dir, run_name="busy", resume=True), task=TinyRegression())
    finally:
        run.stop()
        run.wait(timeout=120)
    assert not run.dir.lock_path.exists(), "the lock goes with the run"
    events = [e["event"] for e in run.events]
    assert events.count("started") == 1 and "resumed" not in events


def test_two_new_runs_with_one_name_started_together_one_wins(runs_dir: Path) -> None:
    racer = (
        "import sys, workbench as wb\nfrom workbench.rundir import prepare\n"
        "try:\n    prepare(wb.RunConfig(runs_dir=sys.argv[1], run_name='contested', seed=int(sys.argv[2])))\n"
        "    print('won')\nexcept ValueError as e:\n    print(e)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", racer, str(runs_dir), str(i)],
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for i in range(6)
    ]
    try:
        outcomes = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert outcomes.count("won") == 1, outcomes
    assert all("in use by pid" in o or "already exists" in o for o in outcomes if o != "won"), (
        outcomes
    )
    assert len(RunDir(runs_dir / "contested").config_paths()) == 1


def test_a_run_whose_processes_are_gone_never_reads_as_running(runs_dir: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    run = RunDir(runs_dir / "lost")
    run.path.mkdir()
    cfg_for(runs_dir, run_name="lost").to_yaml(run.config_path)
    run.set_status("running", world_size=2)
    import socket

    for rank in (0, 1):
        run.write_heartbeat(
            rank, {"host": socket.gethostname(), "pid": gone.pid, "create_time": 0, "step": 7}
        )
    assert run.summary().status == "running"
    assert wb.RunResult.load(run.path).status == "failed"
    status, why = run.observed_status()
    assert status == "failed" and "every process of the run is gone" in why and "step 7" in why
    from workbench.cli import main

    assert main(["status", str(run.path)]) == 1


# ---- I/O errors ----------------------------------------------------------------------------------
def test_a_disk_that_fills_up_names_the_run_directory_and_the_file(tmp_path: Path) -> None:
    import resource

    cfg_for(
        tmp_path / "runs",
        task="tasks_for_tests:TinyBlocks",
        run_name="full",
        max_steps=4,
        task_options={"width": 256},
    ).to_yaml(tmp_path / "run.yaml")

    def small_files() -> None:  # writes past 256 KiB fail with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "train", "run.yaml", "--no-progress"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=small_files,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    run = RunDir(tmp_path / "runs" / "full")
    assert proc.returncode == 1, err[-3000:]
    message = f"could not write checkpoint step 4 ({run.checkpoints_path / '.tmp-step_4'}) in run directory {run.path}"
    assert message in err and "GiB free there" in err
    summary = run.summary()
    assert summary.status == "failed" and message in summary.error["message"]
    assert run.latest_checkpoint() is None


def test_a_failing_write_while_preparing_leaves_no_half_made_run(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    real = files.atomic_write_bytes

    def full(path: Path, data: bytes) -> None:
        if path.name == "config.yaml":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(files, "atomic_write_bytes", full)
    with pytest.raises(
        OSError,
        match=r"could not write the run's config \(.*config.yaml\) in run directory "
        r".*runs/nospace: No space left on device",
    ):
        wb.launch(cfg_for(runs_dir, run_name="nospace"), task=TinyRegression())
    assert not (runs_dir / "nospace").exists()


def test_installing_a_method_as_a_signal_handler_never_takes_its_objects_repr() -> None:
    """signal.signal formats the handler it replaces into a ValueError while it checks for an enum:
    for a Run's `_forward` that repr read the run directory, twice per launch. The handlers go in
    as plain functions, still calling the method."""
    from workbench.utils import preemption

    class Costly:
        reprs = 0
        calls: list[int] = []

        def __repr__(self) -> str:
            Costly.reprs += 1
            return "costly"

        def on_signal(self, signum: int, frame: Any) -> None:
            Costly.calls.append(signum)

    costly = Costly()
    cfg = wb.RunConfig(preempt_signal="SIGUSR1")
    with preemption.handling(costly.on_signal, cfg, leave_ignored=False) as installed:
        assert installed
        signal.raise_signal(signal.SIGUSR1)
    assert Costly.calls == [signal.SIGUSR1] and Costly.reprs == 0
