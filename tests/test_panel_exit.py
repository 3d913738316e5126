"""A script that creates wb.Panel and exits, exits cleanly (issue 46, item 8): the panel's estimate
runs in a daemon thread, and one still inside torch's C++ when the interpreter finalizes used to abort
the process ("terminate called without an active exception", rc 134). The exit now cancels the
estimate (its trace or measurement children killed) and waits for its thread first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from workbench.estimator import cancel
from workbench.estimator.machine import profile
from workbench.estimator.trace import step as trace_step_module
from workbench.notebook.panel import estimates
from workbench.notebook.panel.estimates import EstimateBox

EXIT_DEADLINE_S = 240
"""A fresh interpreter imports torch and builds the panel: seconds, tens of them on 2 busy cores."""


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter, with its own caches (no other test's traces or profile)."""
    env = {**os.environ, "WORKBENCH_CACHE_DIR": str(tmp_path / "cache"), "PYTHONFAULTHANDLER": ""}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXIT_DEADLINE_S,  # kills the child and raises if it never ends
    )


@pytest.mark.slow
def test_a_script_that_creates_a_panel_and_exits_exits_cleanly(tmp_path: Path) -> None:
    # the exact probe
    done = run_python("import workbench as wb; wb.Panel(wb.RunConfig(task='digits'))", tmp_path)
    assert "terminate called" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


EXIT_INSIDE_TORCH = textwrap.dedent(
    """
    import sys, threading
    import torch
    import workbench as wb
    from workbench.estimator import cancel, catalog

    inside = threading.Event()

    def measuring(dtype_name):
        # the estimate's first step (this CPU's matmul peak), held inside torch's C++ until the
        # estimate is cancelled: an estimate sure to be running when the interpreter exits
        a = torch.randn(256, 256)
        inside.set()
        while not cancel.is_cancelled():
            a @ a
        print("the estimate was cancelled", file=sys.stderr)
        return 1e12

    catalog._cpu_matmul_flops = measuring
    panel = wb.Panel(wb.RunConfig(task="digits"))
    assert inside.wait(120), "the panel's estimate never started"
    print("exiting while the estimate is", panel.state.estimate.status, file=sys.stderr)
    """
)


@pytest.mark.slow
def test_exiting_while_the_estimate_runs_inside_torch_is_clean(tmp_path: Path) -> None:
    done = run_python(EXIT_INSIDE_TORCH, tmp_path)
    assert "exiting while the estimate is estimating" in done.stderr, done.stderr
    assert "terminate called" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    # the exit cancelled it and waited for it: the thread ended by itself, before finalization
    assert "the estimate was cancelled" in done.stderr, done.stderr


def test_the_exit_hook_ends_every_estimate_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process: what threading's exit hook runs. An estimate blocked until cancelled ends,
    and no request after the exit starts a thread."""
    monkeypatch.setattr(estimates, "_EXITING", threading.Event())  # this process goes on
    entered = threading.Event()

    def until_cancelled(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        deadline = time.monotonic() + 60
        while not cancel.is_cancelled() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise cancel.Cancelled("cancelled in the test")

    import workbench as wb
    from workbench.estimator.target import Target

    monkeypatch.setattr(EstimateBox, "_estimate_on", staticmethod(until_cancelled))
    box = EstimateBox()
    try:
        box.request(
            wb.RunConfig(task="digits"), None, Target(gpu="H100-SXM-80GB", gpus_per_node=8), delay=0
        )
        thread = box._thread
        assert thread is not None and entered.wait(30), "the estimate never started"
        started = time.monotonic()
        estimates.end_estimates_at_exit()
        assert not thread.is_alive(), "the exit hook returned with the estimate still running"
        assert time.monotonic() - started < 30
        assert box.state.status == "idle"
        box.request(wb.RunConfig(task="digits"), None, Target(gpu="H100-SXM-80GB", gpus_per_node=8))
        assert box._thread is None, "an estimate started after the exit began"
    finally:
        cancel.allow()


def test_cancel_ends_a_machine_measurement_at_once() -> None:
    """The machine's measurement (seconds, more on a busy box) is the longest part of a first
    estimate: cancel() kills its children and it raises Cancelled."""
    result: list[BaseException | object] = []

    def measure() -> None:
        try:
            result.append(profile.measure(1, 1, {"test": "yes"}, fork=True, stall_s=90))
        except BaseException as e:  # noqa: BLE001  (looked at below)
            result.append(e)

    thread = threading.Thread(target=measure, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not cancel._RUNNING and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        children = list(cancel._RUNNING)
        assert children, "the measurement started no child"
        cancel.cancel()
        thread.join(30)
        assert not thread.is_alive(), "the measurement went on after cancel()"
        assert len(result) == 1 and isinstance(result[0], cancel.Cancelled), result
        assert all(not child.is_alive() for child in children)
        with pytest.raises(cancel.Cancelled, match="cancelled before measuring this machine"):
            profile.measure(1, 1, {"test": "yes"}, fork=True, stall_s=90)
    finally:
        cancel.allow()
        thread.join(30)


def test_cancel_ends_a_trace_in_flight_and_refuses_the_next() -> None:
    import workbench as wb
    from workbench.tasks import get_task

    cfg, task = wb.RunConfig(task="digits", max_steps=2), get_task("digits")
    result: list[Any] = []

    def trace() -> None:
        try:
            result.append(trace_step_module.trace_step(cfg, task, world=1))
        except BaseException as e:  # noqa: BLE001  (looked at below)
            result.append(e)

    thread = threading.Thread(target=trace, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not cancel._RUNNING and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert cancel._RUNNING, "the trace's child never started"
        cancel.cancel()
        thread.join(30)
        assert not thread.is_alive()
        assert len(result) == 1 and isinstance(result[0], cancel.Cancelled), result
        with pytest.raises(cancel.Cancelled, match="cancelled before a trace"):
            trace_step_module.trace_step(cfg, task, world=1)
    finally:
        cancel.allow()
        thread.join(30)
