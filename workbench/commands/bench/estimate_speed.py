"""`workbench bench estimate-speed`: how long the first estimate takes, how long a change that
retraces the step takes, and how long a change that keeps the traced step takes to answer from the
trace already made.

Each first estimate runs in a fresh interpreter, as a notebook's first would: once through
`estimate()` (the library call, after `import workbench`) and once through the panel's estimate box
(request to result, its debounce included). The same interpreter then makes the changes a user makes
in the panel that retrace the step, one after the other (RETRACES: tp=2, then 2 nodes, then fp16; a
task without a tensor-parallel plan takes zero3 for tp=2), and the changes that don't change the
traced step (another accelerator, more steps, another price, twice the GPUs of a replicated run),
counting the traces they made. Wall time is what a user waits for; CPU time (this process and its
trace children) shows how much of it was the machine being busy with something else.

Every row is measured twice: "quiet" (nothing else of ours running) and "loaded", beside a
concurrent `workbench demo` loop (2 DDP ranks of digits on CPU, restarted as each ends), the state
of a box where a run trains while its next plan is estimated. Budgets: quiet, 3 s for a first
estimate or a retrace; loaded, LOADED_FACTOR (3x) that. Why 3x: on 2 cores the demo's two ranks
keep both busy, so the estimate's one busy process (the trace child) gets a fair share of 2/3 of a
core, 1.5x its quiet time; the ranks' gloo collectives and data loading add wake-ups that preempt it
further, and the kernel's own threads compete too; 3x is that share with margin. Changes answered
from memory: 0.3 s quiet, 1 s loaded, and no new trace either way. The load average before and
after each condition is in the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.commands.bench.results import write_result

MODELS: dict[str, dict[str, Any]] = {
    "digits": {"task": "digits", "micro_batch_size": 32},
    "gpt2-small": {
        "task": "char-gpt",
        "micro_batch_size": 8,
        "task_options": {"preset": "gpt2-small"},
    },
}
"""The models timed: digits' MLP, and char-gpt at GPT-2 small's size (12 layers x 768, 1024 tokens,
85M)."""
FIRST_BUDGET_S = {"digits": 3.0, "gpt2-small": 3.0}
"""Quiet: the first estimate in a fresh interpreter, and each retrace."""
CACHED_BUDGET_S = 0.3
LOADED_FACTOR = 3.0
"""Loaded budgets are this many times the quiet ones (the module docstring says why)."""
LOADED_CACHED_BUDGET_S = 1.0
CONDITIONS = ("quiet", "loaded")
DEMO_WARMUP_S = 8.0
"""Seconds the demo loop runs before the loaded rows: its ranks are training by then."""
CHANGES = ("another accelerator", "10x the steps", "another price", "2x the GPUs")
RETRACES = ("tp=2", "2 nodes", "fp16")
"""Changes that retrace the step, applied one after the other as in the panel."""


@dataclass
class SpeedRow:
    model: str
    target: str
    via: str
    """'estimate()' (the library call) or 'panel box' (request to result, debounce included)."""
    first_s: list[float] = field(default_factory=list)
    first_cpu_s: list[float] = field(default_factory=list)
    import_s: list[float] = field(default_factory=list)
    cached_s: dict[str, list[float]] = field(default_factory=dict)
    cached_traces: int = 0
    """New traces the cached changes made (0: every one was answered from memory)."""
    retrace_s: dict[str, list[float]] = field(default_factory=dict)
    """Seconds to answer each change of RETRACES (each a new trace)."""
    condition: str = "quiet"
    """'quiet', or 'loaded' (beside a `workbench demo` loop)."""

    @property
    def first(self) -> float:
        return statistics.median(self.first_s)

    @property
    def cached(self) -> float:
        return max(statistics.median(v) for v in self.cached_s.values())

    @property
    def retrace(self) -> float:
        """The slowest retrace's median (0 when none was timed)."""
        return max((statistics.median(v) for v in self.retrace_s.values()), default=0.0)

    @property
    def budget_s(self) -> float:
        """The first estimate's and each retrace's budget under this row's condition."""
        quiet = FIRST_BUDGET_S[self.model]
        return quiet * LOADED_FACTOR if self.condition == "loaded" else quiet

    @property
    def cached_budget_s(self) -> float:
        return LOADED_CACHED_BUDGET_S if self.condition == "loaded" else CACHED_BUDGET_S

    @property
    def passed(self) -> bool:
        return (
            self.first <= self.budget_s
            and self.retrace <= self.budget_s
            and self.cached <= self.cached_budget_s
            and not self.cached_traces
        )


