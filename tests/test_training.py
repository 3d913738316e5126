"""The trainer and launch(), for real: 2 forked CPU ranks over gloo, as on a user's box without GPUs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.rundir import RunDir
from workbench.utils import files

pytestmark = pytest.mark.slow


def cfg_for(runs_dir: Path, **fields) -> wb.RunConfig:
    base = dict(
        task="tiny-regression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=12,
        log_every=1,
        lr=5e-2,
        runs_dir=str(runs_dir),
        seed=3,
    )
    return wb.RunConfig(**{**base, **fields})


def losses(result: wb.RunResult) -> list[float]:
    return [r["loss"] for r in result.metrics if "loss" in r]


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        # it exited between the listing and this look (seen once in a full run)
        return False


def no_children_left() -> list[psutil.Process]:
    deadline = time.time() + 10
    while time.time() < deadline:
        alive = [p for p in psutil.Process().children(recursive=True) if _running(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def test_ddp_ranks_form_one_job_with_identical_weights(runs_dir: Path) -> None:
    result = wb.launch(cfg_for(runs_dir), task=TinyRegression())
    ranks = result.summary["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["distributed_type"] for r in ranks} == {"MULTI_CPU"}, (
        "CPU ranks must form a gloo process group"
    )
    assert {r["world_size"] for r in ranks} == {2}
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    assert result.summary["status"] == "completed" and result.summary["steps"] == 12
    # Forked ranks must not keep the parent's thread pool: 2 ranks x all cores would oversubscribe the CPU.
    assert sum(r["torch_threads"] for r in ranks) <= max(2, psutil.cpu_count())


def test_ddp_all_reduces_gradients_two_ranks_match_one_process_on_the_global_batch(
    runs_dir: Path,
) -> None:
    # Each rank sees half of every global batch (DistributedSampler interleaves one permutation), so only
    # all-reduced gradients can make 2 x 16 train exactly like 1 x 32.
    two = wb.launch(cfg_for(runs_dir, run_name="two"), task=TinyRegression())
    one = wb.launch(
        cfg_for(runs_dir, run_name="one", num_processes=1, micro_batch_size=32),
        task=TinyRegression(),
    )
    assert losses(two) == pytest.approx(losses(one), rel=1e-4)
    assert losses(two)[-1] < losses(two)[0] * 0.7, "the model should learn"


def test_grad_accumulation_matches_a_bigger_micro_batch(runs_dir: Path) -> None:
    accum = wb.launch(
        cfg_for(runs_dir, run_name="accum", micro_batch_size=8, grad_accum_steps=2),
        task=TinyRegression(),
    )
    big = wb.launch(cfg_for(runs_dir, run_name="big", micro_batch_size=16), task=TinyRegression())
    assert accum.summary["global_batch_size"] == big.summary["global_batch_size"] == 32
    assert losses(accum) == pytest.approx(losses(big), rel=1e-4)


def test_grad_accumulation_all_reduces_only_on_the_last_micro_batch(runs_dir: Path) -> None:
    result = wb.launch(
        cfg_for(runs_dir, max_steps=3, grad_accum_steps=4, micro_batch_size=4, eval_every=0),
        task=TinyRegression(),
    )
    # 3 steps x 4 micro-batches = 12 backward passes, of which DDP itself counts 3 that all-reduced
    assert [r["gradient_syncs"] for r in result.summary["ranks"]] == [3, 3], result.summary["ranks"]


def _passed_the_barrier(out: Path, i: int) -> None:
    from workbench.training import rank

    (out / f"waiting_{i}").touch()
    rank.wait_for_forked_siblings(timeout_s=60)
    (out / f"sibling_{i}").write_text(repr(time.monotonic()))


def test_forked_ranks_wait_for_every_sibling_before_going_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No rank reaches the process-group store while a later sibling is still to be forked (rank.py says why):
    the early siblings pass the barrier only after the last fork, however long it comes after them."""
    import multiprocessing

    from workbench.training import rank

    monkeypatch.setattr(rank, "_forked_siblings", None)
    rank.expect_forked_ranks(3)
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=_passed_the_barrier, args=(tmp_path, i)) for i in range(3)]
    try:
        children[0].start()
        children[1].start()
        wait_until(
            lambda: all((tmp_path / f"waiting_{i}").exists() for i in range(2)),
            60,
            "the first two siblings reach the barrier",
        )
        last_fork = time.monotonic()
        children[2].start()
        for child in children:
            child.join(90)
        assert [c.exitcode for c in children] == [0, 0, 0]
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
    passed = [float((tmp_path / f"sibling_{i}").read_text()) for i in range(3)]
    assert min(passed) >= last_fork, (passed, last_fork)


