"""Checkpoints written in the background (checkpoint_async): the same checkpoints and losses as
written synchronously, one write in flight at a time, a failed write failing the run as a
synchronous one does, and a run killed mid-write resuming from the checkpoint before. Real runs on 2
forked gloo CPU ranks; a test task slows or breaks DCP's file writes inside the ranks, and logs when
each ran."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import RunDir
from workbench.training.checkpoint.background import writes_async

pytestmark = pytest.mark.slow


class CheckpointWrites(TinyRegression):
    """TinyRegression whose ranks slow down or fail DCP's file writes of one checkpoint, and log
    each write's start and end (rank, step, part) to `write_log`."""

    name = "checkpoint-writes"
    default_options: dict[str, Any] = {
        **TinyRegression.default_options,
        "write_log": None,
        "slow_write_s": 0.0,
        "slow_write_step": None,
        "fail_write_step": None,
        "fail_write_rank": None,
    }

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        if "RANK" in os.environ:  # in a rank, never in the test's own process
            instrument_writes(self.options(cfg))
        return super().build_model(cfg)


def instrument_writes(o: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    original = getattr(FileSystemWriter.write_data, "original", FileSystemWriter.write_data)

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        began, rank = time.time(), int(os.environ["RANK"])
        step = int(re.search(r"tmp-step_(\d+)", str(self.path)).group(1))
        if (step, rank) == (o["fail_write_step"], o["fail_write_rank"]):
            raise OSError(errno.EIO, "injected write failure")
        if o["slow_write_s"] and o["slow_write_step"] in (None, step):
            time.sleep(o["slow_write_s"])
        result = original(self, plan, planner)
        if o["write_log"]:
            with open(o["write_log"], "a") as log:
                part = Path(str(self.path)).name
                log.write(
                    json.dumps(
                        {
                            "rank": rank,
                            "step": step,
                            "part": part,
                            "start": began,
                            "end": time.time(),
                        }
                    )
                    + "\n"
                )
        return result

    write_data.original = original  # type: ignore[attr-defined]
    FileSystemWriter.write_data = write_data


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = {
        "num_processes": 2,
        "device": "cpu",
        "micro_batch_size": 16,
        "max_steps": 6,
        "log_every": 1,
        "checkpoint_every": 2,
        "keep_checkpoints": 3,
        "lr": 5e-2,
        "runs_dir": str(runs_dir),
        "seed": 3,
    }
    return wb.RunConfig(**{**base, **fields})


def losses(run: RunDir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.metrics() if "loss" in r}


def events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e.get("event") == kind]


def ranks(run: RunDir) -> list[psutil.Process]:
    """The rank processes, from their heartbeats (psutil keeps the start time: never another
    process given the same pid)."""
    found = []
    for beat in run.ranks_path.glob("rank_*.json"):
        with contextlib.suppress(psutil.Error, ValueError, KeyError):
            found.append(psutil.Process(json.loads(beat.read_text())["pid"]))
    return found


def contents(ckpt: Path, tmp: Path) -> dict[str, Any]:
    """Everything a checkpoint holds, read back: each DCP part as one state dict, each rank's file,
    the trainer state (but its clock)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    held: dict[str, Any] = {}
    for part in ("model", "optim"):
        dcp_to_torch_save(ckpt / part, tmp / f"{part}.pt")
        held[part] = torch.load(tmp / f"{part}.pt", weights_only=True)
    for rank_file in sorted(ckpt.glob("rank_*.pt")):
        held[rank_file.name] = torch.load(rank_file, weights_only=True)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    held["trainer_state"] = {k: v for k, v in state.items() if k != "train_time_s"}
    return held


def assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


# ---- the same checkpoints ------------------------------------------------------------------------
TINY_GPT = {"task": "char-gpt", "task_options": {"preset": "tiny"}, "micro_batch_size": 4}
LAYOUTS = {
    "ddp": {"parallelism": "ddp"},
    "zero3": {"parallelism": "zero3"},
    "tp": {**TINY_GPT, "tp": 2},
    "pp": {**TINY_GPT, "pp": 2, "grad_accum_steps": 2},
}
"""Replicas writing alone (ddp), shards of a collective write (zero3), DTensors split by tensor
parallel, a pipeline's stages."""


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_background_checkpoints_hold_what_synchronous_ones_do(
    runs_dir: Path, tmp_path: Path, layout: str
) -> None:
    task = None if "task" in LAYOUTS[layout] else TinyRegression()
    runs = {
        mode: wb.launch(
            cfg_for(runs_dir, run_name=mode, checkpoint_async=mode, **LAYOUTS[layout]), task=task
        )
        for mode in ("off", "on")
    }
    assert_same_runs(runs["off"], runs["on"], tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned-memory staging needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["ddp", "zero3"], ids=["ddp", "zero3"])
