"""Runs on a real multi-node Ray cluster on this machine (CI's Ray stage: `pytest -m ray`): a head on 127.0.0.1 and
a node on 127.0.0.2, one CPU each and token authentication on, brought up for this module by LocalRayCluster and
taken down after it (every process it started). Ray starts slowly on 2 cores (a node ~8 s, a worker group ~20 s), so
each test makes one or two runs and asserts all it can of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import workbench as wb
from workbench.cluster.raytrain.local import LocalRayCluster, available
from workbench.launcher.phases import STARTING_RAY, LaunchPhases, announcing
from workbench.rundir import RunFailedError, Status

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _cfg(tmp_path: Path, **changes: object) -> wb.RunConfig:
    base = {
        "task": "digits",
        "num_processes": 2,
        "max_steps": 20,
        "log_every": 5,
        "runs_dir": str(tmp_path / "runs"),
    }
    return wb.RunConfig(**{**base, **changes})


def _losses(result: wb.RunResult) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in result.metrics if m.get("loss") is not None}


def _until(what: str, check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def test_token_auth_set_after_ray_was_imported_is_refused_at_once_saying_why() -> None:
    """Ray reads RAY_AUTH_MODE once, at import: without this check the connection retries for ~20 s and fails
    naming nothing. No cluster needed: the refusal comes before any connection."""
    if available() is not None:
        pytest.skip(available())
    code = textwrap.dedent(
        """
        import os, time, ray
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 32)
        from workbench.cluster.raytrain.session import connect
        started = time.monotonic()
        try:
            connect("127.0.0.1:1", "workbench")
        except ValueError as e:
            print(round(time.monotonic() - started, 1), e)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    seconds, _, message = done.stdout.strip().partition(" ")
    assert float(seconds) < 2, done.stdout + done.stderr
    assert (
        "Ray was imported in this process before it was" in message
        and "restart the kernel" in message
    )


def test_two_ranks_on_two_nodes_train_as_a_local_run_does(
    ray_cluster: LocalRayCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path, run_name="on-ray")
    phases = LaunchPhases()
    capfd.readouterr()
    with announcing(phases):
        run = wb.start(cfg, cluster=wb.Ray(address=ray_cluster.address), progress=False)
    assert isinstance(run, wb.RayRun) and run.start_method == "ray"
    assert STARTING_RAY in [name for name, _ in phases.history]
    result = run.wait(timeout=240)
    said = capfd.readouterr()
    # Ray's own lines (connection, token auth, worker banners) went to the run directory, not to this process's
    # stdout/stderr, which a notebook cell shows
    assert "ray" not in (said.out + said.err).lower(), said
    assert (run.run_dir / "ray" / "ray.log").is_file()
    assert result.summary["status"] == "completed" and result.summary["world_size"] == 2
    workers = run.workers()
    assert [w["rank"] for w in workers] == [0, 1]
    assert {w["node_rank"] for w in workers} == {0, 1}
    assert len({w["node_ip"] for w in workers}) == 2, workers
    assert "127.0.0.2" in {w["node_ip"] for w in workers}
    for w in workers:  # each rank's output is in the run directory
        assert (run.run_dir / "ray" / f"rank_{w['rank']}.log").stat().st_size > 0
    assert run.driver()[0] == "GONE"  # the driver actor ended with the run
    here = wb.launch(cfg.replace(run_name="here"), progress=False)
    ray_losses, local_losses = _losses(result), _losses(here)
    assert sorted(ray_losses) == sorted(local_losses) == [5, 10, 15, 20]
    assert max(abs(ray_losses[s] - local_losses[s]) for s in ray_losses) < 1e-5


