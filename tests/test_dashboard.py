"""The dashboard's live numbers, figure and static snapshot, without a browser; recorded names of labelled runs."""

from __future__ import annotations

import base64
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from IPython.core.formatters import DisplayFormatter
from matplotlib.figure import Figure

import workbench as wb
import workbench.notebook.dashboard as dashboard_mod
import workbench.regress.recording as rec
from workbench import rundir
from workbench.notebook.axis_format import sci
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.pace import eta_s, run_average
from workbench.notebook.plots import LIVE_POINTS, LiveFigure, draw, ema
from workbench.notebook.reading import Reading, RowTail, lower_thread_priority
from workbench.rundir import MetricsRow
from workbench.utils import files
from workbench.utils.units import fmt_duration

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
BATCH = 64


def trainer_rows(step_times: list[float], log_every: int) -> list[dict[str, Any]]:
    """Rows as the trainer writes them: a row at step k is logged before step k's own time is counted, so its
    elapsed_s holds the steps before it; samples/s and step time are the window's."""
    rows, window_start = [], 0.0
    for k in range(log_every, len(step_times) + 1, log_every):
        elapsed = sum(step_times[: k - 1])
        window = (elapsed + step_times[k - 1] - window_start) / log_every
        rows.append(
            {
                "step": k,
                "loss": 2.0 / k,
                "lr": 3e-4,
                "step_time_s": window,
                "samples_per_s": BATCH / window,
                "peak_memory_bytes": 300 * 2**20,
                "samples": k * BATCH,
                "elapsed_s": elapsed,
                "eta_s": window * (100 - k),
            }
        )
        window_start = elapsed + step_times[k - 1]
    return rows


def fake_run(
    tmp_path: Path, rows: list[dict[str, Any]], max_steps: int = 100, **summary: Any
) -> Path:
    run_dir = tmp_path / "runs" / "fake-run"
    run_dir.mkdir(parents=True)
    wb.RunConfig(max_steps=max_steps).to_yaml(run_dir / rundir.CONFIG)
    files.write_json(
        run_dir / rundir.SUMMARY,
        {
            "status": "running",
            "world_size": 2,
            "precision": "fp32",
            "global_batch_size": BATCH,
            **summary,
        },
    )
    files.append_jsonl(run_dir / rundir.EVENTS, {"time": 0.0, "event": "started", "step": 0})
    for row in rows:
        files.append_jsonl(run_dir / rundir.METRICS, row)
    return run_dir


# ---- live numbers --------------------------------------------------------------------------------
def test_run_average_counts_the_samples_of_the_timed_steps(tmp_path: Path) -> None:
    times = [0.5] + [0.1] * 9 + [0.3] * 10  # a slow first step, then two speeds
    dash = Dashboard(fake_run(tmp_path, trainer_rows(times, log_every=5)))
    # At step 20 the row has timed steps 1..19: summary.json's definition, samples / training time, over them.
    assert dash.run_average == pytest.approx(19 * BATCH / sum(times[:19]), rel=1e-12)
    window_rate = BATCH / 0.3
    assert (
        f"{window_rate:,.0f} (last 5 steps) · {dash.run_average:,.0f} (run average)"
        in dash.stats.value
    )
    assert "300.0 ms (last 5 steps)" in dash.stats.value


@pytest.mark.slow
def test_run_average_matches_the_summary_of_a_real_run(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        max_steps=20,
        log_every=5,
        micro_batch_size=16,
        device="cpu",
        runs_dir=str(runs_dir),
    )
    result = wb.launch(cfg)
    summary, rows = result.summary, result.dir.metrics_rows()
    timings = files.read_json(result.run_dir / "timings.json")["step_time_s"]
    batch = summary["global_batch_size"]
    # What summary.json's samples_per_s is: this session's samples over its step times.
    assert summary["samples_per_s"] == pytest.approx(len(timings) * batch / sum(timings), rel=1e-9)

    dash = Dashboard(result)
    assert dash.ended and dash.run_average == pytest.approx(summary["samples_per_s"], rel=1e-9)
    assert f"{summary['samples_per_s']:,.0f} (run average)" in dash.stats.value
    assert "(last 5 steps)" in dash.stats.value
    # While it ran, the same definition over the steps its rows had timed: every row agrees with timings.json.
    for row in (r for r in rows if r.is_train):
        live = Reading(
            rows=[r for r in rows if r.step <= row.step], summary={"global_batch_size": batch}
        )
        k = row.step
        assert run_average(live, ended=False) == pytest.approx(
            (k - 1) * batch / sum(timings[: k - 1]), rel=1e-9
        )


