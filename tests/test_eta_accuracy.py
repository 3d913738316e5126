"""The dashboard's ETA comes from a smoothed pace and, after 10% of a run with steady steps, stays within 20% of the
time actually left: on synthetic row streams (steady, jittered, stalled now and then, a slow first step, a lasting
change of pace), and on a real run whose steps sleep a known time."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.notebook.pace import ETA_HORIZON_S, eta_s, smoothed_step_time
from workbench.notebook.reading import Reading
from workbench.rundir import MetricsRow
from workbench.utils.files import read_json

TOLERANCE = 0.2


def rows_of(step_times: list[float], log_every: int) -> list[MetricsRow]:
    """Training rows as the trainer writes them: the row of step k is written during step k, before k's own time
    is added to elapsed_s; its step time is its window's."""
    rows, before = [], 0.0
    for k in range(log_every, len(step_times) + 1, log_every):
        elapsed = sum(step_times[: k - 1])
        window = (elapsed + step_times[k - 1] - before) / log_every
        rows.append(MetricsRow(step=k, loss=1.0, step_time_s=window, elapsed_s=elapsed))
        before = elapsed + step_times[k - 1]
    return rows


def relative_errors(
    step_times: list[float], log_every: int, *, after: float = 0.1, min_steps_left: int = 1
) -> list[tuple[int, float]]:
    """(step, (ETA - time left) / time left) at every row after `after` of the run, while at least
    `min_steps_left` steps remain. The time left from the row of step k: the rest of step k and the steps after
    it."""
    total = len(step_times)
    rows = rows_of(step_times, log_every)
    found = []
    for i, row in enumerate(rows):
        if row.step < after * total or total - row.step < min_steps_left:
            continue
        left = sum(step_times[row.step :])
        eta = eta_s(Reading(rows=rows[: i + 1]), total, row.step)
        assert eta is not None
        found.append((row.step, (eta - left) / left))
    return found


def worst(errors: list[tuple[int, float]]) -> tuple[int, float]:
    return max(errors, key=lambda e: abs(e[1]))


# ---- synthetic row streams -----------------------------------------------------------------------
def test_steady_steps_after_a_slow_first_step_give_the_exact_time_left() -> None:
    times = [2.0] + [0.01] * 4999  # the first step pays for start-up: 200 steps' worth
    errors = relative_errors(times, log_every=5)
    assert len(errors) > 800
    assert abs(worst(errors)[1]) < 1e-6, worst(errors)


def test_jittered_steps_stay_within_20_percent() -> None:
    rng = random.Random(0)
    times = [0.01 * rng.uniform(0.5, 1.5) for _ in range(5000)]
    # Near the very end the time left is a handful of steps, and one step's jitter is 50% of it: judged while 50
    # steps remain (0.5 s), where the jitter of what is left averages out.
    errors = relative_errors(times, log_every=5, min_steps_left=50)
    assert abs(worst(errors)[1]) <= TOLERANCE, worst(errors)


def test_steps_stalled_now_and_then_count_at_their_share() -> None:
    # Every 40th step stalls 0.3 s (a figure drawn on the ranks' cores, a collection): the mean step is 17.5 ms.
    # A median of recent windows sees the 10 ms ones and promises the end in little more than half the time left.
    times = [0.01 + (0.3 if k % 40 == 39 else 0.0) for k in range(5000)]
    errors = relative_errors(times, log_every=5, min_steps_left=200)
    assert abs(worst(errors)[1]) <= TOLERANCE, worst(errors)
    mean = sum(times) / len(times)
    rows = rows_of(times, log_every=5)
    assert smoothed_step_time(rows[:500]) == pytest.approx(mean, rel=0.05)


def test_a_lasting_change_of_pace_shows_within_two_horizons() -> None:
    times = [0.01] * 3000 + [0.03] * 7000  # the pace drops to a third at step 3000 (30 s in)
    rows = rows_of(times, log_every=5)
    change_s = sum(times[:3000])
    for i, row in enumerate(rows):
        assert row.elapsed_s is not None
        if row.elapsed_s > change_s + 2 * ETA_HORIZON_S[0] and row.step < 9900:
            pace = smoothed_step_time(rows[: i + 1])
            assert pace is not None and abs(pace - 0.03) <= TOLERANCE * 0.03, (row.step, pace)


def test_a_single_slow_window_counts_as_part_of_the_pace_not_as_the_pace() -> None:
    # one window ten times slower (an eval, a neighbour's burst)
    times = [0.2] * 24 + [2.0] * 5 + [0.2] * 71
    rows = rows_of(times, log_every=5)
    eta = eta_s(Reading(rows=rows[:6]), 100, 30)
    # 70 steps at the fast pace take 14 s, at the slow one 140 s: the newest window weighs most, yet is one of five.
    assert eta is not None and 14 < eta < 0.4 * 140


def test_a_resumed_session_times_only_its_own_steps() -> None:
    before = rows_of([0.5] * 100, log_every=5)  # the first session: slow steps
    after = [
        MetricsRow(
            step=r.step + 100, loss=1.0, step_time_s=0.01, elapsed_s=50.0 + 0.01 * (r.step - 1)
        )
        for r in rows_of([0.01] * 100, log_every=5)
    ]
    reading = Reading(rows=before + after, session_step=100)
    assert eta_s(reading, 300, 200) == pytest.approx(0.01 * 100)


def test_without_a_window_between_rows_the_first_rows_own_time_is_used() -> None:
    [row] = rows_of([0.3] + [0.1] * 4, log_every=5)
    assert eta_s(Reading(rows=[row]), 100, 5) == pytest.approx(row.step_time_s * 95)
    assert eta_s(Reading(rows=[]), 100, 0) is None


# ---- a real run with a known step time -----------------------------------------------------------
def test_a_run_of_sleeping_steps_gets_an_eta_within_20_percent(runs_dir: Path) -> None:
    # Each step sleeps 50 ms in the task's loss: a known pace that a loaded machine stretches little (sleeping
    # needs no CPU, and the step's own work is a few ms). The ETA is what the dashboard computes from the rows as they were when written; the time
    # actually left is what timings.json says the remaining steps took. The last step's time also holds the
    # final evaluation and checkpoint, which the ETA (to the last step) leaves out: it counts as a typical step.
    cfg = wb.RunConfig(
        task="tiny-regression",
        num_processes=1,
        device="cpu",
        micro_batch_size=16,
        max_steps=100,
        log_every=2,
        eval_every=0,
        runs_dir=str(runs_dir),
        trackers=[],
        monitor_interval_s=0,
        task_options={"slow_s": 0.05},
    )
    result = wb.launch(cfg, task=TinyRegression())
    times = read_json(result.dir.timings_path)["step_time_s"]
    rows = [r for r in result.dir.metrics_rows() if r.is_train]
    assert len(times) == 100 and min(times) >= 0.05
    typical = statistics.median(times)
    checked = []
    for i, row in enumerate(rows):
        if row.step < 10 or row.step > 90:
            # after 10% of the run; while 10 steps (0.5 s) or more remain
            continue
        left = sum(times[row.step : -1]) + typical
        eta = eta_s(Reading(rows=rows[: i + 1]), 100, row.step)
        assert eta is not None
        checked.append((row.step, round(eta, 3), round(left, 3)))
        assert abs(eta - left) <= TOLERANCE * left, (checked, [round(t, 3) for t in times])
    assert len(checked) >= 40
