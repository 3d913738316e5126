"""The panel's "where" on a Ray cluster, without one: the controls a wb.Ray fills, the plan and the launch line
they form, that building the panel never connects to Ray (it costs seconds; ↻ does), and that Launch hands the
run to the Ray submission and the status line follows the run's driver.

What is faked, and why: the Ray submission (workbench.cluster.raytrain.submit.submit) is replaced by one that
records what it was given and returns a RayRun whose driver state the test sets (_StandIn), and ↻'s connection
(session.connect) by a stand-in with ray.nodes()'s answer. Bringing up a cluster and a run on it takes ~35 s on 2
cores, so the real path is tested in the Ray stage (test_ray.py, test_ray_bench.py: pytest -m ray)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from tests.test_panel import until
from workbench.cluster.raytrain import session
from workbench.cluster.raytrain import submit as ray_submit
from workbench.cluster.raytrain.run import ALIVE, GONE, RayRun
from workbench.notebook.panel.ray_controls import RayTarget
from workbench.rundir import Status, prepare

ADDRESS = "10.0.0.1:6379"


def tiny(runs_dir: Path, **changes: Any) -> wb.RunConfig:
    base = dict(task="digits", num_processes=2, max_steps=20, device="cpu", runs_dir=str(runs_dir))
    return wb.RunConfig(**{**base, **changes})


@pytest.fixture
def no_connection(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """session.connect refused (and counted): nothing may connect unless the test lets it."""
    calls: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("connected to Ray")

    monkeypatch.setattr(session, "connect", refuse)
    return calls


class _StandIn(RayRun):
    """A RayRun whose driver is ALIVE until the test calls end(): the run directory is real (prepared
    as the submission would), Ray is not."""

    ended = False

    def driver(self) -> tuple[str, str]:
        return (GONE, "ended") if self.ended else (ALIVE, "running")

    def workers(self) -> list[dict[str, Any]]:
        return [{"rank": r, "node_id": f"n{r}", "attempt": 0} for r in range(2)]

    def end(self, status: Status) -> None:
        self.dir.set_status(status)
        self.ended = True


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The Ray submission replaced: records (cfg, spec, task), returns a _StandIn."""
    calls: list[Any] = []

    def fake(cfg: wb.RunConfig, spec: wb.Ray, task: Any = None) -> _StandIn:
        cfg, run, token = prepare(cfg)
        job = {"actor": f"workbench-{cfg.run_name}-ab12", "address": ADDRESS, "workers": 2}
        calls.append((cfg, spec, task))
        calls.append(_StandIn(run.path, cfg, job, token))
        return calls[-1]

    monkeypatch.setattr(ray_submit, "submit", fake)
    return calls


def test_a_ray_cluster_fills_the_controls_and_the_plan_without_connecting(
    runs_dir: Path, no_connection: list[Any]
) -> None:
    ray = wb.Ray(
        address=ADDRESS,
        max_failures=2,
        resources_per_worker={"CPU": 2, "memory": 1e9},
        runtime_env={"env_vars": {"A": "1"}},
    )
    panel = wb.Panel(tiny(runs_dir), cluster=ray, display=False, estimate=False)
    t = panel.target_controls
    assert no_connection == [], "building the panel doesn't connect to Ray"
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert t.where.value == "ray" and t.ray.widget.layout.display is None
    assert t.slurm.widget.layout.display == "none" and t.size_box.layout.display == "none"
    assert (t.ray.address.value, t.ray.max_failures.value, t.ray.cpus.value, t.ray.gpus.value) == (
        ADDRESS,
        2,
        2.0,
        0.0,
    )
    assert "isn't asked until ↻" in t.ray.info.value
    assert isinstance(panel.target, RayTarget) and panel.target.launchable
    assert panel.state.problem == "" and not panel.launch_button.disabled, panel.state.problem
    assert (
        f"Launch starts it on Ray: 2 Ray workers (CPU 2 each) on the cluster at {ADDRESS}"
        in panel.launch_info.value
    )
    assert "= 2 Ray workers of CPU 2" in panel.limit.value
    panel.controls["num_processes"].value = 3  # the workers are the processes
    assert "= 3 Ray workers" in panel.limit.value and panel.state.problem == ""
    spec = t.cluster()
    assert spec == wb.Ray(
        address=ADDRESS,
        max_failures=2,
        resources_per_worker={"memory": 1e9, "CPU": 2.0},
        use_gpu=False,
        runtime_env={"env_vars": {"A": "1"}},
    ), "the controls' fields over the preset's; workers stay the processes"

    t.ray.gpus.value = 1  # GPU workers: planned on the catalog GPU chosen, the device follows
    assert t.gpu.layout.display is None and t.gpu.description == "GPU model"
    assert not panel.target.cpu_nodes and panel.config.device == "auto"
    assert f"x {t.gpu.value} (CPU 2, GPU 1 each)" in panel.launch_info.value
    t.ray.max_failures.value = -1
    assert t.cluster() == wb.Ray(
        address=ADDRESS,
        max_failures=-1,
        resources_per_worker={"memory": 1e9, "CPU": 2.0, "GPU": 1.0},
        use_gpu=True,
        runtime_env={"env_vars": {"A": "1"}},
    )
    t.where.value = "here"
    assert panel.target.local and t.ray.widget.layout.display == "none"
    assert no_connection == []


