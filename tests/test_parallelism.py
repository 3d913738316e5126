"""Sharded data parallelism, for real: gloo CPU ranks running DDP, ZeRO-1/2/3 and HSDP on the same data.

Each mode must train exactly like DDP (ZeRO and FSDP are reformulations, not approximations), and each must
really shard: the bytes a rank holds are measured by the trainer from its DTensor shards and optimizer state,
so a mode that quietly ran as DDP would hold full copies and fail here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from collected_ids import cases
from safetensors.torch import load_file
from tasks_for_tests import TinyBlocks

import workbench as wb
from workbench.config.preflight import preflight
from workbench.rundir import RunDir

pytestmark = pytest.mark.slow

STEPS = 20


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="tiny-blocks",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        grad_accum_steps=2,
        max_steps=STEPS,
        log_every=1,
        lr=1e-2,
        grad_clip=0.5,
        runs_dir=str(runs_dir),
        seed=5,
        oversubscribe=True,
    )
    return wb.RunConfig(**{**base, **fields})


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


def weights(result: wb.RunResult) -> dict[str, torch.Tensor]:
    return load_file(str(result.dir.weights_path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    """One run per mode on the same global batch (32 samples per micro-batch): 2 ranks x 16, hsdp 4 x 8."""
    runs_dir = tmp_path_factory.mktemp("runs")
    layouts = {
        "ddp": {},
        "zero1": {},
        "zero2": {},
        "zero3": {},
        "hsdp": {"num_processes": 4, "dp_shard": 2, "micro_batch_size": 8},
    }
    return {
        mode: wb.launch(
            cfg_for(runs_dir, parallelism=mode, run_name=mode, **extra), task=TinyBlocks()
        )
        for mode, extra in layouts.items()
    }


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3", "hsdp"])
def test_every_mode_trains_like_ddp(runs: dict[str, wb.RunResult], mode: str) -> None:
    ddp, other = runs["ddp"], runs[mode]
    assert other.summary["parallelism"] == mode and other.status == "completed"
    clipped = [r["grad_norm"] for r in ddp.metrics if "grad_norm" in r]
    assert sum(n > 0.5 for n in clipped) >= 5, (
        "clipping must be active for the comparison to cover it"
    )
    assert len(losses(other)) == STEPS
    assert losses(other) == pytest.approx(losses(ddp), rel=1e-5)
    reference, got = weights(ddp), weights(other)
    assert reference.keys() == got.keys()
    worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert worst < 1e-6, f"final weights differ by {worst:.2e}"


def _rows_held_by(rank: int, world: int, dim0: int) -> int:
    """FSDP2 shards dim 0 in torch.chunk pieces: ceil(dim0 / world) rows, the last ranks fewer or none."""
    chunk = -(-dim0 // world)
    return max(0, min(chunk, dim0 - rank * chunk))


def test_sharding_is_real_each_rank_holds_its_shard(runs: dict[str, wb.RunResult]) -> None:
    model = TinyBlocks().build_model(cfg_for(Path(".")))
    params = list(model.parameters())
    full = sum(p.numel() * 4 for p in params)
    adam = 2 * full + 4 * len(params)  # exp_avg + exp_avg_sq, and a 4-byte step per parameter
    held = {mode: r.summary["ranks"] for mode, r in runs.items()}

    for rank in held["ddp"]:
        assert (rank["params_bytes"], rank["grads_bytes"], rank["optimizer_bytes"]) == (
            full,
            full,
            adam,
        )
        assert not rank["sharded"]
    zero1 = held["zero1"]
    assert all(r["params_bytes"] == full and r["grads_bytes"] == full for r in zero1)
    assert sum(r["optimizer_bytes"] for r in zero1) == adam, (
        "each parameter's state lives on exactly one rank"
    )
    assert all(0 < r["optimizer_bytes"] < adam for r in zero1)

    for mode, world in (("zero2", 2), ("zero3", 2), ("hsdp", 2)):  # hsdp: shards over groups of 2
        for rank in held[mode]:
            shard = rank["rank"] % world
            expected = sum(
                _rows_held_by(shard, world, p.shape[0]) * (p[0].numel() if p.dim() > 1 else 1) * 4
                for p in params
            )
            assert rank["sharded"] and rank["params_bytes"] == expected, (mode, rank)
            assert rank["grads_bytes"] == expected
            assert rank["optimizer_bytes"] == 2 * expected + 4 * len(params)
            assert rank["params_bytes"] < 0.6 * full
    row = [r for r in runs["zero3"].metrics if "loss" in r][-1]
    assert row["params_bytes_per_rank"] == [r["params_bytes"] for r in held["zero3"]], (
        "metrics rows report it too"
    )


def test_bf16_under_sharding_computes_in_bf16_with_fp32_master_weights(runs_dir: Path) -> None:
    result = wb.launch(
        cfg_for(runs_dir, parallelism="zero3", precision="bf16", max_steps=3), task=TinyBlocks()
    )
    ranks = result.summary["ranks"]
    assert [r["compute_dtype"] for r in ranks] == ["bfloat16", "bfloat16"]
    fp32 = sum(p.numel() * 4 for p in TinyBlocks().build_model(cfg_for(runs_dir)).parameters())
    assert sum(r["params_bytes"] for r in ranks) == fp32, "the sharded master weights stay fp32"
    assert all(t.dtype == torch.float32 for t in weights(result).values())


def test_sharded_checkpoints_resume_on_other_rank_counts_and_modes(runs_dir: Path) -> None:
    straight = wb.launch(
        cfg_for(runs_dir, parallelism="zero3", max_steps=10, run_name="straight"), task=TinyBlocks()
    )
    expected = losses(straight)[4:]
    for source in ("zero3", "ddp"):
        wb.launch(
            cfg_for(
                runs_dir,
                parallelism=source,
                max_steps=10,
                checkpoint_every=4,
                keep_checkpoints=5,
                run_name=f"saved-{source}",
            ),
            task=TinyBlocks(),
        )
    targets = [
        ("zero3", "zero3", 1, 32),
        ("zero3", "zero3", 4, 8),
        ("zero3", "ddp", 2, 16),
        ("ddp", "zero3", 2, 16),
        ("zero3", "zero1", 2, 16),
    ]
    for source, mode, n, micro in targets:
        name = f"{source}-to-{mode}-x{n}"
        saved = RunDir(runs_dir / f"saved-{source}")
        target = RunDir(runs_dir / name)
        target.path.mkdir()
        for item in ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json"):
            (target.path / item).write_bytes((saved.path / item).read_bytes())
        step4 = dict(saved.checkpoints())[4]
        (target.checkpoints_path).mkdir()
        shutil.copytree(step4, target.checkpoints_path / "step_4")
        resumed = wb.launch(
            cfg_for(
                runs_dir,
                parallelism=mode,
                num_processes=n,
                micro_batch_size=micro,
                max_steps=10,
                run_name=name,
                resume=True,
            ),
            task=TinyBlocks(),
        )
        assert resumed.summary["world_size"] == n
        assert losses(resumed)[4:] == pytest.approx(expected, rel=1e-5), name


@pytest.mark.parametrize(
    "fields,message",
    cases(
        [
            (
                {"parallelism": "hsdp", "num_processes": 3, "dp_shard": 2},
                r"dp_shard=2 with parallelism='hsdp' and num_processes=3: .*dp_shard must divide num_processes",
            ),
            (
                {"parallelism": "zero3", "cpu_offload": True},
                r"cpu_offload=True on CPU: .*set cpu_offload=False",
            ),
            (
                {"parallelism": "zero3", "grad_compression": "powersgd"},
                r"grad_compression='powersgd' with parallelism='zero3': .*Set grad_compression='none', or parallelism='ddp'",
            ),
            (
                {"parallelism": "ddp", "grad_compression": "bf16"},
                r"grad_compression='bf16' on CPU: .*use grad_compression='fp16'",
            ),
            (
                {"parallelism": "ddp", "cpu_offload": True},
                r"cpu_offload=True with parallelism='ddp': .*needs parallelism='zero3'",
            ),
            (
                {"parallelism": "zero3", "dp_shard": 2},
                r"dp_shard=2: only parallelism='hsdp' uses it",
            ),
        ]
    ),
)
def test_a_mode_that_cannot_apply_is_refused_before_launch(
    runs_dir: Path, fields: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        wb.launch(cfg_for(runs_dir, **fields), task=TinyBlocks())
    assert not any(runs_dir.iterdir()), "nothing may be created for a config that can't run"


def test_gradient_compression_hook_is_the_one_ddp_runs(runs_dir: Path) -> None:
    plain = wb.launch(cfg_for(runs_dir, max_steps=6), task=TinyBlocks())
    fp16 = wb.launch(cfg_for(runs_dir, max_steps=6, grad_compression="fp16"), task=TinyBlocks())
    assert [r["comm_hook"] for r in fp16.summary["ranks"]] == ["fp16_compress_hook"] * 2
    assert losses(fp16) != losses(plain), "fp16 all-reduce rounds the gradients"
    assert losses(fp16) == pytest.approx(losses(plain), rel=1e-3)


def test_more_processes_than_cores_is_refused_unless_asked_for(runs_dir: Path) -> None:
    import os

    cores = len(os.sched_getaffinity(0))
    with pytest.raises(
        ValueError, match=rf"num_processes={cores + 1}: .*or set oversubscribe=True"
    ):
        preflight(
            cfg_for(runs_dir, num_processes=cores + 1, oversubscribe=False), task=TinyBlocks()
        )
    with pytest.warns(UserWarning, match="oversubscribe=True"):
        preflight(cfg_for(runs_dir, num_processes=cores + 1), task=TinyBlocks())


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_activation_checkpointing_keeps_the_losses_and_saves_activation_memory(
    runs_dir: Path, mode: str
) -> None:
    # 256 samples: the activations must be what sets the peak (at 64 the end of backward - gradients and
    # optimizer state - is as high)
    common = dict(
        parallelism=mode,
        max_steps=4,
        micro_batch_size=256,
        grad_accum_steps=1,
        track_memory=True,
        task_options={"width": 64, "blocks": 4},
    )
    plain = wb.launch(cfg_for(runs_dir, **common), task=TinyBlocks())
    memory = {"none": plain.summary["ranks"][0]["tracked_memory"]}
    for policy in ("full", "selective"):
        checkpointed = wb.launch(
            cfg_for(runs_dir, activation_checkpointing=policy, **common), task=TinyBlocks()
        )
        assert losses(checkpointed) == pytest.approx(losses(plain), rel=1e-6)
        memory[policy] = checkpointed.summary["ranks"][0]["tracked_memory"]
    saved = {policy: m["activations_after_forward"] for policy, m in memory.items()}
    assert saved["full"] < saved["selective"] < saved["none"], saved
    assert memory["full"]["peak"] < memory["none"]["peak"]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fp16 with a sharded gradient scaler needs a CUDA GPU"
)
def test_fp16_under_zero3_scales_sharded_gradients_on_a_gpu(runs_dir: Path) -> None:
    result = wb.launch(
        cfg_for(
            runs_dir,
            device="cuda",
            num_processes=1,
            parallelism="zero3",
            precision="fp16",
            max_steps=6,
        ),
        task=TinyBlocks(),
    )
    assert result.status == "completed"
    assert result.summary["ranks"][0]["compute_dtype"] == "float16"
    assert all(torch.isfinite(t).all() for t in weights(result).values())
