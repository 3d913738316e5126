"""wb.Ray without a cluster: its fields' checks, the CLI's spelling, the refusals made before anything connects,
and the placement check against the nodes a cluster lists (ray.nodes()'s records, written out here: the check is
workbench's arithmetic on them; the real cluster's answer is tested in tests/test_ray.py, CI's Ray stage)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import workbench as wb
from workbench.cluster.raytrain.spec import check_placement, check_run, from_spec


def _node(ip: str, cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    resources = {"CPU": cpus, "memory": 1e10, f"node:{ip}": 1.0}
    if gpus:
        resources["GPU"] = gpus
    return {
        "NodeID": ip.replace(".", ""),
        "NodeManagerAddress": ip,
        "Alive": alive,
        "Resources": resources,
    }


def test_import_workbench_and_wb_ray_do_not_import_ray() -> None:
    code = "import sys, workbench as wb; wb.Ray(address='h:6379'); wb.RayRun; print('ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"workers": 0}, r"workers=0: a whole number of at least 1"),
        ({"max_failures": -2}, r"max_failures=-2: a whole number, 0 for none, -1 for no limit"),
        ({"placement_strategy": "spread"}, r"placement_strategy='spread': one of PACK, SPREAD"),
        (
            {"resources_per_worker": {"CPU": -1}},
            r"resources_per_worker\['CPU'\]=-1: a number of at least 0",
        ),
        ({"resources_per_worker": {}}, r"a dict of resource -> amount"),
        ({"use_gpu": False, "resources_per_worker": {"GPU": 1}}, r"drop 'GPU' from the resources"),
        ({"runtime_env": "pip"}, r"runtime_env='pip': a dict"),
    ],
    ids=[
        "workers",
        "max-failures",
        "strategy",
        "negative-resource",
        "empty-resources",
        "gpu-conflict",
        "env",
    ],
)
def test_bad_fields_are_refused_naming_the_field_and_the_fix(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wb.Ray(**fields)


def test_the_cli_spelling_makes_the_same_ray() -> None:
    ray = from_spec(
        "address=10.0.0.1:6379,workers=4,use_gpu=true,max_failures=2,resources_per_worker=CPU:8;GPU:1"
    )
    assert ray == wb.Ray(
        address="10.0.0.1:6379",
        workers=4,
        use_gpu=True,
        max_failures=2,
        resources_per_worker={"CPU": 8, "GPU": 1},
    )
    with pytest.raises(
        ValueError, match=r"--ray nodes='2': not a field of wb.Ray; use one of address"
    ):
        from_spec("nodes=2")
    with pytest.raises(ValueError, match=r"--ray 'address': write key=value"):
        from_spec("address")
    with pytest.raises(ValueError, match=r"resources_per_worker='CPU=2': write NAME:AMOUNT"):
        from_spec("resources_per_worker=CPU=2")
    with pytest.raises(ValueError, match=r"--ray use_gpu='yes': true or false"):
        from_spec("use_gpu=yes")


def test_workers_and_device_must_agree_with_the_run() -> None:
    cfg = wb.RunConfig(num_processes=2)
    with pytest.raises(
        ValueError, match=r"workers=4 with num_processes=2: each worker is one rank"
    ):
        check_run(cfg, wb.Ray(workers=4))
    with pytest.raises(ValueError, match=r"device='cuda' with Ray use_gpu=False"):
        check_run(cfg.replace(device="cuda"), wb.Ray(use_gpu=False))
    with pytest.raises(ValueError, match=r"use_gpu=True with device='cpu'"):
        check_run(cfg.replace(device="cpu"), wb.Ray(use_gpu=True))
    with pytest.raises(
        ValueError,
        match=r"max_restarts=2: on Ray, Ray restarts the workers; set wb.Ray\(max_failures=2\)",
    ):
        check_run(cfg.replace(max_restarts=2), wb.Ray())
    check_run(cfg, wb.Ray(workers=2))  # agreeing: no error


def test_placement_counts_what_each_alive_node_fits() -> None:
    cfg = wb.RunConfig(num_processes=3, device="cpu")
    nodes = [_node("10.0.0.1", 2), _node("10.0.0.2", 1), _node("10.0.0.3", 8, alive=False)]
    plan = check_placement(cfg, wb.Ray(), nodes)
    assert plan == {
        "world": 3,
        "use_gpu": False,
        "per_worker": {"CPU": 1.0},
        "fits": {"10.0.0.1": 2, "10.0.0.2": 1},
    }
    with pytest.raises(
        ValueError,
        match=r"3 worker\(s\) of CPU 2 each can't be placed \(PACK\).*10\.0\.0\.1: 1, 10\.0\.0\.2: 0",
    ):
        check_placement(cfg, wb.Ray(resources_per_worker={"CPU": 2}), nodes)
    with pytest.raises(ValueError, match=r"\(STRICT_SPREAD\): the cluster's 2 alive node\(s\)"):
        check_placement(cfg, wb.Ray(placement_strategy="STRICT_SPREAD"), nodes)
    with pytest.raises(ValueError, match=r"\(STRICT_PACK\)"):
        check_placement(cfg, wb.Ray(placement_strategy="STRICT_PACK"), nodes)


def test_gpus_follow_the_device_and_the_cluster() -> None:
    gpu_nodes = [_node("10.0.0.1", 16, gpus=8), _node("10.0.0.2", 16, gpus=8)]
    plan = check_placement(
        wb.RunConfig(num_processes=16), wb.Ray(), gpu_nodes
    )  # device 'auto': the cluster's GPUs
    assert plan["use_gpu"] and plan["per_worker"] == {"CPU": 1.0, "GPU": 1.0}
    assert plan["fits"] == {"10.0.0.1": 8, "10.0.0.2": 8}
    with pytest.raises(
        ValueError, match=r"no node of the cluster has one; set use_gpu=False and device='cpu'"
    ):
        check_placement(
            wb.RunConfig(num_processes=2, device="cuda"), wb.Ray(), [_node("10.0.0.1", 4)]
        )
    with pytest.raises(ValueError, match=r"17 worker\(s\) of CPU 1, GPU 1 each can't be placed"):
        check_placement(wb.RunConfig(num_processes=17), wb.Ray(), gpu_nodes)


def test_no_alive_node_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"the cluster has no alive node; is it up \(`ray status`\)"
    ):
        check_placement(wb.RunConfig(), wb.Ray(), [_node("10.0.0.1", 4, alive=False)])


def test_a_cluster_of_another_kind_is_refused_before_anything_runs(tmp_path: Path) -> None:
    cfg = wb.RunConfig(runs_dir=str(tmp_path))
    with pytest.raises(
        ValueError, match=r"cluster='ray://h:10001': pass wb.Slurm\(...\) or wb.Ray\(...\)"
    ):
        wb.start(cfg, cluster="ray://h:10001", progress=False)
    assert not any(tmp_path.iterdir())


def test_attach_gives_a_ray_run_for_a_directory_with_ray_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    wb.RunConfig(run_name="r", runs_dir=str(tmp_path)).to_yaml(run_dir / "config.yaml")
    job = {
        "actor": "workbench-r-1",
        "namespace": "workbench",
        "address": "10.0.0.1:6379",
        "workers": 1,
    }
    (run_dir / "ray.json").write_text(json.dumps(job))
    run = wb.attach(run_dir)
    assert isinstance(run, wb.RayRun) and run.job == job and run.start_method == "ray"
    (run_dir / "ray.json").write_text(json.dumps({"address": "x"}))
    with pytest.raises(ValueError, match=r"no ray.json naming a driver actor"):
        wb.attach(run_dir)
