"""track_memory and micro_batch_size='auto' under pipeline parallelism, on 2 gloo CPU ranks (char-gpt, pp=2).

1F1B runs under PyTorch's MemTracker (its module counts restarted before each micro-batch's stage forward); the
zero-bubble schedule's split backward is measured from the live tensors instead; 'auto' starts from the
estimate's proposal (it traces two chunks per rank) and the stages search together from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import workbench as wb

pytestmark = pytest.mark.slow


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="char-gpt",
        num_processes=2,
        pp=2,
        parallelism="ddp",
        device="cpu",
        micro_batch_size=4,
        grad_accum_steps=2,
        max_steps=2,
        log_every=1,
        runs_dir=str(runs_dir),
        seed=3,
        oversubscribe=True,
        dist_timeout_s=120,
        eval_batches=1,
        track_memory=True,
        task_options={"block_size": 32, "train_stride": 64, "dropout": 0.0},
    )
    return wb.RunConfig(**{**base, **fields})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    runs_dir = tmp_path_factory.mktemp("runs")
    return {
        "1f1b": wb.launch(cfg_for(runs_dir, run_name="pp-1f1b")),
        "auto": wb.launch(
            cfg_for(
                runs_dir,
                run_name="pp-auto",
                pp_schedule="zero_bubble",
                micro_batch_size="auto",
                memory_budget_gb=0.02,
                task_options={"block_size": 32, "train_stride": 64, "dropout": 0.0, "n_layer": 4},
            )
        ),
    }


@pytest.mark.parametrize("name, method", [("1f1b", "MemTracker"), ("auto", "live tensors")])
def test_pp_tracks_each_stage(runs: dict[str, wb.RunResult], name: str, method: str) -> None:
    run = runs[name]
    assert run.status == "completed", run.summary
    ranks = sorted(run.summary["ranks"], key=lambda r: r["rank"])
    assert [r["pp_stage"] for r in ranks] == [0, 1]
    for r in ranks:
        m = r["tracked_memory"]
        assert m["method"].startswith(method), m
        # This stage's parameters exactly (the stages hold different blocks), all alive at the peak.
        assert m["params"] == r["params_bytes"] > 0
        assert m["optimizer"] == r["optimizer_bytes"]
        assert m["peak"] >= r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
        # buffers: the activations/gradients received
        assert m["activations"] > 0 and m["buffers"] > 0, m
        parts = sum(
            m[k] for k in ("params", "grads", "optimizer", "activations", "buffers", "temporaries")
        )
        assert parts == m["peak"], m
    assert ranks[0]["tracked_memory"]["params"] != ranks[1]["tracked_memory"]["params"]


def test_pp_auto_agrees_on_one_micro_batch(runs: dict[str, wb.RunResult]) -> None:
    run = runs["auto"]
    record = json.loads((run.run_dir / "autobatch.json").read_text())
    # the estimate traces the zero-bubble layout: its proposal starts the ranks' search in range
    assert isinstance(record["proposed"], int) and record["proposed"] > 1, record
    first, second = (r["tries"] for r in record["ranks"])
    # the stages tried together
    assert [t["micro_batch"] for t in first] == [t["micro_batch"] for t in second]
    chosen = record["chosen"]
    # the smallest any stage fits
    assert 1 < chosen <= min(r["own_choice"] for r in record["ranks"])
    assert record["grad_accum_steps"] == 2 and record["global_batch"] == chosen * 2
    assert (run.summary["micro_batch_size"], run.summary["grad_accum_steps"]) == (chosen, 2)
    assert run.summary["global_batch_size"] == chosen * 2
