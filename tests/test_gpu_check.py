"""scripts/gpu-check: its dry run on this CPU machine, and the steps it plans for machines with GPUs."""

from __future__ import annotations

import subprocess
from pathlib import Path

from workbench.commands.gpu_check import plan

REPO = Path(__file__).resolve().parents[1]


def test_the_dry_run_lists_every_step_in_order_with_its_cap_and_why_one_is_skipped_here() -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--dry-run", "--skip", "doctor"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        lines[0].startswith("gpu-check on 0 x no CUDA GPU, torch ") and "budget 540 s" in lines[0]
    )
    steps = {line.strip().split("  ")[0]: line for line in lines[1:]}
    assert list(steps) == [
        "bench mfu",
        "gpu tests",
        "bench estimate",
        "bench precision",
        "bench overhead ddp",
        "bench compile",
        "doctor",
        "bench parallelism",
        "bench overhead zero3",
        "bench overhead tp",
        "bench overhead pp",
    ]
    assert (
        "bench compile --set num_processes=1 --layouts ddp --json gpu-check/results/compile/"
        in steps["bench compile"]
    )
    assert "bench mfu --json gpu-check/results/mfu/" in steps["bench mfu"]
    assert (
        "bench overhead --mode ddp --device cuda --num-processes 1" in steps["bench overhead ddp"]
    )
    assert (
        "(up to" in steps["bench overhead ddp"]
        and "skipped: needs 2 GPUs" in steps["bench overhead pp"]
    )
    assert "-m pytest -m gpu -n 0" in steps["gpu tests"] and "(skipped: --skip)" in steps["doctor"]
    assert "bench estimate --no-cited --json gpu-check/results/estimate/" in steps["bench estimate"]
    assert (
        "skipped: needs 2 GPUs" in steps["bench parallelism"]
        and "this machine has 0" in steps["bench parallelism"]
    )


def test_the_one_gpu_steps_caps_fit_the_default_budget(tmp_path: Path) -> None:
    from workbench.commands.gpu_check import DEFAULT_BUDGET_S, MARGIN_S

    steps = [s for s in plan(1, tmp_path) if not s.skipped]
    assert [s.name for s in steps][:2] == ["bench mfu", "gpu tests"], (
        "what tells us most runs first"
    )
    assert sum(s.timeout_s for s in steps) <= DEFAULT_BUDGET_S - MARGIN_S <= 600 - 60
    assert all(0 < s.typical_s <= s.timeout_s for s in steps)
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--dry-run", "--budget", "540"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and " left, needs up to " not in done.stdout, (
        done.stdout + done.stderr
    )


def test_a_smaller_budget_skips_the_later_steps_and_says_why() -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--dry-run", "--budget", "200"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    steps = {line.strip().split("  ")[0]: line for line in done.stdout.splitlines()[1:]}
    assert "(up to 90 s" in steps["bench mfu"]
    assert "(skipped: 95 s left, needs up to 120 s)" in steps["gpu tests"]
    assert "(skipped: 5 s left, needs up to 60 s)" in steps["bench compile"]
    assert "(skipped: 5 s left, needs up to 30 s)" in steps["doctor"]


def test_without_a_gpu_it_refuses_to_run_and_says_what_to_do() -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=60
    )
    assert (
        done.returncode == 2
        and "no CUDA GPU is visible here" in done.stderr
        and "--dry-run" in done.stderr
    )


def test_a_step_name_that_does_not_exist_is_refused_with_the_names() -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--dry-run", "--skip", "docter"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert (
        "--skip 'docter': no such step; the steps are bench compile, bench estimate, bench mfu"
        in done.stderr
    )


def test_with_gpus_enough_the_layout_benches_run_on_them(tmp_path: Path) -> None:
    one, four = {s.name: s for s in plan(1, tmp_path)}, {s.name: s for s in plan(4, tmp_path)}
    two_gpus = {
        "bench parallelism",
        "bench overhead zero3",
        "bench overhead tp",
        "bench overhead pp",
    }
    assert all(one[name].skipped and not four[name].skipped for name in two_gpus)
    assert "num_processes=4" in four["bench parallelism"].argv
    tp = four["bench overhead tp"].argv
    assert tp[tp.index("--num-processes") + 1] == "2", (
        "tp over 2 of the 4 GPUs: the hand loop's one TP group"
    )
    assert all(not s.skipped for name, s in one.items() if name not in two_gpus)


