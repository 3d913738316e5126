"""`workbench bench estimate`: the estimate against the measured peak per rank, for every layout the
trainer runs (data parallel, tensor parallel, pipeline, FSDP x TP, pipelines with replicas) and two
model shapes, side by side in one run; on CPU also a transformers model (hf-causal-lm, a tiny
Llama), trained fully and with LoRA under zero3.

Measured is PyTorch's memory tracker on the real run on CPU (track_memory),
torch.cuda.max_memory_allocated on a GPU. The estimate compared is its tensor bytes (the runtime
overhead it adds for the CUDA context or the interpreter is not a tensor and is left out of both
sides). A pipeline's memory can't be tracked on CPU (the trainer refuses track_memory with pp > 1);
there only the model state by rank is compared, and tests/test_estimate_layouts.py checks each
stage's peak against the real schedule under the same tracker. A layout the shape's task can't run
(digits has no tensor-parallel plan or pipeline stages) gets a row saying so.

Then, on any machine, the estimate against each published training run the accelerator catalog
cites (estimate_cited.py): the error of the time model's per-accelerator efficiency, with no GPU of
that class at hand.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.commands.bench.estimate_cited import CitedRow, as_dict, cited_rows, cited_table
from workbench.commands.bench.results import write_result
from workbench.config import RunConfig
from workbench.launcher.launch import launch
from workbench.utils.hardware import detect, resolve_device
from workbench.utils.units import fmt_bytes

SHAPES = {
    "digits MLP (hidden 512)": RunConfig(
        task="digits",
        num_processes=2,
        micro_batch_size=64,
        max_steps=4,
        log_every=2,
        task_options={"hidden": 512},
    ),
    "char-gpt tiny (2 x 64, ctx 64)": RunConfig(
        task="char-gpt",
        num_processes=2,
        micro_batch_size=16,
        max_steps=4,
        log_every=2,
        eval_batches=1,
        task_options={"preset": "tiny"},
    ),
}
GPU_SHAPES = {
    "digits MLP (hidden 512)": SHAPES["digits MLP (hidden 512)"],
    "char-gpt small (6 x 384, ctx 256) bf16": RunConfig(
        task="char-gpt",
        num_processes=2,
        micro_batch_size=32,
        max_steps=4,
        log_every=2,
        eval_batches=1,
        precision="bf16",
        task_options={"preset": "small"},
    ),
    "GPT-2 small (12 x 768, ctx 1024) bf16": RunConfig(
        task="char-gpt",
        num_processes=2,
        micro_batch_size=8,
        max_steps=4,
        log_every=2,
        eval_batches=1,
        precision="bf16",
        task_options={"preset": "gpt2-small"},
    ),
}
"""On a GPU the tiny shapes only measure the host: these are the sizes a GPU is bought for."""
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"parallelism": "ddp"},
    "zero1": {"parallelism": "zero1"},
    "zero2": {"parallelism": "zero2"},
    "zero3": {"parallelism": "zero3"},
    "tp 2": {"tp": 2},
    "pp 2": {"pp": 2, "grad_accum_steps": 4},
    "zero3 x tp 2": {"parallelism": "zero3", "tp": 2, "num_processes": 4, "oversubscribe": True},
    "pp 2 x ddp 2": {"pp": 2, "grad_accum_steps": 2, "num_processes": 4, "oversubscribe": True},
}
"""Each layout as the RunConfig fields it changes from the shape's config."""
HF_SHAPE = "hf Llama tiny (2 x 64, seq 64)"
_HF_OPTIONS: dict[str, Any] = {
    "model": "llama",
    "model_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
    "dataset": "tinyshakespeare",
    "tokenizer": "train:512",
    "seq_len": 64,
}
HF_ROWS: dict[str, RunConfig] = {
    layout: RunConfig(
        task="hf-causal-lm",
        num_processes=2,
        micro_batch_size=8,
        max_steps=4,
        log_every=2,
        eval_every=0,
        parallelism="zero3",
        task_options={**_HF_OPTIONS, "lora": lora},
    )
    for layout, lora in (
        ("zero3", None),
        ("zero3 + LoRA r8", {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
    )
}
"""A transformers model (the built-in hf-causal-lm task, a Llama at random init from its config,
a BPE tokenizer trained on the corpus), fully and with LoRA's frozen base, on CPU only: its own
rows, not crossed with LAYOUTS (hf_models' tests cover the other layouts' model state)."""
TIMED_STEPS = 60
"""Steps each real run takes: six logged windows, the first left out as warm-up."""
_MEASURED: set[tuple[str, int]] = set()
"""(bench folder, ranks) whose machine profile this bench measured anew."""


@dataclass
class EstimateRow:
    shape: str
    layout: str
    measured_bytes: int | None
    """The largest rank's measured peak; None where it can't be measured (a pipeline on CPU) or
    run."""
    estimated_bytes: int | None
    model_state_exact: bool | None
    note: str = ""
    """Why a figure is missing: the task can't run the layout, or the peak can't be measured."""
    measured_step_s: float | None = None
    """The real run's step time: the median of its logged windows after the first (warm-up), as
    learning reads it."""
    estimated_step_s: float | None = None
    """The estimate's step time from the model alone (nothing learnt from runs)."""
    learnt_step_s: float | None = None
    """The estimate's step time once this row's run has completed, learnt from it (and, on a GPU,
    from the other rows' runs), as a user's next estimate of the same run would be."""
    repeat_step_s: float | None = None
    """A second real run of the row, after the estimate learnt from the first: what the learnt
    estimate is for."""
    run_name: str | None = None
    """The real run's directory name."""
    busy_cores: float | None = None
    """Other processes' CPU use during the real run, in cores: what the measured time shared the
    machine with."""

    @property
    def error(self) -> float | None:
        if self.measured_bytes is None or self.estimated_bytes is None:
            return None
        return self.estimated_bytes / self.measured_bytes - 1

    @property
    def step_error(self) -> float | None:
        return _ratio(self.estimated_step_s, self.measured_step_s)

    @property
    def learnt_error(self) -> float | None:
        return _ratio(self.learnt_step_s, self.repeat_step_s)


def _ratio(estimated: float | None, measured: float | None) -> float | None:
    return None if estimated is None or not measured else estimated / measured - 1


@dataclass
class EstimateReport:
    device: str
    rows: list[EstimateRow]
    cited: list[CitedRow] = field(default_factory=list)
    """The published runs the catalog cites, each against its estimate (estimate_cited.py)."""

    def table(self) -> str:
        lines = self._measured_lines() if self.rows else []
        if self.cited:
            lines += ([""] if lines else []) + cited_table(self.cited)
        return "\n".join(lines)

    def _measured_lines(self) -> list[str]:
        lines = [
            (
                f"workbench bench estimate on {self.device}: peak per rank, estimated (tensors) "
                "against measured (max over ranks); step time measured (median after warm-up) "
                "against the model alone; then a second run of the row against the estimate "
                "learnt from the first; busy: other processes' cores during the first run"
            ),
            f"  {'shape':32} {'layout':13} {'measured':>10} {'estimated':>10} {'error':>7} "
            f"{'model state':>12} {'step':>9} {'estimated':>9} {'error':>7} {'again':>9} "
            f"{'learnt':>9} {'error':>7} {'busy':>5}",
        ]
        for r in self.rows:
            measured = fmt_bytes(r.measured_bytes) if r.measured_bytes is not None else "-"
            estimated = fmt_bytes(r.estimated_bytes) if r.estimated_bytes is not None else "-"
            error = f"{r.error:+7.1%}" if r.error is not None else f"{'-':>7}"
            state = (
                "-"
                if r.model_state_exact is None
                else "exact"
                if r.model_state_exact
                else "DIFFERS"
            )
            times = (
                f"{_ms(r.estimated_step_s):>9} {_pct(r.step_error):>7} {_ms(r.repeat_step_s):>9} "
                f"{_ms(r.learnt_step_s):>9} {_pct(r.learnt_error):>7}"
            )
            busy = f"{r.busy_cores:5.1f}" if r.busy_cores is not None else f"{'-':>5}"
            note = f"  ({r.note})" if r.note else ""
            lines.append(
                f"  {r.shape:32} {r.layout:13} {measured:>10} {estimated:>10} {error} {state:>12} "
                f"{_ms(r.measured_step_s):>9} {times} {busy}{note}"
            )
        return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}ms"


def _pct(error: float | None) -> str:
    return "-" if error is None else f"{error:+.1%}"


def estimate_accuracy(
    shapes: dict[str, RunConfig] | None = None,
    layouts: dict[str, dict[str, Any]] | None = None,
    json_path: Path | None = None,
    *,
    measured: bool = True,
    cited: bool = True,
    cited_ids: list[str] | None = None,
) -> EstimateReport:
    """Run each shape under each layout for real (memory tracked where it can be) and estimate it;
    compare per rank (`measured`). Then each published run the catalog cites (or those of
    `cited_ids`) against its estimate (`cited`): in the JSON under 'cited', or as its 'rows' when
    nothing was measured."""
    hw = detect()
    rows: list[EstimateRow] = []
    device = "cpu"
    if measured:
        device = _measure(rows, shapes, layouts, hw)
    report = EstimateReport(
        device=hw.device_line(device), rows=rows, cited=cited_rows(ids=cited_ids) if cited else []
    )
    cited_dicts = [as_dict(r) for r in report.cited]
    if json_path is not None:  # the published runs alone: they are the result's rows
        write_result(
            json_path,
            {"device": report.device, "rows": cited_dicts}
            if not measured
            else {"device": report.device, "rows": [asdict(r) for r in rows], "cited": cited_dicts},
        )
    return report


def _measure(
    rows: list[EstimateRow],
    shapes: dict[str, RunConfig] | None,
    layouts: dict[str, dict[str, Any]] | None,
    hw: Any,
) -> str:
    """The real runs of each shape and layout against their estimates, into `rows`; the device
    they ran on."""
    device = "cpu"
    on_gpus = resolve_device(RunConfig(), hw) == "cuda"
    planned = [
        (shape, layout, base.replace(**fields))
        for shape, base in (shapes or (GPU_SHAPES if on_gpus else SHAPES)).items()
        for layout, fields in (layouts or LAYOUTS).items()
    ]
    if shapes is None and layouts is None and not on_gpus:
        planned += [(HF_SHAPE, layout, cfg) for layout, cfg in HF_ROWS.items()]
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        for shape, layout, planned_cfg in planned:
            try:
                cfg = planned_cfg.replace(
                    runs_dir=tmp, run_name=None, track_memory=planned_cfg.pp == 1
                )
                device = resolve_device(cfg, hw)
                if device == "cuda":
                    cfg = on_these_gpus(cfg, hw.max_processes("cuda"))
                rows.append(_compare(shape, layout, cfg, hw, device == "cuda"))
            except (ValueError, ImportError) as e:
                # the task can't run this layout (said in words by the config checks), or its
                # extra (workbench[hf]) isn't installed
                rows.append(
                    EstimateRow(
                        shape, layout, None, None, None, note=str(e).split(";")[0].split(" (")[0]
                    )
                )
        _learn_from_a_first_run(rows, Path(tmp), hw)
    return device


def on_these_gpus(cfg: RunConfig, gpus: int) -> RunConfig:
    """The layout on this machine's GPUs: as many data-parallel replicas as fit (one GPU runs ddp
    and zero1-3 on one rank); a model-parallel layout that needs more GPUs than there are is refused
    in words."""
    group = cfg.tp * cfg.pp
    if group > gpus:
        raise ValueError(f"needs {group} GPUs, this machine has {gpus}")
    return cfg.replace(
        num_processes=min(cfg.num_processes, gpus // group * group), oversubscribe=False
    )


def _compare(shape: str, layout: str, cfg: RunConfig, hw: Any, cuda: bool) -> EstimateRow:
    from workbench.estimator import estimate
    from workbench.estimator.timing.learning import measured_step_s
    from workbench.estimator.timing.step import cpu_profile

    # Enough steps for a steady median, logged as often as by default (a logging step gathers over
    # the ranks).
    cfg = cfg.replace(max_steps=max(cfg.max_steps, TIMED_STEPS), log_every=RunConfig().log_every)
    if not cuda and (cfg.runs_dir, cfg.num_processes) not in _MEASURED:
        # this machine as it is now, beside the runs compared with it (not a profile stored at a
        # busier moment)
        cpu_profile(cfg, cfg.num_processes, refresh=True)
        _MEASURED.add((cfg.runs_dir, cfg.num_processes))
    meter = BusyMeter()
    result = launch(cfg)
    busy = meter.cores()
    ranks = result.summary["ranks"]
    measured = [
        r["peak_memory_bytes"] if cuda else (r["tracked_memory"] or {}).get("peak") for r in ranks
    ]
    # The model alone learns from no run (this row's own is in cfg.runs_dir)
    est = estimate(
        cfg,
        hw.gpus[0].name if cuda else None,
        cfg.num_processes,
        runs_dir=Path(cfg.runs_dir) / "none",
    )
    done = Path(cfg.runs_dir) / "done"
    done.mkdir(exist_ok=True)
    shutil.move(str(result.dir.path), str(done / result.dir.path.name))
    exact = all(
        est.ranks[r["rank"]].held == {k: r[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}
        for r in ranks
    )
    known = [m for m in measured if m is not None]
    note = "" if known else "a pipeline's memory isn't tracked on CPU; model state compared"
    return EstimateRow(
        shape,
        layout,
        max(known) if known else None,
        max(r.tensors for r in est.ranks),
        exact,
        note,
        measured_step_s=measured_step_s(done / result.dir.path.name),
        estimated_step_s=est.step_s,
        busy_cores=busy,
        run_name=result.dir.path.name,
    )


def _learn_from_a_first_run(rows: list[EstimateRow], runs: Path, hw: Any) -> None:
    """Each row's estimate once its first run has completed (learnt from it, with every row's first
    run there), against a second real run of the same config."""
    from workbench.estimator import estimate
    from workbench.estimator.timing.learning import measured_step_s
    from workbench.rundir import RunDir

    done, again = runs / "done", runs / "again"
    again.mkdir(exist_ok=True)
    for row in rows:
        if row.run_name is None:
            continue
        cfg = RunDir(done / row.run_name).config().replace(runs_dir=str(runs), run_name=None)
        cuda = resolve_device(cfg, hw) == "cuda"
        row.learnt_step_s = estimate(
            cfg, hw.gpus[0].name if cuda else None, cfg.num_processes, runs_dir=done
        ).step_s
        result = launch(cfg)
        shutil.move(str(result.dir.path), str(again / result.dir.path.name))
        row.repeat_step_s = measured_step_s(again / result.dir.path.name)


class BusyMeter:
    """Other processes' CPU use from now on, in cores: all the machine's busy time less this
    process's and its children's (the ranks, reaped by the launcher, count as its children)."""

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.started, self.busy, self.own = time.perf_counter(), self._busy(), self._own()

    def _busy(self) -> float:
        t = self.psutil.cpu_times()
        return (
            sum(t)
            - t.idle
            - getattr(t, "iowait", 0.0)
            - getattr(t, "guest", 0.0)
            - getattr(t, "guest_nice", 0.0)
        )

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def cores(self) -> float:
        wall = time.perf_counter() - self.started
        return max(0.0, (self._busy() - self.busy - (self._own() - self.own)) / wall)
