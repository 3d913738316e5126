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
    assert list(steps) == ["gpu tests", "doctor", "bench precision", "bench mfu", "bench estimate", "bench compile",
                           "bench parallelism", "bench overhead ddp", "bench overhead zero3", "bench overhead tp",
                           "bench overhead pp"]
    assert "bench compile --set num_processes=1 --layouts ddp --json gpu-check/compile.json" in steps["bench compile"]
    assert ("bench precision --set task_options.preset=gpt2-small --set compile=blocks --set micro_batch_size=16"
            in steps["bench mfu"])
    assert "bench overhead --mode ddp --device cuda --num-processes 1" in steps["bench overhead ddp"]
    assert "(up to" in steps["bench overhead ddp"] and "skipped: needs 2 GPUs" in steps["bench overhead pp"]
    assert "-m pytest -m gpu -n 0" in steps["gpu tests"] and "(skipped: --skip)" in steps["doctor"]
    assert "bench estimate --json gpu-check/estimate.json" in steps["bench estimate"]
    assert "skipped: needs 2 GPUs" in steps["bench parallelism"] and "this machine has 0" in steps["bench parallelism"]


def test_without_a_gpu_it_refuses_to_run_and_says_what_to_do() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no CUDA GPU is visible here" in done.stderr and "--dry-run" in done.stderr


def test_a_step_name_that_does_not_exist_is_refused_with_the_names() -> None:
    done = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--dry-run", "--skip", "docter"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--skip 'docter': no such step; the steps are bench compile, bench estimate, bench mfu" in done.stderr


def test_with_gpus_enough_the_layout_benches_run_on_them(tmp_path: Path) -> None:
    one, four = {s.name: s for s in plan(1, tmp_path)}, {s.name: s for s in plan(4, tmp_path)}
    two_gpus = {"bench parallelism", "bench overhead zero3", "bench overhead tp", "bench overhead pp"}
    assert all(one[name].skipped and not four[name].skipped for name in two_gpus)
    assert "num_processes=4" in four["bench parallelism"].argv
    tp = four["bench overhead tp"].argv
    assert tp[tp.index("--num-processes") + 1] == "2", "tp over 2 of the 4 GPUs: the hand loop's one TP group"
    assert all(not s.skipped for name, s in one.items() if name not in two_gpus)


def test_each_step_runs_in_turn_with_its_log_and_the_tables_at_the_end(tmp_path: Path, capsys) -> None:
    import sys

    from workbench.commands.gpu_check import Step, run

    say = "import sys; print('progress', file=sys.stderr); print('| {} | 1.0 |')"
    steps = [Step("bench a", [sys.executable, "-c", say.format("a")], 60),
             Step("bench b", [sys.executable, "-c", "import sys; sys.exit(3)"], 60),
             Step("bench c", [sys.executable, "-c", say.format("c")], 60, skipped="needs 2 GPUs")]
    assert run(steps, tmp_path) == 1, "one step failed"
    assert (tmp_path / "bench-a.log").read_text() == "| a | 1.0 |\nprogress\n"
    assert (tmp_path / "bench-b.log").is_file() and not (tmp_path / "bench-c.log").exists()
    printed = capsys.readouterr().out
    assert "exit 3" in printed and "== bench c: skipped (needs 2 GPUs)" in printed
    assert printed.index("### bench a\n| a | 1.0 |") > printed.index("== bench c")


def test_the_estimate_bench_fits_each_layout_to_the_gpus_there_are() -> None:
    import pytest

    from workbench.commands.bench.estimate_accuracy import GPU_SHAPES, LAYOUTS, on_these_gpus

    base = GPU_SHAPES["GPT-2 small (12 x 768, ctx 1024) bf16"]
    assert on_these_gpus(base.replace(**LAYOUTS["zero3"]), 1).num_processes == 1, "one GPU runs zero3 on one rank"
    assert on_these_gpus(base.replace(**LAYOUTS["zero3 x tp 2"]), 2).num_processes == 2
    assert on_these_gpus(base.replace(**LAYOUTS["pp 2 x ddp 2"]), 8).num_processes == 4, "never more than planned"
    with pytest.raises(ValueError, match=r"needs 2 GPUs, this machine has 1"):
        on_these_gpus(base.replace(**LAYOUTS["tp 2"]), 1)
