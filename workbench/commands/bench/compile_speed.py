"""`workbench bench compile`: eager against torch.compile, side by side in one run, per layout.

Per layout (ddp, zero3, tp, pp over the config's ranks; one: a single process on every core): an
eager run, then the same run compiled twice with the inductor cache emptied before the first
('cold': every kernel generated) and kept for the second ('warm': a relaunch). Reported: the median
step time after warm-up of eager and of the warm compiled run and their ratio, the step's matmul
floor (compile_ceiling.py), the first step of each compiled run (compiling, cold and warm), graphs
and graph breaks, and the largest relative difference of the logged losses from eager's. Runs go
eager, cold, warm in that order, each layout in turn.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workbench.commands.bench.compile_ceiling import Floor, matmul_floor
from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.launcher.launch import launch
from workbench.rundir import TIMINGS
from workbench.utils.files import read_json

WARMUP_STEPS = 5
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"parallelism": "ddp"},
    "zero3": {"parallelism": "zero3"},
    "tp": {"parallelism": "zero3", "tp": 2},
    # 1F1B: micro-batches >= pp
    "pp": {"parallelism": "ddp", "pp": 2, "pp_schedule": "1f1b", "grad_accum_steps": 2},
    # The first row: one process on every core (spawned: a forked rank keeps one OpenMP
    # thread), micro-batch 16.
    "one": {"num_processes": 1, "micro_batch_size": 16, "start_method": "spawn"},
}
COMPILE_BENCH = RunConfig(
    task="char-gpt",
    num_processes=2,
    micro_batch_size=8,
    max_steps=20,
    lr=1e-3,
    log_every=1,
    eval_batches=1,
    compile="blocks",
    task_options={"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128},
)
"""The issue's model: char-gpt 4 blocks x 256 wide, context 128, 20 steps logged every step
(fp32)."""


@dataclass
class CompileRow:
    layout: str
    eager_ms: float
    compiled_ms: float
    speedup: float
    first_step_cold_s: float
    first_step_warm_s: float
    eager_first_step_s: float
    graphs: int
    graph_breaks: int
    max_loss_rel_diff: float
    matmul_floor_ms: float
    """The step's matmul FLOPs on one rank at the device's best rate (compile_ceiling.py)."""
    ranks: int
    threads: int
    """CPU threads per rank (torch's, as the eager run's rank 0 reported them)."""

    @property
    def ceiling(self) -> float:
        """The most any compiler could speed this step up: eager's step over its matmul floor."""
        return self.eager_ms / self.matmul_floor_ms


@dataclass
class CompileReport:
    rows: list[CompileRow]
    config: dict[str, Any]
    matmul_rate: str = ""
    """Where the floor's rate came from, and the rate."""

    def table(self) -> str:
        cfg = self.config
        head = (
            f"compile={cfg['compile']} ({cfg['compile_backend']}) against eager: {cfg['task']} "
            f"{cfg['task_options']}, {cfg['num_processes']} ranks, micro-batch "
            f"{cfg['micro_batch_size']} (but where the layout says), {cfg['max_steps']} steps, "
            f"{cfg['precision']}"
        )
        lines = [
            head,
            "| layout | ranks x threads | eager ms/step | compiled ms/step | speed-up | "
            "matmul floor ms/step (ceiling) | first step: eager / compiling cold / warm (s) | "
            "graphs, breaks | losses: max rel diff |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r.layout} | {r.ranks} x {r.threads} | {r.eager_ms:.0f} | {r.compiled_ms:.0f} | "
            f"{r.speedup:.2f}x | {r.matmul_floor_ms:.0f} ({r.ceiling:.2f}x) | "
            f"{r.eager_first_step_s:.1f} / {r.first_step_cold_s:.1f} / {r.first_step_warm_s:.1f} | "
            f"{r.graphs}, {r.graph_breaks} | {r.max_loss_rel_diff:.1e} |"
            for r in self.rows
        ]
        lines.append(
            f"matmul floor: the step's matmul FLOPs per rank at {self.matmul_rate}; the ceiling is "
            "eager over it, the most any compiler could give"
        )
        return "\n".join(lines)


