"""Device monitoring: NVML sampling against a fake pynvml, the idle-GPU warning, the CPU path in a real run,
the rows and the dashboard; the NVML path for real where there is a GPU."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from collected_ids import cases
from fake_nvml import FakeNvml
from matplotlib.figure import Figure

import workbench as wb
import workbench.training.observe.monitor as monitor_mod
from workbench import rundir
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.plots import draw
from workbench.training.observe.device_samplers import nvml_target
from workbench.training.observe.monitor import FIELDS, DeviceMonitor, row_fields
from workbench.utils import files

MB = 2**20


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `condition` until true; fail after `timeout` seconds (a busy 2-core box is slow, not hung)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def monitors() -> Iterator[list[DeviceMonitor]]:
    """Monitors a test starts; stopped whatever the test did."""
    started: list[DeviceMonitor] = []
    yield started
    for m in started:
        m.stop(timeout=5)
    assert not any(m.running for m in started)


def run_monitor(monitors: list[DeviceMonitor], *args: Any, **kwargs: Any) -> DeviceMonitor:
    return run_recorded(monitors, *args, **kwargs)[0]


def run_recorded(
    monitors: list[DeviceMonitor], *args: Any, **kwargs: Any
) -> tuple[DeviceMonitor, list[float]]:
    """A started monitor and the times its thread finished each sample (idle check and event included), so a
    test can wait until enough samples were taken rather than sleep and hope the thread got to run."""
    m = DeviceMonitor(*args, **kwargs)
    done: list[float] = []
    sample_once = m.sample_once

    def recorded(samplers: list[Any]) -> dict[str, float]:
        sample = sample_once(samplers)
        done.append(time.monotonic())
        return sample

    m.sample_once = recorded  # type: ignore[method-assign]  (the thread looks it up on the instance)
    monitors.append(m)
    m.start()
    assert m.wait_ready(10)
    return m, done


def wait_for_samples(done: list[float], seconds: float, after: int = 0) -> None:
    """Until samples taken after the first `after` span more than `seconds` (at least three of them)."""
    wait_for(
        lambda: len(done) >= after + 3 and done[-1] - done[after] > seconds,
        what=f"samples spanning {seconds} s",
    )


# ---- sampling against the fake NVML --------------------------------------------------------------
def test_scripted_nvml_readings_land_in_the_window_mean_for_rates_max_for_levels(
    monitors: list,
) -> None:
    nvml = FakeNvml()
    m = DeviceMonitor(1.0, gpu_index=1, nvml=nvml)
    samplers = m._open()  # the thread's samplers, driven by hand: exact samples, no timing
    try:
        assert m.source == "nvml" and ("nvmlDeviceGetHandleByIndex", 1) in nvml.calls
        nvml.set(1, util=80, mem_used=5 * 2**30, power_mw=200_000, temp_c=70)
        m.sample_once(samplers)
        nvml.set(1, util=40, mem_used=3 * 2**30, power_mw=100_000, temp_c=65)
        m.sample_once(samplers)
        window = m.take_window()
        # means (power: mW -> W)
        assert window["gpu_util_pct"] == 60 and window["gpu_power_w"] == 150
        assert window["gpu_mem_used_bytes"] == 5 * 2**30 and window["gpu_temp_c"] == 70  # maxima
        assert window["rss_bytes"] > 10 * MB and window["cpu_pct"] >= 0
        # A window with no sample of its own repeats the latest sample rather than reporting a gap.
        assert m.take_window()["gpu_util_pct"] == 40
        nvml.set(1, power_mw=None)  # a board without power readings: NaN, then None in the row
        m.sample_once(samplers)
        assert m.take_window()["gpu_power_w"] == 100  # the last good reading stands in
    finally:
        for s in samplers:
            s.close()
    assert nvml.initialised == 0 and nvml.calls[-1] == ("nvmlShutdown",)


def test_the_thread_samples_in_the_background_and_shuts_nvml_down(monitors: list) -> None:
    nvml = FakeNvml()
    nvml.set(0, util=77, temp_c=55)
    m = run_monitor(monitors, 0.01, gpu_index=0, nvml=nvml)
    wait_for(lambda: m.take_window()["gpu_util_pct"] == 77, what="a sample")
    m.stop(timeout=5)
    assert not m.running and nvml.initialised == 0


def test_cuda_visible_devices_maps_the_torch_index_to_nvml(
    monitors: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert nvml_target(1, None) == 1 and nvml_target(1, "") == 1
    assert nvml_target(1, "2,3") == 3
    assert nvml_target(0, "GPU-00000002, 1") == "GPU-00000002"
    with pytest.raises(LookupError, match="not among CUDA_VISIBLE_DEVICES='2'"):
        nvml_target(1, "2")
    nvml = FakeNvml()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    DeviceMonitor(1.0, gpu_index=1, nvml=nvml)._open()[1].close()
    assert ("nvmlDeviceGetHandleByIndex", 3) in nvml.calls
    # by UUID (prefix), as CUDA accepts it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000002")
    sampler = DeviceMonitor(1.0, gpu_index=0, nvml=nvml)._open()[1]
    assert sampler.handle.index == 2
    sampler.close()


def test_without_pynvml_a_gpu_rank_warns_once_and_records_torch_memory(
    monitors: list, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(monitor_mod, "load_nvml", lambda: None)
    monkeypatch.setattr(monitor_mod, "_missing_warned", False)
    with caplog.at_level(logging.WARNING, logger="workbench"):
        for _ in range(2):
            m = DeviceMonitor(1.0, gpu_index=0)
            samplers = m._open()
            m.sample_once(samplers)
    assert m.source == "torch" and caplog.text.count("needs nvidia-ml-py") == 1
    window = m.take_window()
    assert window["gpu_mem_used_bytes"] == (
        torch.cuda.memory_reserved(0) if torch.cuda.is_available() else 0
    )
    assert math.isnan(window["gpu_util_pct"])  # so no idle warning either


# ---- the idle warning ----------------------------------------------------------------------------
def test_idle_gpu_warns_once_per_episode_and_rearms(
    monitors: list, caplog: pytest.LogCaptureFixture
) -> None:
    nvml, events = FakeNvml(), []
    nvml.set(0, util=3)
    with caplog.at_level(logging.WARNING, logger="workbench"):
        m, done = run_recorded(
            monitors,
            0.01,
            gpu_index=0,
            nvml=nvml,
            rank=1,
            idle_util_pct=10,
            idle_after_s=0.15,
            on_idle=events.append,
            step_of=lambda: 42,
        )
        wait_for(lambda: len(events) == 1, what="the first gpu_idle")
    event = events[0]
    assert (
        event["rank"] == 1
        and event["util_pct"] == 3
        and event["seconds"] >= 0.15
        and event["step"] == 42
    )
    assert "num_workers" in event["advice"] and "GPU under 10% utilisation" in caplog.text
    # Still idle: the same episode. Samples over two more idle_after_s must have been taken (a wrong second event
    # would come from one of them), however slowly this machine runs the thread.
    wait_for_samples(done, 2 * 0.15, after=len(done))
    assert len(events) == 1
    nvml.set(0, util=95)
    wait_for(lambda: m._idle_since is None, what="the busy GPU to re-arm the warning")
    nvml.set(0, util=1)
    wait_for(lambda: len(events) == 2, what="the second episode's gpu_idle")
    assert events[1]["util_pct"] == 1


def test_a_busy_gpu_or_a_cpu_rank_never_warns(monitors: list) -> None:
    nvml, events = FakeNvml(), []
    nvml.set(0, util=95)
    busy, busy_done = run_recorded(
        monitors, 0.01, gpu_index=0, nvml=nvml, idle_after_s=0.05, on_idle=events.append
    )
    cpu, cpu_done = run_recorded(
        monitors, 0.01, gpu_index=None, idle_after_s=0.05, on_idle=events.append
    )
    # Samples over eight idle_after_s on each: long enough for a wrong warning to show, however slowly this
    # machine runs the threads.
    wait_for_samples(busy_done, 8 * 0.05)
    wait_for_samples(cpu_done, 8 * 0.05)
    assert events == [] and busy.running and cpu.running and cpu.source == "cpu"


def test_for_rank_writes_gpu_idle_to_events_jsonl(
    monitors: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = FakeNvml()
    nvml.set(0, util=0)
    monkeypatch.setattr(monitor_mod, "load_nvml", lambda: nvml)
    run = rundir.RunDir(tmp_path / "run")
    run.path.mkdir()
    cfg = wb.RunConfig(monitor_interval_s=0.05, idle_util_pct=5, idle_after_s=0.1)
    m = monitor_mod.for_rank(cfg, torch.device("cuda", 0), 0, run.event, lambda: 7)
    monitors.append(m.start())
    wait_for(
        lambda: any(e["event"] == "gpu_idle" for e in run.events()),
        what="the event in events.jsonl",
    )
    (event,) = [e for e in run.events() if e["event"] == "gpu_idle"]
    assert event["rank"] == 0 and event["util_pct"] == 0 and event["step"] == 7 and event["advice"]
    assert (
        monitor_mod.for_rank(
            cfg.replace(monitor_interval_s=0), torch.device("cpu"), 0, run.event, lambda: 0
        )
        is None
    )


# ---- rows, config --------------------------------------------------------------------------------
def test_row_fields_are_per_rank_lists_with_none_for_unmeasured() -> None:
    nan = float("nan")
    gathered = torch.tensor(
        [
            [50.0, 2.0**30, nan, 61.0, 101.26, 300.0 * MB],
            [nan, 2.0**31, nan, 62.0, 99.0, 310.0 * MB],
        ],
        dtype=torch.float64,
    )
    row = row_fields(gathered)
    # power: no rank measured it
    assert row == {
        "gpu_util_pct_per_rank": [50.0, None],
        "gpu_mem_used_bytes_per_rank": [2**30, 2**31],
        "gpu_temp_c_per_rank": [61.0, 62.0],
        "cpu_pct_per_rank": [101.3, 99.0],
        "rss_bytes_per_rank": [300 * MB, 310 * MB],
    }
    assert len(FIELDS) == gathered.shape[1]


@pytest.mark.parametrize(
    "fields,message",
    cases(
        [
            (
                {"monitor_interval_s": -1.0},
                r"monitor_interval_s=-1.0: use 0.05 to 3600 seconds .* or 0 to turn",
            ),
            ({"monitor_interval_s": 0.001}, r"monitor_interval_s=0.001: use 0.05 to 3600"),
            (
                {"idle_util_pct": 150.0},
                r"idle_util_pct=150.0: a GPU utilisation percentage, 0 to 100",
            ),
            ({"idle_after_s": -5.0}, r"idle_after_s=-5.0: must be 0 or more seconds"),
        ]
    ),
)
def test_monitor_settings_are_validated(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.RunConfig(**fields)
    assert wb.RunConfig(monitor_interval_s=0, idle_after_s=0).monitor_interval_s == 0


# ---- the dashboard -------------------------------------------------------------------------------
def monitored_rows(kind: str) -> list[dict[str, Any]]:
    rows = []
    for step in range(5, 45, 5):
        row: dict[str, Any] = {
            "step": step,
            "loss": 2.0 / step,
            "lr": 1e-3,
            "samples_per_s": 500.0,
            "step_time_s": 0.1,
            "peak_memory_bytes": 300 * MB,
            "elapsed_s": step * 0.1,
            "cpu_pct_per_rank": [95.0, 101.0],
            "rss_bytes_per_rank": [400 * MB, 420 * MB],
        }
        if kind == "gpu":
            row.update(
                gpu_util_pct_per_rank=[93.0, 4.0 if step > 20 else 90.0],
                gpu_mem_used_bytes_per_rank=[12 * 2**30, 12 * 2**30],
                gpu_power_w_per_rank=[300.0, 90.0],
                gpu_temp_c_per_rank=[66.0, 50.0],
            )
        rows.append(row)
    return rows


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_dashboard_draws_the_monitor_and_shows_the_latest_values(tmp_path: Path, kind: str) -> None:
    from test_dashboard import fake_run

    run_dir = fake_run(tmp_path, monitored_rows(kind))
    if kind == "gpu":
        files.append_jsonl(
            run_dir / rundir.EVENTS,
            {
                "time": 1.0,
                "event": "gpu_idle",
                "rank": 1,
                "util_pct": 4.0,
                "seconds": 300.0,
                "threshold_pct": 10.0,
                "step": 30,
                "advice": "the GPU waits on something else",
            },
        )
    dash = Dashboard(run_dir)
    png = dash.figure_png()
    assert png.startswith(b"\x89PNG")
    titles = [ax.get_title() for ax in dash._figure.axes]
    assert len(titles) == 6
    stats = dash.stats.value
    if kind == "gpu":
        assert (
            "GPU utilisation (%, window mean)" in titles
            and "GPU memory used (GiB, window max)" in titles
        )
        assert (
            "rank 0: 93%, rank 1: 4%" in stats and "rank 0: 300 W" in stats and "12.00 GiB" in stats
        )
        assert (
            "wb-stat-warning" in stats
            and "rank 1: GPU at 4.0% for 300.0 s (under 10.0%) near step 30" in stats
        )
    else:
        assert "process CPU (%, window mean; 100 = one core)" in titles
        assert "rank 0: 95%, rank 1: 101%" in stats and "rank 1: 420 MiB" in stats
        assert "GPU" not in stats and "warning" not in stats


def test_rows_without_monitoring_keep_the_four_panels() -> None:
    fig = Figure()
    draw(
        fig,
        [
            (
                "run",
                [
                    {k: v for k, v in r.items() if not k.endswith("_per_rank")}
                    for r in monitored_rows("cpu")
                ],
            )
        ],
    )
    assert len(fig.axes) == 4
    draw(fig, [("run", monitored_rows("gpu"))])  # one run: a line per rank
    util = fig.axes[4]
    assert [line.get_label() for line in util.get_lines()] == ["rank 0", "rank 1"]
    assert (
        list(util.get_lines()[1].get_ydata())[-1] == 4.0
        and util.get_title() == "GPU utilisation (%, window mean)"
    )


def test_overlaid_runs_show_each_runs_busiest_rank_in_the_runs_own_style() -> None:
    fig = Figure()
    idle = [dict(r, gpu_util_pct_per_rank=[20.0, 30.0]) for r in monitored_rows("gpu")]
    draw(fig, [("a", monitored_rows("gpu")), ("b", idle)])
    loss, util, memory = fig.axes[0], fig.axes[4], fig.axes[5]
    # one line per run, not runs x ranks
    assert [line.get_label() for line in util.get_lines()] == ["a", "b"]
    assert (
        list(util.get_lines()[0].get_ydata()) == [93.0] * 8
        and list(util.get_lines()[1].get_ydata()) == [30.0] * 8
    )
    assert util.get_title() == "GPU utilisation (%, window mean)\nthe busiest rank of each run"
    assert memory.get_title() == "GPU memory used (GiB, window max)\nthe busiest rank of each run"
    run_lines = {
        line.get_label(): line for line in loss.get_lines() if line.get_label() in ("a", "b")
    }
    for line in util.get_lines():  # the colour and style the run has in the loss panel
        twin = run_lines[line.get_label()]
        assert (line.get_color(), line.get_linestyle()) == (twin.get_color(), twin.get_linestyle())


# ---- for real ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_cpu_run_records_process_cpu_and_rss_per_rank_from_the_first_logged_step(
    runs_dir: Path,
) -> None:
    """With the default sampling interval (2 s), a run of short steps logs every 25 steps before the
    sampler's second sample: the first rows still carry each rank's CPU % (its CPU time over the
    window) and RSS, so the figure's monitor panels start at the first logged step, not ~100."""
    cfg = wb.RunConfig(
        task="digits",
        num_processes=2,
        max_steps=100,
        log_every=25,
        micro_batch_size=16,
        device="cpu",
        runs_dir=str(runs_dir),
        eval_batches=1,
    )
    assert cfg.monitor_interval_s == 2.0
    result = wb.launch(cfg)
    rows = [r for r in result.metrics if r.get("loss") is not None]
    assert result.summary["status"] == "completed" and len(rows) == 4
    for row in rows:
        assert len(row["rss_bytes_per_rank"]) == 2 and "gpu_util_pct_per_rank" not in row
        assert all(10 * MB < b < 64 * 2**30 for b in row["rss_bytes_per_rank"]), row
        cpu = row["cpu_pct_per_rank"]
        assert len(cpu) == 2 and all(0 < p <= 100 * 64 for p in cpu), row  # training uses CPU
    assert not [e for e in result.events if e["event"] == "gpu_idle"]
    # in the ranks, not here
    assert not [t for t in threading.enumerate() if t.name.startswith("wb-monitor")]
    # the figure's monitor panels (result.plot() and the dashboard's) from the first logged step
    figure = result.plot()
    monitor = [ax for ax in figure.axes if ax.get_title().startswith("process")]
    assert len(monitor) == 2
    for ax in monitor:
        assert [line.get_xdata()[0] for line in ax.get_lines()] == [rows[0]["step"]] * 2
    dashboard = wb.Dashboard(result)
    assert dashboard.figure_png()
    live = dashboard._live.figure.axes
    for ax in [ax for ax in live if ax.get_title().startswith("process")]:
        assert [line.get_xdata()[0] for line in ax.get_lines()] == [rows[0]["step"]] * 2


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="reads a real GPU through NVML; this machine has none"
)
def test_nvml_reads_this_gpu_for_real(monitors: list) -> None:
    nvml = pytest.importorskip(
        "pynvml", reason="the GPU path needs nvidia-ml-py: pip install 'workbench[gpu]'"
    )
    m = run_monitor(monitors, 0.05, gpu_index=0, nvml=nvml)
    assert m.source == "nvml"
    x = torch.randn(4096, 4096, device="cuda")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # keep the GPU busy for a few samples
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    window = m.take_window()
    assert window["gpu_util_pct"] > 0 and window["gpu_mem_used_bytes"] >= x.numel() * 4
    assert 10 < window["gpu_temp_c"] < 110
    assert math.isnan(window["gpu_power_w"]) or 10 < window["gpu_power_w"] < 2000