def test_the_progress_line_shows_the_eta_at_the_smoothed_pace(tmp_path: Path) -> None:
    # Every 40th step stalls 0.3 s: the mean step is 17.5 ms, most windows' 10 ms (tests/test_eta_accuracy.py
    # holds the estimator's own tests).
    times = [0.01 + (0.3 if k % 40 == 39 else 0.0) for k in range(600)]
    dash = Dashboard(fake_run(tmp_path, trainer_rows(times, log_every=5), max_steps=1000))
    eta = eta_s(dash.reading, 1000, 600)
    assert dash.step == 600 and eta == pytest.approx(400 * 0.0175, rel=0.05)
    assert f"ETA {fmt_duration(eta)}" in dash.progress_text.value


# ---- the figure ----------------------------------------------------------------------------------
def _rows_with_wobble() -> list[dict[str, Any]]:
    return [
        {
            "step": s,
            "loss": 2.0 / s + 0.05 * (-1) ** s,
            "lr": 3e-4 * (1 - s / 100),
            "samples_per_s": 640.0,
            "peak_memory_bytes": 300 * 2**20 + (s % 2) * 2**20,
        }
        for s in range(5, 105, 5)
    ]


def test_figure_memory_from_zero_log_loss_ema_lr_ticks_and_step() -> None:
    fig = Figure()
    rows = _rows_with_wobble()
    draw(fig, [("run", rows)], log_loss=True, drawn_at=100)
    ax_loss, _, ax_mem, ax_lr = fig.axes
    assert ax_mem.get_ylim()[0] == 0  # a 1 MiB wobble on 300 MiB stays flat
    assert ax_loss.get_yscale() == "log"
    raw, smooth = ax_loss.get_lines()[:2]
    assert list(smooth.get_ydata()) == pytest.approx(ema([r["loss"] for r in rows]))
    assert (
        smooth.get_label() == "run train (EMA)"
        and raw.get_alpha() < 1
        and smooth.get_alpha() in (None, 1)
    )
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax_lr.get_yticklabels() if t.get_text()]
    assert ticks and all(re.fullmatch(r"-?\d(\.\d+)?e-?\d+|0", t) for t in ticks), ticks
    assert any(t.get_text() == "drawn at step 100" for t in fig.texts)
    # A learning rate that barely decays still gets ticks that differ from each other.
    slow = Figure()
    draw(slow, [("run", [dict(r, lr=1e-3 * (1 - 1e-4 * r["step"])) for r in rows])])
    slow.canvas.draw()
    ticks = [t.get_text() for t in slow.axes[3].get_yticklabels() if t.get_text()]
    assert len(ticks) > 2 and len(set(ticks)) == len(ticks), ticks


def test_sci_labels_and_ema() -> None:
    assert (sci(3e-4), sci(2.5e-4), sci(0.0), sci(1e-2)) == ("3e-4", "2.5e-4", "0", "1e-2")
    smooth = ema([1.0, 3.0, 1.0, 3.0, 1.0, 3.0])
    # debiased, and calmer than the raw swing
    assert smooth[0] == 1.0 and max(smooth[2:]) - min(smooth[2:]) < 1.0


