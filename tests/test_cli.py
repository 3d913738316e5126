"""The command line: thin wrappers whose exit codes and messages users and CI scripts rely on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.cli import main
from workbench.utils import files


def test_data_list_and_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "tinyshakespeare" in out and "digits" in out
    assert main(["data", "show", "tinyshakespeare"]) == 0
    assert (
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
        in capsys.readouterr().out
    )


def test_data_path_and_verify_exit_codes(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    needs_mirror: Path,
) -> None:
    monkeypatch.setenv("WORKBENCH_DATA_DIR", str(tmp_path / "cache"))
    assert main(["data", "verify", "tinyshakespeare"]) == 1  # nothing cached yet: missing
    assert "missing" in capsys.readouterr().out
    assert main(["data", "path", "tinyshakespeare"]) == 0
    root = Path(capsys.readouterr().out.strip())
    assert (root / "input.txt").stat().st_size == 1_115_394
    assert main(["data", "verify", "tinyshakespeare"]) == 0
    (root / "input.txt").write_text("tampered")
    assert main(["data", "verify", "tinyshakespeare"]) == 1
    assert "corrupt" in capsys.readouterr().out


def test_unknown_dataset_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "show", "imagenet"]) == 2
    assert "imagenet" in capsys.readouterr().err


def test_check_validates_and_describes_the_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    wb.RunConfig(num_processes=2, micro_batch_size=8, grad_accum_steps=2, device="cpu").to_yaml(
        path
    )
    assert main(["check", str(path)]) == 0
    assert "2 CPU processes, DDP over gloo, fp32, global batch 32" in capsys.readouterr().out
    assert main(["check", str(path), "--set", "precision=fp16"]) == 2
    assert "fp16 needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_is_a_real_two_rank_run_with_a_plot(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "demo",
            "--runs-dir",
            str(tmp_path),
            "--steps",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "weights identical on every rank: True" in proc.stdout
    (run_dir,) = tmp_path.iterdir()
    summary = files.read_json(run_dir / "summary.json")
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert (run_dir / "plot.png").stat().st_size > 10_000
    assert files.read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_bench_precision_runs_each_supported_precision_side_by_side(tmp_path: Path) -> None:
    from workbench.commands.bench import precision

    cfg = wb.RunConfig(task="digits", num_processes=1, device="cpu", max_steps=8, log_every=4)
    report = precision(cfg, json_path=tmp_path / "p.json")
    rows = {r.precision: r for r in report.rows}
    assert (rows["fp32"].compute_dtype, rows["bf16"].compute_dtype) == ("float32", "bfloat16")
    assert rows["fp32"].samples_per_s > 0 and rows["bf16"].peak_memory_bytes > 0
    assert not rows["fp16"].available and "needs a CUDA GPU" in rows["fp16"].reason
    assert "unavailable: fp8 needs a CUDA GPU" in report.table()
    assert (tmp_path / "p.json").stat().st_size > 100


@pytest.mark.slow
def test_bench_overhead_trains_bit_for_bit_what_the_hand_loop_trains(tmp_path: Path) -> None:
    """Timing is the benchmark's business; a test can hold it to the numerics: the trainer, with everything it
    adds to a step (breakdown, agreement, monitor, metrics), ends on the hand loop's weights bit for bit."""
    from workbench.commands.bench import overhead

    report = overhead(steps=14, repeats=1, json_path=tmp_path / "o.json")
    assert report.weights_equal, report.table()
    assert report.trainer_median_s > 0 and report.hand_median_s > 0 and report.log_every == 10
    assert "weights bitwise equal: True" in report.table()
    assert files.read_json(tmp_path / "o.json")["weights_equal"] is True


