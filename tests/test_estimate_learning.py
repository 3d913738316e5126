"""The estimator learns from the newest usable runs (issue 46): 250 newer failed runs beside the one
completed run of a config no longer push it out of what is read; its measured step still corrects
that config's estimate."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import workbench as wb
from workbench.estimator.timing import learning
from workbench.rundir import RunDir, Status

CFG = wb.RunConfig(task="digits", num_processes=2, micro_batch_size=8, grad_accum_steps=1)
NOW = 1_700_000_000.0
MEASURED_S = 0.0239
"""The completed run's step (the issue's 23.9 ms)."""


@pytest.fixture
def learning_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Remembered estimates in a folder of the test's own, with the session's machine profiles
    copied in (measuring the machine again is not this test's subject)."""
    session = Path(os.environ["WORKBENCH_CACHE_DIR"])  # the session's (conftest.py)
    folder = tmp_path / "cache"
    folder.mkdir()
    for profile in session.glob("machine-*.json"):
        shutil.copy2(profile, folder / profile.name)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(folder))
    return folder


def past_run(
    runs: Path, name: str, status: Status, age_s: float, cfg: wb.RunConfig = CFG
) -> RunDir:
    """A run of `cfg` on this CPU that ended `age_s` ago with `status` (a completed one with its
    measured steps)."""
    run = RunDir(runs / name)
    run.path.mkdir(parents=True)
    run.write_config(cfg)
    run.set_status(
        status,
        device_class="cpu",
        world_size=cfg.num_processes,
        started_at=NOW - age_s - 60,
        micro_batch_size=cfg.micro_batch_size,
    )
    if status == Status.COMPLETED:
        run.write_timings([MEASURED_S] * 10)
    os.utime(run.summary_path, (NOW - age_s, NOW - age_s))
    return run


def fill_with_failed(runs: Path, count: int) -> None:
    """`count` failed runs of the same config, all newer than any other run in `runs`."""
    for i in range(count):
        past_run(runs, f"digits-failed-{i:03d}", Status.FAILED, age_s=i)


def test_newer_failed_runs_never_push_out_the_completed_run_of_the_same_config(
    tmp_path: Path,
) -> None:
    # the probe: one completed run, then 250 newer failed runs of the same config
    runs = tmp_path / "runs"
    past_run(runs, "digits-completed", Status.COMPLETED, age_s=100_000)
    fill_with_failed(runs, 250)
    assert len(learning.newest_summaries(runs)) == 251
    assert [r.name for r in learning.completed_runs(runs, "cpu")] == ["digits-completed"]
    lesson = learning.learn(CFG, 2, "cpu", runs, "key", lambda *a: MEASURED_S / 2)
    assert lesson.runs == ["digits-completed"], lesson.note
    assert lesson.ratio == pytest.approx(2.0), lesson.note


def test_the_newest_usable_runs_are_read_however_many_others_are_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SCAN counts usable runs: the SCAN newest completed ones are read, the older ones aren't,
    whatever number of failed runs sits among them."""
    monkeypatch.setattr(learning, "SCAN", 2)
    runs = tmp_path / "runs"
    for i, age in enumerate((300_000, 200_000, 100_000)):
        past_run(runs, f"digits-completed-{i}", Status.COMPLETED, age_s=age)
    fill_with_failed(runs, 30)
    assert [r.name for r in learning.completed_runs(runs, "cpu")] == [
        "digits-completed-2",
        "digits-completed-1",
    ]


def test_a_failed_run_that_completes_on_resume_teaches_at_once(tmp_path: Path) -> None:
    """Runs passed over as failed are remembered by their summary's time: one whose summary
    changes (resumed, now completed) is read again."""
    runs = tmp_path / "runs"
    fill_with_failed(runs, 5)
    assert learning.completed_runs(runs, "cpu") == []
    resumed = RunDir(runs / "digits-failed-002")
    resumed.set_status(Status.COMPLETED, device_class="cpu", world_size=2, started_at=NOW)
    resumed.write_timings([MEASURED_S] * 10)
    os.utime(resumed.summary_path, (NOW + 10, NOW + 10))
    found = learning.completed_runs(runs, "cpu")
    assert [r.name for r in found] == ["digits-failed-002"]
    assert found[0].measured_s == pytest.approx(MEASURED_S)


@pytest.mark.slow
def test_the_estimate_of_a_config_keeps_its_completed_runs_step_beside_250_failed_runs(
    learning_cache: Path, tmp_path: Path
) -> None:
    """The issue's probe end to end: the estimate of the config is the completed run's own step
    (23.9 ms) with the failed runs beside it, not the model's unlearnt figure."""
    from workbench.estimator import estimate

    runs = tmp_path / "runs"
    raw = estimate(CFG, runs_dir=tmp_path / "no-runs")
    assert any("nothing learnt" in a for a in raw.assumptions)
    past_run(runs, "digits-completed", Status.COMPLETED, age_s=100_000)
    fill_with_failed(runs, 250)
    learnt = estimate(CFG, runs_dir=runs)
    assert learnt.step_s == pytest.approx(MEASURED_S, rel=1e-6), learnt.assumptions
    assert any("learnt from 1 completed run(s)" in a for a in learnt.assumptions)
    assert raw.step_s != pytest.approx(MEASURED_S, rel=1e-3), "the test needs a step to correct"
