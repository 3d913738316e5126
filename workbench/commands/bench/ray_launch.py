"""`workbench bench launch --cluster ray`: how long a run on Ray takes from the call to its first
logged step, beside the same run launched on this machine, interleaved.

Both sides start 2 digits ranks in fresh interpreters: locally with start_method='subprocess' (what
`workbench train` does from the shell; a fork would copy this process's Ray connection, whose gRPC
threads don't survive it), on Ray as Ray Train workers placed on a 2-node cluster (LocalRayCluster:
a head on 127.0.0.1 and a node on 127.0.0.2, one CPU each, brought up for the bench and stopped
after it) or on the cluster at --address. Each launch is timed from the call to its first metrics
row (what a user waits for before the run shows progress), and to its end. One unmeasured pair
first (the cluster's first worker group, the first imports), reported apart as the first launch;
then `repeats` pairs, which side goes first alternating.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.commands.bench.results import write_result
from workbench.config import RunConfig

log = logging.getLogger("workbench")

RAY_LAUNCH_BENCH = RunConfig(
    task="digits",
    num_processes=2,
    device="cpu",
    max_steps=5,
    log_every=1,
    seed=0,
    micro_batch_size=64,
    trackers=[],
    monitor_interval_s=0.0,
    start_method="subprocess",
)
"""A 5-step digits run on 2 CPU ranks, logging every step: what starting costs, not training."""
FIRST_STEP_S = 600.0
"""How long one launch may take to log its first step before the bench gives up on it (a loaded
2-core machine starts a Ray worker group in ~20 s)."""
POLL_S = 0.05
"""How often the bench looks for a run's first metrics row."""


@dataclass
class RayLaunchReport:
    """Seconds from the call to the first logged step (and to the run's end) per launch, each
    side."""

    steps: int = 0
    """Steps of each run."""
    address: str = ""
    """The Ray cluster's address ('a local 2-node cluster' when the bench brought it up)."""
    local_first_step_s: list[float] = field(default_factory=list)
    ray_first_step_s: list[float] = field(default_factory=list)
    local_end_s: list[float] = field(default_factory=list)
    ray_end_s: list[float] = field(default_factory=list)
    ray_submit_s: list[float] = field(default_factory=list)
    """Until wb.start returned on Ray: the checks, the connection, the driver actor up."""
    ray_nodes: list[int] = field(default_factory=list)
    """Nodes the Ray side's ranks ran on, per launch."""
    first_local_first_step_s: float | None = None
    """The unmeasured first pair: the first launch each side makes (imports, the cluster's first
    worker processes)."""
    first_ray_first_step_s: float | None = None

    @property
    def ratio(self) -> float:
        """Ray's median time to the first step over the local one's."""
        return statistics.median(self.ray_first_step_s) / statistics.median(self.local_first_step_s)

    @property
    def passed(self) -> bool:
        """No time budget: the bench fails only when a Ray run didn't spread over 2 nodes (a
        measurement of something else)."""
        return bool(self.ray_nodes) and all(n >= 2 for n in self.ray_nodes)

    def table(self) -> str:
        lf, rf = (
            statistics.median(self.local_first_step_s),
            statistics.median(self.ray_first_step_s),
        )
        le, re_ = statistics.median(self.local_end_s), statistics.median(self.ray_end_s)
        return "\n".join(
            [
                f"workbench bench launch --cluster ray: a {self.steps}-step 2-rank digits run, "
                f"{len(self.ray_first_step_s)} interleaved pairs; Ray at {self.address}",
                "                      first step (median)   end (median)",
                f"  this machine        {lf:8.2f} s            {le:8.2f} s   "
                f"({_listed(self.local_first_step_s)})",
                f"  Ray, {min(self.ray_nodes, default=0)}+ nodes       {rf:8.2f} s            "
                f"{re_:8.2f} s   ({_listed(self.ray_first_step_s)}; wb.start returned after "
                f"{_listed(self.ray_submit_s)})",
                f"  ratio Ray / local   {self.ratio:8.2f}",
                "  first launch of each (not in the medians): local "
                f"{_opt(self.first_local_first_step_s)} s, "
                f"Ray {_opt(self.first_ray_first_step_s)} s",
                "  verdict: "
                + ("PASS" if self.passed else "FAIL: the Ray side's ranks didn't span 2 nodes"),
            ]
        )