@dataclass
class SpeedReport:
    rows: list[SpeedRow]
    load: tuple[float, float] = (0.0, 0.0)
    """The 1-minute load average before and after: above the core count, wall time includes waiting
    for cores."""
    cores: int = 0
    loads: dict[str, list[float]] = field(default_factory=dict)
    """Per condition, the 1-minute load average before and after its rows were measured."""

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def table(self) -> str:
        runs = len(self.rows[0].first_s) if self.rows else 0
        lines = [
            (
                "workbench bench estimate-speed: first estimate in a fresh interpreter (median of "
                f"{runs}), changes that retrace, then changes answered from the trace in memory "
                f"(budget {CACHED_BUDGET_S} s each quiet, {LOADED_CACHED_BUDGET_S} s loaded)"
            ),
            (
                f"  {'model':11} {'target':18} {'via':11} {'load':7} {'import':>7} {'first':>7} "
                f"{'cpu':>7} {'retrace':>8} {'budget':>7} {'cached':>8} {'traces':>6}"
            ),
        ]
        for r in self.rows:
            imported = f"{statistics.median(r.import_s):.2f} s" if r.import_s else "-"
            lines.append(
                f"  {r.model:11} {r.target:18} {r.via:11} {r.condition:7} {imported:>7} "
                f"{r.first:5.2f} s {statistics.median(r.first_cpu_s):5.2f} s {r.retrace:6.2f} s "
                f"{r.budget_s:5.1f} s {r.cached:6.3f} s {r.cached_traces:>6}  "
                f"{'PASS' if r.passed else 'FAIL'}"
            )
            lines.append(
                "      "
                + ", ".join(
                    f"{what} {statistics.median(v):.2f} s"
                    for what, v in {**r.retrace_s, **r.cached_s}.items()
                )
            )
        for condition, (before, after) in self.loads.items():
            lines.append(f"  {condition}: load average {before:.1f} before, {after:.1f} after")
        lines.append(
            f"  load average {self.load[0]:.1f} before, {self.load[1]:.1f} after, on {self.cores} "
            "cores (cpu: this interpreter's and its trace children's CPU seconds; wall above it "
            "is waiting)"
        )
        return "\n".join(lines)


def estimate_speed(
    models: tuple[str, ...] = tuple(MODELS),
    gpu: str = "H100-SXM-80GB",
    gpus: int = 8,
    repeats: int = 3,
    json_path: Path | None = None,
    conditions: tuple[str, ...] = CONDITIONS,
) -> SpeedReport:
    """Time `repeats` fresh interpreters per model, way in and condition, alternating the ways so
    neither gets a warmer page cache."""
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"models={unknown}: choose from {', '.join(MODELS)}")
    odd = sorted(set(conditions) - set(CONDITIONS))
    if odd or not conditions:
        raise ValueError(f"conditions={list(conditions)}: choose from {', '.join(CONDITIONS)}")
    rows = {
        (m, via, c): SpeedRow(model=m, target=f"{gpus} x {gpu}", via=via, condition=c)
        for c in conditions
        for m in models
        for via in ("estimate()", "panel box")
    }
    loads: dict[str, list[float]] = {}
    before = os.getloadavg()[0]
    for condition in conditions:
        with _demo_loop() if condition == "loaded" else contextlib.nullcontext():
            start = os.getloadavg()[0]
            for i in range(repeats):
                for model in models:
                    vias = (
                        ("estimate()", "panel box") if i % 2 == 0 else ("panel box", "estimate()")
                    )
                    for via in vias:
                        _record(rows[(model, via, condition)], _run_child(model, via, gpu, gpus))
            loads[condition] = [start, os.getloadavg()[0]]
    report = SpeedReport(
        rows=list(rows.values()),
        load=(before, os.getloadavg()[0]),
        cores=os.cpu_count() or 0,
        loads=loads,
    )
    if json_path is not None:
        data = {
            "passed": report.passed,
            "load": report.load,
            "loads": report.loads,
            "cores": report.cores,
            "budgets": {
                "quiet_s": FIRST_BUDGET_S,
                "loaded_factor": LOADED_FACTOR,
                "cached_quiet_s": CACHED_BUDGET_S,
                "cached_loaded_s": LOADED_CACHED_BUDGET_S,
            },
            "rows": [
                {**asdict(r), "budget_s": r.budget_s, "passed": r.passed} for r in report.rows
            ],
        }
        write_result(json_path, data)
    return report


@contextlib.contextmanager
def _demo_loop() -> Iterator[None]:
    """A `workbench demo` restarted as each ends, in its own session and a scratch runs folder,
    for the loaded condition; its whole process group is ended after (each demo's ranks too)."""
    scratch = Path(tempfile.mkdtemp(prefix="wb-bench-demo-"))
    loop = (
        f"while true; do {shlex.quote(sys.executable)} -m workbench.cli demo --runs-dir "
        f"{shlex.quote(str(scratch / 'runs'))} >/dev/null 2>&1; done"
    )
    proc = subprocess.Popen(["bash", "-c", loop], cwd=scratch, start_new_session=True)
    try:
        time.sleep(DEMO_WARMUP_S)  # its ranks started: the cores are busy before the first row
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)


def _record(row: SpeedRow, result: dict[str, Any]) -> None:
    row.first_s.append(result["first_s"])
    for what, seconds in result.get("retrace_s", {}).items():
        row.retrace_s.setdefault(what, []).append(seconds)
    row.first_cpu_s.append(result["first_cpu_s"])
    if result.get("import_s") is not None:
        row.import_s.append(result["import_s"])
    for what, seconds in result["cached_s"].items():
        row.cached_s.setdefault(what, []).append(seconds)
    row.cached_traces += result["cached_traces"]


