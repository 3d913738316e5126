"""The estimate of the model-parallel layouts: tensor parallel, pipeline parallel, FSDP x TP and pipelines with
data-parallel replicas, checked against the same runs for real on gloo CPU ranks, and priced on a catalog GPU.

Model state is exact by rank (what each rank's strategy holds). The peak is compared where PyTorch's memory
tracker can watch the real step: the trainer's track_memory for TP; for a pipeline (which the trainer can't
track: MemTracker refuses a module called once per micro-batch), the trainer's own PipelineParallel run here on
two gloo ranks under the same tracker, restarted per forward as the trainer does between micro-batches.
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest
from collected_ids import cases
from conftest import shared_mirror
from machine_stand_in import stand_in_machine

import workbench as wb
from workbench.estimator import estimate

pytestmark = pytest.mark.slow
GPT = {"preset": "tiny", "block_size": 32, "train_stride": 64}
LAYOUTS = {
    "tp2": dict(num_processes=2, tp=2, track_memory=True),
    "pp2": dict(num_processes=2, pp=2, grad_accum_steps=4),
    "zero3 x tp2": dict(
        num_processes=4, tp=2, parallelism="zero3", micro_batch_size=4, track_memory=True
    ),
    "pp2 x ddp2": dict(num_processes=4, pp=2, micro_batch_size=4),
    "pp2 x zero3 x tp2": dict(num_processes=8, pp=2, tp=2, parallelism="zero3", micro_batch_size=2),
    "pp2 interleaved": dict(
        num_processes=2,
        pp=2,
        pp_schedule="interleaved_1f1b",
        grad_accum_steps=4,
        task_options={**GPT, "n_layer": 4},
    ),
}


def cfg_for(runs_dir: Path | str, **fields: Any) -> wb.RunConfig:
    base = dict(
        task="char-gpt",
        num_processes=2,
        device="cpu",
        micro_batch_size=8,
        grad_accum_steps=2,
        max_steps=2,
        log_every=1,
        eval_batches=1,
        runs_dir=str(runs_dir),
        oversubscribe=True,
        dist_timeout_s=120,
        task_options=GPT,
    )
    return wb.RunConfig(**{**base, **fields})


@pytest.fixture(scope="module", params=list(LAYOUTS))
def measured(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]], Any]:
    """One real run of the layout (2 steps) and the estimate of the same config on this machine (its memory: the
    step time is priced on a stand-in profile, as measuring this box as 8 ranks would take both cores 15 s)."""
    if shared_mirror() is None:
        pytest.skip(
            "no dataset mirror for char-gpt: set WORKBENCH_TEST_MIRROR or provide ../shared/data"
        )
    cfg = cfg_for(tmp_path_factory.mktemp("runs"), **LAYOUTS[request.param])
    result = wb.launch(cfg)
    assert result.status == "completed"
    with stand_in_machine():
        return request.param, result.summary["ranks"], estimate(cfg)


def test_model_state_per_rank_is_what_the_strategy_holds(
    measured: tuple[str, list[dict[str, Any]], Any],
) -> None:
    layout, ranks, est = measured
    assert len(est.ranks) == len(ranks)
    for real in ranks:
        mine = est.ranks[real["rank"]]
        assert mine.held == {k: real[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}, (
            layout,
            real["rank"],
        )
        if real["tracked_memory"] is not None:
            tracked = real["tracked_memory"]["peak"]
            assert abs(mine.tensors / tracked - 1) < 0.02, (
                layout,
                real["rank"],
                mine.tensors,
                tracked,
            )
    if "pp" in layout:  # the stages hold different halves of the model
        stages = {r["pp_stage"]: est.ranks[r["rank"]].held["params"] for r in ranks}
        assert len(set(stages.values())) == 2, stages


# ---- a pipeline's peak against the real schedule -------------------------------------------------
def _schedule_worker(rank: int, world: int, port: int, fields: dict[str, Any], out: Any) -> None:
    """The trainer's PipelineParallel on a gloo rank: one step to build the optimizer state, then one under the
    trainer's memory tracker, with the stage's receive buffers (made in the first step, before the tracker
    started, which a GPU's allocator would count) registered with it."""
    import torch
    import torch.distributed as dist

    from workbench.estimator.trace.fake_world import Placement, optimizer_for
    from workbench.tasks import get_task
    from workbench.training.batches import ShardedBatches
    from workbench.training.observe.memory import next_micro_batch, tracked
    from workbench.training.parallel import parallelize
    from workbench.training.step import accumulate

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        cfg = wb.RunConfig(**fields)
        task = get_task(cfg.task)
        strategy = parallelize(
            cfg,
            Placement(torch.device("cpu"), world, rank, tracing=False),
            task.build_model(cfg),
            task,
            optimizer_for(cfg, task, False),
        )
        forward = strategy.pipeline_stages[0].forward_one_chunk

        def each_on_its_own(chunk: int, *args: Any, **kwargs: Any) -> Any:
            if chunk > 0:
                next_micro_batch()
            return forward(chunk, *args, **kwargs)

        strategy.pipeline_stages[0].forward_one_chunk = each_on_its_own
        loader = ShardedBatches(
            task.build_datasets(cfg)[0], cfg, rank, world, task.collate_fn(cfg)
        ).iterate(0)
        batches = [next(loader) for _ in range(cfg.grad_accum_steps)]

        def step() -> None:
            accumulate(strategy, task, iter(batches), cfg.grad_accum_steps, torch.device("cpu"))
            strategy.clip_grad_norm(cfg.grad_clip)
            strategy.step()

        step()
        stage = strategy.pipeline_stages[0]
        buffers = [
            info.buffer
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos
            if getattr(info, "buffer", None) is not None
        ]
        _, memory = tracked(strategy, step, (*batches, *buffers))
        out.put((rank, memory["peak"]))
    finally:
        dist.destroy_process_group()


def _real_schedule_peaks(fields: dict[str, Any], timeout: float = 120.0) -> dict[int, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from workbench.estimator.machine.profile import resource_tracker_pid, stop_resource_tracker

    tracker_was_running = resource_tracker_pid() is not None
    # forked: each worker runs on one thread (OpenMP's pool is never used, so the fork is safe) and skips the
    # fresh interpreter's imports, 2-3 s a rank on 2 cores
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    world = fields["num_processes"]
    procs = [
        ctx.Process(target=_schedule_worker, args=(r, world, port, fields, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        peaks = dict(out.get(timeout=timeout) for _ in procs)
        for p in procs:
            p.join(timeout=timeout)
        return peaks
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        out.close()
        out.join_thread()
        # if anything started it: no process outlives the test
        stop_resource_tracker(tracker_was_running)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stages_peak_is_the_real_schedules(
    needs_mirror: Path, tmp_path: Path, schedule: str
) -> None:
    cfg = cfg_for(tmp_path, pp=2, grad_accum_steps=4, pp_schedule=schedule)
    # the forked ranks find the data as this process does
    real = _real_schedule_peaks(cfg.to_dict())
    est = estimate(cfg)
    for rank, peak in real.items():
        assert abs(est.ranks[rank].tensors / peak - 1) < 0.02, (
            schedule,
            rank,
            est.ranks[rank].tensors,
            peak,
        )


# ---- cheaper: what the layouts change in the estimate --------------------------------------------
def test_gpipe_holds_more_micro_batches_in_flight_than_1f1b(
    needs_mirror: Path, tmp_path: Path
) -> None:
    gpipe = estimate(cfg_for(tmp_path, pp=2, grad_accum_steps=4, pp_schedule="gpipe"))
    one_f_one_b = estimate(cfg_for(tmp_path, pp=2, grad_accum_steps=4, pp_schedule="1f1b"))
    # GPipe: all 4 micro-batches' activations at once on both stages; 1F1B: 2 on stage 0, 1 on stage 1
    assert gpipe.ranks[0].activations > 1.7 * one_f_one_b.ranks[0].activations
    assert gpipe.ranks[1].activations > 3 * one_f_one_b.ranks[1].activations
    assert gpipe.ranks[0].held == one_f_one_b.ranks[0].held, (
        "the schedule changes activations, not model state"
    )
    assert any("stage 0: 4, stage 1: 4 of 4" in a for a in gpipe.assumptions)
    assert any("stage 0: 2, stage 1: 1 of 4" in a for a in one_f_one_b.assumptions)


def test_the_pipeline_bubble_is_in_the_step_time(needs_mirror: Path, tmp_path: Path) -> None:
    few, many = (
        estimate(cfg_for(tmp_path, pp=2, grad_accum_steps=m, pp_schedule="gpipe")) for m in (2, 8)
    )
    for est, m in ((few, 2), (many, 8)):
        idle = est.step_s - est.compute_s - est.exposed_comm_s
        assert idle == pytest.approx(est.compute_s * (2 - 1) / m, rel=1e-6), m
        assert any(f"(pp - 1) / (m + pp - 1) = {1 / (m + 1):.0%}" in a for a in est.assumptions)
    assert few.step_s > few.compute_s + few.exposed_comm_s
    # two chunks per rank: each stage boundary idles a chunk's share of a micro-batch, half of GPipe's
    interleaved = estimate(
        cfg_for(
            tmp_path,
            pp=2,
            grad_accum_steps=2,
            pp_schedule="interleaved_1f1b",
            task_options={**GPT, "n_layer": 4},
        )
    )
    idle = interleaved.step_s - interleaved.compute_s - interleaved.exposed_comm_s
    assert idle == pytest.approx(interleaved.compute_s / (2 * 2), rel=1e-6)
    assert any("(pp - 1) / (v x m + pp - 1) = 20%" in a for a in interleaved.assumptions)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_is_priced_on_a_catalog_gpu(
    needs_mirror: Path, tmp_path: Path, layout: str
) -> None:
    fields = {k: v for k, v in LAYOUTS[layout].items() if k != "track_memory"}
    cfg = cfg_for(tmp_path, **{**fields, "device": "auto", "precision": "bf16"})
    est = estimate(cfg, "H100-SXM-80GB", cfg.num_processes)
    assert (
        len(est.ranks) == cfg.num_processes
        and est.fits
        and est.step_s > 0
        and est.target.kind == "cuda"
    )
    assert all(r.held["params"] > 0 and r.activations > 0 for r in est.ranks)
    if cfg.tp > 1:  # exposed: the TP group's collectives wait for the matrix multiplies around them
        lead = "tensor parallel: the TP group's" if cfg.pp == 1 else "the stage's other collectives"
        assert any(a.startswith(lead) for a in est.assumptions), est.assumptions
        assert est.exposed_comm_s > 0
    if cfg.pp > 1:
        groups = est.rank_groups()
        # the two stages, each its own rows (a sharded stage's ranks may hold shards of different sizes)
        assert len(groups) >= 2 and groups[0][1] != groups[-1][1], groups


@pytest.mark.parametrize("parallelism", ["ddp", "zero3"])
def test_fp16_estimates_on_an_h100_with_its_loss_scaler(parallelism: str) -> None:
    cfg = wb.RunConfig(task="digits", num_processes=8, parallelism=parallelism, precision="fp16")
    est = estimate(cfg, "H100-SXM-80GB", 8)
    assert len(est.ranks) == 8 and est.step_s > 0
    assert all(r.held["optimizer"] > 0 for r in est.ranks), (
        "the update ran: the optimizer state exists"
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    cases(
        [
            (
                dict(task="digits", tp=2, task_options={}),
                r"tp=2: task 'digits' has no tensor-parallel plan",
            ),
            (
                dict(task="digits", pp=2, task_options={}),
                r"pp=2: task 'digits' can't be split into pipeline stages",
            ),
            (
                dict(num_processes=4, tp=2, parallelism="zero1"),
                r"tp=2 with parallelism='zero1' .*set parallelism='zero2'",
            ),
        ]
    ),
)
def test_a_layout_that_cannot_run_is_refused_in_words(
    tmp_path: Path, fields: dict[str, Any], match: str
) -> None:
    """A ValueError that names the setting and the fix (what the panel shows), never a trace's RuntimeError."""
    with pytest.raises(ValueError, match=match):
        cfg = cfg_for(tmp_path, **fields)
        estimate(cfg, "H100-SXM-80GB", 2) if cfg.device == "auto" else estimate(cfg)
