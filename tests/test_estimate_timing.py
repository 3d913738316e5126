"""Step time an estimate gives: this machine measured (and the measurement kept), a traced step priced op by op
against it, a GPU target priced from its datasheet, and completed runs correcting what the model says."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from machine_stand_in import made_up_profile, sized

import workbench as wb
from workbench.estimator.catalog import lookup
from workbench.estimator.efficiency import matmul_efficiency
from workbench.estimator.machine import cache as machine_cache
from workbench.estimator.machine.probe import COLLECTIVES, KINDS
from workbench.estimator.machine.profile import MachineProfile
from workbench.estimator.timing.cpu import cpu_step, dtensor_op_cost, layout_factor, slowdown
from workbench.estimator.timing.gpu import GPU_LAUNCH_S, GPU_STEP_S, gpu_step
from workbench.estimator.timing.op_kinds import op_kind
from workbench.estimator.trace.step import StepTrace


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Profiles and remembered estimates in a folder of the test's own, none in memory."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "cache"))
    machine_cache.forget()
    yield tmp_path / "cache"
    machine_cache.forget()


@pytest.fixture
def learning_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Remembered estimates in a folder of the test's own, with this session's machine profiles copied in: what
    learning does is these tests' subject, not measuring the machine again (9 s on 2 cores)."""
    import shutil

    session = Path(os.environ["WORKBENCH_CACHE_DIR"])  # the session's (conftest.py)
    folder = tmp_path / "cache"
    folder.mkdir()
    for profile in session.glob("machine-*.json"):
        shutil.copy2(profile, folder / profile.name)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(folder))
    return folder


def made_up_trace(
    flops: float = 0.0,
    ops: dict[str, tuple[int, int]] | None = None,
    comm: dict[str, dict[str, Any]] | None = None,
) -> StepTrace:
    """A step of `ops` ({name: (count, bytes written)}), `flops` and collectives `comm`."""
    ops = ops or {}
    return StepTrace(
        rank=0,
        world=2,
        memory={},
        activations_after_forward=0,
        held={"params": 0, "grads": 0, "optimizer": 0},
        flops=flops,
        comm=comm or {},
        ops={k: n for k, (n, _) in ops.items()},
        op_bytes={k: b for k, (_, b) in ops.items()},
    )


def collective(count: int, wire_bytes: float) -> dict[str, Any]:
    return {
        "count": count,
        "bytes": wire_bytes,
        "wire_bytes": wire_bytes,
        "group": 2,
        "spans_nodes": False,
    }


CFG = wb.RunConfig(task="digits", num_processes=2, micro_batch_size=8, grad_accum_steps=1)


