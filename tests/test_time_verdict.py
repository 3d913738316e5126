"""The estimate's time verdict beside its memory verdict: a plan whose step is 10x slower than the
same plan in another precision its target supports, or whose run to max_steps takes over a day, is
warned about (amber), naming the cause and the faster choice; and refusals advise the precision
that is fast on the target."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from machine_stand_in import made_up_profile

import workbench as wb
from workbench.config import precision
from workbench.config.preflight import preflight
from workbench.estimator.report import SLOW_RUN_S, SLOWER_FACTOR, TIME_WARNING_COLOR
from workbench.estimator.timing import step as timing
from workbench.notebook.panel.estimate_html import EstimateState, render
from workbench.utils.hardware import Hardware

EMULATED_BF16 = {"fp32": [[1e6, 1e10], [1e8, 4e10]], "bf16": [[1e6, 5e7], [1e8, 2e8]]}
"""Matmul rates of a CPU without a bf16 unit (the issue's: bf16 0.2 against fp32's 44.5 GFLOP/s)."""


@pytest.fixture
def cpu_without_bf16_unit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This machine as a CPU without avx512_bf16: its flags say so, its profile measured bf16
    matmuls 200x slower than fp32's."""
    monkeypatch.setattr(
        timing,
        "machine_profile",
        lambda ranks, threads, refresh=False: made_up_profile(
            ranks=ranks, threads=threads, matmul=EMULATED_BF16
        ),
    )
    monkeypatch.setattr(precision, "cpu_bf16_unit", lambda: False)
    yield


def gpt2_small(runs_dir: Path, **fields: Any) -> wb.RunConfig:
    """The issue's plan: char-gpt gpt2-small, zero3, tp=2, bf16, 100 steps."""
    base: dict[str, Any] = dict(
        task="char-gpt",
        task_options={"preset": "gpt2-small"},
        parallelism="zero3",
        tp=2,
        num_processes=2,
        precision="bf16",
        max_steps=100,
        runs_dir=str(runs_dir),
    )
    return wb.RunConfig(**{**base, **fields})


@pytest.mark.slow  # two traces of gpt2-small-sized plans: 8-22 s on 2 cores
def test_a_cpu_bf16_plan_without_a_bf16_unit_warns_amber_and_names_fp32(
    cpu_without_bf16_unit: None, runs_dir: Path
) -> None:
    slow = wb.estimate(gpt2_small(runs_dir))
    fast = wb.estimate(gpt2_small(runs_dir, precision="fp32"))
    assert slow.step_s >= SLOWER_FACTOR * fast.step_s, "the stand-in profile's bf16 is emulated"

    warning = slow.time_verdict()
    assert slow.slow and warning is not None
    factor = re.search(r"bf16 on this CPU runs ([\d,]+)x slower than fp32", warning)
    assert factor, warning
    # the what-if fp32 step (same trace, fp32 rates) agrees with fp32's own estimate
    assert int(factor[1].replace(",", "")) == pytest.approx(slow.step_s / fast.step_s, rel=0.25)
    assert "no bf16 matrix unit" in warning and "measured here" in warning
    assert "use fp32" in warning

    # the memory verdict of a slow plan isn't a plain 'fits' (5 GiB per rank: short on a small box)
    assert slow.verdict().startswith("fits in memory: " if slow.fits else "short by ")
    assert slow.to_dict()["time_verdict"] == warning and slow.to_dict()["slow"] is True
    assert f"slow: {warning}" in slow.table()
    assert re.search(
        r"; slow: bf16 [\d,]+x slower than fp32(, over a day)?; no price>$", repr(slow)
    )
    for page in (slow._repr_html_(), render(EstimateState(result=slow, status="done"))):
        amber = re.search(r"<div class='wb-time-warning' style='color:([^']+)'>(.*?)</div>", page)
        assert amber, "the time warning sits in its own amber element"
        assert amber[1] == TIME_WARNING_COLOR and "use fp32" in amber[2]


def test_the_same_plan_in_fp32_has_no_time_warning(
    cpu_without_bf16_unit: None, runs_dir: Path
) -> None:
    est = wb.estimate(gpt2_small(runs_dir, precision="fp32"))
    assert est.run_s < SLOW_RUN_S, "100 steps of fp32 here take under a day"
    assert est.time_verdict() is None and not est.slow
    assert not est.verdict().startswith("fits in memory")
    assert "wb-time-warning" not in render(EstimateState(result=est, status="done"))
    assert est.to_dict()["time_verdict"] is None


