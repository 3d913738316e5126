"""Checkpoints on an object store (checkpoint_url='s3://...'), against a real S3 server (rclone
serve s3, tests/s3_server.py): written under <url>/<run_name>/step_<N>/ in every layout,
synchronously and in the background, sealed by a manifest written last; resumed from, loaded by
load_model(step=), attach and RunResult; a partial step (no manifest) never used and swept; the
server killed mid-write, then back; bad credentials and a missing bucket refused before launch. The
run directory's own files stay local. Real runs on 2 forked gloo CPU ranks, a few steps each."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tasks_for_tests import TinyRegression

import workbench as wb
from tests import s3_server as server_module
from tests.s3_server import S3Server
from workbench.rundir import RunDir
from workbench.storage import StorageError
from workbench.storage.store_path import StorePath

pytestmark = pytest.mark.slow
s3_server = server_module.s3_server  # the fixture, for pytest to see in this module

KILL_DEADLINE_S = 60.0


def cfg_for(runs_dir: Path, url: str, **fields: Any) -> wb.RunConfig:
    base = {
        "num_processes": 2,
        "device": "cpu",
        "micro_batch_size": 16,
        "max_steps": 4,
        "log_every": 1,
        "checkpoint_every": 2,
        "keep_checkpoints": 3,
        "lr": 5e-2,
        "runs_dir": str(runs_dir),
        "seed": 3,
        "checkpoint_url": url,
    }
    return wb.RunConfig(**{**base, **fields})


def losses(run: RunDir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.metrics() if "loss" in r}


def events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e.get("event") == kind]


def on_server(server: S3Server, url: str) -> Path:
    """The folder rclone serves for s3://bucket/prefix: what the store holds, seen on disk."""
    return server.root / url.removeprefix("s3://")


def sealed_steps(server: S3Server, url: str, run_name: str) -> list[int]:
    where = on_server(server, url) / run_name
    return sorted(
        int(p.name.removeprefix("step_"))
        for p in where.glob("step_*")
        if (p / "manifest.json").is_file()
    )


