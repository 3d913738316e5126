"""`workbench bench hf-overhead`: a transformers Llama-shaped model stepped by workbench and by the plain
Accelerate loop from accelerate's docs trains the same weights and losses, bit for bit, and the result says
so. Timing is the benchmark's business (benchmarks/results/hf-overhead/); a test holds it to the numerics,
the data order and the result's fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.commands.bench.results import default_result_path

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is needed")

from workbench.commands.bench.hf_overhead import (  # noqa: E402  (after the importorskip)
    HF_BENCH,
    LlamaOverheadTask,
    hf_overhead,
    last_window,
    trainer_order,
)


def test_the_cli_parses_the_bench_and_keeps_its_result_in_its_own_folder(tmp_path: Path) -> None:
    from workbench import cli
    from workbench.commands.bench_command import result_name

    args = cli._parser().parse_args(["bench", "hf-overhead", "--steps", "30", "--pairs", "3"])
    assert (args.steps, args.pairs, args.num_processes) == (30, 3, 2)
    assert result_name(args) == "hf-overhead"
    (tmp_path / "results").mkdir()
    assert default_result_path("hf-overhead", tmp_path / "results").parent.name == "hf-overhead"


def test_the_plain_loop_reads_each_rank_s_batches_in_the_trainer_s_order() -> None:
    """Dealt as accelerate deals batches (batch k to rank k % 2), the order is, rank by rank, the
    trainer's own ShardedBatches, across an epoch boundary."""
    from workbench.training.batches import ShardedBatches

    cfg = HF_BENCH.replace(
        max_steps=40, task_options={"samples": 48, "seq_len": 4, "vocab": 32}
    )  # 6 steps an epoch: 40 steps cross six epochs
    dataset = LlamaOverheadTask().build_datasets(cfg)[0]
    order = trainer_order(dataset, cfg, 2)
    mbs = cfg.micro_batch_size
    assert len(order) == 40 * 2 * mbs
    for rank in range(2):
        batches = ShardedBatches(dataset, cfg, rank, 2, None).iterate(0)
        for step in range(40):
            (tokens,) = next(batches)
            k = 2 * step + rank
            expected = torch.stack([dataset[i][0] for i in order[k * mbs : (k + 1) * mbs]])
            assert torch.equal(tokens, expected), (rank, step)


def test_the_last_window_is_the_trainer_s_last_metrics_row() -> None:
    assert last_window(HF_BENCH.replace(max_steps=60, log_every=10)) == 10
    assert last_window(HF_BENCH.replace(max_steps=65, log_every=10)) == 5
    assert last_window(HF_BENCH.replace(max_steps=7, log_every=10)) == 7


def test_too_few_steps_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"steps=10: must exceed the 10 warm-up steps"):
        hf_overhead(steps=10, pairs=1)
    with pytest.raises(ValueError, match=r"pairs=0: at least 1"):
        hf_overhead(steps=20, pairs=0)
    with pytest.raises(
        ValueError,
        match=r"grad_clip=1.0: the plain Accelerate loop has no .*"
        r"leave .*grad_clip=0.0",
    ):
        hf_overhead(steps=20, pairs=1, cfg=HF_BENCH.replace(grad_clip=1.0))


@pytest.mark.slow
def test_workbench_and_the_plain_accelerate_loop_train_the_same_weights_and_losses(
    tmp_path: Path,
) -> None:
    from workbench.utils import files

    report = hf_overhead(steps=12, pairs=1, json_path=tmp_path / "hf.json")
    assert report.trainer_median_s > 0 and report.hand_median_s > 0  # both sides ran their steps
    assert report.weights_equal and report.weights_max_abs_diff == 0.0, report.table()
    assert report.weights_max_abs > 0  # the full weights were loaded and compared
    assert report.trainer_final_loss is not None and report.trainer_final_loss > 0
    assert report.trainer_final_loss == report.accelerate_final_loss and report.losses_equal
    assert report.model.startswith("LlamaForCausalLM: 4 layers x 128 wide")
    assert report.params == sum(
        p.numel() for p in LlamaOverheadTask().build_model(HF_BENCH).parameters()
    )
    table = report.table()
    assert table.startswith("workbench bench hf-overhead: LlamaForCausalLM")
    assert "weights bitwise equal: True" in table and "equal in every pair" in table
    saved = files.read_json(tmp_path / "hf.json")
    assert saved["measured_on"]["date"]
    for key in ("overhead_ms", "budget_ms", "trainer_median_s", "hand_median_s", "passed"):
        assert key in saved, key
    assert (
        saved["trainer_final_loss"] == saved["accelerate_final_loss"] == report.trainer_final_loss
    )
    assert (saved["steps"], saved["repeats"], saved["num_processes"]) == (12, 1, 2)
    assert saved["passed"] == (saved["overhead_ms"] <= saved["budget_ms"])
