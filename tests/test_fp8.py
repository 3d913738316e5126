"""precision='fp8': torchao's Float8 training (workbench/training/parallel/float8.py).

On CPU the ranks run torchao's emulation (WORKBENCH_FP8_EMULATE=1, for tests only: the casts to fp8
and their scaling as on a GPU, the matmul in high precision), and preflight's refusal of fp8 off an
8.9+ GPU is lifted for those runs only (`emulated`). They prove the swap (which Linear layers became
Float8Linear), and that 2 gloo ranks train under ddp, zero3 (FSDP2's fp8 all-gather) and tp as bf16
does, with compile and through a checkpoint. The `gpu` test trains on fp8 tensor cores (8.9+).

torchao is the optional extra `workbench[fp8]`, not in `test`: the tests that run it skip without it
(pytest.importorskip); the refusals, the recipe's checks and the estimate need no torchao.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import copy_for_resume
from tasks_for_tests import TinyBlocks

import workbench as wb
from workbench.config.precision import accelerate_mixed_precision
from workbench.config.preflight import preflight
from workbench.rundir import RunDir
from workbench.tasks import get_task
from workbench.training.parallel.strategy import DTYPES
from workbench.utils.hardware import GPU, Hardware, detect

H100x1 = Hardware(
    cpu_count=16,
    gpus=(GPU(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), memory_bytes=80 << 30),),
)
A100x1 = Hardware(
    cpu_count=16,
    gpus=(GPU(name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), memory_bytes=80 << 30),),
)
STEPS = 20
LOSS_TOLERANCE = 0.03
"""fp8's loss at each of the STEPS steps is within 3% (relative) of bf16's in the same layout.
Measured on these runs: 0.14% (ddp), 0.23% (zero3), 0.33% (tp2), 1.9% (zero3 rowwise). For scale:
e4m3 keeps 3 mantissa bits, and one 64-wide emulated fp8 matmul errs by 3.6% (relative norm) against
fp32 where bf16 errs by 0.3%; the same bf16 run under ddp (autocast) and zero3 (FSDP2's cast
parameters) already differs by 1.3%. A broken scale or a lost gradient puts the loss far off."""
BLOCK_LINEARS = [
    f"blocks.{b}.{name}"
    for b in range(2)
    for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2")
]
"""char-gpt tiny's Linear layers inside its blocks (64 and 256 wide); the head (64 -> 65) is not."""


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    """char-gpt tiny (2 layers, 64 wide) on 2 gloo ranks, 32-character windows, dropout 0."""
    base = dict(
        task="char-gpt",
        num_processes=2,
        device="cpu",
        micro_batch_size=8,
        max_steps=STEPS,
        log_every=1,
        lr=3e-3,
        runs_dir=str(runs_dir),
        seed=3,
        oversubscribe=True,
        dist_timeout_s=120,
        eval_batches=1,
        task_options={"block_size": 32, "train_stride": 64, "dropout": 0.0},
    )
    return wb.RunConfig(**{**base, **fields})


@contextmanager
def emulated() -> Iterator[None]:
    """Ranks on torchao's emulation, and preflight checking fp8 as it checks bf16 (every other check
    still runs, the fp8 task check included)."""
    real = Hardware.precision_problem
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORKBENCH_FP8_EMULATE", "1")
        patch.setattr(
            Hardware,
            "precision_problem",
            lambda self, precision, device: real(
                self, "bf16" if precision == "fp8" else precision, device
            ),
        )
        yield


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


def worst_relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ---- the swap ------------------------------------------------------------------------------------
def test_the_swap_takes_each_blocks_linear_and_leaves_the_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from workbench.training.parallel.float8 import swap_linears

    monkeypatch.setenv("WORKBENCH_FP8_EMULATE", "1")
    cfg = wb.RunConfig(task="char-gpt", precision="fp8", device="cpu")
    task = get_task("char-gpt")
    torch.manual_seed(0)
    model = task.build_model(cfg)
    seen: list[torch.dtype] = []
    model.blocks[0].attn.q.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    swap = swap_linears(cfg, model, task, torch.device("cpu"))
    assert swap.names == BLOCK_LINEARS and swap.emulated and not swap.fsdp_fp8_all_gather
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(BLOCK_LINEARS)
    assert type(model.head) is torch.nn.Linear and model.head.weight is model.tok.weight
    loss = model(torch.randint(0, 65, (4, 32))).float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].attn.q.weight.grad is not None
    assert seen == [torch.float32], "the hook on the swapped Linear moved to its Float8Linear"


