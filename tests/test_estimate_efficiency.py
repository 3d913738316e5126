"""The time model's efficiency per accelerator: the catalog's values by precision and model size,
each citing the published runs it comes from, read and used by the GPU step time; and the bench's
comparison of the estimate with each cited run."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

import workbench as wb
from workbench.commands.bench.estimate_cited import cited_rows, standin
from workbench.estimator import estimate
from workbench.estimator.catalog import load_catalog, load_measurements, lookup
from workbench.estimator.efficiency import DEFAULT_EFFICIENCY, Efficiency, matmul_efficiency
from workbench.estimator.timing.gpu import gpu_step
from workbench.estimator.trace.step import StepTrace

GPU = """  - name: {name}
    memory_gib: 80
    peak_tflops: {{fp32: 0.0005, bf16: 0.001}}
    memory_bandwidth_gbs: 1000000
    link: {{kind: NVLink, gbs: 450}}
    price_per_hour: 1.0
    price_source: test
"""
"""A made-up GPU of 1 GFLOP/s bf16 and boundless memory bandwidth: a small model's step is all
matmul."""
TINY_RUN = """measurements:
  - id: tiny-run
    source: "a test's own table"
    url: https://example.com/tiny
    date: 2025-01
    accelerator: Slow-GPU
    hardware: "2 made-up GPUs"
    model: tiny GPT
    params: 110000
    shape: {n_layer: 2, n_embd: 64, n_head: 2, seq_len: 64}
    flops_per_token: 700000
    gpus: 2
    nodes: 1
    parallelism: ddp
    micro_batch: 4
    grad_accum: 1
    precision: bf16
    tokens_per_s_per_gpu: 400
"""


def catalog_file(
    tmp_path: Path, efficiency: str, name: str = "Slow-GPU", file: str = "mine.yaml"
) -> Path:
    path = tmp_path / file
    path.write_text("accelerators:\n" + GPU.format(name=name) + efficiency + TINY_RUN)
    return path


def one_value(value: float | str) -> str:
    return f"    efficiency:\n      - {{precision: [bf16], value: {value}, from: [tiny-run]}}\n"


def made_up_trace(flops: float) -> StepTrace:
    return StepTrace(
        rank=0,
        world=1,
        memory={},
        activations_after_forward=0,
        held={"params": 0, "grads": 0, "optimizer": 0},
        flops=flops,
        ops={"aten.mm": 10},
        op_bytes={"aten.mm": 0},
    )


# ---- read and used -------------------------------------------------------------------------------
def test_the_gpu_step_prices_matmuls_at_the_catalog_efficiency_of_the_accelerator() -> None:
    h100 = lookup("H100-SXM-80GB")
    cfg = wb.RunConfig(precision="bf16")
    slow = dataclasses.replace(h100, efficiency=(Efficiency(("bf16",), 0.2, ("x",)),))
    fast = dataclasses.replace(h100, efficiency=(Efficiency(("bf16",), 0.8, ("x",)),))
    a, b = (gpu_step(cfg, made_up_trace(1e16), {}, g, 1, "infiniband") for g in (slow, fast))
    assert a.parts["matmul"] == pytest.approx(1e16 / (h100.peak("bf16") * 0.2))
    assert a.parts["matmul"] == pytest.approx(4 * b.parts["matmul"])
    assert (a.efficiency, b.efficiency) == (0.2, 0.8)
    assert any("FLOPs at 20% (any size" in line for line in a.assumptions)


def test_an_estimate_changes_with_the_accelerator_efficiency_in_the_catalog(tmp_path: Path) -> None:
    """Two catalog files alike but for the efficiency: the estimate's matmul time follows it."""
    cfg = wb.RunConfig(
        task="digits", micro_batch_size=64, precision="bf16", task_options={"hidden": 256}
    )
    quarter, half = (
        estimate(
            cfg,
            "Slow-GPU",
            1,
            runs_dir=tmp_path / "no-runs",
            catalog=catalog_file(tmp_path, one_value(v), file=f"{v}.yaml"),
        )
        for v in (0.25, 0.5)
    )
    flops, peak = half.flops_per_step, 1e9
    assert flops > 0 and (quarter.efficiency, half.efficiency) == (0.25, 0.5)
    matmul_difference = flops / (peak * 0.25) - flops / (peak * 0.5)
    assert quarter.compute_s - half.compute_s == pytest.approx(matmul_difference)
    assert any(
        "FLOPs at 25%" in a and "tiny GPT on 2 GPUs (a test's own table, 2025-01)" in a
        for a in quarter.assumptions
    )


