"""wb.Panel and the live dashboard, without a browser: widget values in, state and widget values out."""

from __future__ import annotations

import html
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest

import workbench as wb
from workbench import rundir
from workbench.config import Precision
from workbench.config.preflight import preflight
from workbench.launcher.processes import describe_launch
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.panel import controls as panel_mod
from workbench.rundir import RunDir
from workbench.tasks.digits import DigitsTask
from workbench.utils import files
from workbench.utils.hardware import GPU, Hardware, detect


def until(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def tiny(runs_dir: Path, **changes: Any) -> wb.RunConfig:
    """Digits on 2 CPU processes: a few seconds end to end."""
    base = dict(
        task="digits",
        num_processes=2,
        max_steps=20,
        log_every=5,
        micro_batch_size=16,
        device="cpu",
        runs_dir=str(runs_dir),
    )
    return wb.RunConfig(**{**base, **changes})


def expected_error(make: Callable[[], Any]) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


# ---- controls <-> RunConfig ----------------------------------------------------------------------
def test_controls_round_trip_keeps_fields_without_a_control(runs_dir: Path) -> None:
    cfg = tiny(
        runs_dir,
        num_processes=1,
        parallelism="none",
        precision="bf16",
        micro_batch_size=8,
        grad_accum_steps=3,
        max_steps=42,
        lr=3e-4,
        run_name="rt-1",
        warmup_steps=4,
        seed=7,
        weight_decay=0.1,
        task_options={"hidden": 32},
    )
    panel = wb.Panel(cfg, estimate=False)
    c = panel.controls
    assert (
        c["task"].value,
        c["num_processes"].value,
        c["parallelism"].value,
        c["precision"].value,
    ) == ("digits", 1, "none", "bf16")
    assert (
        c["micro_batch_size"].value,
        c["grad_accum_steps"].value,
        c["max_steps"].value,
        c["lr"].value,
        c["run_name"].value,
    ) == ("8", 3, 42, 3e-4, "rt-1")
    assert panel.config == cfg

    c["num_processes"].value = 2
    c["parallelism"].value = "ddp"
    c["grad_accum_steps"].value = 2
    c["run_name"].value = ""
    assert panel.config == cfg.replace(
        num_processes=2, parallelism="ddp", grad_accum_steps=2, run_name=None
    )
    # no control: kept
    assert panel.config.task_options == {"hidden": 32} and panel.config.seed == 7
    assert "global batch <b>32</b>" in panel.batch_info.value  # 8 x 2 x 2
    assert panel.launch_info.value == html.escape(describe_launch(panel.config))

    other = tiny(runs_dir, max_steps=7, lr=0.01)
    panel.config = other
    assert panel.config == other and c["max_steps"].value == 7


def test_invalid_combination_shows_runconfig_message_and_disables_launch(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir), estimate=False)
    assert panel.state.problem == "" and not panel.launch_button.disabled

    panel.controls["parallelism"].value = "none"  # with 2 processes: RunConfig refuses it
    message = expected_error(lambda: tiny(runs_dir, parallelism="none"))
    assert panel.state.problem == message
    assert (
        panel.state.config is None and panel.launch_button.disabled and panel.save_button.disabled
    )
    assert "parallelism=&#x27;none&#x27; with num_processes=2" in panel.problem_box.value
    with pytest.raises(ValueError, match="parallelism='none'"):
        panel.config  # noqa: B018
    with pytest.raises(ValueError, match="parallelism='none'"):
        panel.launch()

    panel.controls["parallelism"].value = "ddp"
    assert panel.state.problem == "" and not panel.launch_button.disabled

    # A config RunConfig accepts but this machine can't run: check()'s message, and Save stays on.
    panel.controls["precision"].value = "fp16"
    assert panel.state.problem == expected_error(
        lambda: preflight(tiny(runs_dir, precision="fp16"))
    )
    assert panel.launch_button.disabled and not panel.save_button.disabled


