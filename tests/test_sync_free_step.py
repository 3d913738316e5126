"""Issue 37: a steady training step reads nothing from the device, in every layout.

`aten::_local_scalar_dense` is what `.item()`, `float(t)` and `bool(t)` run: on a GPU each one makes
the host wait for the device. Each layout's run profiles steady steps (no logging, evaluation or
checkpoint among them, a stop/signal vote forced into every one), and the test counts those calls
on every rank's trace from the first profiled step's start to the last one's end, outside the
optimizer's and the data loader's own ranges: none. Divergence is still caught, at the next read
point, and reported at the step that went bad.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import profile, record_function

import workbench as wb
from workbench.rundir import RunDir
from workbench.training.nonfinite import NonFiniteWatch, judge
from workbench.training.observe.profiling import STEP_LABEL

SYNC = "aten::_local_scalar_dense"
CUDA_WAITS = (SYNC, "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
"""On a GPU: a host read, or the CUDA runtime calls by which the host waits for the device."""
OWN_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#", "enumerate(DataLoader)#")
"""The optimizer's and the data loader's record_function ranges: their reads are theirs (AdamW's
step counters, a dataset's CPU indexing), not the trainer's."""
PROFILED = (4, 7)
"""Steady steps of an 8-step run logging every 50: only the last step logs, evaluates, saves."""


def syncs_in_steps(trace: Path, names: tuple[str, ...] = (SYNC,)) -> tuple[int, set[str]]:
    """Host reads (events called `names`) on the profiled steps' thread between the first step's
    start and the last one's end, outside OWN_RANGES; and the step labels the trace holds."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("workbench step")]
    assert steps, f"{trace} holds no profiled step"
    tid = steps[0]["tid"]
    begin, end = min(s["ts"] for s in steps), max(s["ts"] + s["dur"] for s in steps)
    own = [e for e in events if e["tid"] == tid and e["name"].startswith(OWN_RANGES)]

    def inside(e: dict[str, Any], r: dict[str, Any]) -> bool:
        return r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]

    reads = [
        e
        for e in events
        if e["name"] in names
        and e["tid"] == tid
        and begin <= e["ts"] <= end
        and not any(inside(e, r) for r in own)
    ]
    return len(reads), {s["name"] for s in steps}


def test_the_count_sees_a_read_in_a_step_and_leaves_the_optimizer_s_out(tmp_path: Path) -> None:
    x = torch.ones(3)
    with profile() as prof:
        with record_function(STEP_LABEL.format(1)):
            x.sum().item()  # counted
            with record_function("Optimizer.step#AdamW.step"):
                float(x.max())  # the optimizer's own
        x.min().item()  # after the last step: not counted
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    assert syncs_in_steps(tmp_path / "t.json") == (1, {STEP_LABEL.format(1)})


def test_the_watch_names_the_first_bad_step_and_its_rank_or_the_norm() -> None:
    watch = NonFiniteWatch(torch.device("cpu"))
    watch.note(1, torch.tensor(1.0), torch.tensor(2.0))
    assert judge(watch.vector().unsqueeze(0)) is None
    watch.note(2, torch.tensor(1.0), torch.tensor(float("inf")))
    watch.note(3, torch.tensor(float("nan")), torch.tensor(float("nan")))
    found = judge(watch.vector().unsqueeze(0))
    assert (found.step, found.reason) == (2, "the gradient norm was not finite (NaN or inf)")
    other = NonFiniteWatch(torch.device("cpu"))
    other.note(2, torch.tensor(float("-inf")), None)  # fp16: no norm to note
    found = judge(torch.stack([watch.vector(), other.vector(), other.vector()]))
    assert (found.step, found.reason) == (2, "the loss was not finite (NaN or inf) on rank 2")