def test_the_band_the_precision_and_the_class_a_value_comes_from_are_chosen_and_said() -> None:
    entries = (
        Efficiency(("bf16",), 0.3, ("a",), params_below=1e9, basis="measured"),
        Efficiency(("bf16",), 0.5, ("b",), basis="mean"),
        Efficiency(("fp8",), 0.2, ("c",), derived_from="Other-GPU"),
    )
    gpu = dataclasses.replace(lookup("H100-SXM-80GB"), name="My-GPU", efficiency=entries)
    small, large = matmul_efficiency(gpu, "bf16", 10**8), matmul_efficiency(gpu, "bf16", 7 * 10**9)
    assert small[0] == 0.3
    assert "models with under 1B parameters, this one 0.1B: measured MFU" in small[1]
    assert large[0] == 0.5
    assert "models with 1B or more parameters, this one 7B: mean MFU of b" in large[1]
    tf32 = matmul_efficiency(gpu, "tf32", 7 * 10**9)
    assert tf32[0] == 0.5 and "no tf32 figure, bf16's" in tf32[1]
    fp8 = matmul_efficiency(gpu, "fp8", 10**8)
    assert fp8[0] == 0.2 and "Other-GPU's, no published figure for My-GPU" in fp8[1]
    none = matmul_efficiency(dataclasses.replace(gpu, efficiency=()), "bf16", 10**8)
    assert none[0] == DEFAULT_EFFICIENCY and "the catalog has no efficiency for My-GPU" in none[1]


# ---- refused when loading ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    ["0", "1.5", "-0.2", "high", "true"],
    ids=["zero", "above-one", "negative", "text", "bool"],
)
def test_an_efficiency_outside_0_to_1_is_refused_naming_the_entry(
    tmp_path: Path, value: str
) -> None:
    path = catalog_file(tmp_path, one_value(value), name="My-GPU")
    with pytest.raises(
        ValueError,
        match=r"accelerator 'My-GPU': efficiency\[0\]: value=.*: "
        r"must be in \(0, 1\]",
    ):
        load_catalog(path)


def test_one_is_a_value_and_entries_without_a_citation_or_with_an_unknown_one_are_refused(
    tmp_path: Path,
) -> None:
    whole = load_catalog(catalog_file(tmp_path, one_value(1.0)))["Slow-GPU"]
    assert whole.efficiency[0].value == 1
    bare = "    efficiency:\n      - {precision: [bf16], value: 0.4}\n"
    with pytest.raises(
        ValueError,
        match=r"'Slow-GPU': efficiency\[0\]: from=None: every "
        "efficiency cites",
    ):
        load_catalog(catalog_file(tmp_path, bare))
    unknown = "    efficiency:\n      - {precision: [bf16], value: 0.4, from: [nowhere]}\n"
    with pytest.raises(
        ValueError,
        match=r"'Slow-GPU': efficiency cites 'nowhere', not among the "
        "measurements",
    ):
        load_catalog(catalog_file(tmp_path, unknown))
    no_peak = "    efficiency:\n      - {precision: [fp8], value: 0.4, from: [tiny-run]}\n"
    with pytest.raises(
        ValueError,
        match=r"efficiency\[0\]: precision=\['fp8'\]: name precisions "
        "its peak_tflops",
    ):
        load_catalog(catalog_file(tmp_path, no_peak))
    with pytest.raises(
        ValueError,
        match=r"'Slow-GPU': efficiency_from='Nothing': not in the "
        "catalog",
    ):
        load_catalog(catalog_file(tmp_path, "    efficiency_from: Nothing\n"))