def _listed(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _first_row(run: Any, started: float) -> float:
    """Seconds from `started` to the run's first metrics row; RuntimeError when the run ends
    without one, TimeoutError past FIRST_STEP_S."""
    deadline = started + FIRST_STEP_S
    metrics = run.dir.metrics_path
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.stat().st_size > 0:
            return time.monotonic() - started
        if run.done():
            run.wait(timeout=60)  # raises how it failed
            raise RuntimeError(f"{run.run_dir}: ended without logging a step")
        time.sleep(POLL_S)
    run.kill()
    raise TimeoutError(f"{run.run_dir}: no step logged after {FIRST_STEP_S:.0f} s")


def _timed(cfg: RunConfig, cluster: Any = None) -> dict[str, Any]:
    """One launch: seconds to wb.start's return, to the first logged step and to the end."""
    from workbench.launcher.launch import start

    started = time.monotonic()
    run = start(cfg, cluster=cluster, progress=False)
    returned = time.monotonic() - started
    first = _first_row(run, started)
    run.wait(timeout=FIRST_STEP_S)
    timed = {"submit": returned, "first": first, "end": time.monotonic() - started}
    if cluster is not None:
        timed["nodes"] = len({w.get("node_id") for w in run.workers()})
    return timed


@contextmanager
def _cluster(address: str | None) -> Iterator[str]:
    """The Ray cluster's address: `address`, or a local 2-node cluster brought up for the block
    (and every process of it stopped after, whatever happened)."""
    if address is not None:
        yield address
        return
    from workbench.cluster.raytrain.local import LocalRayCluster, available

    why = available()
    if why is not None:
        raise RuntimeError(f"bench launch --cluster ray: {why}")
    local = LocalRayCluster(nodes=2, cpus=1)
    try:
        local.start()
        with local.in_environment():  # the driver and this process talk to it with its token
            yield local.address
    finally:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()  # this process's connection first: it would retry a stopped head
        local.stop()


def ray_launch(
    repeats: int = 2,
    cfg: RunConfig = RAY_LAUNCH_BENCH,
    *,
    address: str | None = None,
    json_path: Path | None = None,
) -> RayLaunchReport:
    """One unmeasured pair, then `repeats` pairs of the same run launched here and on Ray, which
    side goes first alternating."""
    from workbench.cluster.raytrain.spec import Ray

    if repeats < 1:
        raise ValueError(f"repeats={repeats}: at least 1 pair")
    report = RayLaunchReport(steps=cfg.max_steps)
    with _cluster(address) as where, tempfile.TemporaryDirectory(prefix="wb-bench-ray-") as tmp:
        report.address = where if address is not None else f"a local 2-node cluster ({where})"
        # every worker one CPU: with the cluster's one per node, Ray places one rank per node
        ray = Ray(address=where, resources_per_worker={"CPU": 1}, max_failures=0)
        runs = cfg.replace(runs_dir=str(Path(tmp) / "runs"))
        for i in range(repeats + 1):
            order = ("local", "ray") if i % 2 == 0 else ("ray", "local")
            for side in order:
                one = runs.replace(run_name=f"{side}-{i}")
                timed = _timed(one, ray if side == "ray" else None)
                log.info("bench launch --cluster ray: %s %d: %s", side, i, timed)
                if i == 0:  # the first of each, apart
                    if side == "ray":
                        report.first_ray_first_step_s = timed["first"]
                    else:
                        report.first_local_first_step_s = timed["first"]
                elif side == "ray":
                    report.ray_first_step_s.append(timed["first"])
                    report.ray_end_s.append(timed["end"])
                    report.ray_submit_s.append(timed["submit"])
                    report.ray_nodes.append(timed["nodes"])
                else:
                    report.local_first_step_s.append(timed["first"])
                    report.local_end_s.append(timed["end"])
    if json_path is not None:
        write_result(
            json_path,
            {
                **asdict(report),
                "ratio": report.ratio,
                "passed": report.passed,
                "task": cfg.task,
                "num_processes": cfg.num_processes,
            },
        )
    return report
