"""The estimate as people read it: a one-line repr, an HTML table, identical ranks grouped, gradients held and
at the peak, costs under a cent, bars a small model shows on, and the panel's box that says which settings it
is for, marks itself stale until their estimate arrives, shows the run's measured figures beside its own, and
answers a change that keeps the traced step from the trace already made."""

from __future__ import annotations

import html
import json
import re
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from workbench.estimator import Estimate, RankEstimate, estimate, lookup
from workbench.estimator.alternatives import compare_table
from workbench.estimator.catalog import BUILTIN
from workbench.estimator.report import GRADS_LEGEND
from workbench.estimator.target import Target
from workbench.estimator.trace import cache as trace_cache
from workbench.estimator.trace.step import allow_traces
from workbench.notebook.panel.estimate_html import EstimateState, render
from workbench.notebook.panel.estimates import EstimateBox
from workbench.tasks import get_task
from workbench.utils.files import read_yaml
from workbench.utils.units import GiB, MiB

H100 = "H100-SXM-80GB"


def cfg_of(**changes: Any) -> wb.RunConfig:
    base = {
        "task": "digits",
        "num_processes": 8,
        "micro_batch_size": 32,
        "max_steps": 100,
        "device": "auto",
    }
    return wb.RunConfig(**{**base, **changes})


def rank(
    r: int,
    *,
    params: int = 100 * 1024,
    grads: int = 100 * 1024,
    held_grads: int = 100 * 1024,
    optimizer: int = 300 * 1024,
    activations: int = 2 * MiB,
    overhead: int = 768 * MiB,
) -> RankEstimate:
    peak = params + grads + optimizer + activations
    return RankEstimate(
        rank=r,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        buffers=0,
        temporaries=0,
        overhead=overhead,
        tracked_peak=peak,
        held={"params": params, "grads": held_grads, "optimizer": optimizer},
    )


def made_up(
    cfg: wb.RunConfig,
    ranks: list[RankEstimate] | None = None,
    step_s: float = 0.0031,
    target: str = H100,
) -> Estimate:
    """An Estimate with figures chosen by the test, for what the view does with them."""
    world = cfg.num_processes
    return Estimate(
        config=cfg.to_dict(),
        target=lookup(target),
        gpus=world,
        nodes=1,
        ranks=ranks or [rank(r) for r in range(world)],
        flops_per_step=1e9,
        compute_s=step_s,
        comm_s=0.0,
        exposed_comm_s=0.0,
        step_s=step_s,
        global_batch=32 * world,
        tokens_per_sample=None,
        efficiency=0.4,
        assumptions=["an assumption"],
    )


@pytest.fixture(scope="module")
def digits_on_h100() -> Estimate:
    return estimate(cfg_of(), H100, 8, task=get_task("digits"))


# ---- the estimate itself -------------------------------------------------------------------------
def test_the_repr_is_one_line_with_the_verdict_peak_time_and_cost(digits_on_h100: Estimate) -> None:
    text = repr(digits_on_h100)
    assert "\n" not in text and len(text) < 200, text
    assert (
        text.startswith("<Estimate digits ddp on 8 x H100-SXM-80GB: fits, peak ")
        and "usable" in text
    )
    assert "step " in text and "100 steps " in text and text.endswith("< $0.01>"), text
    big = made_up(
        cfg_of(max_steps=10**6), [rank(r, activations=90 * GiB) for r in range(8)], step_s=2.0
    )
    assert re.search(
        r": short by [\d.]+ GiB, peak [\d.]+ GiB of 73.60 GiB usable; .*; \$[\d,]+\.\d\d>$",
        repr(big),
    )


def test_identical_ranks_are_one_row_even_when_apart_or_different_below_what_is_shown() -> None:
    ranks = [rank(r) for r in range(9)]
    ranks[7] = rank(7, optimizer=40 * MiB)
    ranks[8] = rank(8, optimizer=300 * 1024 + 3)  # 3 bytes more: the same as shown
    est = made_up(cfg_of(num_processes=9), ranks)
    assert [label for label, _ in est.rank_groups()] == ["0-6, 8", "7"]
    assert re.search(r"^\s+0-6, 8 ", est.table(), re.MULTILINE) and re.search(
        r"^\s+7 ", est.table(), re.MULTILINE
    )
    html_ = est._repr_html_()
    assert html_.count("class='wb-rank-group'") == 2 and "data-ranks='0-6, 8'" in html_
    exact = est.to_dict()["ranks"]
    assert exact[8]["optimizer"] - exact[0]["optimizer"] == 3, "the exact figures stay in to_dict()"


