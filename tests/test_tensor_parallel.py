"""Tensor parallelism, for real: gloo CPU ranks splitting char-gpt's matrices (TP=2, and FSDP x TP on 2 x 2).

TP is a reformulation of the same computation, so it must train like one process does (fp32, dropout 0), and
it must really split: each rank reports, per split parameter, its DTensor placement and the local shape it
holds, and a run that quietly replicated the model would report none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import copy_for_resume
from safetensors.torch import load_file
from tasks_for_tests import TinyBlocks

import workbench as wb
from workbench.rundir import RunDir
from workbench.tasks.char_gpt import GPT

pytestmark = pytest.mark.slow

STEPS = 10
SPLIT_ROWS = ("attn.q", "attn.k", "attn.v", "mlp.0")  # ColwiseParallel: output features split, Shard(0)
SPLIT_COLS = ("attn.proj", "mlp.2")  # RowwiseParallel: input features split, Shard(1)


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    """char-gpt tiny (2 layers, 2 heads, 64 wide), 32-character windows; global batch 16 in every layout."""
    base = dict(task="char-gpt", num_processes=1, device="cpu", micro_batch_size=8,
                grad_accum_steps=2, max_steps=STEPS, log_every=1, lr=3e-3, grad_clip=0.5, runs_dir=str(runs_dir),
                seed=3, oversubscribe=True, dist_timeout_s=120,
                task_options={"block_size": 32, "train_stride": 64, "dropout": 0.0})
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
        "tp2": wb.launch(cfg_for(runs_dir, num_processes=2, tp=2, run_name="tp2", checkpoint_every=5,
                                 keep_checkpoints=3)),
        "fsdp_tp": wb.launch(cfg_for(runs_dir, num_processes=4, tp=2, parallelism="zero3", micro_batch_size=4,
                                     run_name="fsdp-tp")),
    }


def test_tp2_trains_like_one_process(runs: dict[str, wb.RunResult]) -> None:
    single, tp = runs["single"], runs["tp2"]
    assert tp.status == "completed" and tp.summary["tp"] == 2 and tp.summary["world_size"] == 2
    assert tp.summary["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert tp.summary["global_batch_size"] == single.summary["global_batch_size"] == 16
    norms = [r["grad_norm"] for r in single.metrics if "grad_norm" in r]
    assert sum(n > 0.5 for n in norms) >= 5, "clipping must be active for the comparison to cover it"
    assert worst_relative(losses(tp), losses(single)) < 1e-5
    reference, got = load_file(str(single.dir.weights_path)), load_file(str(tp.dir.weights_path))
    assert reference.keys() == got.keys() and got["blocks.0.attn.q.weight"].shape == (64, 64)
    worst = max((reference[k] - got[k]).abs().max().item() for k in reference)
    # The TP all-reduce sums partial products in another order than one process's matmul, and AdamW divides
    # by sqrt(v): where a gradient is near zero, float32 rounding moves a weight by a fraction of one step
    # (lr). How much depends on the CPU's kernels: under 1e-5 on one machine, 2.8e-5 on an AMD EPYC.
    assert worst < 0.05 * tp.config.lr, f"the exported full weights differ by {worst:.2e}"


def _check_split(rank: dict[str, Any], local_rows: int, placements: dict[str, list[str]]) -> None:
    split = rank["tp_params"]
    for block in (0, 1):
        for name in SPLIT_ROWS + SPLIT_COLS:
            p = split[f"blocks.{block}.{name}.weight"]
            full = p["global_shape"]
            assert p["placements"] == placements[name], (rank["rank"], name, p)
            if name in SPLIT_ROWS:
                assert p["local_shape"] == [full[0] // local_rows, full[1]], (rank["rank"], name, p)
            else:
                assert p["local_shape"][1] == full[1] // 2, (rank["rank"], name, p)
    assert not any(k.startswith(("tok.", "pos.", "ln_f.")) for k in split), "embeddings and norms stay replicated"


def test_tp2_ranks_hold_half_of_each_split_matrix(runs: dict[str, wb.RunResult]) -> None:
    ranks = runs["tp2"].summary["ranks"]
    assert [r["coordinates"] for r in ranks] == [{"tp": 0}, {"tp": 1}]
    layout = {**{n: ["Shard(dim=0)"] for n in SPLIT_ROWS}, **{n: ["Shard(dim=1)"] for n in SPLIT_COLS}}
    for rank in ranks:
        assert rank["mesh"] == {"tp": 2} and rank["sharded"]
        _check_split(rank, 2, layout)
    full = sum(p.numel() * 4 for p in GPT(65, 2, 2, 64, 32).parameters())
    held = [r["params_bytes"] for r in ranks]
    assert held[0] == held[1] and 0.5 * full < held[0] < 0.75 * full, (held, full)


def test_fsdp_x_tp_on_2x2_trains_like_one_process(runs: dict[str, wb.RunResult]) -> None:
    single, both = runs["single"], runs["fsdp_tp"]
    assert both.status == "completed" and both.summary["global_batch_size"] == 16
    assert both.summary["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert worst_relative(losses(both), losses(single)) < 1e-4
    ranks = both.summary["ranks"]
    assert [r["coordinates"] for r in ranks] == [{"dp_shard": d, "tp": t} for d in (0, 1) for t in (0, 1)]
    for rank in ranks:
        assert rank["mesh"] == {"dp_shard": 2, "tp": 2}
        q = rank["tp_params"]["blocks.0.attn.q.weight"]
        # TP splits the 64 rows in two, FSDP splits each half again: 16 rows here.
        assert q["mesh"] == ["dp_shard", "tp"] and q["local_shape"] == [16, 64], q
        assert rank["tp_params"]["tok.weight"]["mesh"] == ["dp_shard"], "the root's params are FSDP-sharded only"


def test_tp2_checkpoint_resumes_under_zero3_and_on_one_process(runs: dict[str, wb.RunResult], runs_dir: Path) -> None:
    expected = losses(runs["single"])[5:]
    saved = RunDir(runs["tp2"].dir.path)
    for name, fields in {"to-zero3": dict(parallelism="zero3", num_processes=2, micro_batch_size=4),
                         "to-single": {}}.items():
        copy_for_resume(saved, RunDir(runs_dir / name), 5)
        resumed = wb.launch(cfg_for(runs_dir, run_name=name, resume=True, resume_allow=["tp"], **fields))
        assert resumed.summary["steps_this_session"] == 5
        assert worst_relative(losses(resumed)[5:], expected) < 1e-5, name


def test_zero3_checkpoint_resumes_under_tp2(runs: dict[str, wb.RunResult], runs_dir: Path) -> None:
    wb.launch(cfg_for(runs_dir, parallelism="zero3", num_processes=2, micro_batch_size=4, checkpoint_every=5,
                      run_name="zero3"))
    copy_for_resume(RunDir(runs_dir / "zero3"), RunDir(runs_dir / "zero3-to-tp2"), 5)
    resumed = wb.launch(cfg_for(runs_dir, num_processes=2, tp=2, run_name="zero3-to-tp2", resume=True))
    assert resumed.summary["ranks"][0]["tp_params"], "the resumed run really is tensor parallel"
    assert worst_relative(losses(resumed)[5:], losses(runs["single"])[5:]) < 1e-5


@pytest.mark.parametrize("fields,message", [
    ({"num_processes": 3, "tp": 2}, r"tp=2 with num_processes=3: .*must divide.*use tp=1 or 3"),
    ({"num_processes": 4, "tp": 2, "parallelism": "ddp"},
     r"tp=2 with parallelism='ddp' on num_processes=4 \(data-parallel size 2\): .*parallelism='zero3'.*tp=4"),
    ({"num_processes": 4, "tp": 4, "parallelism": "zero3"},
     r"tp=4: task 'char-gpt' has n_head=2 attention heads.*use tp=1 or 2"),
    ({"num_processes": 2, "tp": 2, "task": "tiny-blocks", "task_options": {}},
     r"tp=2: task 'tiny-blocks' has no tensor-parallel plan .*set tp=1"),
    ({"num_processes": 8, "tp": 2, "parallelism": "hsdp", "dp_shard": 2}, r"hsdp x tp .*not supported yet"),
])
def test_impossible_layouts_are_refused_before_launch(runs_dir: Path, fields: dict, message: str) -> None:
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
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


@pytest.mark.parametrize("bias", [False, True])
def test_split_qkv_keeps_the_fused_init_and_loads_fused_checkpoints(monkeypatch: pytest.MonkeyPatch,
                                                                     bias: bool) -> None:
    from workbench.tasks import char_gpt

    with monkeypatch.context() as m:
        m.setattr(char_gpt, "CausalSelfAttention", FusedAttention)
        torch.manual_seed(0)
        old = GPT(65, 2, 2, 64, 32, bias=bias)
    torch.manual_seed(0)
    new = GPT(65, 2, 2, 64, 32, bias=bias)
    for b in (0, 1):
        fused, attn = old.blocks[b].attn.qkv.weight, new.blocks[b].attn
        assert torch.equal(fused, torch.cat([attn.q.weight, attn.k.weight, attn.v.weight])), "same init, bit for bit"
    loaded = GPT(65, 2, 2, 64, 32, bias=bias)
    loaded.load_state_dict(old.state_dict())  # a fused checkpoint: split by the pre-hook
    x = torch.randint(0, 65, (2, 16))
    assert torch.equal(loaded(x), old(x))