def test_fp8_is_offered_and_labelled_for_the_machine_or_the_target(runs_dir: Path) -> None:
    fp8 = wb.Panel(tiny(runs_dir, precision="fp8"), estimate=False)
    assert fp8.controls["precision"].value == "fp8" and fp8.config.precision == "fp8"
    # preflight's first refusal first, then the task's (every problem at once)
    assert fp8.state.problems[0] == expected_error(
        lambda: preflight(tiny(runs_dir, precision="fp8"))
    )
    fp8.target_controls.gpu.value = (
        "H100-SXM-80GB"  # relabelled for the target, which has fp8 cores
    )
    assert ("fp8", "fp8") in fp8.controls["precision"].options


def test_task_options_problem_is_shown(runs_dir: Path) -> None:
    cfg = tiny(runs_dir, task_options={"hiden": 64})
    panel = wb.Panel(cfg, estimate=False)
    assert panel.state.problem == expected_error(lambda: preflight(cfg))
    assert "hiden" in panel.state.problem and panel.launch_button.disabled


def test_unavailable_precisions_have_short_labels_and_the_reason_beside(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir), estimate=False)
    hw = detect()
    control = panel.controls["precision"]
    labels = dict((value, label) for label, value in control.options)
    assert set(labels) == set(get_args(Precision))
    note = html.unescape(panel.form.precision_note.value)
    for precision, label in labels.items():
        problem = hw.precision_problem(precision, panel.device)
        # short enough for the dropdown: the reason goes to its tooltip and the note under it
        assert label == (precision if problem is None else f"{precision} (unavailable)")
        if problem is not None:
            assert problem in control.tooltip
            assert f"{precision}: {panel_mod.short_reason(precision, problem)}" in note
    if panel.device == "cpu":
        assert labels["fp16"] == "fp16 (unavailable)" and labels["bf16"] == "bf16"
        assert "fp16: needs a CUDA GPU" in note


def test_precision_labels_on_an_old_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    v100 = Hardware(
        cpu_count=8, gpus=(GPU(name="Tesla V100", compute_capability=(7, 0), memory_bytes=2**34),)
    )
    monkeypatch.setattr(panel_mod, "detect", lambda: v100)
    options, reasons = panel_mod.precision_options("cuda", shown="fp8")
    labels = dict((value, label) for label, value in options)
    assert labels["fp16"] == "fp16" and labels["fp32"] == "fp32"
    assert labels["bf16"] == "bf16 (unavailable)" and labels["fp8"] == "fp8 (unavailable)"
    assert reasons["bf16"] == v100.precision_problem("bf16", "cuda")
    note = html.unescape(panel_mod.precision_note_html(reasons))
    assert "bf16: needs compute capability 8.0+ (A100 and newer)" in note
    assert "fp8: needs a CUDA GPU of compute capability 8.9+" in note


def test_values_the_machine_cant_take_are_said_not_clamped(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir, num_processes=1), estimate=False)
    too_many = detect().max_processes(panel.device) + 1
    panel.controls["num_processes"].value = too_many
    # kept as typed, and refused with the reason
    assert panel.controls["num_processes"].value == too_many
    assert f"num_processes={too_many}: this machine has" in panel.state.problem
    assert panel.launch_button.disabled and "launching" not in panel.launch_info.value
    panel.controls["num_processes"].value = 1
    panel.controls["micro_batch_size"].value = "0"
    assert panel.controls["micro_batch_size"].value == "0"
    assert panel.state.problem.startswith("micro_batch_size=0")
    panel.controls[
        "micro_batch_size"
    ].value = "auto"  # a value of its own: the ranks pick the largest that fits
    assert panel.state.problem == "" and panel.config.micro_batch_size == "auto"
    assert "global batch <b>chosen at launch</b>" in panel.batch_info.value
    assert (
        wb.Panel(tiny(runs_dir, micro_batch_size="auto"), estimate=False).config.micro_batch_size
        == "auto"
    )


