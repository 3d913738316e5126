"""`workbench bench overhead --mode zero3|tp|pp`: the hand-written FSDP2, tensor-parallel and pipeline loops train
what the trainer trains, bit for bit, and the report says which layout it measured. Timing is the benchmark's
business (README); a test holds it to the numerics and the report's fields."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from workbench.commands.bench.overhead import (
    OverheadReport,
    bench_config,
    overhead,
    weights_difference,
)
from workbench.config import RunConfig
from workbench.utils import files


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero3", "tp", "pp"])
def test_each_layout_s_hand_loop_trains_the_trainer_s_weights_bit_for_bit(
    mode: str, tmp_path: Path
) -> None:
    report = overhead(steps=12, repeats=1, mode=mode, json_path=tmp_path / "o.json")
    assert (report.mode, report.task, report.num_processes) == (mode, "char-gpt", 2)
    assert report.trainer_median_s > 0 and report.hand_median_s > 0  # both sides ran their steps
    assert report.weights_equal and report.weights_max_abs_diff == 0.0, report.table()
    # the full weights were loaded and compared, not just their digests
    assert report.weights_max_abs > 0
    table = report.table()
    assert table.startswith(f"workbench bench overhead --mode {mode}: char-gpt, 2 ranks on cpu")
    assert "weights bitwise equal: True (max abs difference 0)" in table
    saved = files.read_json(tmp_path / "o.json")
    assert (saved["mode"], saved["weights_equal"]) == (mode, True)


def test_each_mode_is_laid_out_as_its_hand_loop_is() -> None:
    zero3, tp, pp = (bench_config(m, 2, 50) for m in ("zero3", "tp", "pp"))
    assert (zero3.parallelism, zero3.tp, zero3.pp, zero3.task) == ("zero3", 1, 1, "char-gpt")
    assert (tp.parallelism, tp.tp, tp.micro_batch_size) == ("ddp", 2, 8)
    assert (pp.pp, pp.pp_schedule, pp.grad_accum_steps, pp.max_steps) == (2, "1f1b", 2, 50)
    assert bench_config("ddp", 2, 50).task == "digits"
    with pytest.raises(ValueError, match="hand-written loops for ddp, zero3, tp, pp"):
        bench_config("zero2", 2, 50)
    with pytest.raises(ValueError, match="doesn't do precision='bf16'"):
        bench_config("tp", 2, 50, RunConfig(task="char-gpt", precision="bf16"))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal a machine without a GPU gives"
)
def test_the_device_asked_for_reaches_both_loops_config_and_is_checked_before_anything_runs(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match=r"device='cuda': no CUDA GPU is visible on this machine"):
        overhead(steps=20, repeats=1, device="cuda", json_path=tmp_path / "o.json")
    assert not (tmp_path / "o.json").exists()


def test_weights_that_are_not_bitwise_equal_are_held_to_the_stated_tolerance() -> None:
    trainer = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64), "b": torch.zeros(0)}
    hand = {"w": torch.tensor([1.0, -2.0 + 1e-7], dtype=torch.float64), "b": torch.zeros(0)}
    assert weights_difference(trainer, hand) == pytest.approx((1e-7, 2.0), rel=1e-6)
    assert weights_difference(trainer, {"w": torch.zeros(2)}) == (math.inf, 0.0)
    near = OverheadReport(
        steps=20,
        num_processes=2,
        repeats=1,
        trainer_median_s=0.01,
        hand_median_s=0.01,
        trainer_mean_s=0.01,
        hand_mean_s=0.01,
        ratio=1.0,
        overhead_ms=0.0,
        budget_ms=1.1,
        weights_equal=False,
        device="cpu",
        log_every=10,
        mode="tp",
        task="char-gpt",
        weights_max_abs_diff=1e-7,
        weights_max_abs=2.0,
    )
    assert near.passed and "within the tolerance 1e-06 x max |w| = 2e-06" in near.table()
    far = OverheadReport(**{**near.__dict__, "weights_max_abs_diff": 1e-5})
    assert not far.passed and "BEYOND the tolerance" in far.table()
