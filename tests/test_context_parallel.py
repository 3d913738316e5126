"""Context parallel (cp): each sequence split over the ranks of a CP group, attention run as PyTorch's ring attention.

PyTorch 2.13 runs ring attention through the CUDA kernels of scaled_dot_product_attention only, so on CPU cp > 1 is
refused before launch with PyTorch's reason, and the real test is GPU-marked: char-gpt with cp=2 trains like one
process (fp32, 1e-5 relative per step), each rank holding half of every sequence. On CPU, the estimator's
`estimator/trace/ring.py` stands in for the CUDA kernels (PyTorch's own ring templates around the CPU kernel), so a gloo run
proves the rest: the sequence and position buffers sharded with load balancing, FSDP2 over dp_shard x cp, the loss
averaged over the group. The layout's refusals (field, value, fix) are pinned here too. The runs are the pipeline
tests' (char-gpt tiny, 32-character windows: 4 chunks of 8 under cp=2, dropout off, so CP must match exactly).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from collected_ids import cases
from test_estimate import _lower_peaks
from test_pipeline_parallel import cfg_for, losses, worst_relative

import workbench as wb
from workbench.config import ParallelDims
from workbench.config.preflight import check_context_parallel_task, preflight
from workbench.tasks import get_task


def assert_trains_like_one_process(
    cp: wb.RunResult, single: wb.RunResult, mesh: dict[str, int]
) -> None:
    assert worst_relative(losses(cp), losses(single)) < 1e-5, (losses(cp), losses(single))
    for rank in cp.summary["ranks"]:
        assert rank["mesh"] == mesh
        # its activations arrive split
        middle = 0 < rank.get("pp_stage", 0) < rank.get("pp_stages", 1) - 1
        held = {} if middle else {"length": 32, "local_length": 32 // mesh["cp"]}
        assert rank["cp_sequence"] == held, "each rank held its slice"


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="context parallel needs 2 CUDA GPUs (ring attention)"
)
def test_cp2_trains_like_one_process_on_gpus(runs_dir: Path) -> None:
    gpu: dict[str, Any] = {"device": "cuda", "tf32": False}
    single = wb.launch(cfg_for(runs_dir, run_name="single", **gpu))
    cp = wb.launch(
        cfg_for(runs_dir, run_name="cp2", num_processes=2, cp=2, parallelism="zero3", **gpu)
    )
    assert_trains_like_one_process(cp, single, {"cp": 2})
    assert cp.summary["ranks"][0]["parallelism"] == "zero3 x cp2"


def test_cp2_wiring_on_gloo_with_the_cpu_ring_stand_in(runs_dir: Path, ring_lifted: None) -> None:
    """The trainer's side of CP on 2 gloo ranks."""
    single = wb.launch(cfg_for(runs_dir, run_name="single"))
    cp = wb.launch(cfg_for(runs_dir, run_name="cp2", num_processes=2, cp=2, parallelism="zero3"))
    assert_trains_like_one_process(cp, single, {"cp": 2})
    evals = [[r["eval_loss"] for r in run.metrics if "eval_loss" in r] for run in (cp, single)]
    assert evals[0] == pytest.approx(evals[1], rel=1e-5), (
        "evaluation ran split too, averaging to the whole"
    )


PIPELINES = {
    "pp2 x cp2": ({"num_processes": 4, "parallelism": "zero3"}, 2),
    "pp2 zero_bubble x zero2 x cp2": (
        {"num_processes": 4, "parallelism": "zero2", "pp_schedule": "zero_bubble"},
        4,
    ),
    "pp2 x cp2 x tp2": ({"num_processes": 8, "parallelism": "zero3", "tp": 2}, 2),
    # a middle stage takes neither inputs nor targets: its ranks still enter the split (and attend as a ring)
    "pp3 x cp2": (
        {
            "num_processes": 6,
            "parallelism": "zero3",
            "pp": 3,
            "micro_batch_size": 2,
            "grad_accum_steps": 4,
        },
        3,
    ),
}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_cp_inside_pipeline_stages_trains_like_one_process(
    runs_dir: Path, ring_lifted: None, layout: str
) -> None:
    """The schedule runs inside the sequence split: the first stage's inputs, the last stage's targets and the
    positions are split before the micro-batches are cut, activations travel between stages split, every stage's
    attention is a ring over its CP group, and FSDP2 shards each chunk over dp_shard x cp."""
    fields, layers = {"pp": 2, **PIPELINES[layout][0]}, PIPELINES[layout][1]
    options = {"block_size": 32, "train_stride": 64, "dropout": 0.0, "n_layer": layers}
    batch = {k: v for k, v in fields.items() if k in ("micro_batch_size", "grad_accum_steps")}
    single = wb.launch(cfg_for(runs_dir, run_name="single", task_options=options, **batch))
    run = wb.launch(cfg_for(runs_dir, run_name="pp-cp", cp=2, task_options=options, **fields))
    mesh = {
        "pp": fields["pp"],
        "dp_replicate": 1,
        "dp_shard": 1,
        "cp": 2,
        "tp": fields.get("tp", 1),
    }
    assert_trains_like_one_process(run, single, mesh)
    evals = [[r["eval_loss"] for r in x.metrics if "eval_loss" in r] for x in (run, single)]
    assert evals[0] == pytest.approx(evals[1], rel=1e-5), (
        "evaluation went through the stages split too"
    )
    first, last = "tok.weight", f"blocks.{layers - 1}.ln1.weight"
    for rank in run.summary["ranks"]:
        stage, params = rank["pp_stage"], rank["pp_params"]
        assert (first in params) == (stage == 0) and (last in params) == (stage == fields["pp"] - 1)
        assert all("dp_shard_cp" in held["mesh"] for held in rank["split_params"].values()), (
            "FSDP2 shards each chunk over the CP group"
        )


