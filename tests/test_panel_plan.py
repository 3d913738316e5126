"""The panel derives every number it shows from one plan: the processes follow the target, the batch, the rank
layout, the launch line and the estimate speak its one world size; a plan that can't run says why once, with no
verdict and Launch visibly off; any change marks the derived figures stale in its own handler."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pytest
from collected_ids import cases
from test_panel_target import H100
from test_panel_target import gpt as planned_gpt

import workbench as wb
from workbench.notebook.panel import panel as panel_module


def gpt(runs_dir: Path, **changes: Any) -> wb.RunConfig:
    """test_panel_target's char-gpt config, on one process unless told."""
    return planned_gpt(runs_dir, **{"num_processes": 1, **changes})


def shown(panel: wb.Panel) -> str:
    """Every text the panel shows, tags stripped."""
    boxes = (
        panel.limit,
        panel.batch_info,
        panel.launch_info,
        panel.layout_box,
        panel.problem_box,
        panel.status_box,
        panel.error_box,
        panel.estimate_box.html,
    )
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", box.value)) for box in boxes)


def numbers(panel: wb.Panel) -> dict[str, int]:
    """The world size as each part of the panel states it."""
    est = panel.estimate_box.state.result
    return {
        "processes": panel.controls["num_processes"].value,
        "target": panel.target_controls.world or panel.controls["num_processes"].value,
        "layout cells": panel.layout_box.value.count("class='wb-layout-rank'"),
        "estimate ranks": len(est.ranks) if est is not None else -1,
    }


@pytest.mark.parametrize(
    ("what", "cfg_changes", "target", "then"),
    cases(
        [
            ("8 x H100 from a 1-process config", {}, {"gpu": H100}, {}),
            (
                "4 x 2 nodes",
                {"num_processes": 3},
                {"gpu": H100, "gpus_per_node": 4, "nodes": 2},
                {},
            ),
            ("processes typed: the target follows", {}, {"gpu": H100}, {"num_processes": 3}),
            (
                "tp 2 x pp 2",
                {"parallelism": "zero3", "grad_accum_steps": 2},
                {"gpu": H100, "gpus_per_node": 4},
                {"tp": 2, "pp": 2},
            ),
        ]
    ),
)
def test_every_number_speaks_the_plans_one_world_size(
    runs_dir: Path,
    what: str,
    cfg_changes: dict[str, Any],
    target: dict[str, Any],
    then: dict[str, Any],
) -> None:
    from workbench.estimator.target import Target

    cfg = gpt(runs_dir, **cfg_changes)
    panel = wb.Panel(cfg, target=Target(**target), display=False)
    if "gpus_per_node" not in target:
        assert panel.state.message == (
            f"processes set to 8 for the target's 8 x {H100} (the config had "
            f"num_processes={cfg.num_processes})"
        ), what
    for name, value in then.items():
        panel.controls[name].value = value
    assert panel.state.problem == "", f"{what}: {panel.state.problem}"
    panel.estimate_box.wait(timeout=100)
    world = panel.config.num_processes
    assert set(numbers(panel).values()) == {world}, f"{what}: {numbers(panel)}"
    dims = panel.config.dims
    assert f"{dims.dp} data-parallel rank" in panel.batch_info.value
    assert f"global batch <b>{panel.config.global_batch_size}</b>" in panel.batch_info.value
    assert panel.estimate_box.state.result.global_batch == panel.config.global_batch_size
    where = panel.target.describe(panel.config)
    assert (
        f"planned for {where}" in panel.launch_info.value and f"on {where}" in panel.estimates.value
    )
    if "num_processes" in then:
        assert panel.state.message == "", "the note was about the settings before the change"


