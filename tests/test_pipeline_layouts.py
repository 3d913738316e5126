"""Pipelines with the other mesh dimensions inside each stage, and several model chunks per rank, for real: gloo
CPU ranks training char-gpt (4 blocks of 64) against one process running the same micro-batches.

pp x zero3 x tp on 8 ranks, pp x zero3, pp x tp under interleaved 1F1B and pp x zero2 under the zero-bubble
schedule on 4,
and both interleaved schedules alone on 2. Each run must train like the one process (fp32, dropout 0, clipping
active) and show that its layout really ran: the mesh each rank reports, the stages it owns, and the placements
and local shapes of its parameters. The 8-rank run's checkpoint resumes on one process and under zero3 on 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from collected_ids import cases
from conftest import copy_for_resume, cpu_refusals_lifted
from tasks_for_tests import SpikedCharGPT

import workbench as wb
from workbench.rundir import RunDir

pytestmark = pytest.mark.slow

STEPS = 3
SAVED_AT = 2
GLOBAL = 16
"""Samples per step in every run: micro_batch_size x grad_accum_steps x data-parallel size."""


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="char-gpt",
        num_processes=1,
        parallelism="none",
        device="cpu",
        micro_batch_size=4,
        grad_accum_steps=4,
        max_steps=STEPS,
        log_every=1,
        lr=3e-3,
        grad_clip=0.5,
        runs_dir=str(runs_dir),
        seed=3,
        oversubscribe=True,
        dist_timeout_s=120,
        eval_batches=1,
        task_options={"block_size": 32, "train_stride": 64, "dropout": 0.0, "n_layer": 4},
    )
    cfg = wb.RunConfig(**{**base, **fields})
    assert cfg.global_batch_size == GLOBAL, cfg.global_batch_size
    return cfg


LAYOUTS = {
    "pp x zero3 x tp": dict(
        num_processes=8,
        pp=2,
        parallelism="zero3",
        tp=2,
        micro_batch_size=2,
        checkpoint_every=SAVED_AT,
    ),
    "pp x zero3": dict(num_processes=4, pp=2, parallelism="zero3", micro_batch_size=2),
    "pp x tp, interleaved 1F1B": dict(
        num_processes=4, pp=2, parallelism="ddp", tp=2, pp_schedule="interleaved_1f1b"
    ),
    "pp x zero2, zero bubble": dict(
        num_processes=4, pp=2, parallelism="zero2", micro_batch_size=2, pp_schedule="zero_bubble"
    ),
    "interleaved 1F1B": dict(
        num_processes=2, pp=2, parallelism="ddp", pp_schedule="interleaved_1f1b"
    ),
    "zero bubble": dict(num_processes=2, pp=2, parallelism="ddp", pp_schedule="zero_bubble"),
}


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


def eval_losses(result: wb.RunResult) -> list[float]:
    return [r["eval_loss"] for r in result.metrics if "eval_loss" in r]


def worst_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def ranks(result: wb.RunResult) -> list[dict[str, Any]]:
    return sorted(result.summary["ranks"], key=lambda r: r["rank"])


class Runs(dict):  # type: ignore[type-arg]
    """Each layout launched when a test first asks for it (a test's time limit counts the launches it waits for)."""

    def __init__(self, runs_dir: Path) -> None:
        super().__init__()
        self.runs_dir = runs_dir

    def __missing__(self, name: str) -> wb.RunResult:
        fields = LAYOUTS.get(name, {})
        self[name] = wb.launch(
            cfg_for(self.runs_dir, run_name=name.replace(" ", "-").replace(",", ""), **fields)
        )
        return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_trains_like_one_process(runs: Runs, layout: str) -> None:
    worst = worst_relative(losses(runs[layout]), losses(runs["single"]))
    print(f"{layout}: worst relative loss deviation {worst:.2e}")
    assert worst < 1e-5
    # evaluation passes the activations chunk by chunk through the stages, forward only
    assert worst_relative(eval_losses(runs[layout]), eval_losses(runs["single"])) < 1e-5


def test_pp_zero3_tp_splits_every_matrix_over_the_stage_mesh(runs: Runs) -> None:
    everyone = ranks(runs["pp x zero3 x tp"])
    assert all(
        r["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2} for r in everyone
    )
    coords = {tuple(r["coordinates"].values()) for r in everyone}
    assert len(coords) == 8, "every rank its own place in the mesh"
    assert [r["pp_stage_ids"] for r in everyone] == [[0]] * 4 + [[1]] * 4
    assert everyone[0]["pp_holds"] == ["blocks.0", "blocks.1", "pos", "tok"]
    assert everyone[4]["pp_holds"] == ["blocks.2", "blocks.3", "head", "ln_f"]
    q = everyone[0]["split_params"]["blocks.0.attn.q.weight"]
    # TP's column split (rows over tp) and FSDP's shard (rows again over dp_shard): a quarter of the rows
    assert q["global_shape"] == [64, 64] and q["local_shape"] == [16, 64], q
    assert len(q["placements"]) == 2 and all("Shard(dim=0" in p for p in q["placements"]), q
    ln = everyone[0]["split_params"]["blocks.0.ln1.weight"]
    assert ln["placements"] == ["Shard(dim=0)"] and ln["local_shape"] == [32], (
        "left out of TP, sharded by FSDP"
    )


def test_interleaved_ranks_hold_every_other_stage(runs: Runs) -> None:
    for layout in ("interleaved 1F1B", "zero bubble"):
        first, second = ranks(runs[layout])
        assert first["pp_stage_ids"] == [0, 2] and second["pp_stage_ids"] == [1, 3]
        assert first["pp_holds"] == ["blocks.0", "blocks.2", "pos", "tok"]
        assert second["pp_holds"] == ["blocks.1", "blocks.3", "head", "ln_f"]
    tp = ranks(runs["pp x tp, interleaved 1F1B"])
    assert [r["pp_stage_ids"] for r in tp] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    proj = tp[3]["split_params"]["blocks.3.attn.proj.weight"]
    assert proj["placements"] == ["Shard(dim=1)"] and proj["local_shape"] == [64, 32], (
        "row-wise over tp"
    )
    zb = ranks(runs["pp x zero2, zero bubble"])
    assert zb[0]["split_params"]["tok.weight"]["placements"] == ["Shard(dim=0)"]
    assert zb[0]["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}


@pytest.mark.parametrize(
    "target",
    [
        dict(num_processes=1, parallelism="none", micro_batch_size=4),
        dict(num_processes=2, parallelism="zero3", micro_batch_size=2),
    ],
    ids=["one process", "zero3 on 2"],
)
def test_pp_zero3_tp_checkpoint_resumes_under_another_layout(
    runs: Runs, target: dict[str, Any]
) -> None:
    runs_dir, expected = runs["single"].dir.path.parent, losses(runs["single"])[SAVED_AT:]
    name = f"resumed-{target['num_processes']}"
    copy_for_resume(RunDir(runs["pp x zero3 x tp"].dir.path), RunDir(runs_dir / name), SAVED_AT)
    resumed = wb.launch(
        cfg_for(runs_dir, run_name=name, resume=True, resume_allow=["pp", "tp"], **target)
    )
    assert resumed.summary["steps_this_session"] == STEPS - SAVED_AT
    assert worst_relative(losses(resumed)[SAVED_AT:], expected) < 1e-5


def test_fp16_offload_and_checkpointing_inside_an_interleaved_pipeline(runs: Runs) -> None:
    # The last stage scales the loss; a spike at its 6th loss (step 2) overflows, and every rank skips the update.
    cfg = cfg_for(
        runs.runs_dir,
        run_name="fp16",
        num_processes=4,
        pp=2,
        parallelism="zero3",
        micro_batch_size=2,
        pp_schedule="interleaved_1f1b",
        precision="fp16",
        cpu_offload=True,
        activation_checkpointing="full",
    )
    with cpu_refusals_lifted():
        fp16 = wb.launch(cfg, task=SpikedCharGPT(spike_at=6))
    assert fp16.status == "completed" and fp16.summary["skipped_steps"] == 1
    everyone = ranks(fp16)
    assert [r["loss_scale"] for r in everyone] == [2.0**15] * 4, "every stage halved its scale"
    assert all(r["compute_dtype"] == "float16" for r in everyone)
    assert all("_checkpoint_wrapped_module" not in n for r in everyone for n in r["pp_params"]), (
        "full names"
    )
    got, fp32 = losses(fp16), losses(runs["single"])
    assert got[1] > 1e5 * fp32[1] and torch.isfinite(torch.tensor(got)).all()
    assert abs(got[0] - fp32[0]) / fp32[0] < 2e-4, "before the spike: fp16 close to fp32"


@pytest.mark.parametrize(
    "fields, match",
    cases(
        [
            (
                {"num_processes": 4, "pp": 2, "parallelism": "zero1"},
                r"ZeRO-1's ZeroRedundancyOptimizer needs DDP",
            ),
            (
                {"num_processes": 4, "pp": 2, "parallelism": "zero3", "pp_schedule": "zero_bubble"},
                r"zero_bubble.*hang.*parallelism='zero2'",
            ),
            (
                {
                    "num_processes": 2,
                    "pp": 2,
                    "pp_schedule": "interleaved_1f1b",
                    "pp_virtual_stages": 1,
                },
                r"pp_virtual_stages=1 with pp_schedule='interleaved_1f1b'.*set pp_virtual_stages=2",
            ),
            (
                {"num_processes": 2, "pp": 2, "pp_virtual_stages": 2},
                r"1f1b runs one chunk per rank",
            ),
            (
                {
                    "num_processes": 2,
                    "pp": 2,
                    "pp_schedule": "interleaved_1f1b",
                    "grad_accum_steps": 5,
                },
                r"whole rounds of pp; set grad_accum_steps=4",
            ),
            (
                {"num_processes": 4, "pp": 2, "parallelism": "hsdp", "dp_shard": 2},
                r"too few for hsdp's groups",
            ),
            (
                {"num_processes": 2, "pp": 2, "cpu_offload": True},
                r"cpu_offload=True with pp=2.*parallelism='zero3'",
            ),
        ]
    ),
)
def test_pipeline_layout_refusals(tmp_path: Path, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wb.RunConfig(
            task="char-gpt",
            device="cpu",
            runs_dir=str(tmp_path),
            **{"grad_accum_steps": 2, **fields},
        )
