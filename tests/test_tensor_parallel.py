"""Tensor parallelism, for real: gloo CPU ranks splitting char-gpt's matrices alone (TP=2, its micro-batch
chosen by micro_batch_size='auto') and with each data-parallel mode it composes with: FSDP x TP on 2 x 2 (with
cpu_offload), DDP x TP on 2 x 2 (FSDP2's replicate) and HSDP x TP on 2 x 2 x 2 (a 3-D mesh); fp16 loss scaling
under pure TP and FSDP x TP.

TP is a reformulation of the same computation, so it must train like one process does (fp32, dropout 0), and
it must really split: each rank reports, per split parameter, its DTensor placement and the local shape it
holds, and a run that quietly replicated the model would report none. Each run evaluates one batch only: the
whole evaluation set, forward through the split model, cost more than the training itself.

preflight refuses fp16 and cpu_offload on CPU (accelerate would run fp16 as fp32 unseen; a CPU run has no GPU
memory to offload), yet workbench's strategies cast, scale and offload on gloo ranks as they do on GPUs:
`cpu_refusals_lifted` lifts those two refusals, and only those, so these runs can prove the layouts take them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from collected_ids import cases
from conftest import copy_for_resume, cpu_refusals_lifted
from safetensors.torch import load_file
from tasks_for_tests import SpikedCharGPT, TinyBlocks

import workbench as wb
from workbench.config import ParallelDims
from workbench.estimator import estimate
from workbench.rundir import RunDir
from workbench.tasks.gpt_model import GPT

pytestmark = pytest.mark.slow

STEPS = 10
# ColwiseParallel: output features split, Shard(0)
SPLIT_ROWS = ("attn.q", "attn.k", "attn.v", "mlp.0")
SPLIT_COLS = ("attn.proj", "mlp.2")  # RowwiseParallel: input features split, Shard(1)
SPIKE_AT = 7
"""The training forward (per rank) whose loss SpikedCharGPT blows up: step 4's first micro-batch."""


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    """char-gpt tiny (2 layers, 2 heads, 64 wide), 32-character windows; global batch 16 in every layout."""
    base = dict(
        task="char-gpt",
        num_processes=1,
        device="cpu",
        micro_batch_size=8,
        grad_accum_steps=2,
        max_steps=STEPS,
        log_every=1,
        lr=3e-3,
        grad_clip=0.5,
        runs_dir=str(runs_dir),
        seed=3,
        oversubscribe=True,
        dist_timeout_s=120,
        eval_batches=1,
        task_options={"block_size": 32, "train_stride": 64, "dropout": 0.0},
    )
    return wb.RunConfig(**{**base, **fields})


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


def worst_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    runs_dir = tmp_path_factory.mktemp("runs")
    return {
        "single": wb.launch(cfg_for(runs_dir, run_name="single")),
        # The TP group searches its micro-batch together and counts as one data-parallel rank: 16 = m x accum.
        "tp2": wb.launch(
            cfg_for(
                runs_dir,
                num_processes=2,
                tp=2,
                run_name="tp2",
                checkpoint_every=5,
                keep_checkpoints=3,
                micro_batch_size="auto",
                target_global_batch=16,
                memory_budget_gb=0.02,
            )
        ),
    }


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    """FSDP x TP (with cpu_offload) and DDP x TP on 2 x 2 ranks."""
    runs_dir = tmp_path_factory.mktemp("hybrids")
    with cpu_refusals_lifted():
        fsdp_tp = wb.launch(
            cfg_for(
                runs_dir,
                num_processes=4,
                tp=2,
                parallelism="zero3",
                micro_batch_size=4,
                cpu_offload=True,
                run_name="fsdp-tp",
            )
        )
    ddp_tp = wb.launch(
        cfg_for(
            runs_dir,
            num_processes=4,
            tp=2,
            parallelism="ddp",
            micro_batch_size=4,
            run_name="ddp-tp",
        )
    )
    return {"fsdp_tp": fsdp_tp, "ddp_tp": ddp_tp}


