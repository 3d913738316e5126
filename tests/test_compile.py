"""compile: torch.compile in every layout the trainer runs, with the same losses as eager, proven by dynamo's own
counters (graphs, compiled frames) in the summary, never by timings; the kernels cached where a relaunch finds
them; a model that can't compile fails with one error naming the module and `compile='off'`.

Most layouts compile with the 'aot_eager' backend: dynamo and AOTAutograd trace forward and backward through the
parallel wrappers exactly as for inductor, without generating C++ (seconds, not a minute, on 2 cores). Inductor
itself runs in the cache test (forked ranks) and the failure test (spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import workbench as wb
from workbench.rundir import RunFailedError, Status

pytestmark = pytest.mark.slow

TINY = {"preset": "tiny"}


def cfg_of(runs_dir: Path, **changes: Any) -> wb.RunConfig:
    base = {
        "task": "char-gpt",
        "task_options": TINY,
        "num_processes": 2,
        "micro_batch_size": 4,
        "max_steps": 6,
        "log_every": 2,
        "runs_dir": str(runs_dir),
        "compile_backend": "aot_eager",
        "eval_batches": 2,
    }
    return wb.RunConfig(**{**base, **changes})


def losses(result: wb.RunResult) -> list[float]:
    return [m["loss"] for m in result.metrics if "loss" in m]


LAYOUTS = {
    "ddp blocks": {"compile": "blocks"},
    "ddp model": {"compile": "model"},
    "zero3 blocks bf16": {"compile": "blocks", "parallelism": "zero3", "precision": "bf16"},
    "zero3 model": {"compile": "model", "parallelism": "zero3"},
    "tp 2 blocks": {"compile": "blocks", "parallelism": "zero3", "tp": 2},
    "hsdp 2 x 2 model": {
        "compile": "model",
        "parallelism": "hsdp",
        "dp_shard": 2,
        "num_processes": 4,
        "oversubscribe": True,
        "micro_batch_size": 2,
    },
    "pp 2 blocks": {"compile": "blocks", "pp": 2, "grad_accum_steps": 2},
    "ddp blocks, activation checkpointing": {
        "compile": "blocks",
        "activation_checkpointing": "full",
    },
    # nn.Sequential's forward is PyTorch's own code, which dynamo skips where compiling starts
    "digits (nn.Sequential) ddp model": {"compile": "model", "task": "digits", "task_options": {}},
    "digits (nn.Sequential) zero3 model": {
        "compile": "model",
        "task": "digits",
        "task_options": {},
        "parallelism": "zero3",
    },
}


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The eager run of a layout's losses, each run once: layouts that differ only in how they compile (or in
    activation checkpointing and start method, which change no number) share it."""
    runs_dir, found = tmp_path_factory.mktemp("eager"), {}

    def of(cfg: wb.RunConfig) -> list[float]:
        key = (
            cfg.task,
            cfg.parallelism,
            cfg.precision,
            cfg.tp,
            cfg.pp,
            cfg.grad_accum_steps,
            cfg.num_processes,
        )
        if key not in found:
            eager = cfg.replace(
                runs_dir=str(runs_dir),
                run_name=f"eager-{len(found)}",
                compile="off",
                activation_checkpointing="none",
                start_method="auto",
            )
            found[key] = losses(wb.launch(eager))
        return found[key]

    return of


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_training_matches_eager_and_the_compiled_path_ran(
    runs_dir: Path, layout: str, eager_losses: Any
) -> None:
    cfg = cfg_of(runs_dir, **LAYOUTS[layout])
    compiled = wb.launch(cfg.replace(run_name="compiled"))
    assert losses(compiled) == pytest.approx(eager_losses(cfg), rel=1e-5), layout
    report = compiled.summary["compile"]
    assert report["mode"] == cfg.compile and report["backend"] == "aot_eager"
    assert report["graphs"] >= 1 and report["compile_steps"][0] == 1, (
        f"{layout}: dynamo compiled nothing"
    )
    assert report["first_step_s"] > 0 and report["recompiles"] == 0, report
    if cfg.compile == "blocks":
        # a block is one graph (DDP's own wrapper breaks the whole model's, by design)
        assert report["graph_breaks"] == {}, report["graph_breaks"]
    if cfg.precision == "bf16":
        assert {r["compute_dtype"] for r in compiled.summary["ranks"]} == {"bfloat16"}
    if cfg.parallelism in ("zero3", "hsdp"):
        # the layout really ran: each rank holds about half the parameters
        full = 4 * compiled.summary["n_params"]
        assert all(
            r["sharded"] and r["params_bytes"] < 0.6 * full for r in compiled.summary["ranks"]
        ), layout
    events = [e["event"] for e in compiled.events]
    assert events.index("compiling") < events.index("compiled") < events.index("compile_report")


