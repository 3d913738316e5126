"""Issue 14: experiment trackers (TensorBoard, MLflow), profile_steps traces, and the DataLoader settings.

The launched tests read what a real run wrote back with each tool's own reader: TensorBoard's EventAccumulator,
MLflow's MlflowClient on the run's file store, json for the Chrome traces.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import workbench as wb
from workbench.config import trackers as tracking
from workbench.config.preflight import preflight
from workbench.training.batches import loader_options
from workbench.training.observe.profiling import STEP_LABEL
from workbench.training.observe.trackers import hyperparameters, scalars
from workbench.utils.hardware import Hardware

CPU2 = Hardware(cpu_count=2)

BAD = [
    (
        {"prefetch_factor": 4},
        r"prefetch_factor=4 with num_workers=0: only worker processes prefetch; set num_workers",
    ),
    ({"prefetch_factor": 0, "num_workers": 2}, r"prefetch_factor=0: must be at least 1"),
    (
        {"persistent_workers": True},
        r"persistent_workers=True with num_workers=0: there are no workers to keep",
    ),
    ({"pin_memory": "yes"}, r"pin_memory='yes': choose one of bool \| 'auto'"),
    ({"profile_steps": [3]}, r"profile_steps=\[3\]: give \[first, last\]"),
    (
        {"profile_steps": [5, 3]},
        r"profile_steps=\[5, 3\]: need 1 <= first <= last <= max_steps=100",
    ),
    ({"profile_steps": [0, 2]}, r"profile_steps=\[0, 2\]: need 1 <= first"),
    (
        {"profile_steps": [8, 12], "max_steps": 10},
        r"profile_steps=\[8, 12\]: need .* <= max_steps=10",
    ),
    (
        {"trackers": ["wandb"]},
        r"trackers=\['wandb'\]: choose one of a list of \('tensorboard' \| 'mlflow'\) \| 'auto'",
    ),
    (
        {"trackers": ["mlflow", "mlflow"]},
        r"trackers=\['mlflow', 'mlflow'\]: name each tracker once, e.g. \['mlflow'\]",
    ),
]


@pytest.mark.parametrize("fields,message", BAD, ids=[str(f) for f, _ in BAD])
def test_bad_settings_are_refused_naming_field_value_and_fix(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.RunConfig(**fields)


def test_good_settings_are_accepted_and_round_trip_through_yaml(tmp_path: Path) -> None:
    cfg = wb.RunConfig(
        trackers=["mlflow", "tensorboard"],
        profile_steps=[2, 2],
        num_workers=2,
        prefetch_factor=4,
        persistent_workers=False,
        pin_memory=False,
        max_steps=2,
    )
    assert (
        wb.RunConfig.from_yaml(Path(cfg.to_yaml(tmp_path / "c.yaml") and tmp_path / "c.yaml"))
        == cfg
    )
    assert wb.RunConfig().trackers == "auto" and wb.RunConfig().profile_steps == []


def test_a_requested_tracker_that_is_not_installed_is_refused_with_the_pip_command(
    monkeypatch,
) -> None:
    monkeypatch.setattr(tracking, "installed", lambda name: name != "mlflow")
    cfg = wb.RunConfig(task="digits", device="cpu", trackers=["tensorboard", "mlflow"])
    with pytest.raises(
        ValueError,
        match=r"trackers=\['tensorboard', 'mlflow'\]: mlflow not installed here; "
        r"`pip install mlflow-skinny`, or leave mlflow out of trackers",
    ):
        preflight(cfg, hardware=CPU2)


def test_auto_means_tensorboard_when_installed_else_none(monkeypatch) -> None:
    monkeypatch.setattr(tracking, "installed", lambda name: True)
    assert tracking.resolve("auto") == ["tensorboard"]
    monkeypatch.setattr(tracking, "installed", lambda name: False)
    assert tracking.resolve("auto") == [] and tracking.missing("auto") == []
    # 'auto' without tensorboard is no error
    preflight(wb.RunConfig(task="digits", device="cpu"), hardware=CPU2)
    assert tracking.resolve(["mlflow"]) == ["mlflow"] and tracking.missing(["mlflow"]) == ["mlflow"]


def test_pin_memory_on_cpu_is_warned_about_not_silently_dropped() -> None:
    with pytest.warns(UserWarning, match=r"pin_memory=True on CPU: .*not used on this run"):
        preflight(wb.RunConfig(task="digits", device="cpu", pin_memory=True), hardware=CPU2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # 'auto' says nothing on CPU
        preflight(wb.RunConfig(task="digits", device="cpu"), hardware=CPU2)


def test_loader_options_resolve_auto_per_device_and_workers() -> None:
    plain = wb.RunConfig()
    assert loader_options(plain, "cpu") == {
        "num_workers": 0,
        "pin_memory": False,
        "persistent_workers": False,
    }
    assert loader_options(plain, "cuda")["pin_memory"] is True
    workers = wb.RunConfig(num_workers=2, prefetch_factor=4)
    assert loader_options(workers, "cpu") == {
        "num_workers": 2,
        "pin_memory": False,
        "persistent_workers": True,
        "prefetch_factor": 4,
    }
    assert loader_options(workers.replace(persistent_workers=False, pin_memory=False), "cuda") == {
        "num_workers": 2,
        "pin_memory": False,
        "persistent_workers": False,
        "prefetch_factor": 4,
    }


def test_hyperparameters_and_scalars_are_what_the_trackers_can_hold() -> None:
    cfg = wb.RunConfig(
        task_options={"n_layer": 2, "dropout": None}, profile_steps=[1, 2], max_steps=5
    )
    hp = hyperparameters(cfg, world_size=2)
    assert hp["lr"] == 1e-3 and hp["max_steps"] == 5 and hp["world_size"] == 2
    assert hp["task_options.n_layer"] == 2 and hp["task_options.dropout"] == "null"
    assert hp["profile_steps"] == "[1, 2]" and hp["run_name"] == "null" and hp["trackers"] == "auto"
    assert all(isinstance(v, (bool, int, float, str)) for v in hp.values())
    row = {"step": 4, "loss": 0.5, "samples": 64, "peak_memory_bytes_per_rank": [10, 20]}
    assert scalars(row) == {
        "loss": 0.5,
        "samples": 64,
        "peak_memory_bytes_per_rank/rank_0": 10,
        "peak_memory_bytes_per_rank/rank_1": 20,
    }


# ---- real runs -----------------------------------------------------------------------------------
LOADER = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4, "pin_memory": True}


def digits(runs_dir: Path, name: str, **fields) -> wb.RunConfig:
    base = dict(
        task="digits",
        num_processes=2,
        device="cpu",
        max_steps=4,
        log_every=2,
        eval_every=4,
        eval_batches=2,
        micro_batch_size=16,
        runs_dir=str(runs_dir),
        run_name=name,
        trackers=[],
        seed=5,
    )
    return wb.RunConfig(**{**base, **fields})


def run_to_end(cfg: wb.RunConfig, deadline_s: float = 120) -> wb.RunResult:
    run = wb.start(cfg)
    try:
        return run.wait(timeout=deadline_s)
    except TimeoutError:
        run.kill()
        raise


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, wb.RunResult]:
    """Two 2-rank runs of the same training: one plain, one with both trackers, a profile of steps 2-3 and the
    DataLoader settings; launched once for the tests below."""
    runs_dir = tmp_path_factory.mktemp("runs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory=True on CPU is warned about (tested above)
        # Both trackers are in the test extra; without one, the tests that read it back skip, the others still run.
        trackers = [name for name in tracking.TRACKERS if tracking.installed(name)]
        tracked = run_to_end(
            digits(runs_dir, "tracked", trackers=trackers, profile_steps=[2, 3], **LOADER)
        )
        plain = run_to_end(digits(runs_dir, "plain"))
    return {"plain": plain, "tracked": tracked}


def train_rows(result: wb.RunResult) -> list[dict]:
    return [r for r in result.metrics if "loss" in r]


@pytest.mark.slow
def test_loader_settings_profile_and_trackers_leave_training_bit_identical(runs: dict) -> None:
    plain, tracked = train_rows(runs["plain"]), train_rows(runs["tracked"])
    assert [r["step"] for r in tracked] == [2, 4]
    assert [r["loss"] for r in tracked] == [r["loss"] for r in plain]
    assert runs["tracked"].summary["weights_sha256"] == runs["plain"].summary["weights_sha256"]
    assert (
        not (runs["plain"].run_dir / "tensorboard").exists()
        and not (runs["plain"].run_dir / "mlflow").exists()
    )


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_rows_and_the_config(runs: dict) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    result = runs["tracked"]
    logdir = result.run_dir / "tensorboard" / "tracked"
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    for row in result.metrics:  # training and eval rows, per-rank lists as name/rank_i
        for name, value in scalars(row).items():
            logged = {e.step: e.value for e in events.Scalars(name)}
            # TensorBoard keeps float32
            assert logged[row["step"]] == pytest.approx(value, rel=1e-6), name
    assert "peak_memory_bytes_per_rank/rank_1" in events.Tags()["scalars"]
    [hparams_file] = logdir.glob("*/events.out.tfevents.*")
    meta = EventAccumulator(str(hparams_file.parent))
    meta.Reload()
    start = plugin_data_pb2.HParamsPluginData.FromString(
        meta.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info
    hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    assert hp["task"] == "digits" and hp["lr"] == pytest.approx(1e-3) and hp["max_steps"] == 4
    assert (
        hp["profile_steps"] == "[2, 3]" and hp["world_size"] == 2 and hp["global_batch_size"] == 32
    )


@pytest.mark.slow
def test_mlflow_file_store_holds_the_metrics_rows_and_the_config(runs: dict, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    for key, value in tracking.MLFLOW_ENV.items():
        monkeypatch.setenv(key, value)
    from mlflow.tracking import MlflowClient

    result = runs["tracked"]
    client = MlflowClient(tracking_uri=tracking.mlflow_uri(result.run_dir))
    assert tracking.mlflow_uri(result.run_dir).startswith("file://")
    [experiment] = [e for e in client.search_experiments() if e.name == "tracked"]
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    for row in result.metrics:
        for name, value in scalars(row).items():
            history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
            assert history[row["step"]] == value, name  # MLflow keeps the float exactly
    params = run.data.params
    assert (
        params["task"] == "digits" and float(params["lr"]) == 1e-3 and params["num_workers"] == "2"
    )
    assert json.loads(params["trackers"]) == [n for n in tracking.TRACKERS if tracking.installed(n)]
    assert params["world_size"] == "2"


@pytest.mark.slow
def test_every_rank_writes_a_chrome_trace_of_the_profiled_steps(runs: dict) -> None:
    result = runs["tracked"]
    paths = [result.run_dir / "profile" / f"rank_{r}.json" for r in (0, 1)]
    assert [r["profile_trace"] for r in result.summary["ranks"]] == [str(p) for p in paths]
    for path in paths:
        names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        steps = {n for n in names if n and n.startswith("workbench step")}
        assert steps == {STEP_LABEL.format(2), STEP_LABEL.format(3)}, path
        assert any(n and n.startswith("aten::") for n in names), (
            "the trace holds the steps' operators"
        )
    saved = [e for e in result.events if e["event"] == "profile_saved"]
    assert sorted((e["rank"], e["path"], e["steps"]) for e in saved) == [
        (r, str(p), [2, 3]) for r, p in enumerate(paths)
    ]
    assert (
        result.summary["ranks"][0].get("profile_trace")
        and runs["plain"].summary["ranks"][0]["profile_trace"] is None
    )

    from workbench.notebook.dashboard import Dashboard

    dash = Dashboard(result)
    assert f"{paths[0]}, {paths[1]} (Chrome traces" in dict(dash.stat_items())["profile"]
    assert str(paths[1]) in dash.stats.value
    assert "profile" not in dict(Dashboard(runs["plain"]).stat_items())