class TwoWidths(torch.nn.Module):
    """Blocks holding a 32 x 32 Linear (fp8-shaped) and 32 -> 24 -> 32 ones (24 isn't a multiple of
    16), under a 32 x 32 head outside the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "a": torch.nn.Linear(32, 32),
                    "b": torch.nn.Linear(32, 24),
                    "c": torch.nn.Linear(24, 32),
                }
            )
            for _ in range(2)
        )
        self.head = torch.nn.Linear(32, 32)


def test_linears_outside_the_blocks_or_not_multiples_of_16_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from workbench.training.parallel.float8 import swap_linears

    monkeypatch.setenv("WORKBENCH_FP8_EMULATE", "1")
    model = TwoWidths()
    swap = swap_linears(wb.RunConfig(precision="fp8"), model, TinyBlocks(), torch.device("cpu"))
    assert swap.names == ["blocks.0.a", "blocks.1.a"]
    kept = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not isinstance(m, Float8Linear)
    ]
    assert kept == ["blocks.0.b", "blocks.0.c", "blocks.1.b", "blocks.1.c", "head"]


def test_a_model_with_no_linear_to_swap_is_refused_before_launch(runs_dir: Path) -> None:
    pytest.importorskip("torchao")
    cfg = wb.RunConfig(task="digits", precision="fp8", runs_dir=str(runs_dir))
    message = (
        r"precision='fp8': task 'digits' has no Linear layer fp8 can train \(those inside "
        r"the model's repeated blocks.*use precision='bf16'"
    )
    with pytest.raises(ValueError, match=message):
        preflight(cfg, hardware=H100x1)


# ---- refusals and settings (no torchao needed) ---------------------------------------------------
@pytest.mark.parametrize(
    "hardware,where",
    [(Hardware(cpu_count=2), r"CPU \(2 cores\)"), (A100x1, r"1 x NVIDIA A100-SXM4-80GB")],
    ids=["cpu", "a100"],
)
def test_fp8_off_an_8_9_gpu_is_refused_with_the_reason(
    hardware: Hardware, where: str, runs_dir: Path
) -> None:
    cfg = wb.RunConfig(task="char-gpt", precision="fp8", runs_dir=str(runs_dir))
    with pytest.raises(
        ValueError,
        match=rf"precision='fp8' on {where}: fp8 needs a CUDA GPU of "
        r"compute capability 8.9\+ \(H100/L40/4090\): its matmuls "
        r"run on their fp8 tensor cores.*use (bf16|fp32)",
    ):
        preflight(cfg, hardware=hardware)


def test_the_ranks_refuse_fp8_on_cpu_unless_emulating() -> None:
    from workbench.training.parallel.float8 import check_device

    with pytest.raises(
        ValueError,
        match=r"precision='fp8' on CPU: fp8 matmuls need a CUDA GPU of "
        r"compute capability 8.9\+",
    ):
        check_device(torch.device("cpu"), emulate=False)
    check_device(torch.device("cpu"), emulate=True)


def test_fp8_without_torchao_is_refused_with_the_install_command(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.training.parallel.float8 import float8_config

    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    cfg = wb.RunConfig(task="char-gpt", precision="fp8", runs_dir=str(runs_dir))
    install = r"`pip install 'workbench\[fp8\]'`"
    message = (
        r"precision='fp8' on 1 x NVIDIA H100 80GB HBM3: fp8 trains with torchao's Float8, "
        rf"which doesn't import here \(.*\); {install}"
    )
    with pytest.raises(ValueError, match=message):
        preflight(cfg, hardware=H100x1)
    with pytest.raises(
        ImportError,
        match=rf"precision='fp8' trains with torchao's Float8.*"
        rf"{install}",
    ):
        float8_config(cfg, emulate=False)


def test_an_fp8_recipe_is_checked_and_warned_about_without_fp8() -> None:
    with pytest.raises(
        ValueError,
        match=r"fp8_recipe='blockwise': choose one of 'tensorwise' \| "
        r"'rowwise'",
    ):
        wb.RunConfig(precision="fp8", fp8_recipe="blockwise")
    with pytest.warns(
        UserWarning,
        match=r"fp8_recipe='rowwise' with precision='bf16': the recipe "
        r"applies to precision='fp8' only and does nothing here",
    ):
        wb.RunConfig(precision="bf16", fp8_recipe="rowwise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wb.RunConfig(precision="fp8", fp8_recipe="rowwise").fp8_recipe == "rowwise"


def test_what_is_not_swapped_computes_in_bf16() -> None:
    """accelerate is told bf16 (its own 'fp8' would choose a backend and convert the model itself),
    and the strategies autocast or cast parameters to bf16 for fp8 as for bf16."""
    assert accelerate_mixed_precision("fp8") == "bf16"
    assert DTYPES["fp8"] is torch.bfloat16


def test_the_estimate_prices_fp8_matmuls_at_the_catalogs_fp8_peak() -> None:
    from workbench.estimator import estimate

    # Wide enough that the matmuls, not the kernel launches, set the H100's step time.
    shape = {"n_layer": 2, "n_embd": 4096, "n_head": 32, "block_size": 1024}
    est = {
        p: estimate(
            wb.RunConfig(task="char-gpt", precision=p, micro_batch_size=16, task_options=shape),
            gpu="H100-SXM-80GB",
            gpus=1,
        )
        for p in ("bf16", "fp8")
    }
    assert est["fp8"].flops_per_step == est["bf16"].flops_per_step
    peak = "of H100-SXM-80GB's {} datasheet peak"
    assert any(peak.format("1979 TFLOP/s fp8") in a for a in est["fp8"].assumptions)
    assert any(peak.format("989 TFLOP/s bf16") in a for a in est["bf16"].assumptions)
    fp8, bf16 = est["fp8"].compute_s, est["bf16"].compute_s
    assert fp8 < 0.8 * bf16, (fp8, bf16)


# ---- training on 2 gloo ranks, emulated ----------------------------------------------------------
RUNS: dict[str, dict[str, Any]] = {
    "bf16-ddp": {"precision": "bf16"},
    "fp8-ddp": {"precision": "fp8"},
    "bf16-zero3": {"precision": "bf16", "parallelism": "zero3"},
    "fp8-zero3": {"precision": "fp8", "parallelism": "zero3", "checkpoint_every": 10},
    "fp8-zero3-rowwise": {"precision": "fp8", "parallelism": "zero3", "fp8_recipe": "rowwise"},
    "bf16-tp2": {"precision": "bf16", "tp": 2},
    "fp8-tp2": {"precision": "fp8", "tp": 2},
    "fp8-zero3-compiled": {
        "precision": "fp8",
        "parallelism": "zero3",
        "compile": "blocks",
        "compile_backend": "aot_eager",
    },
}
"""Each run once per module, launched by the first test that needs it."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], wb.RunResult]:
    pytest.importorskip("torchao")
    runs_dir = tmp_path_factory.mktemp("fp8-runs")
    done: dict[str, wb.RunResult] = {}

    def get(name: str) -> wb.RunResult:
        if name not in done:
            with emulated():
                done[name] = wb.launch(cfg_for(runs_dir, run_name=name, **RUNS[name]))
            assert done[name].status == "completed", done[name].summary.get("error")
        return done[name]

    return get