def test_on_gpus_auto_writes_in_the_background_what_a_synchronous_write_holds(
    runs_dir: Path, tmp_path: Path, layout: str
) -> None:
    fields = {
        "device": "cuda",
        "num_processes": min(2, torch.cuda.device_count()),
        "parallelism": layout,
    }
    runs = {
        mode: wb.launch(
            cfg_for(runs_dir, run_name=mode, checkpoint_async=mode, **fields), task=TinyRegression()
        )
        for mode in ("off", "auto")
    }
    assert "pinned host memory" in runs["auto"].summary["checkpoints"]["why"]
    assert_same_runs(runs["off"], runs["auto"], tmp_path)


def assert_same_runs(sync: wb.RunResult, background: wb.RunResult, tmp_path: Path) -> None:
    """Each run wrote the way it says; the same losses, and checkpoints that hold the same."""
    for result, behind in ((sync, False), (background, True)):
        assert result.summary["checkpoints"]["async"] is behind
        saved = events(RunDir(result.run_dir), "checkpoint_saved")
        assert [(e["step"], e["background"]) for e in saved] == [
            (2, behind),
            (4, behind),
            (6, behind),
        ]
    a_run, b_run = RunDir(sync.run_dir), RunDir(background.run_dir)
    assert losses(b_run) == losses(a_run) and len(losses(a_run)) == 6
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "b").mkdir(exist_ok=True)
    for (step, a), (_, b) in zip(a_run.checkpoints(), b_run.checkpoints(), strict=True):
        assert a.name == b.name
        files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
        assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
        assert_same(contents(a, tmp_path / "a"), contents(b, tmp_path / "b"), f"step_{step}")


# ---- one write at a time -------------------------------------------------------------------------
def test_one_background_write_at_a_time_while_training_goes_on(
    runs_dir: Path, tmp_path: Path
) -> None:
    log, slow = tmp_path / "writes.jsonl", 1.0
    result = wb.launch(
        cfg_for(
            runs_dir,
            run_name="slow",
            checkpoint_async="on",
            checkpoint_every=1,
            max_steps=4,
            task_options={"write_log": str(log), "slow_write_s": slow},
        ),
        task=CheckpointWrites(),
    )
    writes = [json.loads(line) for line in log.read_text().splitlines()]
    # ddp: rank 0 writes the model, rank 1 the optimizer; checkpoint k+1's writes start after
    # checkpoint k's have ended
    spans = {
        s: (
            min(w["start"] for w in writes if w["step"] == s),
            max(w["end"] for w in writes if w["step"] == s),
        )
        for s in (1, 2, 3, 4)
    }
    assert sorted({(w["rank"], w["part"]) for w in writes}) == [(0, "model"), (1, "optim")]
    for step in (1, 2, 3):
        assert spans[step + 1][0] >= spans[step][1], (step, spans)
    stalls = result.summary["checkpoints"]["stall_s"]
    # the first checkpoint's write didn't stop the loop; the next ones waited for the write before
    assert len(stalls) == 4 and stalls[0] < slow / 2, stalls
    assert max(stalls[1:]) > slow / 2, stalls
    run = RunDir(result.run_dir)
    assert [s for s, _ in run.checkpoints()] == [2, 3, 4]  # the last one too: the run waited for it
    assert not list(run.checkpoints_path.glob(".tmp-step_*"))


# ---- a failed write ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["off", "on"], ids=["synchronous", "background"])
def test_a_failed_write_fails_the_run_naming_the_checkpoint(runs_dir: Path, mode: str) -> None:
    cfg = cfg_for(
        runs_dir,
        run_name=f"fails-{mode}",
        checkpoint_async=mode,
        task_options={"fail_write_step": 4, "fail_write_rank": 1},
    )
    run = RunDir(runs_dir / cfg.run_name)
    partial = re.escape(str(run.checkpoints_path / ".tmp-step_4"))
    failing = (
        rf"could not write checkpoint step 4 \({partial}\) in run directory .*fails-{mode}: "
        "injected write failure"
    )
    with pytest.raises(
        wb.RunFailedError, match=rf"rank 1 failed with RunDirWriteError: \[Errno 5\] {failing}"
    ):
        wb.launch(cfg, task=CheckpointWrites())
    assert re.search(failing, run.summary().error["message"])
    assert [s for s, _ in run.checkpoints()] == [2]
    assert not list(run.checkpoints_path.glob(".tmp-step_*"))