@pytest.mark.slow
def test_bench_parallelism_runs_every_mode_side_by_side(tmp_path: Path) -> None:
    from workbench.commands.bench import parallelism

    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        device="cpu",
        max_steps=8,
        log_every=4,
        task_options={"hidden": 64},
    )
    report = parallelism(
        cfg, modes=("ddp", "zero1", "zero3", "hsdp", "tp"), json_path=tmp_path / "p.json"
    )
    rows = {r.mode: r for r in report.rows}
    assert [m for m, r in rows.items() if r.available] == ["ddp", "zero1", "zero3"]
    assert "hsdp needs an even num_processes >= 4" in rows["hsdp"].reason
    assert "has no tensor-parallel plan" in rows["tp"].reason
    ddp, zero3 = rows["ddp"], rows["zero3"]
    assert zero3.final_loss == pytest.approx(ddp.final_loss, rel=1e-5)
    assert (
        max(zero3.params_bytes) < max(ddp.params_bytes)
        and sum(zero3.params_bytes) == ddp.params_bytes[0]
    )
    assert sum(rows["zero1"].optimizer_bytes) == ddp.optimizer_bytes[0]
    assert all(r.step_ms > 0 and r.tracked_peak_bytes for r in rows.values() if r.available)
    table = report.table()
    assert "zero3" in table and "unavailable: hsdp needs" in table
    assert (tmp_path / "p.json").stat().st_size > 100


@pytest.mark.slow
def test_bench_parallelism_has_the_model_parallel_layouts(tmp_path: Path) -> None:
    """tp and pp over both ranks: each rank holds part of the model, and the losses are DDP's."""
    from workbench.commands.bench import parallelism

    cfg = wb.RunConfig(
        task="char-gpt",
        num_processes=2,
        device="cpu",
        micro_batch_size=4,
        max_steps=6,
        log_every=3,
        eval_batches=1,
        task_options={"preset": "tiny", "block_size": 32, "dropout": 0.0},
    )
    rows = {r.mode: r for r in parallelism(cfg, modes=("ddp", "tp", "pp", "cp")).rows}
    cp = rows.pop("cp")  # ring attention runs on CUDA only: the row says why, as preflight would
    assert not cp.available and cp.reason.startswith("cp=2 on CPU: PyTorch's context parallel")
    assert all(r.available for r in rows.values()), [r.reason for r in rows.values()]
    for mode in ("tp", "pp"):
        assert rows[mode].final_loss == pytest.approx(rows["ddp"].final_loss, rel=1e-4), mode
        assert max(rows[mode].params_bytes) < 0.8 * rows["ddp"].params_bytes[0], mode


@pytest.mark.parametrize(
    "setup,args,message",
    [
        (
            lambda p: p.write_text("max_steps: [1\n"),
            [],
            r"run.yaml: not valid YAML \(line 2, column 1\)",
        ),
        (lambda p: None, [], r"run.yaml: no such file"),
        (
            lambda p: p.write_text("max_steps: 5\n"),
            ["--set", "max_steps=[1"],
            r"--set 'max_steps=\[1': not valid YAML",
        ),
        (
            lambda p: p.write_text("max_steps: 5\n"),
            ["--set", "max_steps"],
            r"--set 'max_steps': expected key=value",
        ),
        (lambda p: p.write_text("lr: .nan\n"), [], r"lr=nan: must be a finite number"),
    ],
    ids=["bad-yaml", "no-file", "bad-set-value", "set-without-value", "nan"],
)
def test_bad_files_and_values_are_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: Any, args: list[str], message: str
) -> None:
    path = tmp_path / "run.yaml"
    setup(path)
    for command in ("train", "check"):
        assert main([command, str(path), *args]) == 2
        err = capsys.readouterr().err
        assert (
            re.match(rf"error: .*{message}", err)
            and err.count("\n") == 1
            and "Traceback" not in err
        ), err


def test_prepare_only_runs_the_same_checks_as_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    wb.RunConfig(precision="fp16", device="cpu", runs_dir=str(tmp_path / "runs")).to_yaml(path)
    assert main(["train", str(path), "--prepare-only"]) == 2
    assert "fp16 needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "nothing is created for a config that can't run"


def test_bench_imports_times_the_worker_beside_torch_and_accelerate() -> None:
    from workbench.commands.bench.imports import ImportReport, imports

    report = imports(repeats=1)
    assert len(report.baseline_s) == len(report.rank_side_s) == 1
    assert all(t > 0 for t in report.baseline_s + report.rank_side_s)
    assert "import torch, accelerate, workbench.worker" in report.table()
    # the verdict is on the median of the pairs' differences, not on either side's own time
    slow = ImportReport(baseline_s=[1.0, 1.0, 1.0], rank_side_s=[1.3, 1.1, 1.4])
    assert slow.added_s == pytest.approx(0.3) and not slow.passed and "FAIL" in slow.table()
    assert ImportReport(baseline_s=[2.0, 1.0], rank_side_s=[2.1, 1.1]).passed
