"""Endings that tell the truth: a run's weights and summary describe the same session (a resumed run
that diverges keeps no earlier session's weights), and a divergence while a checkpoint is written in
the background names that checkpoint once it is sealed. Real runs on 2 forked gloo CPU ranks; NaN
is injected by the test task, and a background write is slowed inside the ranks."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import RunDir
from workbench.rundir.run_files import resume_config
from workbench.training.weights import state_digest

pytestmark = pytest.mark.slow


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = {
        "task": "tasks_for_tests:TinyRegression",
        "num_processes": 2,
        "device": "cpu",
        "micro_batch_size": 16,
        "log_every": 1,
        "lr": 5e-2,
        "runs_dir": str(runs_dir),
        "seed": 3,
    }
    return wb.RunConfig(**{**base, **fields})


def events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e.get("event") == kind]


def weights(model: torch.nn.Module) -> str:
    return state_digest(dict(model.state_dict()))


# ---- weights from the wrong session (issue 46, item 3) -------------------------------------------
def test_a_resumed_run_that_diverges_exports_nothing_and_loads_its_last_good_checkpoint(
    runs_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe: a run completes at step 20 (exports weights), is resumed to 100 and diverges at
    step 37. Step 20's weights must not pass as the run's: the summary has no hash of them beside
    'steps 36', and load_model() returns the last good checkpoint (step 30), naming the
    divergence."""
    cfg = cfg_for(runs_dir, run_name="resumed", max_steps=20, checkpoint_every=10)
    first = wb.launch(cfg, task=TinyRegression())
    run = RunDir(first.run_dir)
    assert first.summary["weights_sha256"] and run.weights_path.exists()
    step_20 = weights(first.load_model())

    # the resumed session's 17th loss call is step 37
    resumed = resume_config(
        cfg, run.path, {"max_steps": 100, "task_options": {"nan_rank": 1, "nan_at_call": 17}}
    )
    with pytest.raises(
        wb.RunDivergedError,
        match=r"diverged at step 37: .* on rank 1; last good checkpoint: .*step_30",
    ):
        wb.launch(resumed, task=TinyRegression())
    summary = run.summary()
    assert summary.status == "diverged" and summary.steps == 36
    assert summary.weights_sha256 is None, "the hash of an earlier session's weights stayed"
    assert not run.weights_path.exists(), "an earlier session's weights stayed"
    assert [s for s, _ in run.checkpoints()][-1] == 30

    result = wb.RunResult(run.path, task=TinyRegression())
    with caplog.at_level(logging.WARNING, logger="workbench"):
        final = weights(result.load_model())
    assert final == weights(result.load_model(step=30)) != step_20
    assert re.search(
        r"resumed has no model\.safetensors \(the session diverged at step 37: .*step_30: it "
        r"exported no weights\); loading the newest checkpoint \(step 30\)",
        caplog.text,
    ), caplog.text


def test_weights_of_another_session_than_the_summary_are_refused_naming_both_steps(
    runs_dir: Path,
) -> None:
    """A run directory from before sessions removed an earlier export: model.safetensors of step 4
    beside a summary of 3 steps (diverged) is refused, pointing at the checkpoint to load."""
    cfg = cfg_for(runs_dir, run_name="old-dir", max_steps=4, checkpoint_every=2)
    result = wb.launch(cfg, task=TinyRegression())
    run = RunDir(result.run_dir)
    run.set_status("diverged", steps=3)  # what the landed code left after a diverged resume
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors holds the weights of step 4, but the run's summary says 3 "
        r"steps \(diverged\): they are an earlier session's.*load_model\(step=2\)",
    ):
        result.load_model()


# ---- a divergence while a checkpoint is written in the background (issue 46, item 4) -------------
class SlowCheckpointWrites(TinyRegression):
    """TinyRegression whose ranks write one checkpoint slowly (DCP's file writes sleep first)."""

    name = "slow-checkpoint-writes"
    default_options: dict[str, Any] = {
        **TinyRegression.default_options,
        "slow_write_s": 0.0,
        "slow_write_step": None,
    }

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        if "RANK" in os.environ:  # in a rank, never in the test's own process
            slow_writes(self.options(cfg))
        return super().build_model(cfg)


def slow_writes(o: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    original = getattr(FileSystemWriter.write_data, "original", FileSystemWriter.write_data)

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        step = int(re.search(r"tmp-step_(\d+)", str(self.path)).group(1))
        if step == o["slow_write_step"]:
            time.sleep(o["slow_write_s"])
        return original(self, plan, planner)

    write_data.original = original  # type: ignore[attr-defined]
    FileSystemWriter.write_data = write_data


def test_nan_during_a_background_write_names_the_checkpoint_that_write_sealed(
    runs_dir: Path,
) -> None:
    """The probe: checkpoint_async='on', step 10's write takes 3 s, and the loss is NaN at step 12
    (the steps take milliseconds: the write is still in flight). The ending waits for it and names
    step 10 as the last good checkpoint, after its checkpoint_saved event."""
    cfg = cfg_for(
        runs_dir,
        run_name="async-nan",
        max_steps=20,
        checkpoint_every=10,
        checkpoint_async="on",
        task_options={"nan_rank": 0, "nan_at_call": 12, "slow_write_s": 3.0, "slow_write_step": 10},
    )
    with pytest.raises(
        wb.RunDivergedError,
        match=r"diverged at step 12: .* on rank 0; last good checkpoint: \S*step_10\n",
    ):
        wb.launch(cfg, task=SlowCheckpointWrites())
    run = RunDir(runs_dir / "async-nan")
    ending = run.summary().ending
    assert ending["last_checkpoint"] == str(run.checkpoints_path / "step_10")
    kinds = [e["event"] for e in run.events() if e["event"] in ("checkpoint_saved", "diverged")]
    assert kinds == ["checkpoint_saved", "diverged"], kinds
    assert [s for s, _ in run.checkpoints()] == [10]
    state = json.loads((run.checkpoints_path / "step_10" / "trainer_state.json").read_text())
    assert state["step"] == 10
    stall = run.summary().checkpoints["stall_s"]
    assert len(stall) == 1 and stall[0] > 1.0, "the wait for the write was not counted as its stall"