def _step_times(run_dir: Path) -> tuple[float, float]:
    """(first step s, median ms of the steps after warm-up) from the run's timings."""
    times = (read_json(run_dir / TIMINGS) or {}).get("step_time_s") or [0.0]
    return float(times[0]), 1e3 * statistics.median(times[WARMUP_STEPS:] or times)


def _losses(metrics: list[dict[str, Any]]) -> list[float]:
    return [m["loss"] for m in metrics if "loss" in m]


def compile_bench(
    cfg: RunConfig = COMPILE_BENCH,
    layouts: tuple[str, ...] = tuple(LAYOUTS),
    *,
    json_path: Path | None = None,
) -> CompileReport:
    """Each layout eager, compiled cold and compiled warm, in this process's ranks (forked)."""
    rows: list[CompileRow] = []
    floors: dict[int, Floor] = {}
    """By threads per rank: the model is the same in every layout."""
    with (
        tempfile.TemporaryDirectory(prefix="wb-bench-compile-") as tmp,
        _environment_kept("WORKBENCH_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"),
    ):
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        for layout in layouts:
            if layout not in LAYOUTS:
                raise ValueError(f"layout {layout!r}: choose from {', '.join(LAYOUTS)}")
            rows.append(_layout_row(cfg, layout, Path(tmp), floors))
    rates = dict.fromkeys(f"{f.rate / 1e9:.0f} GFLOP/s ({f.rate_source})" for f in floors.values())
    result = CompileReport(rows=rows, config=cfg.to_dict(), matmul_rate="; ".join(rates))
    if json_path is not None:
        write_result(json_path, {**asdict(result), "ceilings": [r.ceiling for r in rows]})
    return result


@contextlib.contextmanager
def _environment_kept(*keys: str) -> Iterator[None]:
    """The environment variables `keys` as they were before, once the block ends."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _layout_row(cfg: RunConfig, layout: str, tmp: Path, floors: dict[int, Floor]) -> CompileRow:
    """`layout` eager, then compiled with an empty inductor cache (cold) and with it kept (warm);
    times the matmul floor into `floors` for a thread count not seen yet."""
    base = cfg.replace(runs_dir=str(tmp / "runs"), **LAYOUTS[layout])
    cache = tmp / f"cache-{layout}"
    os.environ["WORKBENCH_CACHE_DIR"] = str(cache)
    shutil.rmtree(cache, ignore_errors=True)
    eager = launch(base.replace(compile="off", run_name=f"{layout}-eager"))
    threads = int(eager.summary["ranks"][0]["torch_threads"])
    # Timed between runs, while no rank runs, with the threads the layout's ranks had.
    if threads not in floors:
        floors[threads] = matmul_floor(base, threads)
    cold = launch(base.replace(run_name=f"{layout}-cold"))
    warm = launch(base.replace(run_name=f"{layout}-warm"))
    report = warm.summary.get("compile") or {}
    diffs = [
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(_losses(warm.metrics), _losses(eager.metrics), strict=True)
    ]
    (eager_first, eager_ms), (warm_first, compiled_ms) = (
        _step_times(eager.run_dir),
        _step_times(warm.run_dir),
    )
    return CompileRow(
        layout=layout,
        eager_ms=eager_ms,
        compiled_ms=compiled_ms,
        speedup=eager_ms / compiled_ms,
        first_step_cold_s=_step_times(cold.run_dir)[0],
        first_step_warm_s=warm_first,
        eager_first_step_s=eager_first,
        graphs=int(report.get("graphs", 0)),
        graph_breaks=sum((report.get("graph_breaks") or {}).values()),
        max_loss_rel_diff=max(diffs, default=0.0),
        matmul_floor_ms=floors[threads].step_ms(
            eager.summary["global_batch_size"], base.num_processes
        ),
        ranks=base.num_processes,
        threads=threads,
    )
