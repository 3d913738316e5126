"""`workbench train CONFIG --ray ...`, without a Ray cluster: what the shell refuses before anything is
submitted (a misspelt spec, --ray with --slurm, workers against the run's processes), and that a valid spec
reaches the Ray submission with the run's config and prints where the run went.

The submission is faked here (a stand-in for workbench.cluster.raytrain.submit.submit that records its
arguments): bringing up a cluster costs ~15 s and a run on it ~35 s, and that path is tested for real in
test_ray.py and test_ray_bench.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.cli import main
from workbench.cluster.raytrain import submit as ray_submit
from workbench.rundir import RunFailedError


@pytest.fixture
def run_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    wb.RunConfig(
        task="digits", num_processes=2, max_steps=3, runs_dir=str(tmp_path / "runs")
    ).to_yaml(path)
    return path


class _Submitted:
    """What the CLI reads of a RayRun: its job (ray.json), its directory and wait()."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.job = {"actor": "workbench-r-abc", "address": "10.0.0.1:6379", "workers": 2}
        self.waited = False

    def wait(self) -> Any:
        self.waited = True
        raise RunFailedError(self.run_dir, {"rank": 1, "type": "RuntimeError", "message": "boom"})


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """The Ray submission replaced by one that records (cfg, spec) and returns a _Submitted."""
    calls: list[Any] = []

    def fake(cfg: wb.RunConfig, spec: wb.Ray, task: Any = None) -> _Submitted:
        calls.append((cfg, spec))
        calls.append(_Submitted(tmp_path / "runs" / "r"))
        return calls[-1]

    monkeypatch.setattr(ray_submit, "submit", fake)
    return calls


def test_ray_spec_reaches_the_submission_and_the_driver_is_printed(
    run_yaml: Path, submitted: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    spec = "address=10.0.0.1:6379,max_failures=1,resources_per_worker=CPU:2;GPU:0"
    assert main(["train", str(run_yaml), "--ray", spec, "--set", "max_steps=5"]) == 0
    cfg, ray = submitted[0]
    assert cfg.max_steps == 5 and cfg.num_processes == 2
    assert ray == wb.Ray(
        address="10.0.0.1:6379", max_failures=1, resources_per_worker={"CPU": 2.0, "GPU": 0.0}
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "started on Ray: driver workbench-r-abc at 10.0.0.1:6379, 2 worker(s)"
    assert out[1].endswith("r") and not submitted[1].waited, "without --follow it returns at once"


def test_follow_waits_and_says_how_the_run_ended(
    run_yaml: Path, submitted: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", str(run_yaml), "--ray", "address=auto", "--follow"]) == 1
    assert submitted[1].waited
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "boom" in err


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("adress=h:6379", "--ray adress='h:6379': not a field of wb.Ray; use one of address"),
        ("max_failures", "--ray 'max_failures': write key=value"),
        ("workers=two", "--ray workers='two': a whole number"),
        ("use_gpu=yes", "--ray use_gpu='yes': true or false"),
        ("resources_per_worker=CPU=2", "write NAME:AMOUNT;NAME:AMOUNT"),
        ("max_failures=-2", "Ray max_failures=-2: a whole number, 0 for none, -1 for no limit"),
    ],
)
def test_a_bad_spec_is_one_error_line_and_exit_2(
    run_yaml: Path, submitted: list[Any], capsys: pytest.CaptureFixture[str], spec: str, said: str
) -> None:
    assert main(["train", str(run_yaml), "--ray", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and len(err.strip().splitlines()) == 1
    assert submitted == [], "nothing is submitted"


def test_workers_against_the_processes_are_refused_before_ray_is_asked(
    run_yaml: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the real submission: its first check needs no cluster
    assert main(["train", str(run_yaml), "--ray", "workers=3"]) == 2
    assert "Ray workers=3 with num_processes=2" in capsys.readouterr().err


def test_ray_and_slurm_together_are_refused(
    run_yaml: Path, submitted: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", str(run_yaml), "--slurm", "partition=gpu", "--ray", "address=auto"])
    assert exited.value.code == 2
    assert "argument --ray: not allowed with argument --slurm" in capsys.readouterr().err
    assert submitted == []