@pytest.fixture(scope="module")
def hsdp_tp(tmp_path_factory: pytest.TempPathFactory) -> wb.RunResult:
    """HSDP x TP: 2 replicas x 2 shards x 2 TP ranks, a checkpoint at step 5."""
    runs_dir = tmp_path_factory.mktemp("hsdp")
    return wb.launch(
        cfg_for(
            runs_dir,
            num_processes=8,
            tp=2,
            parallelism="hsdp",
            dp_shard=2,
            micro_batch_size=2,
            checkpoint_every=5,
            run_name="hsdp-tp",
        )
    )


def test_tp2_trains_like_one_process(runs: dict[str, wb.RunResult]) -> None:
    single, tp = runs["single"], runs["tp2"]
    assert tp.status == "completed" and tp.summary["tp"] == 2 and tp.summary["world_size"] == 2
    assert tp.summary["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert tp.summary["global_batch_size"] == single.summary["global_batch_size"] == 16
    norms = [r["grad_norm"] for r in single.metrics if "grad_norm" in r]
    assert sum(n > 0.5 for n in norms) >= 5, (
        "clipping must be active for the comparison to cover it"
    )
    assert worst_relative(losses(tp), losses(single)) < 1e-5
    assert tp.metrics[-1]["eval_loss"] > 0, (
        "the split model evaluates (its own micro-batch, so another batch)"
    )
    reference, got = load_file(str(single.dir.weights_path)), load_file(str(tp.dir.weights_path))
    assert reference.keys() == got.keys() and got["blocks.0.attn.q.weight"].shape == (64, 64)
    worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
    # The TP all-reduce sums partial products in another order than one process's matmul, and AdamW divides
    # by sqrt(v): where a gradient is near zero, float32 rounding moves a weight by a fraction of one step
    # (lr). How much depends on the CPU's kernels: under 1e-5 on one machine, 2.8e-5 on an AMD EPYC.
    assert worst < 0.05 * tp.config.lr, f"the exported full weights differ by {worst:.2e}"


def test_tp2_chooses_its_micro_batch_as_one_data_parallel_rank(
    runs: dict[str, wb.RunResult],
) -> None:
    tp = runs["tp2"]
    record = json.loads((tp.run_dir / "autobatch.json").read_text())
    chosen, accum = record["chosen"], record["grad_accum_steps"]
    # Both ranks of the TP group tried the same sizes (a split forward needs both), and the global batch counts
    # the group once: 16 = m x accum x 1, where counting ranks would have given 16 = m x accum x 2.
    first, second = (r["tries"] for r in record["ranks"])
    assert first == second
    assert chosen * accum == 16 and record["global_batch"] == 16 and record["proposed"] >= 1
    assert (tp.summary["micro_batch_size"], tp.summary["grad_accum_steps"]) == (chosen, accum)


def _check_split(
    rank: dict[str, Any], rows: int, placements: dict[str, list[str]], cols: int = 2
) -> None:
    """Each block's planned matrices are DTensors placed as `placements` says, holding 1/rows of the rows of a
    column-wise split and 1/cols of the columns of a row-wise one."""
    split = rank["tp_params"]
    for block in (0, 1):
        for name in SPLIT_ROWS + SPLIT_COLS:
            p = split[f"blocks.{block}.{name}.weight"]
            full = p["global_shape"]
            assert p["placements"] == placements[name], (rank["rank"], name, p)
            if name in SPLIT_ROWS:
                assert p["local_shape"] == [full[0] // rows, full[1]], (rank["rank"], name, p)
            else:
                assert p["local_shape"][1] == full[1] // cols, (rank["rank"], name, p)
    assert not any(
        k.startswith(("tok.", "pos.", "ln_f.")) and "tp" in p["mesh"] for k, p in split.items()
    ), "embeddings and norms are not split by TP"


def test_tp2_ranks_hold_half_of_each_split_matrix(runs: dict[str, wb.RunResult]) -> None:
    ranks = runs["tp2"].summary["ranks"]
    assert [r["coordinates"] for r in ranks] == [{"tp": 0}, {"tp": 1}]
    layout = {
        **{n: ["Shard(dim=0)"] for n in SPLIT_ROWS},
        **{n: ["Shard(dim=1)"] for n in SPLIT_COLS},
    }
    for rank in ranks:
        assert rank["mesh"] == {"tp": 2} and rank["sharded"]
        _check_split(rank, 2, layout)
        assert not any(k.startswith(("tok.", "pos.", "ln_f.")) for k in rank["tp_params"]), (
            "these stay replicated"
        )
    full = sum(p.numel() * 4 for p in GPT(65, 2, 2, 64, 32).parameters())
    held = [r["params_bytes"] for r in ranks]
    assert held[0] == held[1] and 0.5 * full < held[0] < 0.75 * full, (held, full)


def _ranks_of_a_hybrid(
    run: wb.RunResult,
    single: wb.RunResult,
    mesh: dict[str, int],
    placements: tuple[list[str], list[str]],
) -> list[dict[str, Any]]:
    """The checks every hybrid layout passes: completed, global batch 16, the loss curve of one process within
    1e-5 relative per step, its mesh and row-major coordinates on every rank, and each block's planned matrices
    placed as `placements` (column-wise, row-wise) say; returns the ranks' records for the layout's own checks."""
    assert run.status == "completed" and run.summary["global_batch_size"] == 16
    assert run.summary["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, **mesh}
    assert worst_relative(losses(run), losses(single)) < 1e-5
    ranks = run.summary["ranks"]
    # the trainer's arithmetic, against the coordinates torch's DeviceMesh gave
    dims = ParallelDims(**mesh)
    assert [r["coordinates"] for r in ranks] == [
        {k: v for k, v in dims.coordinates(r).items() if k in mesh} for r in range(len(ranks))
    ]
    layout = {**{n: placements[0] for n in SPLIT_ROWS}, **{n: placements[1] for n in SPLIT_COLS}}
    for rank in ranks:
        assert rank["mesh"] == mesh
        _check_split(rank, 2 * mesh.get("dp_shard", 1), layout)
    return ranks


def test_fsdp_x_tp_on_2x2_with_cpu_offload_trains_like_one_process(
    runs: dict[str, wb.RunResult], hybrids: dict[str, wb.RunResult]
) -> None:
    assert hybrids["fsdp_tp"].config.cpu_offload
    # TP splits each matrix over 'tp', FSDP shards each TP slice again over 'dp_shard' (dim 0: the slice's rows).
    ranks = _ranks_of_a_hybrid(
        hybrids["fsdp_tp"],
        runs["single"],
        {"dp_shard": 2, "tp": 2},
        (["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"], ["Shard(dim=0)", "Shard(dim=1)"]),
    )
    for rank in ranks:
        q = rank["tp_params"]["blocks.0.attn.q.weight"]
        assert q["mesh"] == ["dp_shard", "tp"] and q["local_shape"] == [16, 64], q
        assert rank["tp_params"]["tok.weight"]["mesh"] == ["dp_shard"], (
            "the root's params are FSDP-sharded only"
        )


def test_ddp_x_tp_on_2x2_replicates_the_split_model(
    runs: dict[str, wb.RunResult], hybrids: dict[str, wb.RunResult]
) -> None:
    ranks = _ranks_of_a_hybrid(
        hybrids["ddp_tp"],
        runs["single"],
        {"dp_replicate": 2, "tp": 2},
        (["Replicate()", "Shard(dim=0)"], ["Replicate()", "Shard(dim=1)"]),
    )
    for rank in ranks:
        assert rank["parallelism"] == "ddp x tp2"
        assert rank["tp_params"]["tok.weight"]["placements"] == ["Replicate()"], (
            "whole on every rank"
        )
    assert len({r["params_bytes"] for r in ranks}) == 1, (
        "the replicas hold the same half of the model"
    )


def test_hsdp_x_tp_on_2x2x2_trains_like_one_process(
    runs: dict[str, wb.RunResult], hsdp_tp: wb.RunResult
) -> None:
    ranks = _ranks_of_a_hybrid(
        hsdp_tp,
        runs["single"],
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
        (
            ["Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
            ["Replicate()", "Shard(dim=0)", "Shard(dim=1)"],
        ),
    )
    for rank in ranks:
        q, tok = rank["tp_params"]["blocks.0.attn.q.weight"], rank["tp_params"]["tok.weight"]
        assert q["mesh"] == ["dp_replicate", "dp_shard", "tp"] and q["local_shape"] == [16, 64], q
        assert tok["mesh"] == ["dp_replicate", "dp_shard"] and tok["placements"] == [
            "Replicate()",
            "Shard(dim=0)",
        ]
    held = [r["params_bytes"] for r in ranks]
    assert held[:4] == held[4:], "the two replicas hold the same shards"


def test_the_estimate_holds_what_the_hybrid_ranks_held(
    hybrids: dict[str, wb.RunResult], hsdp_tp: wb.RunResult
) -> None:
    """wb.estimate traces the new layouts (here for 8 and 4 H100s, hsdp x tp in fp16 with its loss scaler):
    the model state it puts on each rank is what each real rank held."""
    for run, fields in (
        (hsdp_tp, {"precision": "fp16"}),
        (hybrids["ddp_tp"], {"precision": "bf16"}),
    ):
        cfg = run.config.replace(device="auto", **fields)
        est = estimate(cfg, "H100-SXM-80GB", cfg.num_processes)
        assert (
            est.fits
            and est.step_s > 0
            and any(a.startswith("tensor parallel:") for a in est.assumptions)
        )
        for real in run.summary["ranks"]:
            held = {k: real[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}
            assert est.ranks[real["rank"]].held == held, (cfg.parallelism, real["rank"])


@pytest.mark.parametrize("layout", ["tp2", "fsdp x tp"])
def test_fp16_loss_scaling_skips_an_overflow_on_every_rank(
    runs: dict[str, wb.RunResult], runs_dir: Path, layout: str
) -> None:
    fields = (
        {"num_processes": 2}
        if layout == "tp2"
        else {"num_processes": 4, "parallelism": "zero3", "micro_batch_size": 4}
    )
    with cpu_refusals_lifted():
        fp16 = wb.launch(
            cfg_for(runs_dir, tp=2, precision="fp16", **fields), task=SpikedCharGPT(SPIKE_AT)
        )
    assert fp16.status == "completed" and fp16.summary["skipped_steps"] == 1
    ranks = fp16.summary["ranks"]
    assert all(r["compute_dtype"] == "float16" for r in ranks)
    # The spike overflowed step 4's scaled gradients: every rank skipped that update and halved its scale.
    assert [r["loss_scale"] for r in ranks] == [2.0**15] * len(ranks)
    got, fp32 = losses(fp16), losses(runs["single"])
    assert got[3] > 1e5 * fp32[3] and torch.isfinite(torch.tensor(got)).all()
    assert worst_relative(got[:3], fp32[:3]) < 2e-4, "before the spike: fp16 close to fp32"


def test_tp2_checkpoint_resumes_under_zero3_and_on_one_process(
    runs: dict[str, wb.RunResult], runs_dir: Path
) -> None:
    expected = losses(runs["single"])[5:]
    saved = RunDir(runs["tp2"].dir.path)
    for name, fields in {
        "to-zero3": dict(parallelism="zero3", num_processes=2, micro_batch_size=4),
        "to-single": {},
    }.items():
        copy_for_resume(saved, RunDir(runs_dir / name), 5)
        resumed = wb.launch(
            cfg_for(runs_dir, run_name=name, resume=True, resume_allow=["tp"], **fields)
        )
        assert resumed.summary["steps_this_session"] == 5
        assert worst_relative(losses(resumed)[5:], expected) < 1e-5, name


def test_hsdp_x_tp_checkpoint_resumes_on_one_process(
    runs: dict[str, wb.RunResult], hsdp_tp: wb.RunResult, runs_dir: Path
) -> None:
    copy_for_resume(RunDir(hsdp_tp.dir.path), RunDir(runs_dir / "hsdp-to-single"), 5)
    resumed = wb.launch(cfg_for(runs_dir, run_name="hsdp-to-single", resume=True))
    assert resumed.summary["steps_this_session"] == 5 and resumed.summary["world_size"] == 1
    assert worst_relative(losses(resumed)[5:], losses(runs["single"])[5:]) < 1e-5


def test_zero3_checkpoint_resumes_under_tp2(runs: dict[str, wb.RunResult], runs_dir: Path) -> None:
    wb.launch(
        cfg_for(
            runs_dir,
            parallelism="zero3",
            num_processes=2,
            micro_batch_size=4,
            checkpoint_every=5,
            run_name="zero3",
        )
    )
    copy_for_resume(RunDir(runs_dir / "zero3"), RunDir(runs_dir / "zero3-to-tp2"), 5)
    resumed = wb.launch(
        cfg_for(runs_dir, num_processes=2, tp=2, run_name="zero3-to-tp2", resume=True)
    )
    assert resumed.summary["ranks"][0]["tp_params"], "the resumed run really is tensor parallel"
    assert worst_relative(losses(resumed)[5:], losses(runs["single"])[5:]) < 1e-5


@pytest.mark.parametrize(
    "fields,message",
    cases(
        [
            (
                {"num_processes": 3, "tp": 2},
                r"tp=2 with num_processes=3: .*must divide.*use tp=1 or 3",
            ),
            (
                {"num_processes": 4, "tp": 2, "parallelism": "zero1"},
                (
                    r"tp=2 with parallelism='zero1' on num_processes=4 \(data-parallel size 2\): .*'c10d.broadcast_.default does "
                    r"not have a sharding strategy registered'.*set parallelism='zero2'.*or 'ddp'"
                ),
            ),
            (
                {"num_processes": 4, "tp": 2, "parallelism": "ddp", "grad_compression": "fp16"},
                r"grad_compression='fp16' with tp=2: .*refuses the DTensor parameters.*FSDP2's replicate.*grad_compression='none'",
            ),
            (
                {"num_processes": 2, "tp": 2, "parallelism": "zero3", "cpu_offload": True},
                (
                    r"cpu_offload=True with tp=2 on num_processes=2 \(pure tensor parallelism\): .*CPUOffloadPolicy.*"
                    r"num_processes=4 with parallelism='zero3'"
                ),
            ),
            (
                {"num_processes": 8, "tp": 2, "parallelism": "hsdp", "dp_shard": 4},
                r"dp_shard=4 with parallelism='hsdp' and num_processes=8 \(tp=2\): .*use dp_shard=2",
            ),
            (
                {"num_processes": 4, "tp": 4, "parallelism": "zero3"},
                r"tp=4: task 'char-gpt' has n_head=2 attention heads.*use tp=1 or 2",
            ),
            (
                {"num_processes": 2, "tp": 2, "task": "tiny-blocks", "task_options": {}},
                r"tp=2: task 'tiny-blocks' has no tensor-parallel plan .*set tp=1",
            ),
        ]
    ),
)
def test_impossible_layouts_are_refused_before_launch(
    runs_dir: Path, fields: dict, message: str
) -> None:
    task = TinyBlocks() if fields.get("task") == "tiny-blocks" else None
    with pytest.raises(ValueError, match=message):
        wb.launch(cfg_for(runs_dir, **fields), task=task)
    assert not any(runs_dir.iterdir()), "nothing may be created for a layout that can't run"


class FusedAttention(torch.nn.Module):
    """char-gpt's attention before the split: one fused qkv Linear."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = torch.nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = torch.nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


@pytest.mark.parametrize("bias", [False, True])
def test_split_qkv_keeps_the_fused_init_and_loads_fused_checkpoints(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    from workbench.tasks import gpt_model

    with monkeypatch.context() as m:
        m.setattr(gpt_model, "CausalSelfAttention", FusedAttention)
        torch.manual_seed(0)
        old = GPT(65, 2, 2, 64, 32, bias=bias)
    torch.manual_seed(0)
    new = GPT(65, 2, 2, 64, 32, bias=bias)
    for b in (0, 1):
        fused, attn = old.blocks[b].attn.qkv.weight, new.blocks[b].attn
        assert torch.equal(fused, torch.cat([attn.q.weight, attn.k.weight, attn.v.weight])), (
            "same init, bit for bit"
        )
    loaded = GPT(65, 2, 2, 64, 32, bias=bias)
    loaded.load_state_dict(old.state_dict())  # a fused checkpoint: split by the pre-hook
    x = torch.randint(0, 65, (2, 16))
    assert torch.equal(loaded(x), old(x))
