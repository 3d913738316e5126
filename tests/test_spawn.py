"""Ranks started as fresh interpreters (start_method='spawn'), and launching after CUDA was initialised here.

The spawn path runs for real on CPU ranks, forced by the config field, so it works on machines without GPUs;
'CUDA already initialised' is faked (torch.cuda.is_initialized and the run's use of CUDA), the ranks still
train on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import secrets
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from workbench.launcher import spawn
from workbench.rundir import TASK as TASK_FILE
from workbench.worker import TASK_DIGEST_ENV, load_task

CELL = """
import json, os, sys
import psutil, torch
import workbench as wb
from torch.utils.data import TensorDataset

class CellTask(wb.Task):
    name = "cell-task"
    MARKER = "{marker}"  # only a class pickled by value (from this cell's source) carries it to the ranks

    def __init__(self, out_dir, fail_once=False):
        self.out_dir, self.fail_once = out_dir, fail_once

    def build_model(self, cfg):
        rank = int(os.environ["RANK"])
        me = psutil.Process()
        seen = {{"marker": self.MARKER, "cmdline": me.cmdline(), "parent": me.parent().cmdline(),
                 "grandparent_pid": me.parent().ppid(), "main": getattr(sys.modules["__main__"], "__spec__").name}}
        with open(os.path.join(self.out_dir, f"rank_{{rank}}.json"), "w") as f:
            json.dump(seen, f)
        print(f"cell says {{self.MARKER}} from rank {{rank}}", flush=True)
        failed = os.path.join(self.out_dir, "failed-once")
        if self.fail_once and rank == 1 and not os.path.exists(failed):
            open(failed, "w").close()
            raise RuntimeError("the first attempt fails")
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def build_datasets(self, cfg):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        return TensorDataset(x, x.sum(1, keepdim=True)), None

    def loss(self, model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
"""


def cell_task_class(marker: str) -> type:
    """CellTask as a notebook cell defines it: its module is __main__, where no worker can import it from."""
    namespace: dict = {"__name__": "__main__"}
    exec(
        compile(textwrap.dedent(CELL.format(marker=marker)), "<ipython-input-3>", "exec"), namespace
    )
    return namespace["CellTask"]


def cfg_for(runs_dir: Path, **fields) -> wb.RunConfig:
    base = dict(
        task="tiny-regression",
        num_processes=2,
        device="cpu",
        micro_batch_size=16,
        max_steps=6,
        log_every=1,
        lr=5e-2,
        runs_dir=str(runs_dir),
        seed=3,
    )
    return wb.RunConfig(**{**base, **fields})


@contextlib.contextmanager
def killed_on_failure(run: wb.Run) -> Iterator[wb.Run]:
    try:
        yield run
    except BaseException:
        run.kill()
        raise


def leftovers() -> list[str]:
    """Processes and output-copying threads of this test still around after a deadline."""
    deadline = time.time() + 10
    while True:
        procs = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        ]
        threads = [t.name for t in threading.enumerate() if t.name.endswith(("-stdout", "-stderr"))]
        if not (procs or threads) or time.time() > deadline:
            return [str(p.pid) for p in procs] + threads
        time.sleep(0.2)


def fake_cuda_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    # a CUDA run, but the ranks train on CPU
    monkeypatch.setattr(spawn, "run_uses_cuda", lambda cfg: True)


# ---- for real, on CPU ranks ----------------------------------------------------------------------
@pytest.mark.slow
def test_task_from_a_notebook_cell_trains_spawned_on_two_cpu_ranks(
    runs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = secrets.token_hex(8)
    cell_task = cell_task_class(marker)
    assert cell_task.__module__ == "__main__" and not hasattr(sys.modules["__main__"], "CellTask")
    cfg = cfg_for(
        runs_dir, task="cell-task", start_method="spawn", max_restarts=1, restart_backoff_s=0
    )
    with killed_on_failure(wb.start(cfg, task=cell_task(str(tmp_path), fail_once=True))) as run:
        assert run.start_method == "spawn"
        assert run.start_reason == "start_method='spawn': the ranks start as fresh interpreters"
        result = run.wait(timeout=240)
    s = result.summary
    assert s["status"] == "completed" and s["steps"] == 6 and s["world_size"] == 2
    assert {r["distributed_type"] for r in s["ranks"]} == {"MULTI_CPU"}, "one gloo group of 2 ranks"
    assert s["ranks"][0]["weights_sha256"] == s["ranks"][1]["weights_sha256"]
    assert run.restarts == 1, "the restart after the failed first attempt spawns again"
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert seen["marker"] == marker
        # A fresh interpreter running the worker under torchrun, which this process started: not a fork of it.
        assert seen["main"] == "workbench.worker" and "workbench.worker" in seen["cmdline"]
        assert "torch.distributed.run" in seen["parent"] and seen["grandparent_pid"] == os.getpid()
    # the ranks' prints reach the caller's sys.stdout (in a notebook: the cell)
    out = capsys.readouterr().out
    assert f"cell says {marker} from rank 0" in out and f"cell says {marker} from rank 1" in out
    assert leftovers() == []


@pytest.mark.slow
def test_cuda_initialised_here_makes_auto_spawn_and_the_ranks_train(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cuda_initialised(monkeypatch)
    cfg = cfg_for(
        runs_dir,
        num_processes=1,
        parallelism="none",
        max_steps=100_000,
        log_every=2,
        task_options={"slow_s": 0.002},
    )
    assert cfg.start_method == "auto"
    with caplog.at_level(logging.INFO, logger="workbench"):
        # importable by name: pickled by reference, found in the rank
        run = wb.start(cfg, task=TinyRegression())
    with killed_on_failure(run):
        assert run.start_method == "spawn"
        assert (
            "ranks start by spawn (start_method='auto': CUDA is already initialised in this process "
            "(torch.cuda.is_initialized() is True" in caplog.text
        )
        deadline = time.time() + 120
        while not run.metrics and time.time() < deadline:
            time.sleep(0.1)
        assert run.metrics, "the spawned rank trains"
        run.kill()
    assert run.done() and run.dir.summary().status.value == "failed"
    assert leftovers() == [], "kill() ends the launcher, the rank and the output copiers"


# ---- refused before anything starts --------------------------------------------------------------
class Unpicklable(TinyRegression):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def test_unpicklable_task_after_cuda_was_initialised_is_refused_naming_the_cause(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda_initialised(monkeypatch)
    with pytest.raises(
        RuntimeError,
        match=r"CUDA is already initialised in this process \(torch.cuda.is_initialized"
        r"\(\) is True.*pickling the task \(Unpicklable\) failed with TypeError: "
        r"cannot pickle '_thread.lock' object.*Restart the kernel and keep CUDA "
        r"work .* inside your Task's methods",
    ):
        wb.start(cfg_for(runs_dir), task=Unpicklable())
    assert not any(runs_dir.iterdir()), "nothing may be created"
    assert leftovers() == []


def test_forced_fork_after_cuda_was_initialised_is_refused(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda_initialised(monkeypatch)
    with pytest.raises(
        RuntimeError,
        match=r"start_method='fork', but CUDA is already initialised .* Set "
        r"start_method='auto' or 'spawn'",
    ):
        wb.start(cfg_for(runs_dir, start_method="fork"), task=TinyRegression())
    assert not any(runs_dir.iterdir())


def test_forced_spawn_of_an_unpicklable_task_is_refused_with_the_fix(runs_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"start_method='spawn': pickling the task .* Use start_method='auto'"
    ):
        wb.start(cfg_for(runs_dir, start_method="spawn"), task=Unpicklable())
    assert not any(runs_dir.iterdir())


def test_auto_forks_when_cuda_is_not_initialised(runs_dir: Path) -> None:
    plan = spawn.plan_start(cfg_for(runs_dir), TinyRegression())
    assert (plan.method, plan.payload) == ("fork", None) and "a CPU run" in plan.reason
    assert (
        spawn.plan_start(cfg_for(runs_dir, start_method="subprocess"), TinyRegression()).method
        == "subprocess"
    ), (
        "start_method='subprocess' (what workbench train resolves 'auto' to) starts fresh interpreters"
    )


def test_the_call_that_initialised_cuda_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"initialised": False}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialised"])
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: state.update(initialised=True))
    monkeypatch.setattr(spawn, "_first_cuda_init", [])
    spawn.watch_cuda_init()

    def notebook_cell() -> None:
        # What model.cuda() runs first:
        torch.cuda._lazy_init()

    assert spawn.cuda_initialised_by() is None
    notebook_cell()
    assert not getattr(torch.cuda._lazy_init, "_workbench_watch", False), (
        "torch's own function is put back"
    )
    cause = spawn.cuda_initialised_by()
    assert cause.startswith(
        "torch.cuda.is_initialized() is True; it was first initialised by `torch.cuda._lazy_init()`"
    )
    assert "in notebook_cell), called from `notebook_cell()` (" in cause, cause


# ---- the worker's side ---------------------------------------------------------------------------
def test_worker_loads_the_pickled_cell_task(tmp_path: Path) -> None:
    marker = secrets.token_hex(8)
    payload = spawn.pickle_task(cell_task_class(marker)(str(tmp_path)), None)
    env = spawn.write_task(tmp_path, payload)
    task = load_task(tmp_path, env[TASK_DIGEST_ENV])
    assert isinstance(task, wb.Task) and task.MARKER == marker and task.out_dir == str(tmp_path)


def test_worker_refuses_a_task_file_whose_digest_differs(tmp_path: Path) -> None:
    ran = tmp_path / "unpickled"
    evil = pickle.dumps(([], pickle.dumps(_Touch(ran))))
    (tmp_path / TASK_FILE).write_bytes(evil)
    written = hashlib.sha256(b"what the launcher wrote").hexdigest()
    with pytest.raises(
        RuntimeError,
        match=r"task.pkl: its sha256 is .* not the .* its launcher wrote "
        r"\(WORKBENCH_TASK_SHA256\); refusing to unpickle it",
    ):
        load_task(tmp_path, written)
    assert not ran.exists(), "nothing in the file may run"


class _Touch:
    """Unpickling this creates a file: the proof that a refused file was never unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.path,))


def test_a_cuda_run_starts_fresh_interpreters_even_before_cuda_is_initialised(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch.cuda.is_available() alone leaves a fork unable to use CUDA, and is_initialized() can't tell
    monkeypatch.setattr(spawn, "run_uses_cuda", lambda cfg: True)
    assert not torch.cuda.is_initialized()
    plan = spawn.plan_start(cfg_for(runs_dir), TinyRegression())
    assert plan.method == "spawn" and plan.payload and "a CUDA run" in plan.reason
    fallback = spawn.plan_start(cfg_for(runs_dir), Unpicklable())
    assert (fallback.method, fallback.payload) == (
        "fork",
        None,
    ) and "can't be pickled" in fallback.reason
    assert fallback.level == logging.WARNING