def test_overlaid_runs_differ_in_colour_line_style_and_marker() -> None:
    fig = Figure()
    draw(fig, [(name, _rows_with_wobble()) for name in ("fp32", "bf16", "fp16")])
    emas = [
        line for line in fig.axes[0].get_lines() if line.get_label() in ("fp32", "bf16", "fp16")
    ]
    assert len(emas) == 3
    for attr in ("get_color", "get_linestyle", "get_marker"):
        assert len({getattr(line, attr)() for line in emas}) == 3, attr
    # One legend entry per run; the title says what the lines are.
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["fp32", "bf16", "fp16"]
    assert fig.axes[0].get_title() == "loss (log scale), train smoothed (EMA)"  # 2/s: past a decade


def test_overlaid_runs_with_evaluations_get_one_eval_entry_not_one_per_run() -> None:
    fig = Figure()
    rows = [
        dict(r, eval_loss=r["loss"] * 1.1) if r["step"] % 20 == 0 else r
        for r in _rows_with_wobble()
    ]
    draw(fig, [("ddp", rows), ("zero3", rows)])
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "ddp",
        "zero3",
        "eval (hollow markers)",
    ]
    evals = [
        line
        for line in fig.axes[0].get_lines()
        if line.get_linestyle() == "None" and len(line.get_xdata())
    ]
    assert len(evals) == 2 and {line.get_color() for line in evals} == {"C0", "C1"}


def test_the_loss_axis_goes_log_once_the_loss_spans_a_decade_and_the_toggle_decides() -> None:
    steady = [dict(r, loss=1.0 + 0.5 / r["step"]) for r in _rows_with_wobble()]  # 1.1 to 1.005
    # 0.4 to 0.02: more than a decade
    falling = [dict(r, loss=2.0 / r["step"]) for r in _rows_with_wobble()]
    for rows, log_loss, scale in (
        (steady, None, "linear"),
        (falling, None, "log"),
        (falling, False, "linear"),
        (steady, True, "log"),
    ):
        fig = Figure()
        draw(fig, [("run", rows)], log_loss=log_loss)
        assert fig.axes[0].get_yscale() == scale, (log_loss, scale)
        assert fig.axes[0].get_title() == "loss" + (" (log scale)" if scale == "log" else "")


def test_the_dashboard_toggle_sets_the_loss_axis(tmp_path: Path) -> None:
    dash = Dashboard(fake_run(tmp_path, trainer_rows([0.1] * 40, log_every=5)), log_loss=False)
    assert dash.loss_scale.value == "linear" and dash.log_loss is False
    drawn = dash.figures_drawn
    dash.loss_scale.value = "log"  # as a click would
    assert dash.log_loss is True and dash.figures_drawn == drawn + 1
    dash.log_loss = None  # and the other way: the trait moves the toggle
    assert dash.loss_scale.value == "auto"


def test_the_live_figure_is_moved_in_place_and_thinned() -> None:
    live = LiveFigure()
    rows = [MetricsRow.from_dict(r) for r in trainer_rows([0.01] * 5000, log_every=5)]  # 1000 rows
    live.png("x2 fp32", rows[:20], title="run", log_loss=False, drawn_at=100)
    png = live.png("x2 fp32", rows, title="run", log_loss=False, drawn_at=5000)
    assert png.startswith(b"\x89PNG") and live.builds == 1  # more rows: the same axes, lines moved
    loss, ema_line = live.figure.axes[0].get_lines()[:2]
    # thinned, newest kept
    assert len(loss.get_xdata()) <= LIVE_POINTS and list(loss.get_xdata())[-1] == 5000
    assert list(ema_line.get_xdata())[-1] == 5000
    assert live.figure.axes[0].get_xlim()[1] >= 5000  # rescaled to the new rows
    assert any(t.get_text() == "drawn at step 5000" for t in live.figure.texts)
    live.png("x2 fp32", rows, title="run", log_loss=True, drawn_at=5000)
    # the scale changes in place too
    assert live.builds == 1 and live.figure.axes[0].get_yscale() == "log"
    assert live.figure.axes[0].get_title() == "loss (log scale)"
    live.png(
        "x2 fp32",
        [*rows, MetricsRow(step=5000, eval_loss=0.5)],
        title="run",
        log_loss=False,
        drawn_at=5000,
    )
    assert live.builds == 2  # an eval row adds a legend entry: built again