def test_user_task_is_offered_and_selected(runs_dir: Path) -> None:
    class Mine(DigitsTask):
        name = "mine"

    panel = wb.Panel(tiny(runs_dir), task=Mine(), estimate=False)
    assert ("mine (your task)", "mine") in panel.controls["task"].options
    assert "digits" in [value for _, value in panel.controls["task"].options]
    assert panel.config.task == "mine" and panel.state.problem == ""
    panel.controls["task"].value = "digits"
    assert panel.config.task == "digits"


def test_save_as_yaml(runs_dir: Path, tmp_path: Path) -> None:
    panel = wb.Panel(tiny(runs_dir, max_steps=9), estimate=False)
    panel.yaml_path.value = str(tmp_path / "run.yaml")
    panel.save_button.click()
    assert panel.state.error == ""
    assert wb.RunConfig.from_yaml(tmp_path / "run.yaml") == panel.config
    assert "workbench train" in panel.status_box.value

    panel.yaml_path.value = "  "
    panel.save_button.click()
    assert "path is empty" in panel.state.error and "path is empty" in panel.error_box.value
    assert (
        not panel.state.busy and not panel.save_button.disabled and not panel.launch_button.disabled
    )


def test_button_exception_is_shown_and_buttons_come_back(runs_dir: Path) -> None:
    (runs_dir / "taken").mkdir()
    (runs_dir / "taken" / "config.yaml").write_text("x: 1\n")
    panel = wb.Panel(tiny(runs_dir, run_name="taken"), estimate=False)
    panel.launch_button.click()  # rundir.prepare refuses before any process starts
    assert "already exists" in panel.state.error and "already exists" in panel.error_box.value
    assert panel.state.status == "ready" and not panel.launch_button.disabled
    assert not any(c.disabled for c in panel.controls.values())


# ---- dashboard from a run directory --------------------------------------------------------------
def _row(step: int, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 2.0 / step,
        "lr": 1e-3,
        "step_time_s": 0.05,
        "samples_per_s": 640.0,
        "tokens_per_s": 640.0 * 64,
        "peak_memory_bytes": 300 * 2**20,
        "peak_memory_bytes_per_rank": [300 * 2**20, 290 * 2**20],
        "eta_s": 0.05 * (100 - step),
        **extra,
    }


def _fake_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / "fake-run"
    run_dir.mkdir(parents=True)
    wb.RunConfig(max_steps=100).to_yaml(run_dir / rundir.CONFIG)
    files.write_json(
        run_dir / rundir.SUMMARY, {"status": "running", "world_size": 2, "precision": "fp32"}
    )
    return run_dir


def test_dashboard_reads_rows_from_a_run_directory(tmp_path: Path) -> None:
    run_dir = _fake_run(tmp_path)
    dash = Dashboard(run_dir)
    assert (
        dash.progress.value == 0
        and "starting" in dash.progress_text.value
        and bytes(dash.image.value) == b""
    )

    for step in (10, 20):
        files.append_jsonl(run_dir / rundir.METRICS, _row(step))
    files.append_jsonl(
        run_dir / rundir.METRICS, {"step": 20, "eval_loss": 0.5, "eval_accuracy": 0.75}
    )
    assert dash.refresh(force_draw=True) is False
    assert (dash.progress.value, dash.progress.max) == (20, 100)
    assert "step 20/100 (20%)" in dash.progress_text.value and "ETA 4 s" in dash.progress_text.value
    stats = dash.stats.value
    for text in (
        "0.1",
        "eval loss",
        "0.5 (step 20)",
        "0.75",
        "640",
        "40,960",
        "50.0 ms",
        "rank 0: 300 MiB, rank 1: 290 MiB",
        "0.001",
    ):
        assert text in stats, text
    assert bytes(dash.image.value).startswith(b"\x89PNG")

    files.append_jsonl(run_dir / rundir.METRICS, _row(30))
    files.write_json(
        run_dir / rundir.SUMMARY, {"status": "completed", "steps": 30, "wall_time_s": 3.0}
    )
    assert dash.refresh() is True
    assert dash.progress.value == 30 and "completed in 3 s" in dash.progress_text.value
    assert dash.progress.bar_style == "success"


