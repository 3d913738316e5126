"""One knob says how ranks start: RunConfig.start_method = auto | fork | spawn | subprocess (clusters: `cluster=`).
The older spellings (`mode=` of wb.start/wb.launch, `workbench train --mode`) are warned about and forwarded for
one release; RunResult.resume() reaches the launcher without an attribute patched on at import."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest
from tasks_for_tests import TinyRegression
from test_spawn import cfg_for

import workbench as wb
from workbench.cli import main
from workbench.launcher.result import RunResult


def test_start_method_subprocess_runs_accelerate_launch_and_mode_forwards_to_it(
    runs_dir: Path,
) -> None:
    run = wb.start(cfg_for(runs_dir, task="digits", start_method="subprocess", max_steps=2))
    try:
        assert (
            run.start_method == "subprocess" and "accelerate launch / torchrun" in run.start_reason
        )
        assert run.wait(timeout=120).status is wb.Status.COMPLETED
    finally:
        if not run.done():
            run.kill()
    with pytest.warns(
        DeprecationWarning,
        match=r"mode='subprocess' is deprecated: set "
        r"RunConfig.start_method='subprocess' instead",
    ):
        result = wb.launch(
            cfg_for(runs_dir, task="digits", max_steps=2), mode="subprocess", progress=False
        )
    assert (
        result.config.start_method == "subprocess"
        and result.dir.config().start_method == "subprocess"
    )


def test_mode_fork_forwards_to_the_default_and_a_bad_mode_names_the_knob(runs_dir: Path) -> None:
    with pytest.warns(
        DeprecationWarning, match=r"mode='fork' is deprecated: set RunConfig.start_method='auto'"
    ):
        result = wb.launch(
            cfg_for(runs_dir, task="digits", max_steps=2, start_method="subprocess"),
            mode="fork",
            progress=False,
        )
    assert result.config.start_method == "auto"
    with pytest.raises(
        ValueError,
        match=r"mode='thread': choose 'fork' or 'subprocess' \(deprecated: set "
        r"RunConfig.start_method='auto' \| 'fork' \| 'spawn' \| 'subprocess'",
    ):
        wb.start(cfg_for(runs_dir, task="digits"), mode="thread")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mode=: no warning
        wb.launch(cfg_for(runs_dir, task="digits", max_steps=1), progress=False)


def test_a_task_object_cannot_go_to_fresh_interpreters_by_name(runs_dir: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"start_method='subprocess' starts fresh interpreters that can't see a task "
        r"object: .* use start_method='auto' for tasks defined in a notebook",
    ):
        wb.start(cfg_for(runs_dir, start_method="subprocess"), task=TinyRegression())
    assert not any(runs_dir.iterdir()), "refused before anything was created"


def test_workbench_train_resolves_auto_to_subprocess_and_forwards_mode(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    cfg_for(tmp_path / "runs", task="digits").to_yaml(path)

    def prepare(*extra: str) -> tuple[wb.RunConfig, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert main(["train", str(path), "--prepare-only", *extra]) == 0, err.getvalue()
        return RunResult.load(out.getvalue().strip()).config, err.getvalue()

    cfg, err = prepare()
    assert cfg.start_method == "subprocess" and "deprecated" not in err
    cfg, err = prepare("--mode", "fork")
    assert cfg.start_method == "fork"
    assert "workbench train: --mode fork is deprecated; use --set start_method=fork" in err
    cfg, _ = prepare("--set", "start_method=spawn")
    assert cfg.start_method == "spawn"


def test_importing_the_launcher_patches_nothing_onto_run_result() -> None:
    import workbench.launcher.launch  # noqa: F401  (it used to set RunResult.launcher as it was imported)

    assert not [name for name in vars(RunResult) if name == "launcher"]