LAYOUTS = [
    ("ddp", "tensorwise", "fp8-ddp", "bf16-ddp"),
    ("zero3", "tensorwise", "fp8-zero3", "bf16-zero3"),
    ("zero3", "rowwise", "fp8-zero3-rowwise", "bf16-zero3"),
    ("tp2", "tensorwise", "fp8-tp2", "bf16-tp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,recipe,fp8,bf16", LAYOUTS, ids=[f"{a}-{b}" for a, b, _, _ in LAYOUTS]
)
def test_fp8_trains_like_bf16_on_two_ranks(
    run: Callable[[str], wb.RunResult], layout: str, recipe: str, fp8: str, bf16: str
) -> None:
    fp8_run, bf16_run = run(fp8), run(bf16)
    for rank in fp8_run.summary["ranks"]:
        assert rank["fp8"]["float8_linears"] == 12, rank["fp8"]  # tp splits weights, not modules
        assert rank["fp8"]["recipe"] == recipe and rank["fp8"]["emulated"]
        # FSDP2 all-gathers each swapped weight in fp8 under zero3's tensorwise recipe, else none.
        gathered = 12 if (layout, recipe) == ("zero3", "tensorwise") else 0
        assert rank["fp8"]["fp8_all_gather_weights"] == gathered, rank["fp8"]
        assert rank["compute_dtype"] == "bfloat16"
    assert "fp8" not in bf16_run.summary["ranks"][0]
    ours, theirs = losses(fp8_run), losses(bf16_run)
    assert worst_relative(ours, theirs) <= LOSS_TOLERANCE, (ours, theirs)
    assert ours != theirs, "fp8 rounds the matmuls' inputs: a run equal to bf16's swapped nothing"
    assert ours[-1] < ours[0] - 0.5, ours


@pytest.mark.slow
def test_fp8_all_gather_composes_with_compile(run: Callable[[str], wb.RunResult]) -> None:
    """compile='blocks' (aot_eager: forward and backward traced through Float8Linear and torchao's
    weight subclass, no code generated, quick on a CPU) under zero3's fp8 all-gather trains as eager
    does."""
    compiled, eager = run("fp8-zero3-compiled"), run("fp8-zero3")
    report = compiled.summary["compile"]
    assert report["graphs"] >= 2 and report["graph_breaks"] == {}, report
    assert all(r["fp8"]["fp8_all_gather_weights"] == 12 for r in compiled.summary["ranks"])
    assert worst_relative(losses(compiled), losses(eager)) < 1e-4


@pytest.mark.slow
def test_an_fp8_zero3_checkpoint_resumes_where_the_run_was(
    run: Callable[[str], wb.RunResult], runs_dir: Path
) -> None:
    """A checkpoint of fp8 weights sharded by FSDP2 (torchao's subclass inside the DTensors) saves
    and loads: resumed at step 10, the run goes on as the one that never stopped."""
    whole = run("fp8-zero3")
    resumed_dir = RunDir(runs_dir / "resumed")
    copy_for_resume(whole.dir, resumed_dir, 10)
    with emulated():
        resumed = wb.launch(cfg_for(runs_dir, run_name="resumed", resume=True, **RUNS["fp8-zero3"]))
    assert resumed.status == "completed", resumed.summary.get("error")
    after = [r["loss"] for r in resumed.metrics if "loss" in r and r["step"] > 10]
    before = [r["loss"] for r in whole.metrics if "loss" in r and r["step"] > 10]
    assert len(after) == len(before) == STEPS - 10
    assert max(abs(a - b) / b for a, b in zip(after, before)) < 1e-4, (after, before)


# ---- on fp8 tensor cores -------------------------------------------------------------------------
def _fp8_gpu() -> bool:
    gpus = detect().gpus  # nvidia-smi: no CUDA context in this process, the ranks can still fork
    return bool(gpus) and min(g.compute_capability for g in gpus) >= (8, 9)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU of compute capability 8.9+ (fp8 cores)")
@pytest.mark.parametrize(
    "fields",
    [
        {"parallelism": "zero3", "compile": "blocks"},
        {"parallelism": "none", "fp8_recipe": "rowwise", "profile_steps": [2, 2]},
    ],
    ids=["zero3-tensorwise-compiled", "one-gpu-rowwise"],
)
def test_fp8_trains_on_fp8_tensor_cores(fields: dict[str, Any], runs_dir: Path) -> None:
    pytest.importorskip("torchao")
    result = wb.launch(
        cfg_for(runs_dir, device="cuda", num_processes=1, precision="fp8", max_steps=10, **fields)
    )
    assert result.status == "completed", result.summary.get("error")
    fp8 = result.summary["ranks"][0]["fp8"]
    assert fp8["float8_linears"] == 12 and not fp8["emulated"], fp8
    assert fp8["fp8_all_gather_weights"] == (12 if fields["parallelism"] == "zero3" else 0)
    trained = losses(result)
    assert all(torch.isfinite(torch.tensor(trained))) and trained[-1] < trained[0], trained
    if "profile_steps" in fields:  # the matmuls ran as torch._scaled_mm: fp8 on tensor cores
        trace = Path(result.summary["ranks"][0]["profile_trace"]).read_text()
        assert "aten::_scaled_mm" in trace
