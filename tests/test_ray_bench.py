"""The shell's ways onto Ray, on a real 2-node Ray cluster on this machine (CI's Ray stage: `pytest -m ray`):
`workbench train CONFIG --ray address=... --follow` end to end, and `workbench bench launch --cluster ray` with one
measured pair. Each makes one or two runs on Ray (~35 s each on 2 cores); the cluster (tests/ray_cluster.py) is shared
with tests/test_ray.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import workbench as wb
from workbench.cli import main
from workbench.cluster.raytrain.local import LocalRayCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_train_with_ray_runs_there_and_follow_prints_how_it_ended(
    ray_cluster: LocalRayCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    wb.RunConfig(
        task="digits", num_processes=2, max_steps=10, runs_dir=str(tmp_path / "runs")
    ).to_yaml(config)
    code = main(
        ["train", str(config), "--ray", f"address={ray_cluster.address},max_failures=1", "--follow"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    first = out.splitlines()[0]
    assert first.startswith("started on Ray: driver workbench-") and first.endswith(", 2 worker(s)")
    assert re.search(r"^  status +completed$", out, re.M) and re.search(r"^  steps +10$", out, re.M)
    run_dir = Path(out.splitlines()[1])
    placed = wb.attach(run_dir).workers()
    assert len({w["node_ip"] for w in placed}) == 2, "one rank on each node"


def test_bench_launch_on_ray_times_both_sides_and_writes_the_ratio(
    ray_cluster: LocalRayCluster, tmp_path: Path
) -> None:
    from workbench.commands.bench.ray_launch import ray_launch

    report = ray_launch(1, address=ray_cluster.address, json_path=tmp_path / "launch-ray.json")
    assert len(report.ray_first_step_s) == len(report.local_first_step_s) == 1
    assert report.ray_nodes == [2] and report.passed
    assert report.first_ray_first_step_s is not None and report.first_local_first_step_s is not None
    assert all(0 < s < e for s, e in zip(report.ray_first_step_s, report.ray_end_s, strict=True))
    saved = json.loads((tmp_path / "launch-ray.json").read_text())
    assert saved["ratio"] == pytest.approx(report.ratio) and saved["measured_on"]["date"]
    assert "ratio Ray / local" in report.table()