def test_refresh_reads_the_cluster_and_its_placement_becomes_a_problem(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = [
        {"Alive": True, "NodeManagerAddress": ip, "Resources": {"CPU": 1.0}}
        for ip in ("127.0.0.1", "127.0.0.2")
    ]
    asked: list[Any] = []

    class _Ray:  # ray as far as ↻ uses it
        @staticmethod
        def nodes() -> list[dict[str, Any]]:
            return nodes

    def connect(address: Any, namespace: str, *rest: Any, **kw: Any) -> Any:
        asked.append((address, namespace))
        if address == "nowhere:1":
            raise ValueError("Ray: no cluster answered at address='nowhere:1'")
        return _Ray

    monkeypatch.setattr(session, "connect", connect)
    panel = wb.Panel(tiny(runs_dir), display=False, estimate=False)
    t = panel.target_controls
    t.where.value = "ray"
    assert asked == [], "choosing Ray doesn't connect; ↻ does"
    assert t.ray.address.value in ("auto", os.environ.get("RAY_ADDRESS"))
    t.ray.address.value = ADDRESS
    t.ray.reread.click()
    assert asked == [(ADDRESS, "workbench")] and not t.ray.reread.disabled
    assert "2 alive nodes: 2 CPUs, 0 GPUs in all" in t.ray.info.value
    assert panel.state.problem == ""
    t.ray.cpus.value = 2  # 2 workers of 2 CPUs: no node has 2
    assert "Ray: 2 worker(s) of CPU 2 each can't be placed" in panel.state.problem
    assert panel.launch_button.disabled
    t.ray.cpus.value = 1
    t.ray.address.value = "nowhere:1"  # what was read was about the other address
    assert t.ray.nodes is None and "isn't asked until ↻" in t.ray.info.value
    t.ray.reread.click()
    assert "no cluster answered at address='nowhere:1'" in panel.state.problem
    assert panel.launch_button.disabled and "nowhere:1" in t.ray.info.value


def test_launch_submits_to_ray_and_the_status_line_follows_the_driver(
    runs_dir: Path, submitted: list[Any], no_connection: list[Any]
) -> None:
    panel = wb.Panel(
        tiny(runs_dir),
        cluster=wb.Ray(address=ADDRESS, max_failures=1),
        display=False,
        estimate=False,
    )
    panel.launch_button.click()
    assert panel.state.error == "", panel.state.error
    cfg, spec, task = submitted[0]
    run = submitted[1]
    assert panel.run is run and cfg.num_processes == 2 and task is None
    assert spec == wb.Ray(
        address=ADDRESS, max_failures=1, resources_per_worker={"CPU": 1.0}, use_gpu=False
    )
    until(lambda: "Ray driver" in panel.state.job, what="the driver's line")
    assert panel.state.job == f"Ray driver {run.job['actor']} alive, 2 rank(s) on 2 node(s)"
    assert f"as Ray driver {run.job['actor']} alive" in panel.status_box.value
    assert panel.controls["max_steps"].disabled, "the settings are frozen while the run goes"

    panel.stop_button.click()  # the graceful stop: the ranks are asked through the run directory
    assert run.dir.stop_requested() and panel.state.status == "stopping"
    run.end(Status.STOPPED)
    assert panel.wait(timeout=30, show=False).status == "stopped"
    assert panel.state.status == "stopped" and panel.state.job == ""
    assert not panel.launch_button.disabled
    assert no_connection == []


def test_a_run_that_ends_well_leaves_the_panel_ready(
    runs_dir: Path, submitted: list[Any], no_connection: list[Any]
) -> None:
    panel = wb.Panel(tiny(runs_dir), cluster=wb.Ray(), display=False, estimate=False)
    run = panel.launch()
    run.end(Status.COMPLETED)
    result = panel.wait(timeout=30, show=False)
    assert result.status == "completed" and panel.state.status == "completed"
    assert submitted[0][1].address in (None, os.environ.get("RAY_ADDRESS"), "auto")


def test_other_clusters_are_refused_by_name(runs_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"pass a workbench.Slurm or a workbench.Ray"):
        wb.Panel(tiny(runs_dir), cluster="ray://head", display=False, estimate=False)  # type: ignore[arg-type]