def test_a_killed_worker_restarts_the_group_which_resumes_from_the_last_checkpoint(
    ray_cluster: LocalRayCluster, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, max_steps=150, checkpoint_every=25, log_every=25)
    run = wb.start(cfg, cluster=wb.Ray(address=ray_cluster.address, max_failures=1), progress=False)
    _until(
        "a checkpoint sealed", lambda: run.dir.latest_checkpoint() is not None or run.done(), 180
    )
    assert not run.done(), run.dir.events()
    killed_at = run.dir.latest_checkpoint().name
    victim = next(w for w in run.workers() if w["rank"] == 1)
    os.kill(victim["rank_pid"], signal.SIGKILL)
    result = run.wait(timeout=300)
    assert result.summary["status"] == "completed" and result.summary["steps"] == 150
    events = run.dir.events()
    restarted = [e for e in events if e["event"] == "ray_restarted"]
    assert len(restarted) == 1 and restarted[0]["attempt"] == 2
    resumed_from = int(restarted[0]["resume_from"].split("_")[1])
    assert resumed_from >= int(killed_at.split("_")[1]) > 0
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] == resumed_from, resumed
    assert max(w["attempt"] for w in run.workers()) == 1  # the workers of the second group
    failure = next(e for e in events if e["event"] == "ray_restarted")
    assert "Ray restarted the worker group" in failure["reason"]


def test_the_run_outlives_its_driver_process_stops_from_an_attached_handle_and_resumes_on_ray(
    ray_cluster: LocalRayCluster, tmp_path: Path
) -> None:
    """A 'kernel' (a Python process) starts the run and dies at once; a new one attaches, stops it and resumes
    it on the cluster."""
    cfg = _cfg(tmp_path, max_steps=100_000, log_every=5)
    kernel = textwrap.dedent(
        f"""
        import os, sys, workbench as wb
        cfg = wb.RunConfig.from_yaml(sys.argv[1])
        run = wb.start(cfg, cluster=wb.Ray(address={ray_cluster.address!r}), progress=False)
        print(run.run_dir, flush=True)
        os._exit(0)  # as a kernel that dies: nothing is cleaned up
        """
    )
    config = tmp_path / "run.yaml"
    cfg.replace(run_name="outlives").to_yaml(config)
    done = subprocess.run(
        [sys.executable, "-c", kernel, str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **ray_cluster.env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    run = wb.attach(run_dir)
    assert isinstance(run, wb.RayRun) and run.driver()[0] == "ALIVE"
    _until("training after the kernel died", lambda: len(run.metrics) >= 2 or run.done(), 180)
    assert run.status is Status.RUNNING, run.dir.events()
    run.stop()
    result = run.wait(timeout=180)
    assert result.summary["status"] == "stopped"
    stopped_at = result.summary["steps"]
    assert 10 <= stopped_at < 100_000
    # the ranks checkpointed on one step
    assert run.dir.latest_checkpoint().name == f"step_{stopped_at}"
    assert run.driver()[0] == "GONE"
    # resume() goes back to the same cluster and continues from that checkpoint
    again = run.resume(max_steps=stopped_at + 10)
    assert isinstance(again, wb.RayRun) and again.run_dir == run.run_dir
    assert again.job["submission"] != run.job["submission"]
    result = again.wait(timeout=180)
    assert result.summary["status"] == "completed" and result.summary["steps"] == stopped_at + 10
    resumed = [e for e in again.dir.events() if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] == stopped_at, resumed


def test_a_node_lost_past_max_failures_fails_the_run_naming_it(
    ray_cluster: LocalRayCluster, tmp_path: Path
) -> None:
    """It kills the node on 127.0.0.2, then starts another in its place for the tests after it."""
    cfg = _cfg(tmp_path, max_steps=100_000, log_every=5)
    run = wb.start(cfg, cluster=wb.Ray(address=ray_cluster.address, max_failures=0), progress=False)
    _until("training", lambda: len(run.metrics) >= 1 or run.done(), 180)
    assert any(w["node_ip"] == "127.0.0.2" for w in run.workers())
    try:
        assert ray_cluster.kill_node("127.0.0.2") > 0
        with pytest.raises(
            RunFailedError,
            match=r"max_failures=0: no restart\); node\(s\) lost: 127\.0\.0\.2 \(rank \d\)",
        ):
            run.wait(timeout=180)
        assert run.dir.summary().status is Status.FAILED
        assert run.driver()[0] == "GONE"
    finally:
        ray_cluster.add_node()  # on 127.0.0.3: two alive nodes again