@pytest.mark.parametrize(
    ("what", "cfg", "change"),
    cases(
        [
            (
                "digits has no tp plan",
                {"task": "digits", "num_processes": 2, "task_options": {}},
                {"tp": 2},
            ),
            ("a micro-batch of 0", {"num_processes": 1}, {"micro_batch_size": "0"}),
            ("pp over more ranks than blocks divide", {"num_processes": 2}, {"pp": 3}),
        ]
    ),
)
def test_a_plan_that_cannot_run_says_why_once_with_no_verdict(
    runs_dir: Path, what: str, cfg: dict[str, Any], change: dict[str, Any]
) -> None:
    panel = wb.Panel(gpt(runs_dir, **cfg), display=False)
    panel.estimate_box.wait(timeout=100)
    assert "fits:" in panel.estimates.value, "the runnable plan before the change had a verdict"
    for name, value in change.items():
        panel.controls[name].value = value
    panel.estimate_box.wait(timeout=100)
    problem = panel.state.problem
    assert problem, what
    text = shown(panel)
    reason = problem.split(":")[0]
    assert text.count(reason) == 1, (
        f"{what}: '{reason}' is said {text.count(reason)} times in: {text}"
    )
    assert "fits" not in text and "short by" not in text, (
        f"{what}: a verdict for a plan that can't run"
    )
    assert not re.search(r"\b[A-Z]\w*(Error|Exception)\b", text), (
        f"{what}: raw exception text: {text}"
    )
    assert panel.launch_button.disabled and panel.launch_button.button_style == ""
    assert "see the problem above" in panel.status_box.value


def test_an_estimator_failure_is_said_in_words(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.notebook.panel.estimates import EstimateBox

    def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "the trace child died (signal 9)\nTraceback (most recent call last): ..."
        )

    monkeypatch.setattr(EstimateBox, "_estimate_on", staticmethod(fails))
    panel = wb.Panel(gpt(runs_dir), display=False)
    panel.estimate_box.wait(timeout=100)
    text = shown(panel)
    assert "Estimate : none, the trace child died (signal 9)" in text
    assert "RuntimeError" not in text and "Traceback" not in text


def test_wb_estimate_says_when_it_plans_another_rank_count_than_the_configs(runs_dir: Path) -> None:
    est = wb.estimate(gpt(runs_dir), gpu=H100, gpus=8)
    assert len(est.ranks) == 8
    assert (
        est.assumptions[0] == f"ranks: 8, the target's 8 x {H100} (the config has num_processes=1)"
    )
    same = wb.estimate(gpt(runs_dir, num_processes=8, parallelism="ddp"), gpu=H100, gpus=8)
    assert not any(a.startswith("ranks: ") for a in same.assumptions)


CHANGES = cases(
    [
        ("task", lambda p: setattr(p.controls["task"], "value", "digits")),
        ("processes", lambda p: setattr(p.controls["num_processes"], "value", 2)),
        ("precision", lambda p: setattr(p.controls["precision"], "value", "bf16")),
        ("micro-batch", lambda p: setattr(p.controls["micro_batch_size"], "value", "4")),
        ("parallelism", lambda p: setattr(p.controls["parallelism"], "value", "none")),
        ("target", lambda p: setattr(p.target_controls.gpu, "value", H100)),
        ("a task option", lambda p: p.task_controls.controls["n_layer"].__setattr__("value", "3")),
    ]
)


@pytest.mark.parametrize(("what", "change"), CHANGES)
def test_a_change_marks_the_figures_stale_before_anything_slow(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch, what: str, change: Any
) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False)
    panel.estimate_box.wait(timeout=100)
    assert panel.estimate_box.state.result is not None and not panel.estimate_box.state.stale
    marked: list[bool] = []
    real_check = panel_module.plan_problems

    def slow_check(*args: Any, **kwargs: Any) -> Any:  # the first slow step of a change's handler
        marked.append("wb-estimate-is-stale" in panel.estimates.value)
        return real_check(*args, **kwargs)

    monkeypatch.setattr(panel_module, "plan_problems", slow_check)
    change(panel)
    assert marked and all(marked), (
        f"{what}: the old figures were unmarked while the change was checked"
    )
    panel.estimate_box.wait(timeout=100)
    assert not panel.estimate_box.state.stale, f"{what}: the new estimate clears the mark"


def test_a_task_message_goes_with_the_task(runs_dir: Path) -> None:
    panel = wb.Panel(
        gpt(runs_dir, task="digits", num_processes=2, task_options={}),
        display=False,
        estimate=False,
    )
    panel.controls["tp"].value = 2
    assert "task 'digits' has no tensor-parallel plan" in shown(panel)
    panel.controls["task"].value = "char-gpt"
    assert "digits" not in shown(panel), "the old task's message stayed"
    assert panel.state.problem == "" and not panel.launch_button.disabled