def test_dashboard_polls_in_a_thread_until_the_run_ends(tmp_path: Path) -> None:
    run_dir = _fake_run(tmp_path)
    dash = Dashboard(run_dir, interval=0.1, figure_interval=0.1).start()
    try:
        assert dash.polling
        files.append_jsonl(run_dir / rundir.METRICS, _row(10))
        until(lambda: dash.progress.value == 10, 10, "the first row")
        until(lambda: dash.image.value, 10, "the first figure")
        files.append_jsonl(run_dir / rundir.METRICS, _row(50))
        until(lambda: dash.progress.value == 50, 10, "the second row")
        files.write_json(
            run_dir / rundir.SUMMARY,
            {
                "status": "failed",
                "steps": 50,
                "error": {"rank": 1, "type": "ValueError", "message": "boom"},
            },
        )
        until(lambda: not dash.polling, 10, "the poller to end with the run")
        assert (
            "rank 1: ValueError: boom" in dash.stats.value and dash.progress.bar_style == "danger"
        )
    finally:
        dash.stop()


# ---- real runs: launch, relaunch, stop, fail -----------------------------------------------------
class FailsOnRank1(DigitsTask):
    """Digits, except rank 1 raises on its third micro-batch."""

    name = "fails-on-rank-1"

    def __init__(self) -> None:
        self.calls = 0

    def loss(self, model: Any, batch: Any) -> Any:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls >= 3:
            raise ValueError("boom from rank 1 (a test task)")
        return super().loss(model, batch)


@pytest.mark.slow
def test_launch_wait_and_launch_again(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir), estimate=False)
    panel.launch_button.click()
    assert panel.state.error == ""
    assert panel.state.status in ("running", "completed")
    first = panel.run
    assert first is not None
    if panel.state.status == "running":  # a loaded machine takes seconds just to start the ranks
        assert panel.launch_button.disabled and all(c.disabled for c in panel.controls.values())
        assert not panel.stop_button.disabled
        with pytest.raises(RuntimeError, match="a run is going"):
            panel.launch()
    result = panel.wait(timeout=120)
    assert result.status == "completed" and panel.state.status == "completed"
    assert not panel.launch_button.disabled and panel.stop_button.disabled
    assert not any(c.disabled for c in panel.controls.values())
    assert panel.dashboard is not None and panel.dashboard.progress.value == 20
    assert "completed" in panel.dashboard.progress_text.value and panel.dashboard.image.value
    assert "wb-stat-loss" in panel.dashboard.stats.value

    panel.controls["max_steps"].value = 10
    panel.controls["grad_accum_steps"].value = 2
    run = panel.launch()
    result = panel.wait(timeout=120)
    assert run.run_dir != first.run_dir and result.summary["steps"] == 10
    assert result.config is not None and result.config.grad_accum_steps == 2
    assert panel.dashboard.run_dir == run.run_dir and panel.state.status == "completed"


@pytest.mark.slow
def test_stop_checkpoints_and_ends_cleanly(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir, max_steps=100_000), estimate=False)
    panel.launch()
    assert panel.dashboard is not None
    until(lambda: panel.dashboard.train_rows, 120, "the first metrics row")
    panel.stop_button.click()
    assert panel.state.status in ("stopping", "stopped") and panel.stop_button.disabled
    result = panel.wait(timeout=120)
    assert result.status == "stopped" and panel.state.status == "stopped"
    assert RunDir(result.run_dir).latest_checkpoint() is not None
    assert not panel.launch_button.disabled
    assert "stopped" in panel.dashboard.progress_text.value