def test_the_figure_is_drawn_when_rows_come_and_the_cadence_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A redraw "costs" so much CPU that the next may come only in ages: new rows then update the numbers, not the
    # figure, until a draw is forced or the run ends. Building the figure is paid once and paces nothing.
    monkeypatch.setattr(dashboard_mod, "FIGURE_CPU_SHARE", 1e-12)
    rows = trainer_rows([0.1] * 30, log_every=5)
    run_dir = fake_run(tmp_path, rows[:2])
    dash = Dashboard(run_dir, interval=0.01, figure_interval=0.01)
    assert dash.figures_drawn == 1  # built
    dash.refresh()
    assert dash.figures_drawn == 1  # nothing new: nothing drawn
    files.append_jsonl(run_dir / rundir.METRICS, rows[2])
    time.sleep(0.02)
    dash.refresh()
    # new rows after figure_interval: moved, and that redraw paces the next
    assert dash.figures_drawn == 2
    files.append_jsonl(run_dir / rundir.METRICS, rows[3])
    dash.refresh()
    assert dash.step == 20 and "step 20/100" in dash.progress_text.value and dash.figures_drawn == 2
    dash.refresh(force_draw=True)
    assert dash.figures_drawn == 3
    files.append_jsonl(run_dir / rundir.METRICS, rows[4])
    files.write_json(
        run_dir / rundir.SUMMARY, {"status": "completed", "steps": 25, "world_size": 2}
    )
    dash.refresh()
    assert dash.ended and dash.figures_drawn == 4  # the final figure, whatever the cadence


def test_no_empty_image_before_the_first_step_then_one_figure(tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path, [])
    dash = Dashboard(run_dir)
    assert dash.image.layout.display == "none" and bytes(dash.image.value) == b""
    assert "waiting for the first logged step" in dash.placeholder.value
    for row in trainer_rows([0.1] * 10, log_every=5):
        files.append_jsonl(run_dir / rundir.METRICS, row)
    dash.refresh(force_draw=True)
    assert bytes(dash.image.value).startswith(b"\x89PNG") and dash.image.layout.display is None
    assert dash.placeholder.layout.display == "none"
    before = bytes(dash.image.value)
    dash.log_loss = True  # the trait redraws at once
    assert bytes(dash.image.value).startswith(b"\x89PNG") and bytes(dash.image.value) != before


def test_a_failed_run_ends_with_one_figure_and_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = fake_run(tmp_path, trainer_rows([0.1] * 20, log_every=5))
    dash = Dashboard(run_dir, interval=0.05, figure_interval=0.05)
    files.write_json(
        run_dir / rundir.SUMMARY,
        {
            "status": "failed",
            "steps": 20,
            "world_size": 2,
            "error": {"rank": 1, "type": "ValueError", "message": "boom"},
        },
    )
    dash.start()
    dash.stop(timeout=10)  # the poller's last refresh and stop()'s final one both render
    dash.refresh(force_draw=True)
    assert not dash.polling and dash.stats.value.count("boom") == 1
    assert [type(c).__name__ for c in dash.children].count("Image") == 1
    shown: list[dict[str, Any]] = []
    monkeypatch.setattr(dashboard_mod, "in_kernel", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda obj, **kw: shown.append(obj))
    dash.show_final()
    dash.show_final()  # a second call (wait() twice) adds nothing
    assert (
        len(shown) == 1
        and shown[0]["text/html"].count("<img") == 1
        and shown[0]["text/html"].count("boom") == 1
    )
    # for readers that take only images
    assert base64.b64decode(shown[0]["image/png"]) == dash.figure_png()
    # The live view points to the static copy instead of showing the figure a second time.
    assert (
        dash.final_shown
        and dash.image.layout.display == "none"
        and "below" in dash.placeholder.value
    )


