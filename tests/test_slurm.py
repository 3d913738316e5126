"""Runs submitted to a real two-node Slurm cluster (Debian's slurm-wlm + munge, two slurmd on this host), brought
up by scripts/slurm-local/up.sh for this module and taken down after it when it wasn't up before."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from collected_ids import cases

import workbench as wb
from tests import s3_server as server_module
from tests.s3_server import S3Server
from workbench.rundir import RunFailedError, Status
from workbench.storage import filesystem

REPO = Path(__file__).resolve().parents[1]
UP, DOWN = REPO / "scripts" / "slurm-local" / "up.sh", REPO / "scripts" / "slurm-local" / "down.sh"
pytestmark = pytest.mark.slow
s3_server = server_module.s3_server  # the fixture, for pytest to see in this module


def _cluster_answers() -> bool:
    return (
        shutil.which("scontrol") is not None
        and subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True, timeout=30, check=False
        ).returncode
        == 0
        and "UP"
        in subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30).stdout
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The local cluster, up: skipped with the reason only where Slurm can't be installed or run (not root)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (slurmd, munged and /etc/hosts)")
    was_up = _cluster_answers()
    if not was_up:
        done = subprocess.run(
            ["bash", str(UP)], capture_output=True, text=True, timeout=110, check=False
        )
        if done.returncode != 0:
            if shutil.which("slurmctld") is None:
                pytest.skip(
                    f"Slurm can't be installed here: {(done.stderr or done.stdout).strip()[-400:]}"
                )
            pytest.fail(
                f"scripts/slurm-local/up.sh failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
    else:  # jobs an earlier session left (killed before its teardown) would hold the nodes: up to their time limit
        left = [
            line.split()[0]
            for line in subprocess.run(
                ["squeue", "-h", "-o", "%i %j"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.splitlines()
            if line.split()[1:2] and line.split()[1].startswith("workbench-")
        ]
        if left:
            print(f"cancelling Slurm jobs an earlier test session left: {' '.join(left)}")
            subprocess.run(["scancel", *left], capture_output=True, timeout=30, check=False)
    try:
        yield
    finally:
        if not was_up:
            subprocess.run(
                ["bash", str(DOWN)], capture_output=True, text=True, timeout=110, check=False
            )


def _cfg(tmp_path: Path, **fields: object) -> wb.RunConfig:
    base = {
        "task": "digits",
        "num_processes": 2,
        "max_steps": 30,
        "log_every": 5,
        "seed": 0,
        "runs_dir": str(tmp_path / "runs"),
    }
    return wb.RunConfig(**{**base, **fields})


def _jobs() -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30, check=True
    )
    return set(out.stdout.split())


def _wait_for(predicate: object, what: str, deadline_s: float = 90.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {deadline_s:.0f} s")
        time.sleep(0.3)


@pytest.fixture
def cancel_after() -> Iterator[list[wb.SlurmRun]]:
    """Runs a test submitted: their jobs are cancelled when the test ends, passed or not."""
    runs: list[wb.SlurmRun] = []
    yield runs
    for run in runs:
        # shown only when the test failed: where the job was and what it said, before it is cancelled
        job = subprocess.run(
            ["scontrol", "show", "job", run.job_id],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        print(
            f"--- Slurm job {run.job_id}:\n{job.stdout or job.stderr}\n--- its stderr:\n{run.stderr_tail()}"
        )
        subprocess.run(["scancel", run.job_id], capture_output=True, timeout=30, check=False)
    nodes = subprocess.run(
        ["sinfo", "-N", "-l"], capture_output=True, text=True, timeout=30, check=False
    )
    log = Path(os.environ.get("SLURM_LOCAL_DIR", "/tmp/slurm-local")) / "log" / "slurmctld.log"
    tail = (
        log.read_text(errors="replace").splitlines()[-40:]
        if log.is_file()
        else ["(no slurmctld.log)"]
    )
    print(f"--- the nodes:\n{nodes.stdout or nodes.stderr}\n--- slurmctld.log:\n" + "\n".join(tail))


def test_a_ddp_run_submitted_to_two_nodes_ends_completed_with_the_losses_of_the_same_run_here(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    cfg = _cfg(tmp_path)
    run = wb.start(cfg, cluster=wb.Slurm(nodes=2, time="5:00"))
    cancel_after.append(run)
    assert isinstance(run, wb.SlurmRun) and run.job_id.isdigit()
    # a TimeoutError with the job's state, before pytest-timeout's 120 s
    there = run.wait(timeout=90)
    assert there.status is Status.COMPLETED and there.summary["world_size"] == 2
    here = wb.launch(cfg.replace(run_name="local"))
    losses = [(m["step"], m["loss"]) for m in there.metrics if "loss" in m]
    assert [s for s, _ in losses] == [5, 10, 15, 20, 25, 30]
    assert [v for _, v in losses] == pytest.approx(
        [m["loss"] for m in here.metrics if "loss" in m], rel=1e-6
    )
    events = [e["event"] for e in there.events]
    assert "submitted" in events and events[-1] == "completed", events


def test_an_unknown_partition_and_too_many_gpus_are_refused_before_anything_is_submitted(
    cluster: None, tmp_path: Path
) -> None:
    before = _jobs()
    with pytest.raises(
        ValueError,
        match=r"partition='gpu-nope': not a partition of this cluster \(sinfo lists "
        r"debug\); choose one of those",
    ):
        wb.start(_cfg(tmp_path), cluster=wb.Slurm(partition="gpu-nope", nodes=2))
    with pytest.raises(
        ValueError, match=r"gpus_per_node=8: partition 'debug' has 0 GPU\(s\) per node"
    ):
        wb.start(_cfg(tmp_path), cluster=wb.Slurm(nodes=2, gpus_per_node=8))
    with pytest.raises(ValueError, match=r"nodes=3: partition 'debug' has 2 node\(s\)"):
        wb.start(_cfg(tmp_path, num_processes=3), cluster=wb.Slurm(nodes=3))
    with pytest.raises(
        ValueError,
        match=r"num_processes=2: the job runs 2 node\(s\) x 2 rank\(s\) = 4; set "
        r"num_processes=4",
    ):
        wb.start(_cfg(tmp_path), cluster=wb.Slurm(nodes=2, processes_per_node=2))
    # a folder below a file: unwritable even for root (CI runs as root)
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "wb-runs"
    with pytest.raises(
        ValueError,
        match=rf"runs_dir='{re.escape(str(unwritable))}': can't write there \(.*\); a cluster "
        r"run's directory is the only channel back .* set runs_dir to a writable folder",
    ):
        wb.start(_cfg(tmp_path, runs_dir=str(unwritable)), cluster=wb.Slurm(nodes=2))
    assert _jobs() == before and not (tmp_path / "runs").exists(), (
        "nothing submitted, no run directory"
    )


def test_a_job_that_ends_before_any_rank_starts_is_failed_with_slurms_words_never_starting(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    run = wb.start(
        _cfg(tmp_path),
        cluster=wb.Slurm(nodes=2, setup=["echo 'no such module: cuda/12' >&2", "exit 3"]),
    )
    cancel_after.append(run)
    with pytest.raises(RunFailedError, match=rf"the Slurm job {run.job_id} ended FAILED"):
        run.wait(timeout=90)
    summary = run.dir.summary()
    assert (
        summary.status is Status.FAILED
        and "before the run recorded an ending" in summary.error["message"]
    )
    assert run.status is Status.FAILED


def test_a_held_job_says_pending_with_slurms_reason_and_stop_cancels_it(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    run = wb.start(_cfg(tmp_path), cluster=wb.Slurm(nodes=2, extra={"hold": True}))
    cancel_after.append(run)
    _wait_for(lambda: run.job()[0] == "PENDING", "the held job was not listed as pending")
    assert run.job() == ("PENDING", "JobHeldUser") and "PENDING (JobHeldUser)" in run.describe()
    assert run.status is Status.STARTING, "a pending job's run is still starting, not failed"
    run.stop()
    assert run.dir.summary().status is Status.STOPPED
    _wait_for(
        lambda: run.job()[0] not in ("PENDING", "RUNNING"), "the cancelled job left the queue"
    )
    assert run.wait(timeout=30).status is Status.STOPPED


def test_attach_from_a_fresh_interpreter_follows_a_running_job_to_its_end(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    # one node: following is what this checks (2 nodes: test_a_ddp_run_submitted_to_two_nodes_...)
    run = wb.start(_cfg(tmp_path, max_steps=60, num_processes=1), cluster=wb.Slurm(nodes=1))
    cancel_after.append(run)
    code = (
        "import sys, workbench as wb; r = wb.attach(sys.argv[1]); "
        "print(r.job_id, r.wait(timeout=100).status.value, flush=True)"
    )
    follower = subprocess.run(
        [sys.executable, "-c", code, str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert follower.returncode == 0, follower.stderr[-2000:]
    assert follower.stdout.split() == [run.job_id, "completed"]
    assert wb.RunResult(run.run_dir).summary["steps"] == 60
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError, match=r"attach: not a run directory: .* has no config.yaml or summary.json"
    ):
        wb.attach(tmp_path / "empty")


def test_stop_ends_a_running_job_stopped_with_a_checkpoint_and_an_scancel_is_reported_as_such(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    slurm = wb.Slurm(nodes=2, time="5:00")
    # the two jobs side by side (a task takes one of each node's cores): one is stopped, the other scancelled
    run = wb.start(
        _cfg(tmp_path, max_steps=100000, log_every=10, run_name="stopped"), cluster=slurm
    )
    cancel_after.append(run)
    cancelled = wb.start(
        _cfg(tmp_path, max_steps=100000, log_every=10, run_name="cancelled"), cluster=slurm
    )
    cancel_after.append(cancelled)
    _wait_for(
        lambda: len(run.metrics) >= 2 and len(cancelled.metrics) >= 1,
        "the submitted runs logged no steps",
    )
    run.stop()
    subprocess.run(["scancel", cancelled.job_id], check=True, timeout=30)
    result = run.wait(timeout=90)
    assert result.status is Status.STOPPED and list((run.run_dir / "checkpoints").iterdir())
    assert cancelled.wait(timeout=90).status is Status.STOPPED, (
        "cancelled on purpose: not a preemption to requeue"
    )
    said = [e for e in cancelled.events if e["event"] == "cancelled"]
    assert (
        len(said) == 1 and said[0]["job_id"] == cancelled.job_id and "scancel" in said[0]["reason"]
    )
    assert list((cancelled.run_dir / "checkpoints").iterdir()), (
        "the ranks checkpointed on the way out"
    )


def test_the_shell_submits_prints_the_job_and_run_directory_and_follows_it(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    config = tmp_path / "run.yaml"
    _cfg(tmp_path, max_steps=10, num_processes=1).to_yaml(config)
    cli = [sys.executable, "-m", "workbench.cli", "train", str(config)]
    done = subprocess.run(
        [*cli, "--slurm", "nodes=1,time=0:05:00", "--follow"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.splitlines()[:2]
    job_id = first.removeprefix("submitted: Slurm job ")
    assert job_id.isdigit() and Path(second).is_dir() and wb.attach(second).job_id == job_id
    assert wb.RunResult(Path(second)).status is Status.COMPLETED
    refused = subprocess.run(
        [*cli, "--slurm", "partition=nope,nodes=1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        refused.returncode == 2
        and "partition='nope': not a partition of this cluster" in refused.stderr
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    cases(
        [
            ("nodes=two", r"--slurm nodes='two': a whole number"),
            ("partition", r"--slurm 'partition': write key=value"),
            ("nodes=0", r"Slurm nodes=0: a whole number of at least 1"),
            ("time=1h", r"Slurm time='1h': minutes, or 'D-HH:MM:SS'"),
        ]
    ),
)
def test_a_bad_slurm_spec_is_refused_with_the_item_and_the_fix(spec: str, message: str) -> None:
    from workbench.cluster.slurm import from_spec

    with pytest.raises(ValueError, match=message):
        from_spec(spec)


def test_slurm_time_limits_read_as_slurm_writes_them() -> None:
    from workbench.cluster.slurm import from_spec, minutes

    assert [
        minutes(t) for t in (90, "90", "30:30", "1:30:00", "2-12", "2-12:30", "1-00:00:01")
    ] == [90, 90, 31, 90, 3600, 3630, 1441]
    spec = from_spec(
        "partition=gpu,nodes=2,gpus_per_node=8,time=4:00:00,setup=module load cuda;source v/bin/activate,"
        "exclusive=true,mail_type=END"
    )
    assert (spec.partition, spec.nodes, spec.gpus_per_node, spec.minutes) == ("gpu", 2, 8, 240)
    assert spec.setup == ("module load cuda", "source v/bin/activate")
    assert spec.extra == {"exclusive": True, "mail-type": "END"}


def test_the_readme_multinode_recipe_runs_on_two_nodes_and_a_job_whose_ranks_never_start_reads_failed(
    cluster: None, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    _cfg(tmp_path, max_steps=10).to_yaml(config)
    cli = [sys.executable, "-m", "workbench.cli"]
    recipe = REPO / "scripts" / "slurm" / "multinode.sbatch"
    python_bin = str(Path(sys.executable).parent)
    runs = {}
    for name, py_bin in (("good", python_bin), ("broken", str(tmp_path / "no-python-here"))):
        run_dir = subprocess.run(
            [*cli, "train", str(config), "--prepare-only", "--set", f"run_name={name}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        sub = subprocess.run(
            [
                "sbatch",
                "--parsable",
                "-N",
                "2",
                "--ntasks-per-node=1",
                "-o",
                str(tmp_path / f"{name}.out"),
                str(recipe),
                run_dir,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
            env={**os.environ, "PY_BIN": py_bin},
        )
        runs[name] = (run_dir, sub.stdout.strip().split(";")[0])
    try:
        for name, (_, job_id) in runs.items():
            _wait_for(
                lambda job_id=job_id: job_id not in _jobs(),
                f"the {name} recipe job did not end",
                100,
            )
        good = subprocess.run(
            [*cli, "status", runs["good"][0]], capture_output=True, text=True, timeout=60
        )
        assert good.returncode == 0 and "completed" in good.stdout, good.stdout + good.stderr
        broken = subprocess.run(
            [*cli, "status", runs["broken"][0]], capture_output=True, text=True, timeout=60
        )
        assert broken.returncode == 1 and "failed" in broken.stdout, broken.stdout + broken.stderr
        assert (
            f"Slurm job {runs['broken'][1]} is no longer running" in broken.stdout + broken.stderr
        )
    finally:
        for _, job_id in runs.values():
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)


def test_a_job_warned_of_its_time_limit_checkpoints_is_requeued_and_completes_with_the_uninterrupted_curve(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    cfg = _cfg(tmp_path, max_steps=600, log_every=50, max_restarts=2, run_name="requeued")
    run = wb.start(cfg, cluster=wb.Slurm(nodes=2, time=10, grace_s=90))
    cancel_after.append(run)
    script = next((run.run_dir / "slurm").glob("*submission.sh")).read_text()
    assert "#SBATCH --signal=USR2@90" in script and "#SBATCH --requeue" in script
    _wait_for(
        lambda: len([m for m in run.metrics if "loss" in m]) >= 2,
        "the submitted run logged no steps",
    )
    # Slurm's warning, grace_s before the limit, is this signal to the job's tasks (sent now: Slurm may send
    # its own up to a minute early, so a test can't wait for it to the second)
    subprocess.run(["scancel", "--signal=USR2", run.job_id], check=True, timeout=30)
    result = run.wait(timeout=100)
    assert result.status is Status.COMPLETED and result.summary["steps"] == 600
    events = [
        e
        for e in result.events
        if e["event"] in ("preempted", "requeued", "requeue_started", "resumed")
    ]
    assert [e["event"] for e in events][:3] == ["preempted", "requeued", "requeue_started"], events
    assert (
        events[0]["signal"] == "SIGUSR2"
        and events[1]["job_id"] == run.job_id
        and events[1]["attempt"] == 2
    )
    assert len(result.dir.config_paths()) == 2 and result.dir.config().resume
    here = wb.launch(cfg.replace(run_name="uninterrupted", max_restarts=0))
    curve = {m["step"]: m["loss"] for m in result.metrics if "loss" in m}
    uninterrupted = {m["step"]: m["loss"] for m in here.metrics if "loss" in m}
    # a logged loss is its window's mean: the window the preemption cut is averaged over its resumed part only
    cut = -(-events[0]["step"] // 50) * 50
    common = sorted((set(curve) & set(uninterrupted)) - {cut})
    assert common[-1] == 600 and len(common) >= 10
    assert [curve[s] for s in common] == pytest.approx([uninterrupted[s] for s in common], rel=1e-5)


def test_the_dashboard_follows_a_cluster_run_to_its_end(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    from workbench.notebook.dashboard import Dashboard

    run = wb.start(
        _cfg(tmp_path, max_steps=200, log_every=10, num_processes=1), cluster=wb.Slurm(nodes=1)
    )
    cancel_after.append(run)
    dash = Dashboard(run, interval=0.2, figure_interval=0.5).start()
    try:
        _wait_for(lambda: not dash.polling, "the dashboard did not see the cluster run end", 100)
    finally:
        dash.stop()
    assert dash.reading.observed[0] == "completed" and dash.reading.train_rows[-1].step == 200
    assert dash.figures_drawn >= 1 and dash.figure_png().startswith(b"\x89PNG")
    assert run.wait(timeout=30).status is Status.COMPLETED


def test_regress_on_slurm_runs_each_case_as_an_array_task_and_writes_one_report_and_junit_file(
    cluster: None, tmp_path: Path
) -> None:
    import json
    import xml.etree.ElementTree as ET

    import yaml

    fixtures = REPO / "tests" / "fixtures" / "notebooks"
    suite = tmp_path / "suite.yaml"
    nb = os.path.relpath(fixtures / "records_metric.ipynb", tmp_path)
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "cases": [
                    {"notebook": nb, "name": "inside", "parameters": {"value": 1.05}},
                    {"notebook": nb, "name": "outside", "parameters": {"value": 1.5}},
                    {
                        "notebook": os.path.relpath(fixtures / "raises_error.ipynb", tmp_path),
                        "name": "broken",
                    },
                ],
            }
        )
    )
    for case in ("t.inside", "t.outside"):
        path = tmp_path / "baselines" / "cpu" / f"{case}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"metrics": {"val_loss": {"value": 1.0}, "steps": {"value": 10}}})
        )
    out, junit = tmp_path / "report", tmp_path / "junit.xml"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "regress",
            str(suite),
            "--out",
            str(out),
            "--junit",
            str(junit),
            "--slurm",
            "time=10",
        ],
        capture_output=True,
        text=True,
        timeout=115,
        check=False,
    )
    # a case that errors wins over one that regressed
    assert done.returncode == 2, done.stderr[-3000:]
    assert "as job array" in done.stderr
    results = {
        c["case"]: c["status"] for c in json.loads((out / "results.json").read_text())["cases"]
    }
    assert results == {"t.inside": "passed", "t.outside": "failed", "t.broken": "error"}
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert (
        set(cases) == {"inside", "outside", "broken"}
        and cases["outside"].find("failure") is not None
    )
    assert (out / "cases" / "t.inside" / "records_metric.ipynb").is_file()
    assert len(list((out / "slurm").glob("*_log.out"))) == 3, (
        "each array task logged under the report"
    )


def test_a_node_failure_requeues_the_job_and_the_run_resumes_from_its_newest_checkpoint(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    cfg = _cfg(
        tmp_path,
        max_steps=800,
        log_every=50,
        checkpoint_every=100,
        max_restarts=1,
        run_name="node-fail",
    )
    run = wb.start(cfg, cluster=wb.Slurm(nodes=2, time=10))
    cancel_after.append(run)
    _wait_for(lambda: run.dir.latest_checkpoint() is not None, "the run wrote no checkpoint")
    subprocess.run(
        ["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=workbench-node-fail-test"],
        check=True,
        timeout=30,
    )
    try:
        _wait_for(
            lambda: (
                "Restarts=1"
                in subprocess.run(
                    ["scontrol", "show", "job", run.job_id],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
            ),
            "Slurm did not requeue the job whose node failed",
            60,
        )
    finally:  # with ReturnToService=2 a node whose slurmd answers is back by itself; RESUME is refused then
        subprocess.run(
            ["scontrol", "update", "NodeName=node2", "State=RESUME"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    result = run.wait(timeout=90)
    assert result.status is Status.COMPLETED and result.summary["steps"] == 800
    started = [e for e in result.events if e["event"] == "requeue_started"]
    assert len(started) == 1 and started[0]["job_id"] == run.job_id and started[0]["attempt"] == 2
    assert len(result.dir.config_paths()) == 2 and any(
        e["event"] == "resumed" for e in result.events
    )


def test_the_panel_submits_to_a_partition_sinfo_lists_and_follows_the_job_to_its_end(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    panel = wb.Panel(_cfg(tmp_path, max_steps=40), display=False, estimate=False)
    t = panel.target_controls
    t.where.value = "slurm"
    assert t.slurm.partition.value == "debug"
    assert (
        t.slurm.partition.label.startswith("debug (default): 2 nodes (")
        and "no GPU" in t.slurm.partition.label
    )
    t.nodes.value, t.gpus_per_node.value = 2, 1
    assert panel.controls["num_processes"].value == 2 and not panel.launch_button.disabled, (
        panel.state.problem
    )
    run = panel.launch()
    cancel_after.append(run)
    assert isinstance(run, wb.SlurmRun) and run.job_id.isdigit()
    result = panel.wait(timeout=100, show=False)
    assert result.status is Status.COMPLETED and result.summary["world_size"] == 2
    assert panel.state.status == "completed" and panel.dashboard is not None
    assert panel.dashboard.reading.train_rows[-1].step == 40, (
        "the panel's dashboard followed the job"
    )
    shown = subprocess.run(
        ["scontrol", "show", "job", run.job_id],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "NodeList=node[1-2]" in shown.stdout, "the job the panel submitted spans both nodes"


def test_the_panel_says_a_held_job_is_pending_with_slurms_reason_and_its_stop_cancels_it(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    panel = wb.Panel(
        _cfg(tmp_path),
        display=False,
        estimate=False,
        cluster=wb.Slurm(nodes=2, extra={"hold": True}),
    )
    assert panel.target_controls.slurm.options.value == "hold=true"
    run = panel.launch()
    cancel_after.append(run)
    _wait_for(
        lambda: "PENDING (JobHeldUser)" in panel.status_box.value,
        "the panel did not say the job waits",
        30,
    )
    assert "Stop cancels the job" in panel.status_box.value and not panel.stop_button.disabled
    panel.stop()
    assert panel.wait(timeout=60, show=False).status is Status.STOPPED
    _wait_for(
        lambda: run.job()[0] not in ("PENDING", "RUNNING"), "the cancelled job left the queue"
    )


def _dead_controller_conf(tmp_path: Path) -> Path:
    """The cluster's configuration with the controller at a port nothing listens on, and a 1 s message timeout
    (with the default, squeue and scontrol take 18 s to give up): a client that reads it can't reach the
    controller, for real, while the cluster goes on for everyone else."""
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text()
    dead = tmp_path / "slurm-unreachable.conf"
    dead.write_text(
        re.sub(r"(?m)^SlurmctldPort=.*$", f"SlurmctldPort={port}", conf) + "\nMessageTimeout=1\n"
    )
    return dead


def test_an_unreachable_controller_leaves_a_live_run_running_locked_and_waited_for(
    cluster: None, tmp_path: Path, cancel_after: list[wb.SlurmRun], caplog: pytest.LogCaptureFixture
) -> None:
    from workbench.commands.status import describe_run
    from workbench.rundir import RunDirLocked, prepare

    cfg = _cfg(tmp_path, max_steps=100000, log_every=10, run_name="outage")
    config = tmp_path / "run.yaml"
    cfg.to_yaml(config)
    # submitted by a process that then exits (a notebook kernel restarted): the lock's owner is gone
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "train",
            str(config),
            "--slurm",
            "nodes=2,time=5:00",
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = wb.attach(done.stdout.splitlines()[1])
    cancel_after.append(run)
    recorded = json.loads((run.run_dir / "slurm.json").read_text())
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", run.job_id],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert recorded["cluster"] == "local" and recorded["job_name"] == "workbench-outage"
    assert (
        "JobName=workbench-outage " in shown and f" SubmitTime={recorded['submit_time']} " in shown
    )
    _wait_for(lambda: len(run.metrics) >= 1, "the submitted run logged no steps")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLURM_CONF", str(_dead_controller_conf(tmp_path)))
        assert (
            "DOWN"
            in subprocess.run(
                ["scontrol", "ping"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        )
        with (
            caplog.at_level(logging.WARNING, logger="workbench"),
            pytest.raises(
                TimeoutError,
                match=rf"\(Slurm job {run.job_id}\) still unknown \(the Slurm controller can't be "
                r"asked \(squeue: slurm_load_jobs error: Unable to contact slurm controller",
            ),
        ):
            run.wait(timeout=3)
        assert (
            f"Slurm job {run.job_id}'s state is unknown" in caplog.text
            and "still waiting" in caplog.text
        )
        assert run.dir.summary().status is Status.RUNNING and run.dir.lock_path.exists(), (
            "nothing finalized"
        )
        text, code = describe_run(run.run_dir)
        assert code == 0 and text.startswith(
            f"outage: running (unknown: its Slurm job {run.job_id}'s state is "
            "unknown: the Slurm controller can't be asked"
        ), text
        with pytest.raises(
            RunDirLocked,
            match=r"its ranks' heartbeats are fresh .*, and its Slurm job \d+'s state "
            r"is unknown",
        ):
            prepare(cfg.replace(resume="auto"))
    # the controller answers again: the run went on all along, and ends as asked
    assert run.job()[0] == "RUNNING" and run.status is Status.RUNNING
    run.stop()
    assert run.wait(timeout=90).status is Status.STOPPED


def test_a_job_id_given_to_another_job_is_not_the_runs_and_is_never_cancelled_for_it(
    cluster: None, tmp_path: Path
) -> None:
    from workbench.rundir import RunDir
    from workbench.rundir.scheduler import query

    # someone else's job (named workbench-* so that a session killed midway has it cancelled by the fixture)
    other = (
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                "--requeue",
                "-J",
                "workbench-someone-elses-job",
                "-t",
                "2",
                "-o",
                "/dev/null",
                "--wrap",
                "sleep 120",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    try:
        _wait_for(lambda: query(other).state == "RUNNING", "the other job did not start", 30)
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait(30)
        dirs = {}
        for name, job in (
            (
                "dead",
                {
                    "job_id": other,
                    "job_name": "workbench-dead",
                    "submit_time": "2026-01-02T03:04:05",
                    "cluster": "local",
                },
            ),
            ("old-format", {"job_id": other}),
        ):
            # a run of the cluster's earlier life, dead: its slurm.json names the id its own job had
            run = RunDir(tmp_path / "runs" / name)
            run.path.mkdir(parents=True)
            _cfg(tmp_path, run_name=name).to_yaml(run.config_path)
            run.set_status(Status.RUNNING, run_name=name)
            run.write_heartbeat(
                0, {"host": socket.gethostname(), "pid": gone.pid, "create_time": 0.0, "step": 7}
            )
            (run.path / "slurm.json").write_text(json.dumps(job))
            dirs[name] = run
        status, why = dirs["dead"].observed_status()
        assert status is Status.FAILED, why
        assert (
            f"job id {other} now names another job (named 'workbench-someone-elses-job', not 'workbench-dead')"
            in why
        )
        dead = wb.attach(dirs["dead"].path)
        assert dead.job()[0] == "GONE"
        with pytest.raises(
            ValueError,
            match=rf"cancel\(\): dead's Slurm job has ended, and job id {other} now names "
            r"another job .*that job is not this run's and was not cancelled",
        ):
            dead.cancel()
        assert query(other).state == "RUNNING", "the other job was left alone"
        # a slurm.json from before the job's name and submit time were recorded: the id alone, as it always was
        assert dirs["old-format"].observed_status()[0] is Status.RUNNING
        # a requeue gives the job a new submit time: it is still the same job
        now = query(other)
        expected = {"job_name": now.name, "submit_time": now.submit_time, "cluster": now.cluster}
        time.sleep(1.1)  # submit times are in whole seconds
        subprocess.run(["scontrol", "requeue", other], check=True, timeout=30)
        _wait_for(
            lambda: query(other).submit_time != now.submit_time,
            "the requeued job kept its submit time",
            30,
        )
        again = query(other, expected)
        assert (
            again.state != "GONE"
            and not again.foreign
            and again.submit_time != expected["submit_time"]
        ), again
    finally:
        subprocess.run(["scancel", other], capture_output=True, timeout=30, check=False)


def test_a_slurm_run_checkpoints_to_object_storage_from_both_nodes_and_loads_back(
    cluster: None, s3_server: S3Server, tmp_path: Path, cancel_after: list[wb.SlurmRun]
) -> None:
    """The clusters guide's recipe: nodes that share no checkpoint folder write to the store (the
    AWS_* settings reach the ranks through the job's environment), sealed steps only, the run
    directory without checkpoints/, the weights of a step loaded back from the store here."""
    url = s3_server.bucket("slurm-ckpt")
    cfg = _cfg(tmp_path, max_steps=20, checkpoint_every=10, checkpoint_url=f"{url}/runs")
    run = wb.start(cfg, cluster=wb.Slurm(nodes=2, time="5:00"))
    cancel_after.append(run)
    there = run.wait(timeout=100)
    assert there.status is Status.COMPLETED, there.summary
    assert not (there.run_dir / "checkpoints").exists()
    saved = [e for e in there.events if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [10, 20]
    assert all(e["path"].startswith(f"{url}/runs/{there.run_dir.name}/") for e in saved)
    fs, root = filesystem(f"{url}/runs/{there.run_dir.name}/step_10")
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(root, refresh=True)}
    # one rank file from each node, and the manifest that seals them
    assert {"rank_0.pt", "rank_1.pt", "manifest.json"} <= names, names
    model = there.load_model(step=10)
    final = there.load_model()
    assert any(
        not torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), final.state_dict().values())
    ), "step 10's weights equal the final ones: not loaded from the step asked for"