def test_gradients_read_as_held_and_at_the_peak_with_what_each_means() -> None:
    zero3 = made_up(
        cfg_of(parallelism="zero3"), [rank(r, grads=0, held_grads=5 * MiB) for r in range(8)]
    )
    table = zero3.table()
    header = next(line for line in table.splitlines() if "grads held" in line)
    row = next(line for line in table.splitlines() if line.strip().startswith("0-7"))
    columns = re.split(r"\s{2,}", header.strip())
    cells = re.split(r"\s{2,}", row.strip())
    assert (
        cells[columns.index("grads held")] == "5 MiB"
        and cells[columns.index("grads at peak")] == "0 B"
    )
    assert " ".join(GRADS_LEGEND.split()) in " ".join(table.split()), "the legend, wrapped"
    html_ = zero3._repr_html_()
    assert "grads held</th>" in html_ and "grads at peak</th>" in html_ and "grads held: " in html_
    box = render(EstimateState(result=zero3, status="done"))
    assert "grads 5 MiB held, 0 B at peak" in box and "grads held: " in box


def test_costs_under_a_cent_read_so_everywhere_a_cost_shows() -> None:
    tiny = made_up(cfg_of(max_steps=10))
    assert tiny.cost is not None and 0 < tiny.cost < 0.01
    under = html.escape("< $0.01")
    assert "< $0.01" in repr(tiny) and "< $0.01" in tiny.table() and under in tiny._repr_html_()
    assert "< $0.01" in compare_table([tiny])
    short = made_up(cfg_of(), [rank(r, activations=90 * GiB) for r in range(8)])
    box = render(
        EstimateState(result=short, alternatives=[("precision bf16", tiny)], status="done")
    )
    assert (
        "would fit with" in box and "precision bf16" in box and under in box and "$0.00" not in box
    )


def test_the_bars_of_a_tiny_model_show_and_the_usable_memory_stays_marked(
    digits_on_h100: Estimate,
) -> None:
    def bar_widths(html_: str) -> list[float]:
        return [
            float(w)
            for w in re.findall(r"class='wb-bar-\w+'[^>]*width:([\d.]+)%;min-width:2px", html_)
        ]

    small = render(EstimateState(result=digits_on_h100, status="done"))
    widths = bar_widths(small)
    assert widths and sum(widths) > 90, "the largest rank's tensors span the bar"
    assert min(widths) > 0 and "wb-bar-runtime" not in small, (
        "the runtime is a number beside it, not 99% of it"
    )
    assert (
        "wb-usable'" not in small
        and "not the device: the peak with the runtime is 1.1% of the usable 73.60 GiB" in small
    )
    # a run near the capacity: the bars are to scale and the usable memory is a dashed line on them
    short = made_up(cfg_of(), [rank(r, activations=90 * GiB) for r in range(8)])
    big = render(EstimateState(result=short, status="done"))
    left = float(
        re.search(r"class='wb-usable' style='position:absolute;left:([\d.]+)%", big).group(1)
    )
    assert left == pytest.approx(100 * short.usable / (short.peak * 1.02), abs=0.01) and left < 100
    assert sum(bar_widths(big)) < 100


# ---- the panel's box -----------------------------------------------------------------------------
@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The box's estimate replaced by made_up(), held back while gate['open'] is cleared."""
    gate = {"open": threading.Event()}
    gate["open"].set()

    def fake(cfg: wb.RunConfig, task: Any, target: Target) -> Estimate:
        assert gate["open"].wait(60), "the test never opened the gate"
        return made_up(cfg.replace(num_processes=target.world(cfg)))

    monkeypatch.setattr(EstimateBox, "_estimate_on", staticmethod(fake))
    return gate