def test_each_step_runs_in_turn_with_its_log_and_the_tables_at_the_end(
    tmp_path: Path, capsys
) -> None:
    import sys

    from workbench.commands.gpu_check import Step, run

    say = "import sys; print('progress', file=sys.stderr); print('| {} | 1.0 |')"
    steps = [
        Step("bench a", [sys.executable, "-c", say.format("a")], 60),
        Step("bench b", [sys.executable, "-c", "import sys; sys.exit(3)"], 60),
        Step("bench c", [sys.executable, "-c", say.format("c")], 60, skipped="needs 2 GPUs"),
    ]
    assert run(steps, tmp_path) == 1, "one step failed"
    assert (tmp_path / "bench-a.log").read_text() == "| a | 1.0 |\nprogress\n"
    assert (tmp_path / "bench-b.log").is_file() and not (tmp_path / "bench-c.log").exists()
    printed = capsys.readouterr().out
    assert "exit 3" in printed and "== bench c: skipped (needs 2 GPUs)" in printed
    assert printed.index("### bench a\n| a | 1.0 |") > printed.index("== bench c")


def test_a_step_past_its_cap_is_killed_with_its_process_group_and_the_next_still_runs(
    tmp_path: Path, capsys
) -> None:
    import json
    import sys
    import time

    from workbench.commands.gpu_check import MARGIN_S, Step, run, write_summary

    pid_file = tmp_path / "grandchild.pid"
    slow = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; echo started; wait"]
    result = tmp_path / "results" / "b" / "x.json"
    write = (
        f"import pathlib; pathlib.Path({str(result)!r}).write_text('{{}}'); print('| b | 2.0 |')"
    )
    steps = [
        Step("bench slow", slow, 2),
        Step("bench b", [sys.executable, "-c", write], 30, result=result),
        Step("bench c", ["sleep", "0"], 49),
    ]
    outcomes: list[dict] = []
    started = time.monotonic()
    assert run(steps, tmp_path, MARGIN_S + 50, outcomes) == 1, (
        "the step killed at its cap counts as failed"
    )
    assert time.monotonic() - started < 20
    slow_out, b, c = outcomes
    assert slow_out["status"] == "timed out" and 2 <= slow_out["seconds"] < 10
    assert "killed its process group" in (tmp_path / "bench-slow.log").read_text()
    grandchild = Path(f"/proc/{pid_file.read_text().strip()}/status")
    assert not grandchild.exists() or "zombie" in grandchild.read_text(), (
        "the sleep it left behind was killed too"
    )
    assert b["status"] == "passed" and b["result"] == str(result)
    assert c["status"] == "skipped" and c["reason"].endswith("s left, needs up to 49 s")
    printed = capsys.readouterr().out
    assert "== bench slow (up to 2 s)" in printed and "timed out (exit -9)" in printed
    assert "== bench c: skipped (" in printed and "### bench b\n| b | 2.0 |" in printed

    write_summary(tmp_path / "gpu-check.json", "1 x test", MARGIN_S + 50, 5.0, outcomes)
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (
        summary["measured_on"]["date"]
        and summary["versions"]["torch"]
        and summary["device"] == "1 x test"
    )
    assert [s["status"] for s in summary["steps"]] == ["timed out", "passed", "skipped"]


def test_the_estimate_bench_fits_each_layout_to_the_gpus_there_are() -> None:
    import pytest

    from workbench.commands.bench.estimate_accuracy import GPU_SHAPES, LAYOUTS, on_these_gpus

    base = GPU_SHAPES["GPT-2 small (12 x 768, ctx 1024) bf16"]
    assert on_these_gpus(base.replace(**LAYOUTS["zero3"]), 1).num_processes == 1, (
        "one GPU runs zero3 on one rank"
    )
    assert on_these_gpus(base.replace(**LAYOUTS["zero3 x tp 2"]), 2).num_processes == 2
    assert on_these_gpus(base.replace(**LAYOUTS["pp 2 x ddp 2"]), 8).num_processes == 4, (
        "never more than planned"
    )
    with pytest.raises(ValueError, match=r"needs 2 GPUs, this machine has 1"):
        on_these_gpus(base.replace(**LAYOUTS["tp 2"]), 1)


def test_gpu_wheels_dry_run_downloads_what_the_image_lacks_for_python_3_12_and_builds_workbench(
    tmp_path,
) -> None:
    done = subprocess.run(
        [str(REPO / "scripts" / "gpu-wheels"), "--dry-run", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    download, wheel = done.stdout.splitlines()
    assert download.startswith("python3 -m pip download --only-binary=:all: --python-version 3.12")
    assert "--platform manylinux2014_x86_64" in download and f"-d {tmp_path / 'w'} " in download
    names = [spec.split(">")[0] for spec in download.split(f"-d {tmp_path / 'w'} ")[1].split()]
    assert {"jupyterlab", "papermill", "submitit"} <= set(names) and not {
        "torch",
        "accelerate",
    } & set(names)
    assert wheel == f"python3 -m pip wheel --no-deps -w {tmp_path / 'w'} ."
