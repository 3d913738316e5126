"""Reading a run back with wb.RunResult.load: a path that is no run is refused with the runs that are there, and
a run that has saved no weights yet says so rather than that it ended."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import RunDir, Status
from workbench.rundir.liveness import this_process

CFG = wb.RunConfig(
    task="tiny-regression", num_processes=2, device="cpu", micro_batch_size=16, max_steps=8
)


def made_up_run(
    runs_dir: Path, name: str, status: Status, age_s: float = 0.0, **summary: object
) -> RunDir:
    """A run directory as a launch leaves it (config.yaml, summary.json), its summary written `age_s` ago."""
    run = RunDir(runs_dir / name)
    run.path.mkdir(parents=True)
    run.write_config(CFG.replace(runs_dir=str(runs_dir), run_name=name, **summary.pop("cfg", {})))
    run.set_status(status, world_size=2, **summary)
    written = time.time() - age_s
    os.utime(run.summary_path, (written, written))
    return run


def test_loading_the_runs_dir_itself_is_refused_naming_its_runs_newest_first(
    runs_dir: Path,
) -> None:
    for i in range(7):
        made_up_run(runs_dir, f"tiny-{i}", Status.COMPLETED, age_s=100 - i)
    message = (
        f"RunResult.load: not a run directory: {runs_dir} has no config.yaml or summary.json: it is a "
        "runs_dir; its runs are tiny-6, tiny-5, tiny-4, tiny-3, tiny-2, ... (7 in all). Load one, e.g. "
        f"wb.RunResult.load('{runs_dir / 'tiny-6'}'), or list them with wb.runs('{runs_dir}')"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        wb.RunResult.load(runs_dir)


def test_a_mistyped_run_path_is_refused_with_the_closest_run(runs_dir: Path) -> None:
    made_up_run(runs_dir, "digits-20240101-120000", Status.COMPLETED)
    typo = runs_dir / "digits-20240101-12000"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"not a run directory: {typo} does not exist (did you mean 'digits-20240101-120000'?); the runs in "
            f"{runs_dir} are digits-20240101-120000"
        ),
    ):
        wb.RunResult.load(typo)


def test_a_folder_without_a_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"not a run directory: {tmp_path / 'notes'} has no config.yaml or summary.json, nor runs in it"
        ),
    ):
        wb.RunResult.load(tmp_path / "notes")


def test_a_run_directory_still_loads_from_its_config_alone(runs_dir: Path) -> None:
    run = RunDir(runs_dir / "just-prepared")
    run.path.mkdir()
    run.write_config(CFG)  # what prepare() writes first
    assert wb.RunResult.load(run.path).config == CFG


def test_load_model_before_the_first_checkpoint_says_the_run_is_still_going(runs_dir: Path) -> None:
    run = made_up_run(runs_dir, "going", Status.RUNNING, cfg={"checkpoint_every": 50})
    # this process: alive
    run.write_heartbeat(0, {**this_process(), "step": 3, "time": time.time()})
    result = wb.RunResult(run.path, run.config(), task=TinyRegression())
    assert result.status is Status.RUNNING
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(
            "going is still running and has saved no checkpoint yet: its first checkpoint comes at step 50. Wait "
            "for it, then call load_model() again, or load_model(step=N) with a step it has saved by then"
        ),
    ):
        result.load_model()


def test_load_model_of_a_run_that_ended_without_weights_says_it_ended(runs_dir: Path) -> None:
    run = made_up_run(runs_dir, "crashed", Status.FAILED)
    with pytest.raises(
        FileNotFoundError,
        match=r"nor a complete checkpoint: the run ended \(failed\) before saving",
    ):
        wb.RunResult(run.path, run.config(), task=TinyRegression()).load_model()
