"""scripts/gpu-check: its dry run on this CPU machine, and the steps it plans for machines with GPUs."""

from __future__ import annotations

import subprocess
from pathlib import Path

from workbench.commands.gpu_check import plan

REPO = Path(__file__).resolve().parents[1]


def test_the_dry_run_lists_every_step_and_why_one_is_skipped_here() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--dry-run", "--skip", "doctor"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu-check on 0 x no CUDA GPU, torch ")
    steps = {line.strip().split("  ")[0]: line for line in lines[1:]}
    assert list(steps) == ["gpu tests", "doctor", "bench precision", "bench estimate", "bench compile",
                           "bench parallelism"]
    assert "bench compile --set num_processes=1 --layouts ddp --json gpu-check/compile.json" in steps["bench compile"]
    assert "-m pytest -m gpu" in steps["gpu tests"] and "(skipped: --skip)" in steps["doctor"]
    assert "bench estimate --json gpu-check/estimate.json" in steps["bench estimate"]
    assert "skipped: needs 2 GPUs" in steps["bench parallelism"] and "this machine has 0" in steps["bench parallelism"]


def test_without_a_gpu_it_refuses_to_run_and_says_what_to_do() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no CUDA GPU is visible here" in done.stderr and "--dry-run" in done.stderr


def test_a_step_name_that_does_not_exist_is_refused_with_the_names() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--dry-run", "--skip", "docter"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--skip 'docter': no such step; the steps are bench compile, bench estimate" in done.stderr


def test_with_gpus_enough_the_parallelism_bench_runs_on_them(tmp_path: Path) -> None:
    one, four = {s.name: s for s in plan(1, tmp_path)}, {s.name: s for s in plan(4, tmp_path)}
    assert one["bench parallelism"].skipped and not four["bench parallelism"].skipped
    assert "num_processes=4" in four["bench parallelism"].argv
    assert all(not s.skipped for name, s in one.items() if name != "bench parallelism")


def test_the_estimate_bench_fits_each_layout_to_the_gpus_there_are() -> None:
    import pytest

    from workbench.commands.bench.estimate_accuracy import GPU_SHAPES, LAYOUTS, on_these_gpus

    base = GPU_SHAPES["GPT-2 small (12 x 768, ctx 1024) bf16"]
    assert on_these_gpus(base.replace(**LAYOUTS["zero3"]), 1).num_processes == 1, "one GPU runs zero3 on one rank"
    assert on_these_gpus(base.replace(**LAYOUTS["zero3 x tp 2"]), 2).num_processes == 2
    assert on_these_gpus(base.replace(**LAYOUTS["pp 2 x ddp 2"]), 8).num_processes == 4, "never more than planned"
    with pytest.raises(ValueError, match=r"needs 2 GPUs, this machine has 1"):
        on_these_gpus(base.replace(**LAYOUTS["tp 2"]), 1)