@pytest.mark.slow
def test_failed_run_shows_the_rank_error_then_launches_again(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir), task=FailsOnRank1(), estimate=False)
    panel.launch_button.click()
    with pytest.raises(wb.RunFailedError) as info:
        panel.wait(timeout=120)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert panel.state.status == "failed"
    assert panel.state.error.startswith("rank 1 failed with ValueError: boom from rank 1")
    assert "boom from rank 1" in panel.error_box.value and "Traceback" in panel.error_box.value
    assert not panel.launch_button.disabled and not any(c.disabled for c in panel.controls.values())

    panel.controls["task"].value = "digits"
    panel.launch_button.click()
    assert panel.state.error == ""
    assert panel.wait(timeout=120).status == "completed" and panel.state.status == "completed"


def test_panel_offers_every_parallelism_with_its_explanation(runs_dir: Path) -> None:
    from workbench.config import PARALLELISM_MODES, Parallelism

    panel = wb.Panel(tiny(runs_dir), estimate=False)
    options = panel.controls["parallelism"].options
    assert [value for _, value in options] == list(get_args(Parallelism))
    for label, value in options:
        assert label.startswith(f"{value} (")
        panel.controls["parallelism"].value = value  # the full explanation shows under the dropdown
        assert html.escape(PARALLELISM_MODES[value]) in panel.mode_info.value
    panel.controls["parallelism"].value = "ddp"
    panel.controls["parallelism"].value = "hsdp"  # 2 processes can't form 2 shard groups
    assert (
        "dp_shard=0 with parallelism='hsdp'" in panel.state.problem and panel.launch_button.disabled
    )
    panel.controls["parallelism"].value = "zero3"
    assert (
        panel.state.problem == ""
        and "zero3 (parameters, gradients and optimizer state sharded" in panel.launch_info.value
    )


@pytest.mark.slow
def test_launching_zero3_from_the_panel_runs_sharded_ranks(runs_dir: Path) -> None:
    panel = wb.Panel(tiny(runs_dir, max_steps=10), estimate=False)
    panel.controls["parallelism"].value = "zero3"
    panel.launch_button.click()
    result = panel.wait(timeout=120)
    assert result.status == "completed" and result.summary["parallelism"] == "zero3"
    ranks = result.summary["ranks"]
    full = sum(p.numel() * 4 for p in DigitsTask().build_model(panel.config).parameters())
    assert all(r["sharded"] and 0 < r["params_bytes"] < full for r in ranks)
    assert sum(r["params_bytes"] for r in ranks) == full, (
        "each parameter byte lives on exactly one rank"
    )


@pytest.mark.slow
def test_the_estimate_box_says_whether_it_fits_and_what_would_make_it_fit(runs_dir: Path) -> None:
    from tasks_for_tests import TinyBlocks

    # 1.6B parameters
    big = wb.RunConfig(
        task="tiny-blocks",
        num_processes=1,
        parallelism="none",
        micro_batch_size=4096,
        device="cpu",
        max_steps=1000,
        runs_dir=str(runs_dir),
        task_options={"width": 8192, "blocks": 6, "n": 8192},
    )
    panel = wb.Panel(big, task=TinyBlocks())
    panel.target_controls.gpu.value = "L4-24GB"
    panel.target_controls.gpus_per_node.value = 1
    panel.estimate_box.wait(timeout=240)
    est = panel.estimate_box.state.result
    assert est is not None, panel.estimate_box.state.message
    assert not est.fits and est.target.name == "L4-24GB"
    text = panel.estimates.value
    assert "short by" in text and "rank 0" in text and "would fit with" in text
    assert "placeholder" not in text
    suggestions = panel.estimate_box.state.alternatives
    assert suggestions and all(alt.fits for _, alt in suggestions)
    for what, alt in suggestions:
        assert html.escape(what) in text and alt.peak < est.peak
    assert any("GPUs with zero3" in what for what, _ in suggestions), (
        "sharding over more GPUs fits it"
    )

    panel.target_controls.gpu.value = "H200-SXM-141GB"
    panel.estimate_box.wait(timeout=240)
    assert panel.estimate_box.state.result.target.name == "H200-SXM-141GB"
    assert "fits:" in panel.estimates.value