@pytest.fixture
def votes_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop/signal vote in every step (forked ranks inherit it): the profiled steps vote too."""
    from workbench.training import stop_vote

    monkeypatch.setattr(stop_vote, "VOTE_EVERY_S", 0.0)


PIPELINE_MESH = {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
LAYOUTS: dict[str, tuple[dict[str, Any], str, dict[str, int] | None]] = {
    # fields; each rank's parallelism and mesh as the summary reports them
    "ddp": ({}, "ddp", None),
    "zero1": ({"parallelism": "zero1"}, "zero1", None),
    "zero2": ({"parallelism": "zero2"}, "zero2", {"dp_shard": 2}),
    "zero3": ({"parallelism": "zero3"}, "zero3", {"dp_shard": 2}),
    "hsdp": (
        {"parallelism": "hsdp", "dp_shard": 2, "num_processes": 4},
        "hsdp",
        {"dp_replicate": 2, "dp_shard": 2},
    ),
    "tp": ({"tp": 2}, "tp2", {"tp": 2}),
    "pp-1f1b": ({"pp": 2}, "pp2 1f1b", PIPELINE_MESH),
    "pp-interleaved": (
        {"pp": 2, "pp_schedule": "interleaved_1f1b", "task_options": {"n_layer": 4}},
        "pp2 interleaved_1f1b, 2 chunks/rank",
        PIPELINE_MESH,
    ),
    "cp": ({"cp": 2, "parallelism": "zero3"}, "zero3 x cp2", {"cp": 2}),
}


def layout_cfg(runs_dir: Path, name: str) -> wb.RunConfig:
    fields = dict(LAYOUTS[name][0])
    options = {
        "block_size": 32,
        "train_stride": 64,
        "dropout": 0.0,
        **fields.pop("task_options", {}),
    }
    base: dict[str, Any] = {
        "task": "char-gpt",
        "num_processes": 2,
        "device": "cpu",
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "max_steps": 8,
        "log_every": 50,
        "eval_batches": 1,
        "seed": 3,
        "runs_dir": str(runs_dir),
        "run_name": name,
        "oversubscribe": True,
        "dist_timeout_s": 120,
        "trackers": [],
        "profile_steps": list(PROFILED),
        "task_options": options,
    }
    return wb.RunConfig(**{**base, **fields})


@pytest.mark.filterwarnings("ignore:num_processes=4 on 2 CPU core")  # hsdp's 4 ranks, few cores
@pytest.mark.parametrize("name", list(LAYOUTS), ids=list(LAYOUTS))
def test_a_steady_step_reads_nothing_from_the_device(
    name: str, runs_dir: Path, votes_every_step: None, request: pytest.FixtureRequest
) -> None:
    if name == "cp":
        request.getfixturevalue("ring_lifted")
    cfg = layout_cfg(runs_dir, name)
    result = wb.launch(cfg)
    _, parallelism, mesh = LAYOUTS[name]
    assert result.status == "completed"
    ranks = result.summary["ranks"]
    assert len(ranks) == cfg.num_processes
    labels = {STEP_LABEL.format(n) for n in range(PROFILED[0], PROFILED[1] + 1)}
    for rank in ranks:
        assert (rank["parallelism"], rank.get("mesh")) == (parallelism, mesh), "the layout ran"
        assert rank["agreement_votes"] == cfg.max_steps, "every step voted, the profiled ones too"
        reads, steps = syncs_in_steps(Path(rank["profile_trace"]))
        assert steps == labels
        assert reads == 0, f"rank {rank['rank']}: {reads} host reads in steps {PROFILED}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="waiting for a GPU needs a CUDA GPU")
def test_a_steady_gpu_step_never_waits_for_the_device(runs_dir: Path) -> None:
    """On a GPU the host waits in the CUDA runtime too (a stream or event synchronize, under a copy
    to the host): none of that in steady steps either, the step-time breakdown's events included."""
    cfg = layout_cfg(runs_dir, "ddp").replace(
        device="cuda", num_processes=1, max_steps=12, profile_steps=[4, 10]
    )
    result = wb.launch(cfg)
    assert result.status == "completed" and result.summary["ranks"][0]["device"].startswith("cuda")
    reads, steps = syncs_in_steps(Path(result.summary["ranks"][0]["profile_trace"]), CUDA_WAITS)
    assert len(steps) == 7 and reads == 0, f"{reads} waits for the device in steps 4-10"


# ---- divergence between read points --------------------------------------------------------------
READ_POINTS = {
    "at-the-next-logging-step": ({"log_every": 5}, [5]),
    "before-the-next-checkpoint": ({"log_every": 50, "checkpoint_every": 4}, []),
}


@pytest.mark.parametrize("read_point", list(READ_POINTS), ids=list(READ_POINTS))
def test_a_nan_on_a_steady_step_is_reported_at_its_step_and_never_saved(
    runs_dir: Path, read_point: str
) -> None:
    """Rank 1's loss is NaN at step 7, a steady step: the next read point (step 8's checkpoint, or
    step 10's row) finds it, the run ends diverged at step 7 on every rank, and nothing after step
    6 is logged or saved."""
    fields, rows = READ_POINTS[read_point]
    cfg = wb.RunConfig(
        task="tasks_for_tests:TinyRegression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=12,
        lr=5e-2,
        runs_dir=str(runs_dir),
        run_name="nan",
        seed=3,
        trackers=[],
        task_options={"nan_rank": 1, "nan_at_call": 7},
        **fields,
    )
    message = r"diverged at step 7: the loss was not finite \(NaN or inf\) on rank 1; "
    with pytest.raises(wb.RunDivergedError, match=message) as info:
        wb.launch(cfg)
    assert info.value.step == 7
    run = RunDir(info.value.run_dir)
    summary = run.summary()
    assert summary.status == "diverged" and summary.steps == 6, "trained steps end before step 7"
    assert [s for s, _ in run.checkpoints()] == ([4] if "checkpoint_every" in fields else [])
    assert [r["step"] for r in run.metrics() if "loss" in r] == rows
    assert not run.weights_path.exists(), "a diverged state is never exported"