# ---- static snapshot in the display bundle -------------------------------------------------------
def test_dashboard_bundle_has_the_widget_and_a_static_snapshot(tmp_path: Path) -> None:
    dash = Dashboard(fake_run(tmp_path, trainer_rows([0.1] * 20, log_every=5)))
    data, _ = DisplayFormatter().format(dash)  # as IPython formats it for a notebook output
    assert data[WIDGET_VIEW]["model_id"] == dash.model_id
    page = data["text/html"]
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert png and base64.b64decode(png.group(1)) == dash.figure_png()
    assert "running" in page and "step 20/100 (20%)" in page and "(last 5 steps)" in page
    assert "VBox(" not in data["text/plain"] and "fake-run" in data["text/plain"]


def test_panel_bundle_has_the_widget_and_a_static_snapshot(tmp_path: Path, runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="digits", num_processes=2, max_steps=42, micro_batch_size=8, runs_dir=str(runs_dir)
    )
    panel = wb.Panel(cfg, display=False, estimate=False)
    bundle = panel._repr_mimebundle_()
    assert bundle[WIDGET_VIEW]["model_id"] == panel.widget.model_id
    page = bundle["text/html"]
    assert "data-status='ready'" in page and "global batch <b>16</b>" in page
    assert re.search(r"max steps</td><td [^>]*class='wb-snapshot-setting-max-steps'>42<", page)
    # one line names the run; the twenty settings rows are behind it
    assert (
        "<summary><b>workbench</b>: digits, 2 processes, ddp, fp32, micro-batch 8 x 1, 42 steps</summary>"
        in page
    )
    assert (
        page.index("<details")
        < page.index("wb-snapshot-setting-max-steps")
        < page.index("</details>")
    )
    # What the settings imply, as the live panel shows it: the rank layout and the estimate box.
    assert panel.layout_box.value.strip()
    assert f"<div class='wb-snapshot-layout'>{panel.layout_box.value}</div>" in page
    panel.estimate_box.html.value = (
        "<div class='wb-estimate'>fits: 0.3 GiB of 16 GiB per rank</div>"
    )
    page = panel._repr_mimebundle_()["text/html"]
    assert (
        "<div class='wb-snapshot-estimate'><div class='wb-estimate'>fits: 0.3 GiB of 16 GiB per rank</div>"
        in page
    )
    failed = fake_run(
        tmp_path,
        trainer_rows([0.1] * 10, log_every=5),
        status="failed",
        error={"rank": 1, "type": "ValueError", "message": "boom"},
    )
    panel.dashboard = Dashboard(failed)
    page = panel._repr_mimebundle_()["text/html"]
    assert page.count("<img") == 1 and "fake-run" in page
    assert "boom" not in page  # the panel's own error box says it; the dashboard's copy is left out


# ---- recorded names ------------------------------------------------------------------------------
class _Shell:
    kernel = object()


def _fake_result(run_dir: Path) -> wb.RunResult:
    run_dir.mkdir(parents=True)
    files.write_json(
        run_dir / rundir.SUMMARY, {"status": "completed", "final_loss": 0.5, "samples_per_s": 9.0}
    )
    return wb.RunResult(run_dir)


