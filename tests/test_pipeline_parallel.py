"""Pipeline parallelism, for real: gloo CPU ranks each running one stage of char-gpt (PP=2, GPipe and 1F1B).

The schedule runs the same micro-batches as one process's gradient accumulation, so it must train like one
process does (fp32, dropout 0, clipping active, the tied embedding/head kept tied by summing its gradients
between the first and the last stage); each rank reports the blocks it holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from collected_ids import cases
from conftest import copy_for_resume
from safetensors.torch import load_file

import workbench as wb
from workbench.config.preflight import preflight
from workbench.rundir import RunDir
from workbench.tasks.stages import balanced_split

pytestmark = pytest.mark.slow

STEPS = 4
SAVED_AT = 2


def cfg_for(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    """char-gpt tiny (2 blocks), 32-character windows, 2 micro-batches of 4 per step."""
    base = dict(
        task="char-gpt",
        num_processes=1,
        device="cpu",
        micro_batch_size=4,
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
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    runs_dir = tmp_path_factory.mktemp("runs")
    return {
        "single": wb.launch(cfg_for(runs_dir, run_name="single", parallelism="none")),
        "pp x dp": wb.launch(
            cfg_for(
                runs_dir,
                num_processes=4,
                pp=2,
                micro_batch_size=2,
                run_name="pp-x-dp",
                parallelism="ddp",
            )
        ),
        **{
            s: wb.launch(
                cfg_for(
                    runs_dir,
                    num_processes=2,
                    pp=2,
                    pp_schedule=s,
                    run_name=f"pp-{s}",
                    checkpoint_every=SAVED_AT,
                    keep_checkpoints=2,
                )
            )
            for s in ("gpipe", "1f1b")
        },
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_trains_like_one_process(runs: dict[str, wb.RunResult], schedule: str) -> None:
    single, pp = runs["single"], runs[schedule]
    assert pp.status == "completed", pp.summary
    assert pp.summary["mesh"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    assert pp.summary["global_batch_size"] == single.summary["global_batch_size"] == 8
    norms = [r["grad_norm"] for r in single.metrics if "grad_norm" in r]
    assert any(n > 0.5 for n in norms), "clipping must be active for the comparison to cover it"
    worst = worst_relative(losses(pp), losses(single))
    print(f"{schedule}: worst relative loss deviation {worst:.2e}")
    assert worst < 1e-5
    reference, got = load_file(str(single.dir.weights_path)), load_file(str(pp.dir.weights_path))
    assert reference.keys() == got.keys()
    assert torch.equal(got["tok.weight"], got["head.weight"]), "the tied copies drifted apart"
    diff = max((reference[k] - got[k]).abs().max().item() for k in reference)
    assert diff < 1e-5, f"exported weights differ by {diff:.2e}"
    evals = {r["step"]: r["eval_loss"] for r in pp.metrics if "eval_loss" in r}
    expected = {r["step"]: r["eval_loss"] for r in single.metrics if "eval_loss" in r}
    assert evals.keys() == expected.keys() and evals, "the pipeline evaluates when one process does"
    assert list(evals.values()) == pytest.approx(list(expected.values()), rel=1e-5)


def test_pp_x_dp_trains_like_one_process(runs: dict[str, wb.RunResult]) -> None:
    """2 replicas of a 2-stage pipeline, each on half of every global batch: the one-process losses."""
    single, hybrid = runs["single"], runs["pp x dp"]
    assert hybrid.status == "completed", hybrid.summary
    assert hybrid.summary["mesh"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert hybrid.summary["global_batch_size"] == 8
    placed = {
        r["rank"]: (r["pp_stage"], r["dp_replica"], r["pp_holds"]) for r in hybrid.summary["ranks"]
    }
    assert placed == {
        0: (0, 0, ["blocks.0", "pos", "tok"]),
        1: (0, 1, ["blocks.0", "pos", "tok"]),
        2: (1, 0, ["blocks.1", "head", "ln_f"]),
        3: (1, 1, ["blocks.1", "head", "ln_f"]),
    }, placed
    worst = worst_relative(losses(hybrid), losses(single))
    print(f"pp2 x dp2: worst relative loss deviation {worst:.2e}")
    assert worst < 1e-4


def test_each_rank_holds_its_stage(runs: dict[str, wb.RunResult]) -> None:
    ranks = runs["1f1b"].summary["ranks"]
    held = {r["rank"]: r["pp_holds"] for r in ranks}
    assert held == {0: ["blocks.0", "pos", "tok"], 1: ["blocks.1", "head", "ln_f"]}, held
    assert [r["pp_stage"] for r in sorted(ranks, key=lambda r: r["rank"])] == [0, 1]


def test_balanced_split() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert balanced_split([3, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert balanced_split([1, 1], 3)[0] == [] or len(balanced_split([1, 1], 3)) == 3


@pytest.mark.parametrize(
    "fields, match",
    cases(
        [
            ({"num_processes": 3, "pp": 2}, r"pp x tp must divide"),
            (
                {"num_processes": 2, "pp": 2, "grad_accum_steps": 1},
                r"1F1B needs at least as many micro-batches",
            ),
            ({"num_processes": 2, "pp": 0}, r"must be at least 1"),
            (
                {"num_processes": 2, "pp": 2, "micro_batch_size": "auto", "target_global_batch": 7},
                r"target_global_batch=7 with pp=2: a pipeline keeps grad_accum_steps=2",
            ),
        ]
    ),
)
def test_layout_refusals(tmp_path: Path, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg_for(tmp_path, **fields)


def test_task_without_stages_is_refused(tmp_path: Path) -> None:
    from tasks_for_tests import TinyBlocks

    cfg = cfg_for(
        tmp_path, task="char-gpt", num_processes=2, pp=2, grad_accum_steps=2, task_options={}
    )
    with pytest.raises(ValueError, match=r"can't be split into pipeline stages"):
        preflight(cfg, task=TinyBlocks())


@pytest.mark.parametrize(
    "fields, what",
    cases(
        [
            (dict(num_processes=4, pp=4), "pp=4"),
            (
                dict(num_processes=2, pp=2, pp_schedule="interleaved_1f1b"),
                "pp=2 x 2 chunks per rank",
            ),
        ]
    ),
)
def test_too_many_stages_for_char_gpt(tmp_path: Path, fields: dict[str, Any], what: str) -> None:
    cfg = cfg_for(tmp_path, grad_accum_steps=4, oversubscribe=True, **fields)
    with pytest.raises(
        ValueError,
        match=rf"{what}: task 'char-gpt' has n_layer=2 blocks, fewer than the 4 pipeline",
    ):
        preflight(cfg)


def test_pp_checkpoint_resumes_on_one_process(runs: dict[str, wb.RunResult]) -> None:
    runs_dir, expected = runs["single"].dir.path.parent, losses(runs["single"])[SAVED_AT:]
    copy_for_resume(RunDir(runs["1f1b"].dir.path), RunDir(runs_dir / "pp-to-single"), SAVED_AT)
    resumed = wb.launch(
        cfg_for(
            runs_dir,
            run_name="pp-to-single",
            parallelism="none",
            resume=True,
            resume_allow=["pp", "pp_schedule"],
        )
    )
    assert resumed.summary["steps_this_session"] == STEPS - SAVED_AT
    got = losses(resumed)[SAVED_AT:]
    assert max(abs(x - y) / y for x, y in zip(got, expected)) < 1e-5


def test_one_process_checkpoint_resumes_under_pp(runs: dict[str, wb.RunResult]) -> None:
    runs_dir, expected = runs["single"].dir.path.parent, losses(runs["single"])[SAVED_AT:]
    wb.launch(
        cfg_for(runs_dir, run_name="single-saved", parallelism="none", checkpoint_every=SAVED_AT)
    )
    copy_for_resume(RunDir(runs_dir / "single-saved"), RunDir(runs_dir / "single-to-pp"), SAVED_AT)
    back = wb.launch(cfg_for(runs_dir, run_name="single-to-pp", num_processes=2, pp=2, resume=True))
    assert back.status == "completed", back.summary
    got = losses(back)[SAVED_AT:]
    assert max(abs(x - y) / y for x, y in zip(got, expected)) < 1e-5


def test_a_nan_loss_on_the_last_stage_ends_the_pipeline_diverged_at_that_step(
    tmp_path: Path,
) -> None:
    """The last stage's NaN loss (its gradients finite) poisons the stage's gradients after the schedule; the
    clip norm, summed over the stages, tells every rank, one all-reduce names the rank, and the step is applied
    nowhere. No vote on every step: the pipeline's ranks vote for stops and signals on an interval, as
    data-parallel ranks do."""
    from tasks_for_tests import SpikedCharGPT

    cfg = cfg_for(
        tmp_path / "runs",
        num_processes=2,
        pp=2,
        parallelism="ddp",
        max_steps=8,
        checkpoint_every=2,
        run_name="nan",
    )
    # the last stage's 8th training loss: step 4's first micro-batch (2 per step, and one more in step 1, where
    # the schedule infers the stage's shapes)
    message = r"diverged at step 4: the loss was not finite \(NaN or inf\) on rank 1; last good checkpoint: .*step_2"
    with pytest.raises(wb.RunDivergedError, match=message):
        wb.launch(cfg, task=SpikedCharGPT(spike_at=8, factor=1.0, offset=float("nan")))
    run = RunDir(tmp_path / "runs" / "nan")
    summary = run.summary()
    assert summary.status == "diverged" and summary.steps == 3, "the diverged step is never applied"
    assert [s for s, _ in run.checkpoints()] == [2]
    votes = [r["agreement_votes"] for r in summary.ranks]
    assert votes[0] == votes[1] < 4, votes
