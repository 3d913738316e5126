"""The panel's estimate box keeps up (issue 47, item 3): it says what the estimate is doing and
for how long, shows the memory as soon as the trace has made it known and the time when it is
priced, ends a superseded request's trace child instead of queueing behind it, and leaves the
kernel's own thread free while it works."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

import workbench as wb
from workbench.estimator import cancel
from workbench.estimator import estimation as estimation_module
from workbench.estimator.target import Target
from workbench.estimator.trace import cache as trace_cache
from workbench.estimator.trace import step as trace_step_module
from workbench.notebook.panel.estimates import EstimateBox

H100 = "H100-SXM-80GB"
DEADLINE_S = 120.0
"""A digits trace takes seconds; on 2 busy cores, tens of them."""
SLOW_STEPS = 777
"""A config with this max_steps gets a trace child that never answers (the test's slow trace)."""


def cfg_of(**changes: Any) -> wb.RunConfig:
    base = {"task": "digits", "num_processes": 8, "micro_batch_size": 32, "max_steps": 100}
    return wb.RunConfig(**{**base, **changes})


def wait_until(condition: Any, what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def fresh_traces() -> Any:
    trace_cache.clear()
    cancel.allow()
    yield
    trace_cache.clear()
    cancel.allow()


def test_the_memory_shows_before_the_time_with_what_the_estimate_is_doing_and_for_how_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    priced = threading.Event()
    pricing = threading.Event()
    real_parallel_time = estimation_module.parallel_time

    def slow_pricing(*args: Any, **kwargs: Any) -> Any:
        # the step's pricing held until the test has seen the memory alone
        pricing.set()
        assert priced.wait(DEADLINE_S), "the test never let the pricing finish"
        return real_parallel_time(*args, **kwargs)

    monkeypatch.setattr(estimation_module, "parallel_time", slow_pricing)
    box = EstimateBox()
    box.request(cfg_of(), None, Target(gpu=H100, gpus_per_node=8), delay=0)
    try:
        wait_until(pricing.is_set, "the estimate reached the step's pricing")
        wait_until(lambda: box.state.time_pending, "the memory part was published")
        memory = box.html.value
        est = box.state.result
        assert est is not None and est.ranks and est.peak > 0, "the memory per rank is known"
        assert "wb-estimate-verdict" in memory and "wb-bar" in memory, "bars and verdict show"
        assert "wb-estimate-time-pending" in memory and "pricing the step on H100" in memory
        assert box.state.status == "estimating"
        # the elapsed time moves while it waits (the box's ticker re-renders once a second)
        shown = box.html.value
        wait_until(lambda: box.html.value != shown, "the elapsed seconds moved", 10)
    finally:
        priced.set()
    box.wait(DEADLINE_S)
    assert box.state.status == "done" and not box.state.time_pending
    assert box.state.result.step_s > 0, "the time part arrived"
    assert "wb-estimate-time-pending" not in box.html.value
    assert "step" in box.html.value


def test_the_box_names_each_phase_of_a_trace_as_it_begins(monkeypatch: pytest.MonkeyPatch) -> None:
    box = EstimateBox()
    phases: list[str] = []
    box.state.observe(lambda change: phases.append(change["new"]), names="doing")
    box.request(cfg_of(), None, Target(gpu=H100, gpus_per_node=8), delay=0)
    box.wait(DEADLINE_S)
    assert box.state.status == "done", box.state.message
    assert "checking the plan against 8 x H100-SXM-80GB" in phases
    assert "building the first micro-batches" in phases
    assert "tracing one step on a fake 8-rank world" in phases
    assert (
        phases.index("building the first micro-batches")
        < phases.index("tracing one step on a fake 8-rank world")
        < phases.index("pricing the step on H100-SXM-80GB")
    )


def test_a_superseded_request_has_its_trace_child_killed_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    children: list[Any] = []
    real_trace_child = trace_step_module._trace_child
    real_started = cancel.started

    def hanging_child(writer: Any, cfg: Any, *args: Any) -> None:
        # forked: the test's slow trace never answers; any other runs as usual
        if cfg.max_steps == SLOW_STEPS:
            time.sleep(3600)
        real_trace_child(writer, cfg, *args)

    def recording(procs: list[Any]) -> Any:
        children.extend(procs)
        return real_started(procs)

    monkeypatch.setattr(trace_step_module, "_trace_child", hanging_child)
    monkeypatch.setattr(cancel, "started", recording)
    box = EstimateBox()
    target = Target(gpu=H100, gpus_per_node=8)
    box.request(cfg_of(max_steps=SLOW_STEPS), None, target, delay=0)
    wait_until(
        lambda: bool(children) and children[0].pid is not None, "the slow trace child started"
    )
    slow = children[0]
    started = time.monotonic()
    box.request(cfg_of(), None, target, delay=0)
    try:
        wait_until(lambda: slow.exitcode is not None, "the superseded trace child ended", 30)
        assert slow.exitcode < 0, "killed by a signal, not finished"
        box.wait(DEADLINE_S)
    finally:
        if slow.exitcode is None:
            os.kill(slow.pid, 9)
    assert box.state.status == "done" and box.state.result is not None
    assert box.state.result.config["max_steps"] == 100, "the newest settings' estimate shows"
    assert time.monotonic() - started < DEADLINE_S
    assert trace_cache.stats()["traces"] >= 1 and len(children) == 2, (
        "one trace for each request; the superseded one made none"
    )


def test_the_kernel_thread_keeps_ticking_while_the_box_estimates() -> None:
    box = EstimateBox()
    box.request(cfg_of(parallelism="zero3"), None, Target(gpu=H100, gpus_per_node=8), delay=0)
    gaps, last = [], time.monotonic()
    deadline = last + DEADLINE_S
    while box.state.status == "estimating" and time.monotonic() < deadline:
        time.sleep(0.01)  # a kernel answering a keystroke: it needs the GIL back within a few ms
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    box.wait(DEADLINE_S)
    assert box.state.status == "done", box.state.message
    assert len(gaps) > 10, "the estimate took long enough to measure"
    # the median tick is what a keystroke waits for; one long gap can be the OS giving the cores
    # to other processes on a loaded box, not the estimate holding the GIL
    gaps.sort()
    assert gaps[len(gaps) // 2] < 0.1, f"median tick {gaps[len(gaps) // 2]:.3f} s"
    assert gaps[int(len(gaps) * 0.9)] < 0.5, (
        f"90th-percentile tick {gaps[int(len(gaps) * 0.9)]:.3f} s"
    )
