"""`workbench bench estimate-speed`: how long the first estimate takes, and how long a change that
keeps the traced step takes to answer from the trace already made (issue 21, item 5).

Each first estimate runs in a fresh interpreter, as a notebook's first would: once through
`estimate()` (the library call, after `import workbench`) and once through the panel's estimate box
(request to result, its debounce included). The same interpreter then asks for changes that don't
change the traced step (another accelerator, more steps, another price, twice the GPUs of a
replicated run) and counts the traces they made. Wall time is what a user waits for; CPU time (this
process and its trace children) shows how much of it was the machine being busy with something else.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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
CACHED_BUDGET_S = 0.3
CHANGES = ("another accelerator", "10x the steps", "another price", "2x the GPUs")


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

    @property
    def first(self) -> float:
        return statistics.median(self.first_s)

    @property
    def cached(self) -> float:
        return max(statistics.median(v) for v in self.cached_s.values())

    @property
    def passed(self) -> bool:
        return (
            self.first <= FIRST_BUDGET_S[self.model]
            and self.cached <= CACHED_BUDGET_S
            and not self.cached_traces
        )


@dataclass
class SpeedReport:
    rows: list[SpeedRow]
    load: tuple[float, float] = (0.0, 0.0)
    """The 1-minute load average before and after: above the core count, wall time includes waiting
    for cores."""
    cores: int = 0

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def table(self) -> str:
        runs = len(self.rows[0].first_s) if self.rows else 0
        lines = [
            (
                "workbench bench estimate-speed: first estimate in a fresh interpreter (median of "
                f"{runs}), then changes answered from the trace in memory (budget "
                f"{CACHED_BUDGET_S} s each)"
            ),
            (
                f"  {'model':11} {'target':22} {'via':11} {'import':>7} {'first':>7} {'cpu':>7} "
                f"{'budget':>7} {'slowest change':>15} {'traces':>7}"
            ),
        ]
        for r in self.rows:
            imported = f"{statistics.median(r.import_s):.2f} s" if r.import_s else "-"
            lines.append(
                f"  {r.model:11} {r.target:22} {r.via:11} {imported:>7} {r.first:5.2f} s "
                f"{statistics.median(r.first_cpu_s):5.2f} s {FIRST_BUDGET_S[r.model]:5.1f} s "
                f"{r.cached:13.3f} s {r.cached_traces:>7}  {'PASS' if r.passed else 'FAIL'}"
            )
            lines.append(
                "      "
                + ", ".join(
                    f"{what} {statistics.median(v):.3f} s" for what, v in r.cached_s.items()
                )
            )
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
) -> SpeedReport:
    """Time `repeats` fresh interpreters per model and way in, alternating the ways so neither gets
    a warmer page cache."""
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"models={unknown}: choose from {', '.join(MODELS)}")
    rows = {
        (m, via): SpeedRow(model=m, target=f"{gpus} x {gpu}", via=via)
        for m in models
        for via in ("estimate()", "panel box")
    }
    before = os.getloadavg()[0]
    for i in range(repeats):
        for model in models:
            for via in ("estimate()", "panel box") if i % 2 == 0 else ("panel box", "estimate()"):
                _record(rows[(model, via)], _run_child(model, via, gpu, gpus))
    report = SpeedReport(
        rows=list(rows.values()), load=(before, os.getloadavg()[0]), cores=os.cpu_count() or 0
    )
    if json_path is not None:
        data = {
            "passed": report.passed,
            "load": report.load,
            "cores": report.cores,
            "rows": [{**asdict(r), "passed": r.passed} for r in report.rows],
        }
        write_result(json_path, data)
    return report


def _record(row: SpeedRow, result: dict[str, Any]) -> None:
    row.first_s.append(result["first_s"])
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
                "cached_s": cached,
                "cached_traces": stats()["traces"] - traces,
            }
        )
    )


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
