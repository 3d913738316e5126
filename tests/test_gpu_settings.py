"""On CUDA: fp32 matmuls on TF32 tensor cores unless `tf32: false`, AdamW's fused kernel when every parameter is
on the GPU; the estimate and MFU price fp32 at the TF32 peak then. The CPU side of each is checked here too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import workbench as wb
from workbench.estimator import estimate
from workbench.estimator.catalog import peak_flops
from workbench.training.optim import all_on_cuda, build_optimizer

GPT2 = {
    "task": "char-gpt",
    "task_options": {"preset": "gpt2-small", "n_layer": 2},
    "num_processes": 8,
    "micro_batch_size": 8,
}
"""GPT-2 small's width and context, 2 of its blocks: matmul-bound on an H100, quick to trace."""


def test_the_peak_for_mfu_comes_from_the_catalog_with_tf32_for_fp32() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(67e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == pytest.approx(494.7e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", tf32=True) == pytest.approx(989e12), (
        "tf32 is fp32's alone"
    )
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == pytest.approx(156e12)
    assert peak_flops("Quadro K600", "fp32") is None


def test_an_fp32_estimate_on_a_gpu_is_priced_at_the_tf32_peak_unless_turned_off() -> None:
    with_tf32 = estimate(wb.RunConfig(**GPT2), "H100-SXM-80GB", 8)
    without = estimate(wb.RunConfig(**GPT2, tf32=False), "H100-SXM-80GB", 8)
    assert without.step_s > 3 * with_tf32.step_s, (with_tf32.step_s, without.step_s)


def test_adamw_is_fused_only_when_every_parameter_is_on_a_gpu() -> None:
    model = torch.nn.Linear(4, 4)
    assert not all_on_cuda(model)
    assert not build_optimizer(model, wb.RunConfig()).defaults.get("fused")


@pytest.mark.slow
def test_a_cpu_run_reports_neither_tf32_nor_a_fused_optimizer(runs_dir: Path) -> None:
    result = wb.launch(
        wb.RunConfig(task="digits", num_processes=1, max_steps=2, runs_dir=str(runs_dir))
    )
    assert {(r["tf32"], r["fused_optimizer"]) for r in result.summary["ranks"]} == {(False, False)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 and fused AdamW need a CUDA GPU")
@pytest.mark.parametrize("tf32", [True, False])
def test_on_cuda_tf32_follows_the_field_and_adamw_is_fused(runs_dir: Path, tf32: bool) -> None:
    result = wb.launch(
        wb.RunConfig(
            task="digits",
            num_processes=1,
            device="cuda",
            max_steps=3,
            tf32=tf32,
            runs_dir=str(runs_dir),
        )
    )
    (rank,) = result.summary["ranks"]
    assert rank["tf32"] is tf32 and rank["fused_optimizer"] is True
    assert all_on_cuda(torch.nn.Linear(4, 4).cuda())