@pytest.mark.parametrize("precision,dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_precision_is_applied_in_every_worker(runs_dir: Path, precision: str, dtype: str) -> None:
    result = wb.launch(cfg_for(runs_dir, precision=precision, max_steps=4), task=TinyRegression())
    ranks = result.summary["ranks"]
    assert [r["compute_dtype"] for r in ranks] == [dtype, dtype]
    assert {r["mixed_precision"] for r in ranks} == {"no" if precision == "fp32" else precision}
    assert result.summary["precision"] == precision


def test_fp16_on_cpu_is_refused_before_anything_runs(runs_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"precision='fp16' on CPU.*use (bf16|fp32)"):
        wb.launch(cfg_for(runs_dir, precision="fp16"), task=TinyRegression())
    assert not any(runs_dir.iterdir()), "nothing may be created for a config that can't run"


def test_failing_rank_is_reported_while_the_other_waits_in_a_collective(runs_dir: Path) -> None:
    # Rank 1 raises in its 3rd loss call; rank 0 is then blocked in the DDP all-reduce of that step.
    cfg = cfg_for(runs_dir, max_steps=50, task_options={"fail_rank": 1, "fail_at_call": 3})
    start = time.time()
    with pytest.raises(
        wb.RunFailedError, match=r"rank 1 failed with ValueError: injected failure on call 3"
    ) as info:
        wb.launch(cfg, task=TinyRegression())
    assert time.time() - start < 60, "a failing rank must not leave the job hanging"
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "tasks_for_tests.py" in err.rank_traceback and "in loss" in err.rank_traceback
    summary = files.read_json(err.run_dir / "summary.json")
    assert summary["status"] == "failed" and summary["error"]["rank"] == 1
    assert summary["error"]["message"] == "injected failure on call 3"
    failed = [e for e in files.read_jsonl(err.run_dir / "events.jsonl") if e["event"] == "failed"]
    assert [e["rank"] for e in failed] == [1], "the failure is recorded once, naming rank 1"
    assert no_children_left() == []


def test_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_its_peer(runs_dir: Path) -> None:
    # Rank 1 dies by SIGKILL (as from the OOM killer); rank 0 then fails in gloo and gets the launcher's SIGTERM.
    cfg = cfg_for(runs_dir, max_steps=50, task_options={"kill_rank": 1, "fail_at_call": 3})
    with pytest.raises(
        wb.RunFailedError,
        match=r"rank 1 failed with Killed: the process (was killed by SIGKILL|ended without raising)",
    ):
        wb.launch(cfg, task=TinyRegression())
    assert no_children_left() == []


def test_checkpoint_resume_matches_an_uninterrupted_run(runs_dir: Path) -> None:
    common = dict(
        max_steps=10, checkpoint_every=4, keep_checkpoints=5, task_options={"dropout": 0.2}
    )
    straight = wb.launch(cfg_for(runs_dir, run_name="straight", **common), task=TinyRegression())

    # Crash on call 7 (step 7): the last complete checkpoint is step 4.
    crashing = cfg_for(
        runs_dir,
        run_name="crashed",
        **{**common, "task_options": {"dropout": 0.2, "fail_rank": 0, "fail_at_call": 7}},
    )
    with pytest.raises(wb.RunFailedError):
        wb.launch(crashing, task=TinyRegression())
    crashed_dir = runs_dir / "crashed"
    assert [s for s, _ in RunDir(crashed_dir).checkpoints()] == [4]
    assert not list((crashed_dir / "checkpoints").glob(".tmp-*")), (
        "a crash must not leave a half checkpoint named"
    )

    # The crash was injected through task_options; the resume drops it, which the resume check must be told.
    resumed = wb.launch(
        cfg_for(runs_dir, run_name="crashed", resume=True, resume_allow=["task_options"], **common),
        task=TinyRegression(),
    )
    # The crashed session's steps 5 and 6 are set aside, not mixed into the resumed curve, and not lost.
    assert [r["step"] for r in resumed.metrics if "loss" in r] == list(range(1, 11))
    assert [r["step"] for r in files.read_jsonl(crashed_dir / "metrics.after-step-4.jsonl")] == [
        5,
        6,
    ]
    after_resume = [r for r in resumed.metrics if "loss" in r and r["step"] > 4]
    expected = [r for r in straight.metrics if "loss" in r and r["step"] > 4]
    assert [r["step"] for r in after_resume] == [5, 6, 7, 8, 9, 10]
    assert [r["loss"] for r in after_resume] == pytest.approx(
        [r["loss"] for r in expected], rel=1e-6
    )
    assert (
        resumed.summary["ranks"][0]["weights_sha256"]
        == straight.summary["ranks"][0]["weights_sha256"]
    )
    assert any(e["event"] == "resumed" for e in resumed.events)


def test_resume_without_a_checkpoint_is_refused(runs_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"resume=True: .* has no complete checkpoint"):
        wb.launch(cfg_for(runs_dir, run_name="never-ran", resume=True), task=TinyRegression())


def test_existing_run_directory_is_not_overwritten(runs_dir: Path) -> None:
    wb.launch(cfg_for(runs_dir, run_name="taken", max_steps=2), task=TinyRegression())
    with pytest.raises(
        ValueError, match=r"run_name='taken': .* already exists; pick another run_name"
    ):
        wb.launch(cfg_for(runs_dir, run_name="taken", max_steps=2), task=TinyRegression())


def test_stop_checkpoints_and_ends_cleanly(runs_dir: Path) -> None:
    run = wb.start(
        cfg_for(runs_dir, max_steps=100_000, log_every=5, task_options={"slow_s": 0.002}),
        task=TinyRegression(),
    )
    try:
        wait_until(lambda: run.metrics, 60, "a first metrics row")
    except AssertionError:
        run.kill()
        raise
    run.stop()
    result = run.wait(timeout=60)
    s = result.summary
    assert s["status"] == "stopped" and 0 < s["steps"] < 100_000
    assert RunDir(result.run_dir).latest_checkpoint().name == f"step_{s['steps']}"
    assert [e["event"] for e in result.events][-2:] == ["checkpoint_saved", "stopped"]
    assert no_children_left() == []


def test_one_kernel_launches_again_and_again(runs_dir: Path) -> None:
    task = TinyRegression()
    first = wb.launch(cfg_for(runs_dir, max_steps=3), task=task)
    with pytest.raises(wb.RunFailedError, match="rank 0 failed"):
        wb.launch(
            cfg_for(runs_dir, max_steps=3, task_options={"fail_rank": 0, "fail_at_call": 2}),
            task=task,
        )
    single = wb.launch(
        cfg_for(runs_dir, max_steps=3, num_processes=1, parallelism="none"), task=task
    )
    run = wb.start(cfg_for(runs_dir, max_steps=100_000, log_every=5), task=task)
    try:
        wait_until(lambda: run.metrics, 60, "a first metrics row")
    except AssertionError:
        run.kill()
        raise
    run.stop()
    stopped = run.wait(timeout=60)
    last = wb.launch(cfg_for(runs_dir, max_steps=3), task=task)
    assert [r.summary["status"] for r in (first, single, stopped, last)] == [
        "completed",
        "completed",
        "stopped",
        "completed",
    ]
    assert single.summary["world_size"] == 1 and last.summary["world_size"] == 2
    assert first.summary["ranks"][0]["weights_sha256"] == last.summary["ranks"][0]["weights_sha256"]


def test_run_directory_has_the_designed_files(runs_dir: Path) -> None:
    result = wb.launch(
        cfg_for(runs_dir, max_steps=6, log_every=2, eval_every=3), task=TinyRegression()
    )
    d = result.run_dir
    for name in ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json"):
        assert (d / name).is_file(), name
    assert wb.RunConfig.from_yaml(d / "config.yaml") == result.config
    s = result.summary
    for key in (
        "status",
        "world_size",
        "parallelism",
        "precision",
        "steps",
        "final_loss",
        "wall_time_s",
        "samples_per_s",
        "peak_memory_bytes",
        "device",
    ):
        assert s.get(key) is not None, key
    rows = [r for r in result.metrics if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4, 6]
    assert all(
        len(r["peak_memory_bytes_per_rank"]) == 2 and r["peak_memory_bytes"] > 10 << 20
        for r in rows
    )
    assert [r["step"] for r in result.metrics if "eval_loss" in r] == [3, 6]
    assert [e["event"] for e in result.events] == ["started", "checkpoint_saved", "completed"]


def test_digits_learns_and_records_its_data(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        device="cpu",
        max_steps=60,
        lr=3e-3,
        log_every=20,
        runs_dir=str(runs_dir),
    )
    s = wb.launch(cfg).summary
    assert s["eval_accuracy"] > 0.8
    assert [d["name"] for d in s["data"]] == ["digits"]
    assert len(next(iter(s["data"][0]["files"].values()))) == 64  # a sha256


def test_char_gpt_trains_on_tinyshakespeare_from_the_mirror(
    runs_dir: Path, needs_mirror: Path
) -> None:
    cfg = wb.RunConfig(
        task="char-gpt",
        num_processes=2,
        device="cpu",
        max_steps=8,
        micro_batch_size=8,
        log_every=4,
        eval_batches=2,
        lr=3e-3,
        runs_dir=str(runs_dir),
    )
    s = wb.launch(cfg).summary
    assert s["status"] == "completed"
    assert s["tokens_per_s"] == pytest.approx(s["samples_per_s"] * 64)
    assert (
        s["data"][0]["files"]["input.txt"]
        == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    )
    assert s["final_loss"] < 4.2  # ln(65) = 4.17 is a uniform guess over the characters


def test_rank_exceptions_are_surfaced_when_the_task_breaks_at_build_time(runs_dir: Path) -> None:
    class BadModel(TinyRegression):
        name = "bad-model"

        def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
            return "not a module"  # type: ignore[return-value]

    with pytest.raises(
        wb.RunFailedError, match=r"rank \d failed with TypeError: BadModel.build_model returned str"
    ):
        wb.launch(cfg_for(runs_dir, max_steps=2), task=BadModel())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 loss scaling needs a CUDA GPU")
def test_fp16_overflow_skips_steps_and_counts_them(runs_dir: Path) -> None:
    class Overflow(TinyRegression):
        name = "overflow"

        def loss(self, model, batch):  # type: ignore[no-untyped-def]
            loss = super().loss(model, batch)
            return loss * 1e30 if self.calls == 2 else loss

    result = wb.launch(
        cfg_for(runs_dir, device="cuda", num_processes=1, precision="fp16", max_steps=6),
        task=Overflow(),
    )
    assert result.summary["skipped_steps"] >= 1
    assert result.summary["ranks"][0]["compute_dtype"] == "float16"


def test_workbench_train_runs_from_the_shell(
    runs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess
    import sys

    cfg = cfg_for(runs_dir, task="tasks_for_tests:TinyRegression", max_steps=4, run_name="shell")
    path = tmp_path / "run.yaml"
    cfg.to_yaml(path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "train",
            str(path),
            "--set",
            "max_steps=6",
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ok.returncode == 0, ok.stderr
    summary = files.read_json(runs_dir / "shell" / "summary.json")
    assert summary["status"] == "completed" and summary["steps"] == 6 and summary["world_size"] == 2
    assert {r["distributed_type"] for r in summary["ranks"]} == {"MULTI_CPU"}

    failing = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "train",
            str(path),
            "--set",
            "run_name=shell-fail",
            "--set",
            "task_options.fail_rank=1",
            "--set",
            "task_options.fail_at_call=2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert failing.returncode == 1
    assert "rank 1 failed with ValueError: injected failure on call 2" in failing.stderr

    # the shell's entry point, in process: nothing starts before the refusal
    from workbench.cli import main

    assert main(["train", str(path), "--set", "num_processes=0"]) == 2
    assert "num_processes=0: must be at least 1" in capsys.readouterr().err


def test_user_task_defined_in_a_notebook_cell_runs_on_two_ranks(tmp_path: Path) -> None:
    import papermill

    source = (
        Path(__file__).parent / "fixtures" / "notebooks" / "launches_task_defined_in_a_cell.ipynb"
    )
    out = tmp_path / "executed.ipynb"
    papermill.execute_notebook(
        str(source),
        str(out),
        parameters={"runs_dir": str(tmp_path / "runs")},
        cwd=str(tmp_path),
        kernel_name="python3",
        progress_bar=False,
    )
    summary = files.read_json(tmp_path / "runs" / "from-a-cell" / "summary.json")
    assert summary["status"] == "completed" and summary["task"] == "cell-task"
    assert {r["distributed_type"] for r in summary["ranks"]} == {"MULTI_CPU"}
    text = out.read_text()
    assert "status completed world 2 same weights True" in text


def test_multi_node_recipe_two_torchrun_nodes_form_one_job(runs_dir: Path, tmp_path: Path) -> None:
    """The README's multi-node path, on one machine: prepare the run directory, then one launcher per node."""
    import subprocess
    import sys

    from workbench.launcher.processes import free_port

    path = tmp_path / "run.yaml"
    cfg_for(
        runs_dir,
        task="tasks_for_tests:TinyRegression",
        num_processes=1,
        max_steps=6,
        run_name="nodes",
    ).to_yaml(path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    prepared = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "train", str(path), "--prepare-only"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    run_dir = Path(prepared.stdout.strip())
    assert prepared.returncode == 0 and run_dir == runs_dir / "nodes", prepared.stderr
    port = str(free_port())
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(i),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "-m",
                "workbench.worker",
                str(run_dir),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    codes = [n.wait(timeout=240) for n in nodes]
    assert codes == [0, 0], [n.stderr.read()[-2000:] for n in nodes]
    s = files.read_json(run_dir / "summary.json")
    assert s["status"] == "completed" and s["world_size"] == 2 and s["global_batch_size"] == 32
    assert s["ranks"][0]["weights_sha256"] == s["ranks"][1]["weights_sha256"]


def test_ctrl_c_in_workbench_train_stops_gracefully_with_a_checkpoint(
    runs_dir: Path, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys

    path = tmp_path / "run.yaml"
    cfg_for(
        runs_dir,
        task="tasks_for_tests:TinyRegression",
        max_steps=100_000,
        log_every=5,
        run_name="ctrl-c",
        task_options={"slow_s": 0.002},
    ).to_yaml(path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    # Its own session, and SIGINT's default disposition: a suite started in the background ignores SIGINT, and
    # a child would inherit that and never see the Ctrl-C.
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", "train", str(path), "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = runs_dir / "ctrl-c" / "metrics.jsonl"
    try:
        wait_until(lambda: metrics.exists() and metrics.read_text(), 120, "a first metrics row")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, err
    summary = files.read_json(runs_dir / "ctrl-c" / "summary.json")
    assert summary["status"] == "stopped"
    assert RunDir(runs_dir / "ctrl-c").latest_checkpoint().name == f"step_{summary['steps']}"
    assert "interrupt again to kill" in err


def test_dataloader_workers_do_not_change_the_result(runs_dir: Path) -> None:
    plain = wb.launch(
        cfg_for(runs_dir, max_steps=6, task_options={"dropout": 0.1}), task=TinyRegression()
    )
    workers = wb.launch(
        cfg_for(runs_dir, max_steps=6, num_workers=2, task_options={"dropout": 0.1}),
        task=TinyRegression(),
    )
    assert (
        workers.summary["ranks"][0]["weights_sha256"] == plain.summary["ranks"][0]["weights_sha256"]
    )
