"""The panel's hints describe the values the controls hold, a change that moves another control says so
beside it, and a plan that can't run lists every problem at once (issue 47, the panel details)."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from test_panel_target import H100, gpt

import workbench as wb
from workbench.estimator.target import Target
from workbench.utils.hardware import detect


def text(widget: object) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", widget.value))  # type: ignore[attr-defined]


def test_processes_7_and_12_on_two_nodes_get_hints_that_match_the_plan(runs_dir: Path) -> None:
    """The issue's probe: processes=12 on 2 x 8 moves GPUs per node to 6 and says so beside it; 7 keeps
    6 x 2 and the hint says the target has 12, not '7 = 6 GPUs x 2 nodes'."""
    panel = wb.Panel(
        gpt(runs_dir, num_processes=16),
        target=Target(gpu=H100, gpus_per_node=8, nodes=2),
        display=False,
        estimate=False,
    )
    t, processes = panel.target_controls, panel.controls["num_processes"]
    assert text(panel.limit) == "= 8 GPUs × 2 nodes" and panel.state.problem == ""

    processes.value = 12
    assert t.gpus_per_node.value == 6 and panel.state.problem == ""
    assert text(panel.limit) == "= 6 GPUs × 2 nodes"
    assert text(t.moved_note) == "↳ GPUs per node 8 → 6 to fit 12 processes on 2 nodes"

    processes.value = 7
    assert t.gpus_per_node.value == 6, "two nodes can't split 7: nothing else moves"
    assert text(panel.limit) == "≠ 12 = 6 GPUs × 2 nodes", "the hint states the target's sum"
    assert "data-matches='false'" in panel.limit.value
    assert text(t.moved_note) == "", "the note was about the change before"
    assert panel.state.problems == [
        f"num_processes=7 with target 2 x 6 x {H100}: the target has 12 GPU(s) in all; use "
        "num_processes=12, or change the target's GPUs per node or nodes"
    ]


def test_a_target_change_that_moves_the_processes_says_so_beside_them(runs_dir: Path) -> None:
    panel = wb.Panel(gpt(runs_dir, num_processes=1), display=False, estimate=False)
    t, processes = panel.target_controls, panel.controls["num_processes"]
    t.gpu.value = H100
    assert processes.value == 8
    assert text(panel.form.processes_note) == "↳ processes 1 → 8: the target's 8 GPUs × 1 node"
    t.nodes.value = 2
    assert processes.value == 16
    assert text(panel.form.processes_note) == "↳ processes 8 → 16: the target's 8 GPUs × 2 nodes"
    t.gpu.value = "this-machine"  # back here: this machine's own count, said in place
    assert processes.value == 1
    assert text(panel.form.processes_note) == (
        "↳ processes 16 → 1: this machine's count from before the target changed"
    )
    panel.controls["max_steps"].value = 20
    assert text(panel.form.processes_note) == "", "a note lasts until the next change"


def test_every_problem_of_a_plan_is_listed_at_once(runs_dir: Path) -> None:
    """The issue's probe: on this machine, too many processes and fp16 (unavailable on a CPU) are both
    said, not fp16 only after the processes were fixed; each is actionable on its own."""
    hw = detect()
    if hw.has_cuda:
        pytest.skip("fp16 is available on a CUDA machine: the probe needs a CPU-only box")
    panel = wb.Panel(gpt(runs_dir, num_processes=1), display=False, estimate=False)
    too_many = hw.max_processes("cpu") + 14
    panel.controls["num_processes"].value = too_many
    panel.controls["precision"].value = "fp16"
    problems = panel.state.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"num_processes={too_many}: this machine has")
    assert "use num_processes=" in problems[0]
    assert problems[1].startswith("precision='fp16' on CPU") and "fp32" in problems[1]
    shown = text(panel.problem_box)
    assert all(p in shown for p in problems) and shown.count("⚠") == 2
    assert "see the 2 problems above" in panel.status_box.value
    assert panel.launch_button.disabled
    # fixing one leaves the other, still said
    panel.controls["num_processes"].value = 1
    assert [p.split(":")[0] for p in panel.state.problems] == [problems[1].split(":")[0]]
    assert "see the problem above" in panel.status_box.value