def test_the_box_says_which_settings_and_is_stale_until_the_new_estimate_arrives(
    gated: dict[str, Any],
) -> None:
    box, target = EstimateBox(), Target(gpu=H100, gpus_per_node=8)
    box.request(cfg_of(), None, target, delay=0)
    box.wait(60)
    shown = box.html.value
    assert box.state.status == "done" and not box.state.stale
    assert (
        "for digits, ddp, fp32, micro-batch 32 x 1 accumulation, 8 ranks" in shown
        and "stale" not in shown
    )
    gated["open"].clear()
    box.request(cfg_of(precision="bf16"), None, target, delay=0)
    try:
        shown = box.html.value
        assert (
            box.state.stale
            and "wb-estimate-stale" in shown
            and "estimating the new settings" in shown
        )
        assert "digits, ddp, bf16" in shown, "the settings being estimated"
        assert "for digits, ddp, fp32" in shown, (
            "the figures still shown say which settings they are for"
        )
    finally:
        gated["open"].set()
    box.wait(60)
    shown = box.html.value
    assert (
        not box.state.stale
        and "wb-estimate-stale" not in shown
        and "for digits, ddp, bf16" in shown
    )


def test_during_a_run_the_box_shows_measured_beside_estimated(gated: dict[str, Any]) -> None:
    box = EstimateBox()
    box.request(cfg_of(), None, Target(gpu=H100, gpus_per_node=8), delay=0)
    box.wait(60)
    est = box.state.result
    box.show_measured(0.0123, 2 * GiB, 3552.0)
    shown = box.html.value
    assert f"measured 12.3 ms/step (estimated {1e3 * est.step_s:.1f} ms)" in shown
    assert (
        "peak 2.00 GiB per rank" in shown
        and f"{3552:,} samples/s (estimated {est.samples_per_s:,.0f})" in shown
    )
    box.show_measured(0.02, None, None)
    assert (
        "measured 20.0 ms/step" in box.html.value and "samples/s (estimated" not in box.html.value
    )
    box.show_measured(None, None, None)
    assert "measured" not in box.html.value