@pytest.mark.filterwarnings("ignore:num_processes=4 on")
def test_the_rank_layout_picture_follows_the_sizes(runs_dir: Path) -> None:
    import re

    panel = wb.Panel(
        tiny(
            runs_dir,
            task="char-gpt",
            num_processes=2,
            oversubscribe=True,
            task_options={"preset": "tiny", "n_layer": 4},
        ),
        estimate=False,
    )

    def cells() -> list[dict[str, int]]:
        html_ = panel.layout_box.value
        return [
            {
                k: int(v)
                for k, v in re.findall(r"data-(rank|dp-replicate|dp-shard|tp)='(\d+)'", cell)
            }
            for cell in re.findall(r"<div class='wb-layout-rank'[^>]*>", html_)
        ]

    # ddp on 2: two replicas, one rank each, rows of one
    assert [(c["rank"], c["dp-replicate"], c["tp"]) for c in cells()] == [(0, 0, 0), (1, 1, 0)]
    assert "dp_replicate 2" in panel.layout_box.value
    # zero3 x tp on 4: two rows (shards) of a tensor-parallel pair
    c = panel.controls
    c["num_processes"].value, c["parallelism"].value, c["tp"].value = 4, "zero3", 2
    assert panel.state.problem == "", panel.state.problem
    assert [(x["rank"], x["dp-shard"], x["tp"]) for x in cells()] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert (
        panel.layout_box.value.count("wb-layout-row") == 2
        and "dp_shard 2 × tp 2" in panel.layout_box.value
    )
    # hsdp on 4 (shard groups of 2): two replicas of two shards, one colour per replica
    c["tp"].value, c["parallelism"].value, c["dp_shard"].value = 1, "hsdp", 2
    assert [(x["dp-replicate"], x["dp-shard"]) for x in cells()] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    hues = re.findall(r"hsl\((\d+),", panel.layout_box.value)
    assert hues[0] == hues[1] != hues[2] == hues[3]
    # pp 2 x ddp 2 on 4: a column per stage, each with the two replicas' ranks
    c["grad_accum_steps"].value = 2
    c["dp_shard"].value, c["parallelism"].value, c["pp"].value = 0, "ddp", 2
    assert panel.state.problem == "", panel.state.problem
    assert re.findall(r"data-(?:rank|pp|dp-replicate)='(\d+)'", panel.layout_box.value) == [
        "0",
        "0",
        "0",
        "1",
        "0",
        "1",
        "2",
        "1",
        "0",
        "3",
        "1",
        "1",
    ]
    assert (
        panel.layout_box.value.count("wb-layout-stage") == 2
        and "pp 2 × dp_replicate 2" in panel.layout_box.value
    )
    assert "2 pipeline stages" in panel.layout_box.value
    # the same 4 ranks as pp 2 x zero3, interleaved (each rank holds 2 chunks; the schedule's control appears)
    assert c["pp_virtual_stages"].layout.display == "none"
    c["parallelism"].value, c["pp_schedule"].value = "zero3", "interleaved_1f1b"
    assert panel.state.problem == "", panel.state.problem
    assert c["pp_virtual_stages"].layout.display is None
    assert "stages 0, 2" in panel.layout_box.value and "stages 1, 3" in panel.layout_box.value
    assert (
        "pp 2 × dp_shard 2" in panel.layout_box.value
        and "cut into 4 stages" in panel.layout_box.value
    )
    c["pp"].value, c["pp_schedule"].value, c["parallelism"].value = 1, "1f1b", "ddp"
    # impossible: 3 does not divide 4; the picture says so instead of drawing a layout
    c["parallelism"].value, c["dp_shard"].value, c["tp"].value = "zero3", 0, 3
    assert (
        "data-layout='impossible'" in panel.layout_box.value
        and "tp=3" not in panel.layout_box.value
    )
    assert "tp=3" in panel.problem_box.value, "the reason is said once, in the problem line"
    assert not cells()
