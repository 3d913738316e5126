"""The estimate before launching: traced through the trainer's own parallelism code on a fake world, checked
against the same runs for real (PyTorch's memory tracker on CPU), and priced on accelerators to rent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from machine_stand_in import stand_in_machine
from tasks_for_tests import TinyBlocks

import workbench as wb
from workbench.estimator import estimate, lookup

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent
SHAPES = {"deep": {"width": 64, "blocks": 4}, "wide": {"width": 192, "blocks": 1}}
LAYOUTS = {
    "ddp": {},
    "zero1": {},
    "zero2": {},
    "zero3": {},
    "hsdp": {"num_processes": 4, "dp_shard": 2, "micro_batch_size": 8},
}
RETRIES = 3  # more runs of a layout whose tracked peak is off (_lower_peaks)


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="tiny-blocks",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        grad_accum_steps=2,
        max_steps=2,
        log_every=1,
        runs_dir=str(runs_dir),
        oversubscribe=True,
        track_memory=True,
    )
    return wb.RunConfig(**{**base, **fields})


@pytest.fixture(scope="module")
def measured(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[tuple[str, str], tuple[list[dict], Any]]:
    """Every mode on both shapes: the real run's ranks (memory tracked) and the estimate of the same config (its
    time priced on a stand-in machine profile: memory is what these tests check)."""
    runs_dir = tmp_path_factory.mktemp("runs")
    out = {}
    for shape, options in SHAPES.items():
        for mode, layout in LAYOUTS.items():
            cfg = cfg_for(runs_dir, parallelism=mode, task_options=options, **layout)
            with stand_in_machine():
                est = estimate(cfg, task=TinyBlocks())
            ranks = wb.launch(cfg, task=TinyBlocks()).summary["ranks"]
            for _ in range(RETRIES):
                if all(
                    abs(est.ranks[r["rank"]].tensors / r["tracked_memory"]["peak"] - 1) < 0.02
                    for r in ranks
                ):
                    break
                ranks = _lower_peaks(ranks, wb.launch(cfg, task=TinyBlocks()).summary["ranks"])
            out[(shape, mode)] = ranks, est
    return out


def _lower_peaks(first: list[dict], second: list[dict]) -> list[dict]:
    """Each rank's run with the lower tracked peak. gloo's async work objects let go of a collective's buffers
    from gloo's own thread, so now and then a real run's tracked step holds one a little longer: seen on one
    rank in about 1 run of 5 (+3% to +13%, FSDP2 on 2 CPU ranks), with the code before the estimator's changes
    too; CI once saw it in two runs in a row (+3.5%, zero3). The steady state the estimate models is each rank's
    lowest of up to 1 + RETRIES runs; a wrong estimate misses them all."""
    return [
        a if a["tracked_memory"]["peak"] <= b["tracked_memory"]["peak"] else b
        for a, b in zip(first, second)
    ]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_model_state_is_exact_and_the_peak_within_2_percent(
    measured: dict, shape: str, mode: str
) -> None:
    ranks, est = measured[(shape, mode)]
    assert len(est.ranks) == len(ranks)
    for real in ranks:
        mine = est.ranks[real["rank"]]
        assert mine.held == {k: real[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}, (
            mode,
            real["rank"],
        )
        tracked = real["tracked_memory"]["peak"]
        assert abs(mine.tensors / tracked - 1) < 0.02, (mode, shape, mine.tensors, tracked)


def test_the_peak_tracks_the_choice_of_mode(measured: dict) -> None:
    """Sharding must show in the estimate as it does in the real run: not a formula that ignores the mode."""
    ddp, zero3 = measured[("wide", "ddp")][1], measured[("wide", "zero3")][1]
    assert zero3.ranks[0].held["params"] < 0.6 * ddp.ranks[0].held["params"]
    assert zero3.ranks[0].optimizer < 0.6 * ddp.ranks[0].optimizer


def test_a_1_5b_parameter_zero3_estimate_never_allocates_the_model(needs_mirror: Path) -> None:
    # 1.5B parameters in 12 wide blocks rather than GPT-2 XL's 48: the trace's time goes with the number of ops.
    code = (
        "import json, time, workbench as wb\nfrom workbench.estimator import estimate\nstarted = time.time()\n"
        "cfg = wb.RunConfig(task='char-gpt', num_processes=8, micro_batch_size=1, parallelism='zero3', "
        "precision='bf16', task_options={'n_layer': 12, 'n_embd': 3200, 'n_head': 25, 'block_size': 1024})\n"
        "e = estimate(cfg, gpu='H100-SXM-80GB', gpus=8)\n"
        "print(json.dumps({'seconds': time.time() - started, 'rss': e.max_rss_bytes, 'fits': e.fits, "
        "'params': sum(p for p in [e.ranks[0].held['params']]), 'peak': e.peak, 'n': e.config['task_options']}))"
    )
    env = {**os.environ, "WORKBENCH_DATA_MIRROR": str(needs_mirror), "WORKBENCH_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    model_bytes = 1.47e9 * 4
    assert result["params"] * 8 > 0.99 * model_bytes, (
        "the estimate covers the whole 1.5B-parameter model"
    )
    assert result["rss"] < model_bytes / 4, f"resident memory {result['rss'] / 2**30:.2f} GiB"
    assert result["fits"] and result["peak"] < 20 * 2**30
    print(
        f"1.5B zero3 estimate: {result['seconds']:.0f} s, resident {result['rss'] / 2**20:.0f} MiB"
    )


def test_auto_micro_batch_agrees_on_the_smaller_fit_and_keeps_the_global_batch(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.training import autobatch

    # bytes each rank may use; forked ranks inherit the patch
    budgets = {0: 1_300_000, 1: 1_000_000}
    monkeypatch.setattr(
        autobatch, "memory_limit", lambda device, cfg, local: budgets[int(os.environ["RANK"])]
    )
    cfg = cfg_for(
        runs_dir,
        micro_batch_size="auto",
        target_global_batch=64,
        grad_accum_steps=1,
        max_steps=3,
        track_memory=False,
        task_options={"width": 64, "blocks": 3},
    )
    result = wb.launch(cfg, task=TinyBlocks())
    record = json.loads((result.run_dir / "autobatch.json").read_text())
    own = {r["rank"]: r["own_choice"] for r in record["ranks"]}
    chosen, s = record["chosen"], result.summary
    assert own[1] < own[0], "the ranks' budgets give different fits"
    assert chosen <= own[1] and 64 % (chosen * 2) == 0
    assert (s["micro_batch_size"], s["grad_accum_steps"], s["global_batch_size"]) == (
        chosen,
        64 // (2 * chosen),
        64,
    )
    assert record["proposed"] >= 1 and record["estimates"], (
        "the launcher's estimate proposed the first try"
    )
    assert any(
        e["event"] == "micro_batch_chosen" and e["micro_batch"] == chosen for e in result.events
    )
    assert result.status == "completed" and result.dir.config().micro_batch_size == "auto"


def test_unknown_accelerators_and_broken_catalog_entries_are_named(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"gpu='H1000': not in the accelerator catalog.*known: A10-24GB, .*H100-SXM-80GB",
    ):
        lookup("H1000")
    catalog = tmp_path / "mine.yaml"
    catalog.write_text(
        "accelerators:\n  - {name: MyGPU, memory_gib: 48, peak_tflops: {bf16: 300}}\n"
    )
    with pytest.raises(
        ValueError,
        match=r"mine.yaml: accelerator 'MyGPU': missing field\(s\) memory_bandwidth_gbs, "
        r"link, price_per_hour, price_source",
    ):
        estimate(wb.RunConfig(), gpu="MyGPU", catalog=catalog)


def test_an_accelerator_of_your_own_is_priced(tmp_path: Path) -> None:
    catalog = tmp_path / "mine.yaml"
    catalog.write_text(
        "accelerators:\n  - {name: MyGPU, memory_gib: 48, peak_tflops: {fp32: 40, bf16: 300}, "
        "memory_bandwidth_gbs: 900, link: {kind: PCIe, gbs: 32}, price_per_hour: 2.0, "
        "price_source: our contract}\n"
    )
    cfg = wb.RunConfig(task="tiny-blocks", max_steps=3600, micro_batch_size=8)
    est = estimate(cfg, gpu="MyGPU", gpus=2, catalog=catalog, task=TinyBlocks())
    assert est.target.name == "MyGPU" and est.fits and est.capacity == 48 * 2**30
    assert est.cost == pytest.approx(2.0 * est.gpu_hours) and est.gpu_hours == pytest.approx(
        2 * est.run_s / 3600
    )
    assert est.step_s >= est.compute_s > 0
    assert any("our contract" in a for a in est.assumptions)


def test_workbench_estimate_prints_a_verdict_and_compares_accelerators(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    wb.RunConfig(
        task="tasks_for_tests:TinyBlocks",
        num_processes=2,
        micro_batch_size=8,
        max_steps=100,
        task_options={"width": 64},
    ).to_yaml(path)
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "estimate",
            str(path),
            "--gpu",
            "A100-SXM-80GB",
            "--gpus",
            "8",
            "--nodes",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    assert "on 2 x 8 x A100-SXM-80GB" in one.stdout and "fits:" in one.stdout
    assert re.search(r"GPU-hours, (< )?\$\d", one.stdout), "a cost, '< $0.01' for this tiny model"
    assert "between nodes" in one.stdout
    table = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "estimate", str(path), "--compare", "--gpus", "4"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert table.returncode == 0, table.stderr[-2000:]
    names = [line.split()[0] for line in table.stdout.splitlines()[2:]]
    assert set(names) >= {"H100-SXM-80GB", "A10-24GB", "L4-24GB"}


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="compares against a real CUDA device"
)
def test_the_estimate_is_within_10_percent_of_max_memory_allocated_on_a_gpu(runs_dir: Path) -> None:
    import torch

    cfg = cfg_for(
        runs_dir,
        device="cuda",
        num_processes=1,
        parallelism="zero3",
        track_memory=False,
        micro_batch_size=64,
        task_options={"width": 1024, "blocks": 4},
    )
    measured = wb.launch(cfg, task=TinyBlocks()).summary["ranks"][0]["peak_memory_bytes"]
    est = estimate(cfg, gpu=torch.cuda.get_device_name(0), gpus=1, task=TinyBlocks())
    assert abs(est.ranks[0].tensors / measured - 1) < 0.10, (est.ranks[0].tensors, measured)


def test_a_cost_under_a_cent_reads_as_under_a_cent_not_as_free() -> None:
    from workbench.utils.units import fmt_money

    assert [fmt_money(x) for x in (0.004, 0.0, 0.01, 1234.5, None)] == [
        "< $0.01",
        "$0.00",
        "$0.01",
        "$1,234.50",
        "?",
    ]


def test_the_tracked_steps_peak_is_torchs_own_with_only_the_global_peak_kept_up_to_date() -> None:
    """training/observe/memory.py keeps only MemTracker's global peak up to date at each op (its per-module peaks, of
    every module at every op, were half an estimate's trace): the peak snapshot and the activations after
    forward it reports are those of torch's own update."""
    import types

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from workbench.training.observe import memory

    def measure(own_update: bool) -> tuple[dict[str, int], bool]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *(
                torch.nn.Sequential(
                    torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
                )
                for _ in range(3)
            )
        )
        optimizer = torch.optim.AdamW(model.parameters())
        x = torch.randn(32, 64)
        strategy = types.SimpleNamespace(
            module=model,
            device=torch.device("cpu"),
            pipelined=False,
            local_optimizer=lambda: optimizer,
            receive_buffers=list,
        )
        trackers: list[MemTracker] = []

        def train() -> None:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        def step() -> None:
            trackers.append(memory._ACTIVE[-1])
            train()

        step_once = memory._global_peak_only
        if own_update:
            memory._global_peak_only = lambda tracker: None
        try:
            train()  # the optimizer's state exists before the step that counts
            _, report = memory.tracked(strategy, step, (x,))
        finally:
            memory._global_peak_only = step_once
        return report, "_update_peak_stats" in vars(trackers[-1])

    fast, replaced = measure(own_update=False)
    torchs, _ = measure(own_update=True)
    assert replaced, (
        "the per-module update is replaced (or torch's tracker changed: see _global_peak_only)"
    )
    assert fast == torchs and fast["peak"] > 0 and fast["activations_after_forward"] > 0