# ---- the machine, measured -----------------------------------------------------------------------
def test_the_profile_is_measured_once_then_read_from_its_file_and_a_damaged_file_is_measured_again(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[MachineProfile] = []
    real = machine_cache.measure

    def counting(*args: Any, **kwargs: Any) -> MachineProfile:
        measured.append(real(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(machine_cache, "measure", counting)
    first = machine_cache.machine_profile(2, 1)
    assert len(measured) == 1 and machine_cache.cache_path().is_file()
    # measured here: matmuls reach some FLOP/s, gloo has a latency and a bandwidth for every collective kind
    assert all(rate > 0 for _, rate in first.matmul["fp32"]) and set(first.collectives) == set(
        COLLECTIVES
    )
    assert first.step_op_s >= first.op_s > 0 and all(
        t > 0 for points in first.collectives.values() for _, t in points
    )
    # a real reference step, its ops counted as a trace counts them, and the same step in each layout family
    assert (
        first.reference["step_s"] > 0
        and first.reference["flops"] > 0
        and first.reference["ops"]["aten.addmm"] > 0
    )
    assert set(first.layouts) == {"ddp", "zero1", "fsdp", "tp"}
    assert first.layouts["tp"]["ops"].get("dtensor.aten.mm", 0) > 0, (
        "tensor parallel's ops on DTensors counted"
    )
    assert (
        "all_gather@2" in first.layouts["fsdp"]["comm"]
        and "broadcast@2" in first.layouts["zero1"]["comm"]
    )
    assert first.layouts["ddp"]["comm"]["all_reduce@2"]["count"] >= 1, (
        "DDP's buckets are seen on a real group"
    )

    assert machine_cache.machine_profile(2, 1) is first, "the second call is answered from memory"
    machine_cache.forget()
    assert machine_cache.machine_profile(2, 1) == first and len(measured) == 1, "then from the file"

    # A damaged file is never trusted: not JSON, or JSON whose figures are not positive numbers.
    monkeypatch.setattr(machine_cache, "measure", lambda *a, **k: measured.append(first) or first)
    path = machine_cache.cache_path()
    stored = json.loads(path.read_text())
    for damage in (
        "{not json",
        json.dumps(
            {**stored, "profiles": {"2x1": {**stored["profiles"]["2x1"], "step_op_s": -1.0}}}
        ),
    ):
        path.write_text(damage)
        machine_cache.forget()
        before = len(measured)
        assert machine_cache.machine_profile(2, 1) == first and len(measured) == before + 1
        assert json.loads(path.read_text())["profiles"]["2x1"]["step_op_s"] == first.step_op_s, (
            "rewritten"
        )


def test_a_profile_measured_on_a_busy_machine_gives_way_to_a_quieter_one(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = made_up_profile(busy_cores=1.5, measured_at=1.0)  # long ago
    quiet = made_up_profile(busy_cores=0.0, step_op_s=2e-5, measured_at=2.0)
    answers = [busy, quiet, busy]
    monkeypatch.setattr(machine_cache, "measure", lambda *a, **k: answers.pop(0))
    assert machine_cache.machine_profile(2, 1) == busy
    machine_cache.forget()
    assert machine_cache.machine_profile(2, 1) == quiet, "an old busy profile is measured again"
    machine_cache.forget()
    assert machine_cache.machine_profile(2, 1) == quiet and answers == [busy], "a quiet one is kept"


# ---- the model -----------------------------------------------------------------------------------
def test_ops_are_priced_by_kind_and_views_write_nothing() -> None:
    assert [
        op_kind(n)
        for n in (
            "prim.device",
            "aten.t",
            "aten.mm",
            "aten.add_",
            "aten.mul",
            "aten.gelu",
            "aten.bernoulli_",
            "dtensor.aten.add_",
        )
    ] == ["free", "view", "flop", "inplace", "copy", "math", "random", "dtensor"]
    p = made_up_profile()
    empty = cpu_step(CFG, made_up_trace(), {}, p).compute_s
    # a view's bytes (the trace may count them) cost nothing beyond its dispatch; prim.device costs nothing at all
    views = cpu_step(
        CFG, made_up_trace(ops={"aten.t": (10, 10**9), "prim.device": (50, 0)}), {}, p
    ).compute_s
    assert views - empty == pytest.approx(10 * p.op_s)


def test_step_time_scales_with_op_counts_bytes_and_flops() -> None:
    p = made_up_profile()
    ops = {
        "aten.add_": (20, 10**6),
        "aten.mul": (10, 2 * 10**6),
        "aten.gelu": (4, 10**6),
        "aten.mm": (8, 0),
    }
    one = cpu_step(CFG, made_up_trace(8e7, ops), {}, p)
    two = cpu_step(
        CFG, made_up_trace(16e7, {k: (2 * n, 2 * b) for k, (n, b) in ops.items()}), {}, p
    )
    data = p.batch_s(CFG.micro_batch_size)
    assert two.compute_s - data == pytest.approx(2 * (one.compute_s - data))
    assert one.parts["dispatch"] == pytest.approx(42 * p.step_op_s)
    # each kind at its own measured cost: the in-place adds at the inplace kind's seconds per byte at their size
    adds = cpu_step(CFG, made_up_trace(ops={"aten.add_": (20, 10**6)}), {}, p).parts["elementwise"]
    assert adds == pytest.approx(10**6 * p.seconds_per_byte("inplace", 10**6 / 20))
    # larger matmuls run at the faster rate measured for their size: the same FLOPs in fewer calls take less time
    few = cpu_step(CFG, made_up_trace(1e9, {"aten.mm": (10, 0)}), {}, p).parts["matmul"]
    many = cpu_step(CFG, made_up_trace(1e9, {"aten.mm": (1000, 0)}), {}, p).parts["matmul"]
    assert few == pytest.approx(1e9 / 4e10) and many == pytest.approx(1e9 / 1e10)
    bf16 = cpu_step(
        CFG.replace(precision="bf16"), made_up_trace(1e9, {"aten.mm": (10, 0)}), {}, p
    ).parts["matmul"]
    assert bf16 == pytest.approx(few / 2)


def test_a_step_runs_as_much_slower_than_its_best_as_the_same_work_does_here() -> None:
    ops = {"aten.add_": (20, 10**6), "aten.mm": (8, 0)}
    quiet = cpu_step(CFG, made_up_trace(8e7, ops), {}, made_up_profile(jitter=[1.0, 0.0]))
    shared = cpu_step(CFG, made_up_trace(8e7, ops), {}, made_up_profile(jitter=[1.8, 0.5]))
    assert shared.compute_s == pytest.approx(1.8 * quiet.compute_s)


def test_kernels_at_their_best_are_scaled_by_how_much_slower_the_real_reference_step_ran() -> None:
    ops = {"aten.add_": (20, 10**6), "aten.mm": (8, 0)}
    reference = {
        "ops": {"aten.add_": 10, "aten.mm": 4},
        "op_bytes": {"aten.add_": 10**6},
        "flops": 4e7,
        "flop_calls": [["aten.mm", 1e7, 4]],
    }
    best = made_up_profile(jitter=[1.0, 0.0])
    base = cpu_step(CFG, made_up_trace(8e7, ops), {}, best).compute_s
    slow = dataclasses.replace(
        best, reference={**reference, "step_s": 2.5 * _priced(best, reference)}
    )
    assert slowdown(slow)[0] == pytest.approx(2.5) and "real training step" in slowdown(slow)[1]
    assert cpu_step(CFG, made_up_trace(8e7, ops), {}, slow).compute_s == pytest.approx(2.5 * base)
    fast = dataclasses.replace(
        best, reference={**reference, "step_s": 0.5 * _priced(best, reference)}
    )
    assert slowdown(fast)[0] == 1.0, "never faster than the kernels at their best"


def _priced(profile: MachineProfile, counts: dict[str, Any]) -> float:
    from workbench.estimator.timing.cpu import _kernels

    keys = ("ops", "op_bytes", "flops", "flop_calls")
    return _kernels(
        dataclasses.replace(made_up_trace(), **{k: counts[k] for k in keys}), "fp32", profile
    ).total


def test_a_sharded_step_is_scaled_by_how_its_reference_ran_against_its_price_and_tp_is_not() -> (
    None
):
    plain = {
        "ops": {"aten.addmm": 4, "aten.add_": 10},
        "op_bytes": {"aten.add_": 10**6},
        "flops": 4e7,
        "flop_calls": [["aten.addmm", 1e7, 4]],
    }
    best = made_up_profile(jitter=[1.0, 0.0])
    plain["step_s"] = _priced(best, plain)  # the plain reference runs at its price: no slowdown
    sharded = {
        **plain,
        "ops": {**plain["ops"], "aten.split": 30},
        "comm": {"all_gather@2": collective(3, 3e4)},
    }
    sharded_price = _priced(best, sharded) + best.collective_s("all_gather", 3, 3e4)
    profile = dataclasses.replace(
        best,
        reference=plain,
        layouts={"fsdp": {**sharded, "plain_s": plain["step_s"], "step_s": 3 * sharded_price}},
    )
    assert (
        layout_factor(profile, "fsdp") == pytest.approx(3.0)
        and layout_factor(profile, "ddp") == 1.0
    )
    ops, comm = {"aten.add_": (20, 10**6), "aten.mm": (8, 0)}, {"all_gather@2": collective(6, 6e4)}
    for parallelism, factor in (("zero3", 3.0), ("ddp", 1.0)):
        cfg = CFG.replace(parallelism=parallelism)
        assert cpu_step(cfg, made_up_trace(8e7, ops, comm), {}, profile).step_s == pytest.approx(
            factor * cpu_step(cfg, made_up_trace(8e7, ops, comm), {}, best).step_s
        )
    tp = CFG.replace(parallelism="zero3", tp=2)
    assert cpu_step(tp, made_up_trace(8e7, ops, comm), {}, profile).step_s == pytest.approx(
        cpu_step(tp, made_up_trace(8e7, ops, comm), {}, best).step_s
    ), "no reference for tensor parallel"


def test_an_op_on_dtensors_costs_what_the_tensor_parallel_reference_left_over_per_such_op() -> None:
    plain = {
        "ops": {"aten.addmm": 4, "aten.add_": 10},
        "op_bytes": {"aten.add_": 10**6},
        "flops": 4e7,
        "flop_calls": [["aten.addmm", 1e7, 4]],
    }
    best = made_up_profile(jitter=[1.0, 0.0])
    plain["step_s"] = _priced(best, plain)
    tp = {
        **plain,
        "ops": {**plain["ops"], "dtensor.aten.mm": 40},
        "comm": {"all_reduce@2": collective(2, 1e4)},
    }
    left_over = 40 * 70e-6  # what the 40 ops on DTensors cost beyond their local ops
    step_s = _priced(dataclasses.replace(best, dtensor_op_s=0.0), tp) + best.collective_s(
        "all_reduce", 2, 1e4
    )
    profile = dataclasses.replace(
        best,
        reference=plain,
        layouts={"tp": {**tp, "plain_s": plain["step_s"], "step_s": step_s + left_over}},
    )
    assert dtensor_op_cost(best) == best.dtensor_op_s, (
        "without a reference: the pointwise ops measured alone"
    )
    assert dtensor_op_cost(profile) == pytest.approx(70e-6)
    sharded = made_up_trace(8e7, {"aten.mm": (8, 0), "dtensor.aten.mm": (100, 0)})
    more = (
        cpu_step(CFG.replace(tp=2), sharded, {}, profile).step_s
        - cpu_step(CFG.replace(tp=2), sharded, {}, best).step_s
    )
    assert more == pytest.approx(100 * (70e-6 - best.dtensor_op_s))


def test_the_trace_counts_the_steady_step_and_keeps_the_first_for_the_gpu_constants_fitted_to_it() -> (
    None
):
    from workbench.estimator.trace.step import trace_step
    from workbench.tasks import get_task

    trace = trace_step(CFG.replace(parallelism="zero3"), get_task("digits"), world=2)
    assert trace.first_ops.get("dtensor.aten.zeros_like", 0) > 0, (
        "the first step creates AdamW's state"
    )
    assert "dtensor.aten.zeros_like" not in trace.ops and sum(trace.ops.values()) < sum(
        trace.first_ops.values()
    )
    assert trace.ops.get("dtensor.aten.lerp_", 0) > 0, (
        "ops on DTensors counted inside FSDP's tracker"
    )
    h100 = lookup("H100-SXM-80GB")
    steady = made_up_trace(1e6, {"aten.add_": (100, 0)})
    with_first = dataclasses.replace(
        steady, first_ops={"aten.add_": 300}, first_op_bytes={"aten.add_": 0}
    )
    assert gpu_step(CFG, with_first, {}, h100, 1, "infiniband").compute_s == pytest.approx(
        gpu_step(CFG, steady, {}, h100, 1, "infiniband").compute_s + 200 * GPU_LAUNCH_S
    )


def test_collectives_cost_the_time_measured_for_their_size_and_none_hides_on_cpu() -> None:
    p = made_up_profile(
        collectives={**{k: sized(1e-4, 1e9) for k in COLLECTIVES}, "all_gather": sized(3e-4, 5e8)}
    )
    ops = {"aten.mm": (4, 0)}
    bare = cpu_step(CFG, made_up_trace(1e8, ops), {}, p)
    one = cpu_step(CFG, made_up_trace(1e8, ops, {"all_gather@2": collective(6, 6e4)}), {}, p)
    assert bare.comm_s == 0 and one.comm_s == pytest.approx(6 * (3e-4 + 1e4 / 5e8)), (
        "a measured size: its time"
    )
    assert one.exposed_comm_s == one.comm_s and one.step_s == pytest.approx(
        bare.step_s + one.comm_s
    )
    ddp = cpu_step(CFG, made_up_trace(1e8, ops), {"all_reduce@ddp": collective(1, 4e6)}, p)
    assert ddp.comm_s == pytest.approx(1e-4 + 4e6 / 1e9), (
        "beyond the largest: its bandwidth between the last two"
    )
    tiny = cpu_step(CFG, made_up_trace(1e8, ops), {"all_reduce@vote": collective(3, 30)}, p)
    assert tiny.comm_s == pytest.approx(3 * (1e-4 + 1e2 / 1e9)), (
        "below the smallest: the smallest's time"
    )
    between = p.collective_s("all_reduce", 1, 1e5)
    assert p.collective_s("all_reduce", 1, 1e4) < between < p.collective_s("all_reduce", 1, 1e6)


def test_a_gpu_target_is_priced_from_its_datasheet_not_this_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workbench.estimator.timing import step as timing

    monkeypatch.setattr(
        timing, "machine_profile", lambda *a, **k: pytest.fail("measured this machine")
    )
    h100 = lookup("H100-SXM-80GB")
    trace = made_up_trace(
        1e13,
        {"aten.mm": (100, 0), "aten.add_": (100, 10**9)},
        {"all_gather@8": {**collective(4, 1e9), "group": 8}},
    )
    t = timing.step_time(
        CFG.replace(precision="bf16"), trace, {}, h100, 1, "infiniband", Path("/nonexistent")
    )
    efficiency = matmul_efficiency(h100, "bf16", 0)[0]  # the catalog's, for the trace's size
    matmul = 1e13 / (h100.peak("bf16") * efficiency)
    assert t.compute_s == pytest.approx(matmul + 10**9 / h100.memory_bandwidth)
    assert t.comm_s == pytest.approx(4 * 20e-6 + 1e9 / h100.link_bandwidth) and t.correction == 1.0
    tiny = gpu_step(CFG, made_up_trace(1e6, {"aten.mm": (1000, 0)}), {}, h100, 1, "infiniband")
    assert tiny.compute_s == pytest.approx(GPU_STEP_S + 1000 * GPU_LAUNCH_S), (
        "never faster than launching its kernels"
    )


# ---- learning from completed runs ----------------------------------------------------------------
def test_a_completed_run_corrects_the_estimate_and_the_estimate_says_which(
    learning_cache: Path, tmp_path: Path
) -> None:
    from workbench.estimator import estimate
    from workbench.estimator.timing.learning import measured_step_s

    runs = tmp_path / "runs"
    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        micro_batch_size=32,
        max_steps=15,
        log_every=5,
        runs_dir=str(runs),
        task_options={"hidden": 64},
    )
    raw = estimate(cfg, runs_dir=tmp_path / "no-runs")
    assert raw.step_s > 0 and any("nothing learnt" in a for a in raw.assumptions)
    result = wb.launch(cfg)
    measured = measured_step_s(result.dir.path)
    learnt = estimate(cfg)  # cfg.runs_dir now holds the run: the same task and layout
    assert learnt.step_s == pytest.approx(measured, rel=1e-6), (
        "one run of the same step: its own time"
    )
    note = next(a for a in learnt.assumptions if a.startswith("learnt from"))
    assert (
        f"learnt from 1 completed run(s) (digits, ddp on 2 rank(s)): {result.dir.path.name}" in note
    )
    assert f"{measured / raw.step_s:.2f}" in note

    # another layout on this CPU learns nothing from it, and says why
    other = estimate(cfg.replace(parallelism="zero3"))
    assert any(
        "nothing learnt: no completed run of digits, zero3" in a
        and "only the same task and layout" in a
        for a in other.assumptions
    )


def test_on_a_gpu_any_run_of_the_device_class_teaches_and_on_this_cpu_only_the_same_task_and_layout(
    tmp_path: Path,
) -> None:
    from workbench.estimator.timing.learning import learn
    from workbench.rundir import RunDir, Status

    for device_class in ("cpu", "cuda-H100"):
        run = RunDir(tmp_path / device_class)
        run.path.mkdir()
        run.write_config(CFG)  # digits, ddp on 2 ranks
        run.set_status(Status.COMPLETED, device_class=device_class, world_size=2, started_at=1.0)
        run.write_timings([0.03] * 10)
    zero3 = CFG.replace(parallelism="zero3")
    gpu = learn(zero3, 2, "cuda-H100", tmp_path, "key", lambda *a: 0.01)
    assert gpu.ratio == pytest.approx(3.0) and "any task and layout on 2 rank(s)" in gpu.note
    cpu = learn(zero3, 2, "cpu", tmp_path, "key", lambda *a: 0.01)
    assert cpu.ratio == 1.0 and cpu.runs == [] and "only the same task and layout teach" in cpu.note
    assert learn(CFG, 2, "cpu", tmp_path, "key", lambda *a: 0.01).ratio == pytest.approx(3.0)


def test_a_damaged_run_among_the_runs_teaches_nothing_and_stops_nothing(tmp_path: Path) -> None:
    from workbench.estimator.timing.learning import completed_runs
    from workbench.rundir import RunDir, Status

    for name, damage in (
        ("good", None),
        ("bad-summary", "summary"),
        ("bad-timings", "timings"),
        ("short", "few"),
    ):
        run = RunDir(tmp_path / name)
        run.path.mkdir()
        run.write_config(CFG)
        run.set_status(Status.COMPLETED, device_class="cpu", world_size=2, started_at=1.0)
        run.write_timings([0.01] * (2 if damage == "few" else 10))
        if damage == "summary":
            run.summary_path.write_text("[")
        elif damage == "timings":
            run.timings_path.write_text("{")
    found = completed_runs(tmp_path, "cpu")
    assert [r.name for r in found] == ["good"] and found[0].measured_s == pytest.approx(0.01)
    assert completed_runs(tmp_path, "cuda-H100") == []


def test_the_runs_read_are_the_most_recent_by_age_not_the_last_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder with more usable runs than are read: the newest are read, whatever their names sort
    as."""
    from workbench.estimator.timing import learning
    from workbench.rundir import RunDir, Status

    monkeypatch.setattr(learning, "SCAN", 1)
    now = 1_700_000_000.0

    def completed(name: str, device_class: str, age_s: float) -> None:
        run = RunDir(tmp_path / name)
        run.path.mkdir()
        run.write_config(CFG)
        run.set_status(
            Status.COMPLETED, device_class=device_class, world_size=2, started_at=now - age_s - 60
        )
        run.write_timings([0.03] * 10)
        os.utime(run.summary_path, (now - age_s, now - age_s))

    completed("digits-new", "cpu", 0)  # the run just made: its name sorts first
    completed("digits-old", "cpu", 10_000)  # older than the SCAN usable run(s) read: not read
    for i in range(5):  # names that sort after both, written in between
        completed(f"zz-other-{i}", "cuda-H100", 100 + i)
    assert [r.name for r in learning.completed_runs(tmp_path, "cpu")] == ["digits-new"]
    lesson = learning.learn(CFG, 2, "cpu", tmp_path, "key", lambda *a: 0.01)
    assert lesson.runs == ["digits-new"] and lesson.ratio == pytest.approx(3.0), lesson.note


def test_what_was_learnt_is_remembered_on_disk_and_tied_to_the_model(
    cache_dir: Path, tmp_path: Path
) -> None:
    from workbench.estimator.timing.learning import PastRun, _remembered, memo_path

    run = PastRun("r", tmp_path, CFG, 2, 0.02, 5.0)
    calls: list[int] = []

    def estimate_of(cfg: wb.RunConfig, world: int, may_trace: bool) -> float:
        calls.append(world)
        return 0.01

    assert _remembered(run, "model-a", estimate_of) == (0.01, True) and calls == [2]
    assert _remembered(run, "model-a", estimate_of) == (0.01, False) and calls == [2], (
        "from the file"
    )
    assert _remembered(run, "model-b", estimate_of) == (0.01, True) and calls == [2, 2], (
        "another model: again"
    )
    assert memo_path().is_file()
    memo_path().write_text("[damaged")
    assert _remembered(run, "model-a", estimate_of) == (0.01, True) and calls == [2, 2, 2]


def test_a_pipeline_run_teaches_nothing_yet(tmp_path: Path) -> None:
    from workbench.estimator.timing.learning import learn
    from workbench.rundir import RunDir, Status

    run = RunDir(tmp_path / "pp")
    run.path.mkdir()
    run.write_config(CFG.replace(task="char-gpt", pp=2, grad_accum_steps=4))
    run.set_status(Status.COMPLETED, device_class="cpu", world_size=2, started_at=1.0)
    run.write_timings([0.05] * 10)
    lesson = learn(
        CFG, 2, "cpu", tmp_path, "key", lambda *a: pytest.fail("estimated a pipeline run")
    )
    assert lesson.ratio == 1.0 and "1 pipeline run(s) there teach nothing yet" in lesson.note


def test_step_time_keeps_its_fields_for_the_layouts_built_on_it() -> None:
    from workbench.estimator.timing.step import StepTime

    names = {f.name for f in dataclasses.fields(StepTime)}
    assert {"compute_s", "comm_s", "exposed_comm_s", "efficiency", "assumptions"} <= names
    t = StepTime(compute_s=1.0, comm_s=0.5, exposed_comm_s=0.25, efficiency=0.1)
    assert t.step_s == 1.25


def test_an_estimate_traces_at_most_one_new_past_run_and_learns_the_rest_later(
    cache_dir: Path, tmp_path: Path
) -> None:
    from workbench.estimator.timing.learning import learn
    from workbench.rundir import RunDir, Status

    for i, seconds in enumerate((0.02, 0.03, 0.04)):
        run = RunDir(tmp_path / f"run{i}")
        run.path.mkdir()
        run.write_config(CFG)
        run.set_status(Status.COMPLETED, device_class="cpu", world_size=2, started_at=float(i))
        run.write_timings([seconds] * 10)

    def estimate_of(cfg: wb.RunConfig, world: int, may_trace: bool) -> float:
        if not may_trace:
            raise LookupError("no trace in memory")
        return 0.01

    learnt = [learn(CFG, 2, "cpu", tmp_path, "key", estimate_of) for _ in range(3)]
    assert [lesson.runs for lesson in learnt] == [
        ["run2"],
        ["run2", "run1"],
        ["run2", "run1", "run0"],
    ]
    assert (
        learnt[-1].ratio == pytest.approx(3.0) and "(digits, ddp on 2 rank(s))" in learnt[-1].note
    )


def test_with_flops_per_call_each_call_runs_at_the_rate_of_its_size_and_attention_at_its_own() -> (
    None
):
    p = made_up_profile()
    ops = {"aten.mm": (10, 0), "aten._scaled_dot_product_flash_attention_for_cpu": (2, 0)}
    trace = dataclasses.replace(made_up_trace(1.2e9, ops))
    whole = cpu_step(CFG, trace, {}, p).parts["matmul"]
    assert whole == pytest.approx(1.2e9 / p.matmul_rate("fp32", 1e8)), (
        "without them: all at the matmul rate"
    )
    trace.flop_calls = [
        ["aten.mm", 1e7, 5],
        ["aten.mm", 1.9e8, 5],
        ["aten._scaled_dot_product_flash_attention_for_cpu", 1e8, 2],
    ]
    split = cpu_step(CFG, trace, {}, p).parts["matmul"]
    assert split == pytest.approx(
        5e7 / p.matmul_rate("fp32", 1e7)
        + 9.5e8 / p.matmul_rate("fp32", 1.9e8)
        + 2e8 / p.attention_rate("fp32", 1e8)
    )
    assert split != pytest.approx(whole)


def test_measuring_in_spawned_children_leaves_no_process_behind() -> None:
    """Spawning starts multiprocessing's resource tracker; a measurement that started it stops it."""
    import psutil

    from workbench.estimator.machine.profile import measure

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    measure(1, 2, {"cpu": "test"}, fork=False, stall_s=90)
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


def _parts_that_take(
    monkeypatch: pytest.MonkeyPatch, seconds: float, hang: str | None = None
) -> None:
    """The probe's compute parts replaced by ones that sleep `seconds` each (`hang`: that one sleeps a minute),
    in the forked children too, with figures of the right shape."""
    import time

    from workbench.estimator.machine import probe as machine_probe

    point = {"fp32": [[1.0, 1.0], [2.0, 1.0]]}
    results = {
        "_matmul": point,
        "_attention": point,
        "_step_op_s": 1e-6,
        "_batch": [1e-6, 1e-7],
        "_elementwise": {kind: [[1.0, 1e-9], [2.0, 1e-9]] for kind in KINDS},
        "_jitter": [1.0, 0.0],
        "reference_step": {},
    }
    for name, result in results.items():

        def part(*args: Any, _result: Any = result, _name: str = name) -> Any:
            time.sleep(60 if _name == hang else seconds)
            return _result

        monkeypatch.setattr(machine_probe, name, part)


def test_a_measurement_that_keeps_finishing_parts_outlasts_its_stall_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loaded machine makes the probe slow, not stuck: 7 parts of 0.6 s each (4.2 s in all) against a stall
    limit of 2.5 s is measured, where a deadline on the whole would have failed it."""
    import time

    from workbench.estimator.machine.profile import measure

    _parts_that_take(monkeypatch, 0.6)
    started = time.perf_counter()
    profile = measure(1, 1, {"cpu": "test"}, fork=True, stall_s=2.5)
    assert time.perf_counter() - started > 4.2 and profile.step_op_s == 1e-6


def test_a_measurement_whose_child_hangs_fails_naming_where_and_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    import psutil

    from workbench.estimator.machine.profile import measure

    _parts_that_take(monkeypatch, 0.0, hang="_attention")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.perf_counter()
    with pytest.raises(
        RuntimeError,
        match=r"measuring this machine stalled: no part ended for 2 s \(child 0 "
        r"after 'matmul'\)",
    ):
        measure(1, 1, {"cpu": "test"}, fork=True, stall_s=1.5)
    assert time.perf_counter() - started < 15  # 1.5 s, then the child is killed (joined 2 s first)
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


def test_more_ranks_than_cores_take_fewer_samples_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks that take turns on the cores make each timed call that many times longer: the probe cuts the calls
    that need every rank by as much, to no fewer than MIN_SAMPLES."""
    import os

    from workbench.estimator.machine import probe as machine_probe

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert machine_probe.samples(30, 2) == 30
    assert machine_probe.samples(30, 4) == 15
    assert machine_probe.samples(30, 8) == 8
    assert machine_probe.samples(30, 2, threads=2) == 15
    assert machine_probe.samples(30, 1) == 30  # never more than asked