# ---- saving, in every layout, synchronously and in the background --------------------------------
TINY_GPT = {"task": "char-gpt", "task_options": {"preset": "tiny"}, "micro_batch_size": 4}
LAYOUTS = {
    "ddp-sync": {"parallelism": "ddp", "checkpoint_async": "off"},
    "ddp-async": {"parallelism": "ddp", "checkpoint_async": "on"},
    "zero3-async": {"parallelism": "zero3", "checkpoint_async": "on"},
    "tp-sync": {**TINY_GPT, "tp": 2, "checkpoint_async": "off"},
    "pp-async": {**TINY_GPT, "pp": 2, "grad_accum_steps": 2, "checkpoint_async": "on"},
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_checkpoints_are_written_to_the_store_sealed_by_their_manifest_and_load_back(
    s3_server: S3Server, runs_dir: Path, layout: str
) -> None:
    url = s3_server.bucket(f"ckpt-{layout}") + "/prefix"
    task = None if "task" in LAYOUTS[layout] else TinyRegression()
    cfg = cfg_for(runs_dir, url, run_name=layout, **LAYOUTS[layout])
    result = wb.launch(cfg, task=task)
    assert result.summary["status"] == "completed", result.summary.get("error")
    run = RunDir(result.run_dir)

    # on the store: both steps, each sealed, every file the manifest lists there with its size
    assert sealed_steps(s3_server, url, layout) == [2, 4]
    step_4 = on_server(s3_server, url) / layout / "step_4"
    manifest = json.loads((step_4 / "manifest.json").read_text())
    assert {"trainer_state.json", "config.yaml", "rank_0.pt", "rank_1.pt"} <= set(manifest["files"])
    assert any(f.startswith("model/") for f in manifest["files"])
    for name, entry in manifest["files"].items():
        assert (step_4 / name).stat().st_size == entry["size"], name
    # the manifest is the newest object of the step: written last
    newest = max((p for p in step_4.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
    assert newest.name == "manifest.json"

    # the run directory's files stay local; no checkpoints/ there
    assert run.config_path.is_file() and run.metrics_path.is_file()
    assert not (run.path / "checkpoints").exists()
    saved = events(run, "checkpoint_saved")
    assert [e["path"] for e in saved] == [f"{url}/{layout}/step_2", f"{url}/{layout}/step_4"]
    assert isinstance(run.checkpoints_path, StorePath)
    assert [s for s, _ in run.checkpoints()] == [2, 4]

    # read back from the store: step 4 is the last step, so its weights are the exported ones
    final = result.load_model()
    from_store = result.load_model(step=4)
    for (name, a), (_, b) in zip(final.state_dict().items(), from_store.state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_from_the_store_continues_as_an_uninterrupted_run(
    s3_server: S3Server, runs_dir: Path
) -> None:
    """2 ranks ddp: 4 steps, then resumed to 6 from the store's step 4 (its checkpoint read back
    through DCP's fsspec reader); the losses equal a 6-step run's, which also checkpoints there (a
    constant learning rate: the cosine schedule would otherwise end at each session's max_steps)."""
    url = s3_server.bucket("resume")
    flat = {"min_lr_ratio": 1.0}
    whole = wb.launch(
        cfg_for(runs_dir, url, run_name="whole", max_steps=6, **flat), task=TinyRegression()
    )
    first = wb.launch(
        cfg_for(runs_dir, url, run_name="split", max_steps=4, **flat), task=TinyRegression()
    )
    resumed = first.resume(max_steps=6)
    assert resumed.summary["status"] == "completed", resumed.summary.get("error")
    run = RunDir(resumed.run_dir)
    assert losses(run) == pytest.approx(losses(RunDir(whole.run_dir)), rel=0, abs=0)
    (event,) = events(run, "resumed")
    assert f"{url}/split/step_4" in json.dumps(event)
    assert sealed_steps(s3_server, url, "split") == [2, 4, 6]

    # a new kernel's view of it: attach and RunResult read the config's URL from the run directory
    attached = wb.attach(run.path)
    assert attached.wait(timeout=30).summary["steps"] == 6
    reread = wb.RunResult(run.path, task=TinyRegression())
    a = reread.load_model(step=2).state_dict()
    b = wb.RunResult(RunDir(whole.run_dir).path, task=TinyRegression()).load_model(step=2)
    for name, tensor in b.state_dict().items():
        assert torch.equal(a[name], tensor), name


def test_a_step_without_its_manifest_is_never_used_and_is_swept(
    s3_server: S3Server, runs_dir: Path
) -> None:
    """The manifest of step 4 deleted on the server: load_model(step=4) refuses it, a resume takes
    step 2 (saying step 4 was skipped), and the resumed run's next seal sweeps the old step 4."""
    url = s3_server.bucket("unsealed")
    first = wb.launch(cfg_for(runs_dir, url, run_name="r"), task=TinyRegression())
    # through the S3 API: rclone caches its listings, so a change behind its back goes unseen
    (StorePath(url) / "r" / "step_4" / "manifest.json").remove()
    run = RunDir(first.run_dir)
    assert [s for s, _ in run.checkpoints()] == [2]
    with pytest.raises(ValueError, match=r"step_4 has no manifest\.json"):
        first.load_model(step=4)

    resumed = first.resume(max_steps=6)
    assert resumed.summary["status"] == "completed", resumed.summary.get("error")
    (skipped,) = events(run, "checkpoint_skipped")
    assert skipped["step"] == 4 and "manifest.json is missing" in skipped["problems"][0]
    (event,) = events(run, "resumed")
    assert event["step"] == 2
    # the resumed run wrote step 4 anew (sealed), and 6
    assert sealed_steps(s3_server, url, "r") == [2, 4, 6]


def test_a_leftover_unsealed_step_is_swept_by_the_next_seal(
    s3_server: S3Server, runs_dir: Path
) -> None:
    url = s3_server.bucket("sweep")
    first = wb.launch(cfg_for(runs_dir, url, run_name="r"), task=TinyRegression())
    # a write cut off at step 3, from a session that died: files, no manifest
    (StorePath(url) / "r" / "step_3" / "model" / "__0_0.distcp").write_bytes(b"partial")
    leftover = on_server(s3_server, url) / "r" / "step_3"
    assert leftover.exists()
    resumed = first.resume(max_steps=6)
    assert resumed.summary["status"] == "completed", resumed.summary.get("error")
    run = RunDir(first.run_dir)
    swept = events(run, "checkpoint_swept")
    assert [e["step"] for e in swept] == [3]
    assert not (leftover / "model" / "__0_0.distcp").exists()


# ---- faults --------------------------------------------------------------------------------------
def test_server_killed_mid_write_fails_the_run_naming_the_store_then_resumes_once_back(
    s3_server: S3Server, runs_dir: Path
) -> None:
    """checkpoint_every=1 with slow steps: the server is SIGKILLed while a checkpoint is being
    written (once two are sealed); the run fails naming the store and the step, seals nothing
    partial; with the server back, a resume continues from the last sealed step."""
    url = s3_server.bucket("killed")
    cfg = cfg_for(
        runs_dir, url, run_name="k", max_steps=8, checkpoint_every=1, task_options={"slow_s": 0.3}
    )
    run = RunDir(cfg.runs_dir_path / "k")
    killed = threading.Event()

    def kill_when_writing() -> None:
        deadline = time.monotonic() + KILL_DEADLINE_S
        while time.monotonic() < deadline:
            if len(sealed_steps(s3_server, url, "k")) >= 2:
                s3_server.kill()
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_writing, daemon=True)
    killer.start()
    try:
        with pytest.raises(wb.RunFailedError) as failed:
            wb.launch(cfg, task=TinyRegression())
    finally:
        killer.join(KILL_DEADLINE_S)
        if s3_server.proc is None:
            s3_server.start()
    assert killed.is_set(), "the run ended before two checkpoints were sealed"
    result = wb.RunResult(run.path, task=TinyRegression())
    assert result.summary["status"] == "failed"
    # the store (its URL) and the step are named, in the error and in the summary
    assert re.search(rf"checkpoint step \d+ \({re.escape(url)}/k/step_\d+\)", str(failed.value))
    assert url in json.dumps(result.summary["error"])

    # nothing partial is sealed: every sealed step verifies, and a resume takes the newest of them
    sealed = sealed_steps(s3_server, url, "k")
    assert sealed and sealed[-1] < 8
    resumed = result.resume()
    assert resumed.summary["status"] == "completed", resumed.summary.get("error")
    resumes = events(run, "resumed")
    assert resumes[-1]["step"] == sealed[-1]
    assert sealed_steps(s3_server, url, "k")[-1] == 8


def test_bad_credentials_are_refused_before_launch(
    s3_server: S3Server, runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3_server.bucket("creds")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=r"checkpoint_url=.*AWS_ACCESS_KEY_ID"):
        wb.launch(cfg_for(runs_dir, url, run_name="creds"), task=TinyRegression())
    assert not (Path(runs_dir) / "creds").exists()


def test_a_missing_bucket_is_refused_before_launch(s3_server: S3Server, runs_dir: Path) -> None:
    with pytest.raises(StorageError, match=r"create the bucket"):
        wb.launch(
            cfg_for(runs_dir, "s3://no-such-bucket/x", run_name="nobucket"), task=TinyRegression()
        )
    assert not (Path(runs_dir) / "nobucket").exists()


def test_a_local_checkpoint_url_is_a_folder_with_the_run_name(runs_dir: Path, tmp_path: Path):
    folder = tmp_path / "elsewhere"
    result = wb.launch(
        cfg_for(runs_dir, str(folder), run_name="local", max_steps=2), task=TinyRegression()
    )
    assert result.summary["status"] == "completed", result.summary.get("error")
    assert (folder / "local" / "step_2" / "manifest.json").is_file()
    assert not list((folder / "local").glob(".tmp-step_*"))
    assert os.path.isdir(result.run_dir) and not (Path(result.run_dir) / "checkpoints").exists()