def test_runs_are_recorded_under_their_label(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[dict[str, Any]] = []
    monkeypatch.setattr(rec.kernel, "kernel_shell", lambda: _Shell())
    monkeypatch.setattr(rec, "_display", shown.append)
    monkeypatch.setattr(rec, "_prefix_counts", {})
    monkeypatch.setattr(rec, "_run_names", {})
    with rec.recorded_as("bf16"):
        assert rec.record_run(_fake_result(tmp_path / "a")) == "bf16"
        assert rec.record_run(_fake_result(tmp_path / "b")) == "bf16_1"
    with rec.recorded_as(None):
        assert rec.record_run(_fake_result(tmp_path / "c")) is None  # a repeat: not recorded
    assert rec.record_run(_fake_result(tmp_path / "d")) == "run"  # outside any block: as before
    names = [
        m["name"] for b in shown if rec.METRIC_MIME in b for m in b[rec.METRIC_MIME]["metrics"]
    ]
    assert names == [
        "bf16.final_loss",
        "bf16.samples_per_s",
        "bf16_1.final_loss",
        "bf16_1.samples_per_s",
        "run.final_loss",
        "run.samples_per_s",
    ]
    with pytest.raises(ValueError, match="label='32 x 1'"):
        with rec.recorded_as("32 x 1"):
            pass


def test_the_step_time_breakdown_is_a_bar_per_rank_with_the_slowest_marked(tmp_path: Path) -> None:
    rows = trainer_rows([0.1] * 10, log_every=5)
    rows[-1].update(
        {
            "data_ms_per_rank": [1.0, 1.0],
            "compute_ms_per_rank": [10.0, 40.0],
            "comm_ms_per_rank": [30.0, 1.0],
            "optimizer_ms_per_rank": [2.0, 2.0],
            "other_ms_per_rank": [1.0, 1.0],
            "comm_measured": True,
            "slowest_rank": 1,
            "verdicts": ["rank 1 is 238% slower than the others: they wait for it every step"],
        }
    )
    dash = Dashboard(fake_run(tmp_path, rows))
    dash.refresh(draw=False)
    bars = re.findall(
        r"<div class='wb-breakdown-rank' data-rank='(\d)'.*?</span></div>", dash.breakdown.value
    )
    assert bars == ["0", "1"]
    rank1 = dash.breakdown.value.split("data-rank='1'")[1]
    assert (
        "◀ straggler: 43.0 ms of its own work" in rank1
        and "◀" not in dash.breakdown.value.split("data-rank='1'")[0]
    )
    # widths are shares of the longest step (45 ms): rank 1's compute is 40/45 of the bar
    assert re.search(
        r"wb-breakdown-compute' title='forward\+backward: 40.00 ms \(89%\)' style='width:88.89%",
        rank1,
    )
    assert "⚠ rank 1 is 238% slower" in dash.breakdown.value
    snapshot = dash.snapshot_html()
    assert "where the step time goes" in snapshot and "◀ straggler" in snapshot
    # a row without a breakdown (an old run directory) shows none
    old = Dashboard(fake_run(tmp_path / "old", trainer_rows([0.1] * 10, log_every=5)))
    old.refresh(draw=False)
    assert old.train_rows and old.breakdown.value == ""


def test_the_mark_and_the_verdict_name_the_same_rank_or_none(tmp_path: Path) -> None:
    """Rank 0 does more of its own work; rank 1's bar reads longer only for waiting in communication. The mark
    goes where the trainer's verdict points (the same measure), and with no straggler no rank is marked."""

    def marks(
        compute: list[float], comm: list[float], straggler: int | None, verdicts: list[str]
    ) -> list[str]:
        rows = trainer_rows([0.1] * 10, log_every=5)
        rows[-1].update(
            {
                "data_ms_per_rank": [0.5, 0.5],
                "compute_ms_per_rank": compute,
                "comm_ms_per_rank": comm,
                "optimizer_ms_per_rank": [1.0, 1.0],
                "other_ms_per_rank": [0.5, 0.5],
                "comm_measured": True,
                "slowest_rank": straggler,
                "verdicts": verdicts,
            }
        )
        dash = Dashboard(fake_run(tmp_path / f"{compute}{comm}{straggler}", rows))
        dash.refresh(draw=False)
        # the snapshot shows the same bars
        assert dash.breakdown.value in dash.snapshot_html(figure=False)
        marked = re.findall(
            r"data-rank='(\d)'.*?font-size:90%'>[\d.]+ ms( <b class='wb-slowest'>)?",
            dash.breakdown.value,
        )
        return [rank for rank, mark in marked if mark]

    verdict = "rank 0 is 61% slower than the others: they wait for it every step"
    assert marks([7.3, 4.0], [1.0, 4.4], 0, [verdict]) == ["0"]
    assert marks([7.3, 4.0], [1.0, 4.4], None, []) == [], (
        "no verdict: no mark, whichever bar is longer"
    )


# ---- reading a poll at a time --------------------------------------------------------------------
def test_metrics_are_read_a_poll_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / rundir.METRICS
    tail = RowTail(path)
    assert tail.read() == []  # not written yet
    rows = trainer_rows([0.1] * 20, log_every=5)
    for row in rows[:2]:
        files.append_jsonl(path, row)
    first = tail.read()
    assert [r.step for r in first] == [
        5,
        10,
    ] and tail.read() is first  # nothing new: the same list, unread
    with path.open("a") as f:
        f.write('{"step": 15, "loss": 0.1')  # a row being written
    assert [r.step for r in tail.read()] == [5, 10]
    with path.open("a") as f:
        f.write(', "lr": 0.001}\nnot json\n')
    # the finished row; a line that isn't one, skipped
    assert [r.step for r in tail.read()] == [5, 10, 15]
    files.write_jsonl(path, rows[3:])  # replaced whole (a new file): read again from its start
    assert [r.step for r in tail.read()] == [20]
    files.append_jsonl(path, {"step": "twenty-five", "loss": 1.0})
    for _ in range(2):  # a row that doesn't fit the schema is named, at every read
        with pytest.raises(ValueError, match=r"metrics.jsonl, row 2: .*step"):
            tail.read()


def test_the_polling_thread_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    if sys.platform != "linux":
        pytest.skip("a thread has its own priority on Linux only")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    dash = Dashboard(
        fake_run(tmp_path, trainer_rows([0.1] * 10, log_every=5)), interval=0.05
    ).start()
    try:
        thread = dash._thread
        assert thread is not None and thread.native_id is not None
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, thread.native_id) != 19:
            assert time.monotonic() < deadline, "the polling thread kept its priority"
            time.sleep(0.01)
        assert dash.polling  # still polling a run that goes on, at nice 19
    finally:
        dash.stop(timeout=10)
    # the caller's is its own
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_lowering_the_priority_takes_only_the_calling_thread() -> None:
    if sys.platform != "linux":
        assert lower_thread_priority() is False
        return
    seen: list[int] = []

    def lowered() -> None:
        seen.extend(
            [
                int(lower_thread_priority()),
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
            ]
        )

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join(10)
    assert seen == [1, 19] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