def test_a_request_waiting_out_its_debounce_ends_at_once_on_cancel(
    gated: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never_cached(*args: Any, **kwargs: Any) -> Any:
        raise trace_cache.NotCached("the test's step is never in memory")

    box = EstimateBox()
    monkeypatch.setattr(EstimateBox, "_estimate_on", staticmethod(never_cached))
    box.request(cfg_of(), None, Target(gpu=H100, gpus_per_node=8), delay=600)
    thread = box._thread
    assert thread is not None
    try:
        box.cancel(timeout=30)
    finally:
        allow_traces()  # cancel() refuses traces until the next request (a launch follows it in the panel)
    assert not thread.is_alive() and box.state.status == "idle" and box.state.result is None


# ---- answers from the trace already made ---------------------------------------------------------
def test_a_change_that_keeps_the_traced_step_is_answered_without_a_new_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = trace_cache.trace_step

    def counted(cfg: wb.RunConfig, *args: Any, **kwargs: Any) -> Any:
        calls.append(cfg.precision)
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(trace_cache, "trace_step", counted)
    trace_cache.clear()
    task = get_task("digits")
    first = estimate(cfg_of(), H100, 8, task=task)
    catalog = read_yaml(BUILTIN)
    for entry in catalog["accelerators"]:
        entry["price_per_hour"] = 1.0
    prices = tmp_path / "prices.yaml"
    prices.write_text(json.dumps(catalog))
    other_target = estimate(cfg_of(), "A100-SXM-80GB", 8, task=task)
    more_steps = estimate(cfg_of(max_steps=5000), H100, 8, task=task)
    cheaper = estimate(cfg_of(), H100, 8, task=task, catalog=prices)
    more_gpus = estimate(cfg_of(num_processes=16), H100, 8, 2, task=task)
    assert calls == ["fp32"], "one trace for all five"
    assert other_target.target.name == "A100-SXM-80GB" and more_steps.run_s == pytest.approx(
        50 * first.run_s
    )
    assert cheaper.cost == pytest.approx(first.cost / 3) and len(more_gpus.ranks) == 16
    # the box answers it from memory at once: a 600 s debounce would not end within wait()'s 60 s
    box = EstimateBox()
    box.request(cfg_of(max_steps=7), task, Target(gpu="A100-SXM-80GB", gpus_per_node=8), delay=600)
    box.wait(60)
    assert (
        box.state.result.config["max_steps"] == 7
        and box.state.result.target.name == "A100-SXM-80GB"
    )
    assert calls == ["fp32"]
    estimate(cfg_of(precision="bf16"), H100, 8, task=task)
    assert calls == ["fp32", "bf16"], "a change of the traced step is traced"


@pytest.mark.slow
def test_the_speed_benchmark_times_a_fresh_first_estimate_and_answers_from_memory(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from workbench.commands.bench.estimate_speed import SpeedReport, SpeedRow

    out = tmp_path / "speed.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "bench",
            "estimate-speed",
            "--models",
            "digits",
            "--repeats",
            "1",
            "--conditions",
            "quiet",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # 1: over budget on a busy machine, said in the table
    assert run.returncode in (0, 1), run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["via"] for r in rows] == ["estimate()", "panel box"] and "digits" in run.stdout
    assert {r["condition"] for r in rows} == {"quiet"} and "quiet" in result["loads"]
    for r in rows:
        assert r["first_s"][0] > 0 and r["first_cpu_s"][0] > 0
        assert len(r["cached_s"]) == 4 and r["cached_traces"] == 0, (
            "every change answered from the trace"
        )
        # digits has no tensor-parallel plan: zero3 stands for tp=2, then 2 nodes, then fp16
        assert sorted(r["retrace_s"]) == ["2 nodes", "fp16", "tp=2"]
        assert all(v[0] > 0 for v in r["retrace_s"].values()) and r["budget_s"] == 3.0
    # the verdict: first estimate within its budget, each change within 0.3 s, and no new trace
    fast = SpeedRow("digits", "8 x H100", "estimate()", [2.5], [2.0], [1.0], {"steps": [0.05]})
    assert SpeedReport([fast]).passed
    # a retrace has the first estimate's budget; loaded rows 3x it, and 1 s for a cached change
    slow_retrace = {"tp=2": [3.5]}
    assert not SpeedReport([replace(fast, retrace_s=slow_retrace)]).passed
    assert SpeedReport([replace(fast, retrace_s=slow_retrace, condition="loaded")]).passed
    assert not SpeedReport([replace(fast, retrace_s={"tp=2": [9.5]}, condition="loaded")]).passed
    assert SpeedReport([replace(fast, cached_s={"s": [0.8]}, condition="loaded")]).passed
    assert not SpeedReport(
        [SpeedRow("digits", "8 x H100", "estimate()", [3.5], [3.0], [1.0], {"s": [0.05]})]
    ).passed
    assert not SpeedReport(
        [SpeedRow("digits", "8 x H100", "estimate()", [2.5], [2.0], [1.0], {"s": [0.5]})]
    ).passed
    assert not SpeedReport(
        [
            SpeedRow(
                "digits",
                "8 x H100",
                "estimate()",
                [2.5],
                [2.0],
                [1.0],
                {"s": [0.05]},
                cached_traces=1,
            )
        ]
    ).passed


def test_a_gpu_target_counts_cublas_workspaces_with_the_tensors_and_a_cpu_target_does_not() -> None:
    from workbench.estimator.report import CUBLAS_WORKSPACE_BYTES

    # no DDP buckets: the only extra buffer on a GPU is cuBLAS's workspace
    cfg = cfg_of(parallelism="zero3", num_processes=2)
    gpu, cpu = (
        estimate(cfg, H100, 2, task=get_task("digits")),
        estimate(cfg, task=get_task("digits")),
    )
    assert [r.extra_buffers for r in gpu.ranks] == [CUBLAS_WORKSPACE_BYTES] * 2
    assert all(r.tensors == r.tracked_peak + CUBLAS_WORKSPACE_BYTES for r in gpu.ranks)
    assert [r.extra_buffers for r in cpu.ranks] == [0, 0] and any(
        "cuBLAS" in a for a in gpu.assumptions
    )