def test_cp_on_cpu_is_refused_with_pytorchs_reason(runs_dir: Path) -> None:
    cfg = cfg_for(runs_dir, num_processes=2, cp=2, parallelism="zero3")
    with pytest.raises(
        ValueError,
        match=r"cp=2 on CPU: PyTorch's context parallel .*CUDA kernels.*"
        r"_scaled_dot_product_flash_attention_for_cpu.*set cp=1",
    ):
        preflight(cfg)


@pytest.mark.parametrize(
    ("fields", "message"),
    cases(
        [
            ({"cp": 0}, r"cp=0: the context-parallel size must be at least 1"),
            (
                {"cp": 2, "num_processes": 3},
                r"cp=2 with num_processes=3: cp x tp must divide .*use cp=3",
            ),
            (
                {"cp": 2, "num_processes": 2, "parallelism": "ddp"},
                r"cp=2 with parallelism='ddp': .*set parallelism='zero2'",
            ),
            (
                {"cp": 2, "num_processes": 4, "parallelism": "hsdp", "dp_shard": 2},
                r"dp_shard=2 with parallelism='hsdp' and num_processes=4 \(cp=2\).*num_processes=8 with dp_shard=2",
            ),
        ]
    ),
)
def test_impossible_cp_layouts_are_refused(runs_dir: Path, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cfg_for(runs_dir, **fields)


def test_tasks_that_cannot_split_their_sequences_are_refused(runs_dir: Path) -> None:
    cfg = cfg_for(runs_dir, num_processes=2, cp=2, parallelism="zero3", device="cuda")
    with pytest.raises(
        ValueError,
        match=r"cp=2: task 'digits' doesn't say where its sequence dimension is .*"
        r"context_parallel_buffers",
    ):
        check_context_parallel_task(cfg.replace(task="digits", task_options={}), get_task("digits"))
    odd = cfg.replace(task_options={"block_size": 30})
    with pytest.raises(
        ValueError,
        match=r"cp=2: task 'char-gpt' has sequences of 30 tokens.*2 x cp = 4 equal chunks"
        r".*task_options.block_size=28",
    ):
        check_context_parallel_task(odd, get_task("char-gpt"))


def test_the_mesh_puts_cp_between_dp_shard_and_tp() -> None:
    """torchtitan's order: a CP group's ranks share the data-parallel coordinate (same batches), TP innermost."""
    cfg = wb.RunConfig(num_processes=8, cp=2, tp=2, parallelism="zero3")
    dims = ParallelDims.of(cfg)
    assert (
        dims.sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
        and cfg.dp_size == 2
    )
    assert dims.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.global_batch(4, 2) == 16 and dims.world_size == 8


def test_micro_batch_auto_measures_the_split_sequences_so_cp_fits_more(
    runs_dir: Path, ring_lifted: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """micro_batch_size='auto' under cp: every rank of a CP group tries each size together (ring attention needs
    them all) inside the sequence split, so a rank's trial holds half of each sequence's activations and a larger
    micro-batch fits the same budget than without cp. The estimate doesn't trace cp: the ranks start from their
    own trials at sizes 1 and 2, as the run without cp is made to here (its estimate would cost a trace per size)."""
    from workbench.estimator import microbatch

    budget = {
        "micro_batch_size": "auto",
        "memory_budget_gb": 0.02,
        "max_steps": 1,
        "num_processes": 2,
        "parallelism": "zero3",
    }
    with monkeypatch.context() as patch:
        patch.setattr(
            microbatch,
            "propose",
            lambda cfg, task: {"proposed": None, "how": "the ranks' own trials"},
        )
        whole = wb.launch(cfg_for(runs_dir, run_name="whole", **budget))
    split = wb.launch(cfg_for(runs_dir, run_name="split", cp=2, **budget))
    chosen = {
        run.dir.path.name: json.loads((run.dir.path / "autobatch.json").read_text())
        for run in (whole, split)
    }
    assert (
        chosen["split"]["proposed"] is None
        and "the ranks search from their own trials" in chosen["split"]["how"]
    )
    # 2x but for the fixed bytes
    assert chosen["split"]["chosen"] > 1.3 * chosen["whole"]["chosen"], chosen
    usable = 0.02 * 2**30 * 0.9
    for rank in chosen["split"]["ranks"]:
        fitting = [t for t in rank["tries"] if t["micro_batch"] == chosen["split"]["chosen"]]
        assert fitting and fitting[-1]["peak_bytes"] <= usable
    assert split.summary["micro_batch_size"] == chosen["split"]["chosen"], (
        "the run trained at the size chosen"
    )
    assert {r["cp_sequence"]["local_length"] for r in split.summary["ranks"]} == {16}


ESTIMATED = {
    "zero3 x cp2": ({"num_processes": 2}, 0.02),
    "pp2 x cp2": ({"num_processes": 4, "pp": 2}, 0.04),
}


@pytest.mark.parametrize("layout", list(ESTIMATED))
def test_the_estimate_traces_ring_attention_and_holds_what_the_ranks_held(
    runs_dir: Path, ring_lifted: None, layout: str
) -> None:
    """The estimate's trace runs the step through PyTorch's ring templates (estimator/trace/ring.py), on each rank's share
    of the sequences: its model state per rank is the real run's, byte for byte, and its tracked peak within 2%
    (4% for a pipeline stage, as without cp: tests/test_estimate_layouts.py)."""
    from workbench.estimator.trace.step import trace_step

    fields, tolerance = ESTIMATED[layout]
    options = {"block_size": 64, "train_stride": 64, "dropout": 0.0, "n_embd": 128}
    cfg = cfg_for(
        runs_dir,
        run_name="cp",
        cp=2,
        parallelism="zero3",
        track_memory=True,
        max_steps=2,
        micro_batch_size=8,
        task_options=options,
        **fields,
    )
    ranks = wb.launch(cfg).summary["ranks"]
    # a rank of each stage: its CP peer holds the same
    traces = {
        r["rank"]: trace_step(
            cfg.replace(track_memory=False), get_task(cfg.task), world=len(ranks), rank=r["rank"]
        )
        for r in (ranks[::2] if cfg.pp > 1 else ranks)
    }
    for _ in range(2):
        # gloo may hold a collective's buffer late in a tracked step (test_estimate._lower_peaks)
        if all(
            abs(t.memory["peak"] / ranks[r]["tracked_memory"]["peak"] - 1) < tolerance
            for r, t in traces.items()
        ):
            break
        ranks = _lower_peaks(ranks, wb.launch(cfg.replace(run_name=f"cp-{_}")).summary["ranks"])
    for r, trace in traces.items():
        real = ranks[r]
        assert trace.held == {k: real[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}, r
        tracked = real["tracked_memory"]["peak"]
        assert abs(trace.memory["peak"] / tracked - 1) < tolerance, (r, trace.memory, tracked)


def test_the_estimate_prices_the_rings_exchanges_and_each_ranks_share_of_the_work() -> None:
    """Against the same ranks without cp: each attention layer adds an all-gather of the keys and values of the
    whole sequence in its forward and again in its backward (PyTorch's default rotation), and a rank computes
    about half of the step (its queries against every key, the rest per token)."""
    from workbench.estimator.trace.step import trace_step

    options = {"block_size": 64, "train_stride": 64, "dropout": 0.0, "n_embd": 128, "n_layer": 2}
    cfg = wb.RunConfig(
        task="char-gpt",
        num_processes=2,
        device="cpu",
        micro_batch_size=8,
        grad_accum_steps=2,
        parallelism="zero3",
        task_options=options,
    )
    whole, split = (trace_step(cfg.replace(cp=cp), get_task("char-gpt"), world=2) for cp in (1, 2))
    without, ring = whole.comm["all_gather@2"], split.comm["all_gather@2"]
    rings = 2 * 2 * 2  # layers x micro-batches x (forward, backward)
    assert ring["count"] - without["count"] == rings
    # (k, v) x micro-batch x sequence x width x fp32, gathered whole
    key_and_value = 2 * 8 * 64 * 128 * 4
    assert ring["bytes"] - without["bytes"] == rings * key_and_value
    assert 0.45 < split.flops / whole.flops < 0.55
    assert split.memory["activations"] < 0.5 * whole.memory["activations"]
