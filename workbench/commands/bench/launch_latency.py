"""`workbench bench launch`: how long `wb.launch` takes for a 1-step run, against
`accelerate.notebook_launcher` running the equivalent hand-written function, side by side in one
process.

Both start 2 forked CPU ranks from this process, build the same model and data, train one step and
end; the hand-written side is bench/hand_loops.py's ddp loop (Accelerate's own prepare, no run
directory). Pairs run back to back, which goes first alternating; the verdict is on the ratio of the
medians. `wb.launch` does more (checks, a run directory, metrics, a summary, the weights, a lock),
and what it costs is the latency a notebook user feels between pressing Shift-Enter and having a
RunResult back.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.commands.bench.hand_loops import hand_loop
from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.launcher.launch import launch
from workbench.launcher.processes import free_port
from workbench.tasks import get_task

LAUNCH_BENCH = RunConfig(
    task="digits",
    num_processes=2,
    device="cpu",
    max_steps=1,
    log_every=1,
    seed=0,
    micro_batch_size=64,
    trackers=[],
    monitor_interval_s=0.0,
)
"""A 1-step digits run on 2 ranks: what a launch costs, not what training costs."""
BUDGET = 1.10
"""wb.launch may take at most 10% longer than notebook_launcher (issue 23)."""


@dataclass
class LaunchReport:
    workbench_s: list[float] = field(default_factory=list)
    notebook_launcher_s: list[float] = field(default_factory=list)
    cold_workbench_s: list[float] = field(default_factory=list)
    """The first launch in a fresh interpreter (imports included), which a notebook's first cell
    pays."""
    cold_notebook_launcher_s: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.workbench_s) / statistics.median(self.notebook_launcher_s)

    @property
    def passed(self) -> bool:
        return self.ratio <= BUDGET

    def table(self) -> str:
        wb, nl = statistics.median(self.workbench_s), statistics.median(self.notebook_launcher_s)
        return "\n".join(
            [
                f"workbench bench launch: a 1-step 2-rank digits run, {len(self.workbench_s)} "
                "interleaved pairs",
                f"  accelerate.notebook_launcher  {nl:6.3f} s (median; "
                f"{_listed(self.notebook_launcher_s)})",
                f"  wb.launch                     {wb:6.3f} s (median; "
                f"{_listed(self.workbench_s)})",
                f"  ratio                         {self.ratio:6.3f} (budget {BUDGET:.2f}): "
                f"{'PASS' if self.passed else 'FAIL'}",
                *(
                    [
                        "  first launch in a fresh interpreter: notebook_launcher "
                        f"{_listed(self.cold_notebook_launcher_s)} s, wb.launch "
                        f"{_listed(self.cold_workbench_s)} s (imports included)"
                    ]
                    if self.cold_workbench_s
                    else []
                ),
            ]
        )


def _listed(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def _notebook_launcher(cfg: RunConfig, out_dir: str) -> float:
    from accelerate import notebook_launcher

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # accelerate announces its processes on stdout
        notebook_launcher(
            hand_loop,
            args=(cfg, get_task(cfg.task), out_dir, "ddp"),
            num_processes=cfg.num_processes,
            use_port=str(free_port()),
        )
    return time.perf_counter() - start


def _workbench(cfg: RunConfig) -> float:
    start = time.perf_counter()
    launch(cfg)
    return time.perf_counter() - start


_COLD = """
import os, sys, time
t = time.perf_counter()
os.makedirs(sys.argv[2], exist_ok=True)
from workbench.commands.bench import launch_latency as b
cfg = b.LAUNCH_BENCH.replace(runs_dir=sys.argv[2], run_name="cold")
b._workbench(cfg) if sys.argv[1] == "wb" else b._notebook_launcher(cfg, sys.argv[2])
print(time.perf_counter() - t)
"""


def _cold(side: str, folder: str) -> float:
    """One launch in a fresh interpreter, timed from its first import to its end."""
    done = subprocess.run(
        [sys.executable, "-c", _COLD, side, folder],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(done.stdout.strip().splitlines()[-1])


def launch_latency(
    pairs: int = 6,
    cfg: RunConfig = LAUNCH_BENCH,
    *,
    cold_pairs: int = 1,
    json_path: Path | None = None,
) -> LaunchReport:
    """`pairs` back-to-back launches of each, which goes first alternating (after one unmeasured of
    each); then `cold_pairs` first launches in fresh interpreters."""
    report = LaunchReport()
    with tempfile.TemporaryDirectory(prefix="wb-bench-launch-") as tmp:
        runs = cfg.replace(runs_dir=str(Path(tmp) / "runs"))
        # first-time imports and caches, for both sides
        _workbench(runs.replace(run_name="warm-up"))
        _notebook_launcher(runs, tmp)
        for i in range(pairs):
            order = ("wb", "nl") if i % 2 == 0 else ("nl", "wb")
            for side in order:
                if side == "wb":
                    report.workbench_s.append(_workbench(runs.replace(run_name=f"run-{i}")))
                else:
                    report.notebook_launcher_s.append(_notebook_launcher(runs, tmp))
        for i in range(cold_pairs):
            report.cold_workbench_s.append(_cold("wb", str(Path(tmp) / f"cold-wb-{i}")))
            report.cold_notebook_launcher_s.append(_cold("nl", str(Path(tmp) / f"cold-nl-{i}")))
    if json_path is not None:
        write_result(json_path, {**asdict(report), "ratio": report.ratio, "passed": report.passed})
    return report