# ---- cited ---------------------------------------------------------------------------------------
def test_every_builtin_efficiency_is_the_mfu_of_the_published_runs_it_cites() -> None:
    catalog, measured = load_catalog(), load_measurements()
    for name, accel in catalog.items():
        assert accel.efficiency, f"{name}: no efficiency"
        for e in accel.efficiency:
            assert e.cited, name
            assert all(m.url.startswith("https://") and m.source and m.date for m in e.cited), name
            if e.derived_from:  # a class without a published figure: the named class's own value
                source = catalog[e.derived_from].efficiency
                assert any((o.value, o.cites) == (e.value, e.cites) for o in source), name
                continue
            precision = e.precisions[0]
            mfu = statistics.mean(m.mfu_at(catalog[m.accelerator].peak(precision)) for m in e.cited)
            assert e.value == pytest.approx(mfu, abs=6e-4), f"{name} {e}"
            assert all(m.accelerator == name and m.precision == precision for m in e.cited), name
    cited = {c for a in catalog.values() for e in a.efficiency for c in e.cites}
    assert cited <= set(measured)


def test_each_published_mfu_agrees_with_its_tokens_per_second_and_flops_per_token() -> None:
    """The transcribed figures are consistent: tokens/s x FLOPs per token over the peak is the MFU
    the source printed, where it printed one."""
    catalog, measured = load_catalog(), load_measurements()
    with_mfu = [m for m in measured.values() if m.mfu is not None]
    assert len(with_mfu) >= 10
    for m in with_mfu:
        peak = catalog[m.accelerator].peak(m.precision)
        assert m.mfu_at(peak) == pytest.approx(m.mfu, rel=2e-3), m.id


# ---- the bench -----------------------------------------------------------------------------------
def test_the_bench_compares_each_cited_run_with_the_estimate_of_its_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.commands.bench.estimate_accuracy import estimate_accuracy

    path = catalog_file(tmp_path, one_value(0.5))
    (row,) = cited_rows(catalog=path, ids=["tiny-run"])
    m = load_measurements(path)["tiny-run"]
    est = estimate(standin(m), "Slow-GPU", 2, catalog=path, runs_dir=tmp_path / "no-runs")
    mfu = est.flops_per_step / est.step_s / 1e9
    assert row.estimated_mfu == pytest.approx(mfu)
    assert row.cited_mfu == pytest.approx(400 * 700000 / 1e9)
    assert row.error == pytest.approx(mfu / row.cited_mfu - 1)
    assert row.estimated_tokens_per_s == pytest.approx(mfu * 1e9 / 700000)
    assert row.sets == "Slow-GPU"

    # the step is all matmul on this GPU: half the efficiency, about half the MFU
    quarter = catalog_file(tmp_path, one_value(0.25), file="quarter.yaml")
    (slower,) = cited_rows(catalog=quarter, ids=["tiny-run"])
    assert slower.estimated_mfu == pytest.approx(row.estimated_mfu / 2, rel=0.05)
    assert slower.error < row.error

    monkeypatch.setenv("WORKBENCH_ACCELERATORS", str(path))
    report = estimate_accuracy(
        measured=False, cited_ids=["tiny-run"], json_path=tmp_path / "result.json"
    )
    assert not report.rows and f"{row.error:+7.1%}" in report.table()
    assert "tiny-run" in report.table()
    saved = json.loads((tmp_path / "result.json").read_text())["rows"]  # nothing measured
    assert saved[0]["id"] == "tiny-run" and saved[0]["error"] == pytest.approx(row.error)
    with pytest.raises(ValueError, match=r"ids=\['nope'\]: not among the catalog's measurements"):
        cited_rows(catalog=path, ids=["nope"])