def test_inductor_kernels_are_cached_where_a_relaunch_finds_them(
    runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # The smallest model inductor compiles (two Linears: three graphs, for the step's forward and backward and for
    # evaluation): a relaunch finds kernels the same way whatever their number.
    cfg = cfg_of(
        runs_dir,
        task="tasks_for_tests:TinyRegression",
        task_options={},
        compile="model",
        compile_backend="inductor",
        num_processes=1,
        max_steps=4,
    )
    cold = wb.launch(cfg.replace(run_name="cold"))
    warm = wb.launch(cfg.replace(run_name="warm"))
    assert cold.summary["compile"]["cache_dir"] == str(tmp_path / "cache" / "inductor")
    assert cold.summary["compile"]["cache_misses"] > 0, "the first launch compiled kernels"
    assert (
        warm.summary["compile"]["cache_hits"] > 0 and warm.summary["compile"]["cache_misses"] == 0
    ), "the relaunch found every kernel in the cache"
    assert any((tmp_path / "cache" / "inductor").rglob("*.py")), (
        "kernels written under workbench's cache"
    )
    assert losses(warm) == losses(cold)


def test_a_model_that_cannot_compile_fails_with_one_error_naming_it_and_the_way_out(
    runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No C++ compiler for inductor's kernels: a failure users meet, in fresh (spawned) ranks that read CXX.
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # one rank: each rank fails alike, and a fresh interpreter per rank costs 3 s of a core
    cfg = cfg_of(
        runs_dir,
        compile="blocks",
        compile_backend="inductor",
        start_method="spawn",
        max_steps=2,
        num_processes=1,
    )
    with pytest.raises(
        RunFailedError,
        match=r"CompileError: torch.compile \(compile='blocks', backend 'inductor'\) "
        r"failed on each block of GPT: .*set compile='off' to train this "
        r"model eagerly",
    ):
        wb.launch(cfg)


def test_a_model_dynamo_skips_entirely_fails_rather_than_train_eagerly_as_compiled(
    runs_dir: Path,
) -> None:
    cfg = cfg_of(
        runs_dir,
        task="tasks_for_tests:UncompilableRegression",
        task_options={},
        compile="model",
        num_processes=1,
        max_steps=2,
    )
    with pytest.raises(
        RunFailedError,
        match=r"CompileError: torch.compile \(compile='model', backend 'aot_eager'\) "
        r"compiled no graph by the end of the first step: dynamo skipped every "
        r"frame of SkippedByDynamo \(the whole model\).*set compile='off'",
    ):
        wb.launch(cfg)


def test_compile_is_checked_before_launch() -> None:
    with pytest.raises(ValueError, match=r"compile"):
        wb.RunConfig(compile="fast")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"track_memory=True with compile='blocks': the memory tracker follows "
        r"eager ops",
    ):
        wb.RunConfig(compile="blocks", track_memory=True)
    from workbench.config.preflight import preflight

    with pytest.raises(
        ValueError,
        match=r"compile='blocks': the digits model has no repeated blocks to compile .* "
        r"set compile='model' to compile it whole",
    ):
        preflight(wb.RunConfig(task="digits", compile="blocks"))
    preflight(wb.RunConfig(task="digits", compile="model"))


def test_a_compiled_run_reports_its_compile_once_and_keeps_it_out_of_the_pace(
    runs_dir: Path,
) -> None:
    result = wb.launch(cfg_of(runs_dir, compile="blocks", max_steps=8, log_every=4, eval_batches=1))
    assert result.status is Status.COMPLETED
    reports = [e for e in result.events if e["event"] == "compile_report"]
    assert len(reports) == 1 and reports[0]["eval_compiles"] >= 1, (
        "evaluation's own graphs counted apart"
    )
    first_step = result.summary["compile"]["first_step_s"]
    first_row = next(m for m in result.metrics if "step_time_s" in m)
    assert first_row["step_time_s"] < first_step / 2, (
        "the compiling step is not in the window's pace"
    )


def test_bench_compile_puts_eager_and_compiled_side_by_side(tmp_path: Path) -> None:
    from workbench.commands.bench.compile_speed import compile_bench

    cfg = wb.RunConfig(
        task="char-gpt",
        task_options=TINY,
        num_processes=2,
        micro_batch_size=4,
        max_steps=6,
        log_every=1,
        eval_batches=1,
        compile="blocks",
        compile_backend="aot_eager",
    )
    report = compile_bench(cfg, ("ddp",), json_path=tmp_path / "compile.json")
    (row,) = report.rows
    assert row.layout == "ddp" and row.speedup == pytest.approx(row.eager_ms / row.compiled_ms)
    assert row.graphs >= 1 and row.graph_breaks == 0 and row.max_loss_rel_diff < 1e-5
    assert row.first_step_cold_s > 0 and row.first_step_warm_s > 0
    assert row.ranks == 2 and row.threads == 1, "forked ranks multiply on one thread each"
    assert "| ddp | 2 x 1 |" in report.table() and (tmp_path / "compile.json").is_file()
    assert row.matmul_floor_ms > 0 and row.ceiling == pytest.approx(
        row.eager_ms / row.matmul_floor_ms
    )
    assert (
        f"({row.ceiling:.2f}x)" in report.table()
        and "GFLOP/s (fp32 2048x2048 matmul" in report.table()
    )


def test_the_matmul_floor_counts_a_samples_forward_and_backward_flops_and_spreads_the_batch() -> (
    None
):
    from workbench.commands.bench.compile_ceiling import Floor, matmul_floor

    cfg = wb.RunConfig(task="tasks_for_tests:TinyRegression", micro_batch_size=4)
    floor = matmul_floor(cfg)
    # Linear(8, 32), then Linear(32, 1): forward 2 x (8x32 + 32x1); backward the second layer's input and weight
    # gradients, the first's weight gradient only (the data needs none).
    assert floor.flops_per_sample == 2 * (8 * 32 + 32) + 2 * (32 + 32) + 2 * 8 * 32
    assert floor.rate > 1e8 and "one CPU thread" in floor.rate_source
    assert "2 CPU threads" in matmul_floor(cfg, threads=2).rate_source
    assert Floor(1e9, 1e11, "").step_ms(global_batch=16, ranks=2) == pytest.approx(80.0)


def test_causal_attention_counts_half_the_flops_of_full_attention() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from workbench.commands.bench.compile_ceiling import _attention_formulas

    q, k, v = (torch.randn(2, 2, 64, 16, requires_grad=True) for _ in range(3))
    counts = []
    for causal in (False, True):
        with FlopCounterMode(display=False, custom_mapping=_attention_formulas()) as counter:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal
            ).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] > 0 and counts[1] * 2 == counts[0]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fp16 and inductor's GPU kernels need a CUDA GPU"
)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_on_cuda_inductor_compiles_mixed_precision_with_eager_s_losses(
    runs_dir: Path, precision: str
) -> None:
    cfg = cfg_of(
        runs_dir,
        compile="blocks",
        compile_backend="inductor",
        num_processes=1,
        device="cuda",
        precision=precision,
        max_steps=6,
    )
    eager = wb.launch(cfg.replace(run_name="eager", compile="off"))
    compiled = wb.launch(cfg.replace(run_name="compiled"))
    # Fused kernels round in other places than eager's in half precision: close, not equal.
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-2)
    report = compiled.summary["compile"]
    assert report["graphs"] >= 1 and report["graph_breaks"] == {} and report["recompiles"] == 0, (
        report
    )
    assert report["cache_misses"] + report["cache_hits"] > 0, (
        "inductor generated (or reused) GPU kernels"
    )