def test_a_run_over_a_day_gets_the_duration_warning(
    cpu_without_bf16_unit: None, runs_dir: Path
) -> None:
    one = wb.estimate(gpt2_small(runs_dir, precision="fp32", max_steps=1))
    two_days = math.ceil(2 * SLOW_RUN_S / one.step_s)
    long = wb.estimate(gpt2_small(runs_dir, precision="fp32", max_steps=two_days))
    warning = long.time_verdict()
    assert warning is not None and long.slow
    assert f"{two_days} steps take " in warning and "over " in warning
    assert "fewer max_steps" in warning and "slower than" not in warning
    assert "; slow: over a day; " in repr(long)
    under_a_day = wb.estimate(gpt2_small(runs_dir, precision="fp32", max_steps=two_days // 3))
    assert under_a_day.time_verdict() is None


@pytest.mark.slow  # two traces of gpt2-small-sized plans: 8-22 s on 2 cores
def test_an_fp32_plan_on_an_h100_without_tf32_names_bf16(runs_dir: Path) -> None:
    cfg = wb.RunConfig(
        task="char-gpt",
        task_options={"preset": "small"},
        precision="fp32",
        tf32=False,
        micro_batch_size=512,
        max_steps=100,
        runs_dir=str(runs_dir),
    )
    fp32 = wb.estimate(cfg, gpu="H100-SXM-80GB", gpus=1)
    bf16 = wb.estimate(cfg.replace(precision="bf16"), gpu="H100-SXM-80GB", gpus=1)
    # the catalog's figures (67 TFLOP/s fp32 against 989 bf16) make this step 10x faster in bf16
    assert fp32.step_s >= SLOWER_FACTOR * bf16.step_s
    warning = fp32.time_verdict()
    assert warning is not None, repr(fp32)
    assert re.search(r"fp32 on H100-SXM-80GB runs \d+x slower than bf16 \(datasheet peaks", warning)
    assert "use bf16" in warning
    assert bf16.time_verdict() is None
    with_tf32 = wb.estimate(cfg.replace(tf32=True), gpu="H100-SXM-80GB", gpus=1)
    assert with_tf32.time_verdict() is None, "TF32's tensor cores are within 10x of bf16's"


@pytest.mark.parametrize(
    "unit,advice",
    [
        (False, r"use fp32 \(bf16 on this CPU has no matrix unit: ~200x slower"),
        (True, r"use bf16 \(this CPU has a bf16 matrix unit\)"),
    ],
    ids=["no-bf16-unit", "bf16-unit"],
)
def test_the_fp16_refusal_on_cpu_advises_the_precision_fast_on_this_cpu(
    monkeypatch: pytest.MonkeyPatch, unit: bool, advice: str, runs_dir: Path
) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_unit", lambda: unit)
    cfg = wb.RunConfig(task="char-gpt", precision="fp16", runs_dir=str(runs_dir))
    with pytest.raises(ValueError, match=rf"precision='fp16' on CPU \(2 cores\).*{advice}"):
        preflight(cfg, hardware=Hardware(cpu_count=2))


def test_small_rates_keep_their_digits_and_tokens_show_only_for_token_tasks(
    cpu_without_bf16_unit: None, runs_dir: Path
) -> None:
    slow = wb.estimate(gpt2_small(runs_dir))
    line = slow.step_line()
    assert slow.step_s > 60
    assert re.match(r"step \d+ (d|h|min) ", line), (
        f"a step over a minute reads as a duration: {line}"
    )
    rates = re.search(r"([\d.,]+) samples/s, ([\d.,]+) tokens/s", line)
    assert rates, line
    assert float(rates[1].replace(",", "")) == pytest.approx(slow.samples_per_s, rel=0.01)
    assert float(rates[2].replace(",", "")) == pytest.approx(slow.tokens_per_s, rel=0.01)
    digits = wb.estimate(wb.RunConfig(task="digits", runs_dir=str(runs_dir)))
    assert digits.tokens_per_sample is None and "tokens/s" not in digits.step_line()