def _run_child(model: str, via: str, gpu: str, gpus: int) -> dict[str, Any]:
    import workbench

    root = str(Path(workbench.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    code = (
        "import time; started = time.perf_counter(); "
        "from workbench.commands.bench.estimate_speed import child; "
        f"child({model!r}, {via!r}, {gpu!r}, {gpus}, started)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"estimate-speed {model} via {via}: the child failed:\n{out.stderr[-3000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(model: str, via: str, gpu: str, gpus: int, started: float) -> None:
    """One fresh interpreter's measurements, printed as a JSON line (run by _run_child)."""
    import time

    from workbench.config import RunConfig
    from workbench.estimator.target import Target
    from workbench.estimator.trace.cache import stats
    from workbench.tasks import get_task

    imported = time.perf_counter() - started
    cfg = RunConfig(**MODELS[model], num_processes=gpus, parallelism="ddp", max_steps=100)
    task = get_task(cfg.task)
    ask = _via_box() if via == "panel box" else _via_library(task)
    cpu = _cpu_s()
    start = time.perf_counter()
    ask(cfg, Target(gpu=gpu, gpus_per_node=gpus))
    first, first_cpu = time.perf_counter() - start, _cpu_s() - cpu
    retraced = {}
    for what, (changed, target) in _retraces(cfg, task, gpu, gpus).items():
        start = time.perf_counter()
        ask(changed, target)
        retraced[what] = time.perf_counter() - start
    traces = stats()["traces"]
    cached = {}
    for what, (changed, target) in _changes(cfg, gpu, gpus).items():
        start = time.perf_counter()
        ask(changed, target)
        cached[what] = time.perf_counter() - start
    print(
        json.dumps(
            {
                "import_s": imported if via == "estimate()" else None,
                "first_s": first,
                "first_cpu_s": first_cpu,
                "retrace_s": retraced,
                "cached_s": cached,
                "cached_traces": stats()["traces"] - traces,
            }
        )
    )


def _retraces(cfg: Any, task: Any, gpu: str, gpus: int) -> dict[str, tuple[Any, Any]]:
    """RETRACES, each on top of the one before (as a user changes the panel): tp=2 (zero3 for a
    task without a tensor-parallel plan), then 2 nodes of that, then fp16."""
    import torch

    from workbench.estimator.target import Target
    from workbench.tasks.model_plans import ModelPlan

    with torch.device("meta"):
        model = task.build_model(cfg)
    tp = ModelPlan(task).tensor_parallel_plan(model, cfg) is not None
    split = cfg.replace(tp=2) if tp else cfg.replace(parallelism="zero3")
    two = split.replace(num_processes=2 * gpus)
    return {
        "tp=2": (split, Target(gpu=gpu, gpus_per_node=gpus)),
        "2 nodes": (two, Target(gpu=gpu, gpus_per_node=gpus, nodes=2)),
        "fp16": (two.replace(precision="fp16"), Target(gpu=gpu, gpus_per_node=gpus, nodes=2)),
    }


def _changes(cfg: Any, gpu: str, gpus: int) -> dict[str, tuple[Any, Any]]:
    """The changes that keep the traced step: each (config, Target)."""
    import tempfile

    from workbench.estimator.catalog import BUILTIN, load_catalog
    from workbench.estimator.target import Target
    from workbench.utils.files import read_yaml

    other = next(name for name in load_catalog() if name != gpu and "80GB" in name)
    data = read_yaml(BUILTIN)
    for entry in data["accelerators"]:
        if entry["name"] == gpu:
            entry["price_per_hour"] = (entry["price_per_hour"] or 1.0) * 0.5
    catalog = Path(tempfile.mkdtemp(prefix="wb-bench-")) / "prices.yaml"
    catalog.write_text(json.dumps(data))  # JSON is YAML
    return {
        "another accelerator": (cfg, Target(gpu=other, gpus_per_node=gpus)),
        "10x the steps": (
            cfg.replace(max_steps=cfg.max_steps * 10),
            Target(gpu=gpu, gpus_per_node=gpus),
        ),
        "another price": (cfg, Target(gpu=gpu, gpus_per_node=gpus, catalog=str(catalog))),
        "2x the GPUs": (
            cfg.replace(num_processes=2 * gpus),
            Target(gpu=gpu, gpus_per_node=gpus, nodes=2),
        ),
    }


def _via_library(task: Any) -> Any:
    from workbench.estimator import estimate

    def ask(cfg: Any, target: Any) -> None:
        estimate(
            cfg, target.gpu, target.gpus_per_node, target.nodes, task=task, catalog=target.catalog
        )

    return ask


def _via_box() -> Any:
    from workbench.notebook.panel.estimates import EstimateBox

    box = EstimateBox()

    def ask(cfg: Any, target: Any) -> None:
        box.request(cfg, None, target)
        box.wait(timeout=600)
        if box.state.result is None:
            raise RuntimeError(f"the estimate box answered no estimate: {box.state.message}")

    return ask


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the trace children)."""
    import resource

    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