@pytest.mark.parametrize("headless", [True, False], ids=["headless", "a-persons-notebook"])
def test_a_panel_executed_headless_saves_the_estimate_that_arrived_after_its_cell(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch, headless: bool
) -> None:
    """papermill keeps the snapshot as last displayed; the estimate arrives after the panel's cell has finished,
    so a headless run refreshes the snapshot then (it stayed at "estimating..."). A person's notebook is left
    alone: re-displaying would re-create the live widget's view under their cursor."""
    import workbench.regress.recording as rec

    monkeypatch.setattr(rec, "headless", lambda: headless)
    cfg = wb.RunConfig(task="digits", num_processes=2, runs_dir=str(runs_dir))
    panel = wb.Panel(cfg, display=False, estimate=False)
    updates: list[dict] = []
    panel._display = type(
        "Handle", (), {"update": lambda self, bundle, raw: updates.append(bundle)}
    )()
    panel.estimate_box.state.status = "estimating"
    assert updates == []
    panel.estimate_box.html.value = (
        "<div class='wb-estimate'>fits: 0.3 GiB of 16 GiB per rank</div>"
    )
    panel.estimate_box.state.status = "done"
    if headless:
        [bundle] = updates
        assert "fits: 0.3 GiB of 16 GiB per rank" in bundle["text/html"] and WIDGET_VIEW in bundle
    else:
        assert updates == []
