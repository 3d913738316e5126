"""The panel plans for a target, not for the box the notebook runs on: checks, rank layout, global batch and
estimate all speak the target's one world size; only launching a plan for other hardware here is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.estimator.target import Target, check_plan
from workbench.utils.hardware import detect

H100 = "H100-SXM-80GB"


def gpt(runs_dir: Path, **changes: Any) -> wb.RunConfig:
    base = dict(
        task="char-gpt",
        num_processes=2,
        micro_batch_size=8,
        max_steps=10,
        runs_dir=str(runs_dir),
        task_options={"preset": "tiny"},
    )
    return wb.RunConfig(**{**base, **changes})


def estimated(panel: wb.Panel) -> Any:
    panel.estimate_box.wait(timeout=100)
    state = panel.estimate_box.state
    assert state.status == "done" and state.result is not None, state.message
    return state.result


def test_a_plan_for_8_h100_is_checked_and_estimated_on_a_small_box(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False)
    c = panel.controls
    panel.target_controls.gpu.value = H100
    assert panel.target_controls.gpus_per_node.value == 8 and c["num_processes"].value == 8
    layouts = [
        ("8 processes, ddp", {}),
        ("hsdp 2 x 4", {"parallelism": "hsdp", "dp_shard": 4}),
        ("fp16", {"parallelism": "ddp", "precision": "fp16"}),
        ("tp 2", {"precision": "bf16", "parallelism": "zero3", "tp": 2}),
    ]
    for what, values in layouts:
        for name, value in values.items():
            c[name].value = value
        assert panel.state.problem == "", f"{what}: {panel.state.problem}"
        est = estimated(panel)
        cfg = panel.config
        assert est.target.name == H100 and len(est.ranks) == 8, what
        assert est.global_batch == cfg.global_batch_size, (
            f"{what}: one world size for the batch and the estimate"
        )
        assert (
            f"{len(est.ranks) // (cfg.tp * cfg.pp)} data-parallel ranks" in panel.batch_info.value
        ), what
        assert "this machine has" not in panel.estimates.value
    assert panel.launch_button.disabled
    assert "planned for 8 x H100-SXM-80GB" in panel.status_box.value
    with pytest.raises(
        ValueError,
        match="planned for 8 x H100-SXM-80GB; this machine has .* set the target to 'this machine'",
    ):
        panel.launch()


def test_processes_and_the_targets_gpus_are_one_number(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    t, c = panel.target_controls, panel.controls
    t.gpu.value = H100
    t.nodes.value = 2
    assert c["num_processes"].value == 16 and panel.state.problem == ""
    c["num_processes"].value = 8
    assert (
        t.gpus_per_node.value == 4
        and panel.target.describe(panel.config) == "2 x 4 x H100-SXM-80GB"
    )
    c["num_processes"].value = 7  # two nodes can't split 7 ranks: said, not silently rounded
    assert t.gpus_per_node.value == 4 and "num_processes=7" in panel.state.problem
    t.gpu.value = "this-machine"
    assert panel.target_controls.size_box.layout.display == "none"


def test_the_global_batch_line_counts_data_parallel_ranks(runs_dir: Path) -> None:
    panel = wb.Panel(
        gpt(runs_dir, num_processes=4, oversubscribe=True), display=False, estimate=False
    )
    c = panel.controls
    c["parallelism"].value, c["tp"].value = "zero3", 2
    assert panel.state.problem == "", panel.state.problem
    assert (
        "global batch <b>16</b> = 8 micro-batch × 1 accumulation × 2 data-parallel ranks"
        in panel.batch_info.value
    )
    assert "(4 processes: each data-parallel rank spans tp 2)" in panel.batch_info.value
    c["tp"].value, c["parallelism"].value, c["grad_accum_steps"].value = 1, "ddp", 4
    c["pp"].value = 2
    assert panel.state.problem == "", panel.state.problem
    assert (
        "global batch <b>64</b> = 8 micro-batch × 4 accumulation × 2 data-parallel ranks"
        in panel.batch_info.value
    )


def test_the_hsdp_shard_group_shows_only_for_hsdp_and_starts_valid(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    panel.target_controls.gpu.value = H100
    c = panel.controls
    assert c["dp_shard"].layout.display == "none"
    c["parallelism"].value = "hsdp"
    assert (
        c["dp_shard"].layout.display is None
        and c["dp_shard"].value == 4
        and panel.state.problem == ""
    )
    c["parallelism"].value = "zero3"
    assert c["dp_shard"].value == 0 and panel.state.problem == ""


def test_buttons_and_status_line_agree(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    assert panel.stop_button.disabled and panel.stop_button.button_style == "", (
        "a disabled Stop isn't orange"
    )
    assert not panel.launch_button.disabled and "ready: pick the settings" in panel.status_box.value
    panel.controls["micro_batch_size"].value = "0"
    assert panel.launch_button.disabled and panel.launch_button.button_style == "", (
        "a disabled Launch isn't green"
    )
    assert "micro_batch_size=0" in panel.problem_box.value
    assert "not launchable: see the problem above" in panel.status_box.value
    assert "ready: pick" not in panel.status_box.value


def test_the_parallelism_labels_fit_and_the_mode_is_explained(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    labels = [label for label, _ in panel.controls["parallelism"].options]
    # the dropdown is 380 px wide with a 140 px description
    assert max(map(len, labels)) <= 36, labels
    panel.controls["parallelism"].value = "zero2"
    assert "parameters gathered from forward to backward" in panel.mode_info.value


def test_check_plan_validates_against_the_target_and_names_it(runs_dir: Path) -> None:
    cfg = gpt(runs_dir, num_processes=8, precision="fp16", parallelism="hsdp", dp_shard=4)
    assert check_plan(cfg, Target(gpu=H100, gpus_per_node=8)) == []
    with pytest.raises(
        ValueError,
        match=r"num_processes=8 with target 2 x 8 x H100-SXM-80GB: the target has 16 "
        r"GPU\(s\) in all; use num_processes=16",
    ):
        check_plan(cfg, Target(gpu=H100, gpus_per_node=8, nodes=2))
    with pytest.raises(
        ValueError, match=r"num_processes=8: the target 1 x L4-24GB has 1 GPU\(s\)|the target has 1"
    ):
        check_plan(cfg, Target(gpu="L4-24GB", gpus_per_node=1))
    with pytest.raises(
        ValueError,
        match=r"precision='bf16' on the target 8 x V100.*|not in the accelerator catalog",
    ):
        Target(gpu="V100-nonexistent", gpus_per_node=8)
    if not detect().has_cuda:
        with pytest.raises(ValueError, match="precision='fp16' on CPU .*: fp16 needs a CUDA GPU"):
            check_plan(cfg.replace(num_processes=2, parallelism="ddp", dp_shard=0), Target())


def test_workbench_check_validates_a_plan_for_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workbench.cli import main

    path = tmp_path / "plan.yaml"
    gpt(tmp_path, num_processes=8, parallelism="hsdp", dp_shard=4, precision="fp16").to_yaml(path)
    assert main(["check", str(path), "--gpu", H100]) == 0
    assert (
        "a valid plan for 8 x H100-SXM-80GB: dp_replicate 2 × dp_shard 4, global batch 64"
        in capsys.readouterr().out
    )
    assert main(["check", str(path), "--gpu", H100, "--gpus-per-node", "8", "--nodes", "2"]) == 2
    assert "the target has 16 GPU(s) in all; use num_processes=16" in capsys.readouterr().err
    if not detect().has_cuda:
        assert main(["check", str(path)]) == 2
        assert "num_processes=8: this machine has" in capsys.readouterr().err


def test_task_options_are_panel_controls_with_the_parameter_count(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir), display=False, estimate=False)
    controls = panel.task_controls.controls
    assert {"preset", "n_layer", "n_head", "n_embd", "block_size", "dropout"} <= set(controls)
    before = panel.task_controls.parameters
    controls["n_layer"].value = "4"
    assert panel.config.task_options.get("n_layer") == 4 and panel.task_controls.parameters > before
    assert f"{panel.task_controls.parameters:,} parameters" in panel.task_controls.count_box.value
    controls["n_head"].value = "5"  # n_embd isn't divisible by 5: said by the check, Launch off
    assert "n_head" in panel.state.problem and panel.launch_button.disabled
    panel.controls["task"].value = "digits"
    assert "hidden" in panel.task_controls.controls and panel.config.task_options == {}
    assert panel.state.problem == ""


@pytest.mark.slow
def test_a_running_run_shows_measured_beside_estimated(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        max_steps=30,
        log_every=5,
        micro_batch_size=16,
        device="cpu",
        runs_dir=str(runs_dir),
    )
    panel = wb.Panel(cfg, display=False)
    est = estimated(panel)
    panel.launch()
    result = panel.wait(timeout=100)
    assert result.status == "completed"
    text = panel.estimates.value
    last = result.metrics[-1] if result.metrics[-1].get("step_time_s") else result.metrics[-2]
    assert "wb-estimate-measured" in text and "/step (estimated " in text, text
    assert f"{last['samples_per_s']:,.0f} samples/s" in text
    assert est.step_s > 0
    panel.target_controls.gpu.value = (
        H100  # another plan: this machine's figures don't belong beside it
    )
    assert "wb-estimate-measured" not in panel.estimates.value