# ---- killed mid-write ----------------------------------------------------------------------------
def test_a_run_killed_during_a_background_write_resumes_from_the_one_before(runs_dir: Path) -> None:
    cfg = cfg_for(
        runs_dir,
        run_name="killed",
        checkpoint_async="on",
        task_options={"slow_write_s": 600.0, "slow_write_step": 4},
    )
    run = RunDir(runs_dir / "killed")
    started = wb.start(cfg, task=CheckpointWrites())
    try:
        deadline = time.monotonic() + 60
        # step_2 complete, step 4's write under way and training past it: a background write
        while not (run.checkpoints() and 5 in losses(run)):
            assert not started.done(), "the run ended before step 5"
            assert time.monotonic() < deadline, f"no step 5 within 60 s: {losses(run)}"
            time.sleep(0.05)
        assert (run.checkpoints_path / ".tmp-step_4").is_dir()
        started.kill()  # SIGKILL to the launcher's process group: every rank, mid-write
        with pytest.raises(wb.RunFailedError, match="killed by Run.kill"):
            started.wait(timeout=30)  # gives the run directory's lock back
    finally:
        tree = ranks(run)
        if not started.done():
            started.kill()
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the start time: never another process that got the pid
    assert [s for s, _ in run.checkpoints()] == [2]
    assert not (run.checkpoints_path / ".tmp-step_4" / "manifest.json").exists()
    result = wb.RunResult(run.path, run.config(), task=TinyRegression())
    with pytest.raises(
        ValueError,
        match=r"step=4: the checkpoint at step 4 is incomplete "
        r"\(.*\.tmp-step_4: its write never finished.*complete "
        r"checkpoints at steps \[2\] only",
    ):
        result.load_model(step=4)
    resumed = wb.launch(
        cfg.replace(resume=True, task_options={}, resume_allow=["task_options"]),
        task=CheckpointWrites(),
    )
    [skipped] = events(run, "checkpoint_skipped")
    assert skipped["step"] == 4 and skipped["problems"] == ["incomplete: its write never finished"]
    [resume] = events(run, "resumed")
    assert resume["step"] == 2 and resume["checkpoint"].endswith("step_2")
    assert resumed.summary["status"] == "completed"
    assert [s for s, _ in run.checkpoints()] == [2, 4, 6]


# ---- the setting ---------------------------------------------------------------------------------
def test_checkpoint_async_names_its_choices_and_auto_writes_in_the_background_on_gpus() -> None:
    with pytest.raises(
        ValueError, match=r"checkpoint_async='yes': choose one of 'auto' \| 'on' \| 'off'"
    ):
        wb.RunConfig(checkpoint_async="yes")
    auto = wb.RunConfig()
    assert writes_async(auto, torch.device("cuda", 0))[0] is True
    assert writes_async(auto.replace(checkpoint_async="off"), torch.device("cuda", 0)) == (
        False,
        "checkpoint_async='off'",
    )
    assert writes_async(auto.replace(checkpoint_async="on"), torch.device("cpu"))[0] is True


# ---- the bench -----------------------------------------------------------------------------------
def test_bench_checkpoint_measures_each_checkpoints_stall_both_ways(tmp_path: Path) -> None:
    from workbench.commands.bench.checkpoint_stall import CHECKPOINT_BENCH, checkpoint_stall

    cfg = CHECKPOINT_BENCH.replace(task_options={"preset": "tiny"}, max_steps=4)
    report = checkpoint_stall(cfg, layouts=("ddp",), json_path=tmp_path / "result.json")
    assert [(r.arm, len(r.stall_s), len(r.write_s), len(r.step_s)) for r in report.runs] == [
        ("sync", 2, 2, 4),
        ("async", 2, 2, 4),
    ]
    assert all(s > 0 for r in report.runs for s in r.stall_s + r.write_s)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["measured_on"]["device_class"] == "cpu" and saved["rows"] == report.rows
    assert [r["writes"] for r in saved["rows"]] == ["synchronous", "background"]
    assert "ddp     background" in report.table()
    with pytest.raises(
        ValueError,
        match=r"checkpoint_every=2 with max_steps=3: the bench needs a "
        r"checkpoint before the final one",
    ):
        checkpoint_stall(cfg.replace(max_steps=3))
