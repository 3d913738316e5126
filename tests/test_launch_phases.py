"""A launch speaks at once: the phase it is in (checking, preparing data, starting N processes,
waiting for the cluster), announced by the code doing that work, shown with the time since the
call by the notebook's line, the panel's line and the terminal, until the ranks report. (The real
kernel's timing is tests/test_launch_view.py's.)"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import workbench as wb
from workbench.launcher.phases import (
    CHECKING,
    PREPARING_DATA,
    WAITING_FOR_CLUSTER,
    LaunchPhases,
    announce,
    announcing,
    current,
    starting,
)
from workbench.rundir import RunDir, Status


def _wait_for(condition: Any, what: str, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {deadline_s:.0f} s")
        time.sleep(0.02)


def test_phases_move_only_inside_a_launch_and_listeners_see_each_change_in_order() -> None:
    announce(PREPARING_DATA)  # outside a launch: nothing to move, nothing raised
    assert current() is None
    phases, seen = LaunchPhases(), []
    phases.listen(lambda p: seen.append((p.name, p.detail)))

    def broken(_: LaunchPhases) -> None:
        raise RuntimeError("a view that fails")

    phases.listen(broken)  # logged and skipped: the launch goes on
    with announcing(phases):
        assert current() is phases
        announce(PREPARING_DATA)
        announce(PREPARING_DATA)  # a repeat is no change
        announce(starting(2))
        announce(WAITING_FOR_CLUSTER, "Slurm job 42 PENDING: Resources")
    assert current() is None
    assert seen == [
        (PREPARING_DATA, ""),
        ("starting 2 processes", ""),
        (WAITING_FOR_CLUSTER, "Slurm job 42 PENDING: Resources"),
    ]
    assert [name for name, _ in phases.history] == [
        CHECKING,
        PREPARING_DATA,
        "starting 2 processes",
        WAITING_FOR_CLUSTER,
    ]
    assert starting(1) == "starting 1 process"
    assert re.fullmatch(
        r"waiting for the cluster \(Slurm job 42 PENDING: Resources\) · \d+\.\d s", phases.text()
    ), phases.text()


class FakeDisplay:
    """IPython's display(..., display_id=True) and its handle's update(), recorded with the time
    each content was shown."""

    def __init__(self) -> None:
        self.shown: list[tuple[float, str]] = []

    def display(self, obj: Any, display_id: bool = False) -> FakeDisplay:
        assert display_id
        self.shown.append((time.monotonic(), obj.data))
        return self

    def update(self, obj: Any) -> None:
        self.shown.append((time.monotonic(), obj.data))


@pytest.fixture
def kernel_like(monkeypatch: pytest.MonkeyPatch) -> FakeDisplay:
    """The launcher believes it runs in a kernel; what it displays is recorded."""
    import IPython.display

    fake = FakeDisplay()
    monkeypatch.setattr("workbench.utils.kernel.in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", fake.display)
    return fake


def _text(content: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", content).split())


def test_a_refused_launch_speaks_at_once_and_then_says_it_was_not_launched(
    kernel_like: FakeDisplay, runs_dir: Path
) -> None:
    """The line shows before the checks run (well under 0.5 s after the call), and a check that
    refuses leaves it saying the run was not launched, with the error's type and the phase it came
    in; the error itself reaches the caller."""
    cfg = wb.RunConfig(task="digits", precision="fp16", device="cpu", runs_dir=str(runs_dir))
    called = time.monotonic()
    with pytest.raises(ValueError, match=r"precision='fp16' on .*CPU"):
        wb.launch(cfg)
    first_at, first = kernel_like.shown[0]
    assert first_at - called < 0.5, f"{first_at - called:.2f} s"
    assert re.fullmatch(r"digits checking · 0\.\d s", _text(first)), _text(first)
    assert "data-status='starting'" in first and "data-phase='checking'" in first
    last = kernel_like.shown[-1][1]
    assert "data-status='not-launched'" in last
    assert re.fullmatch(r"digits not launched ValueError while checking · [\d.]+ s", _text(last))
    assert not list(runs_dir.iterdir()), "a refused launch creates nothing"


def test_the_panel_line_shows_the_phase_until_the_ranks_report_then_hides(tmp_path: Path) -> None:
    from workbench.notebook.live_view import PanelLine

    phases = LaunchPhases()
    line = PanelLine(phases, "my-run", interval=0.05)
    try:
        assert "wb-panel-line" in line.widget._dom_classes and "'wb-live wb-live-line'" in (
            line.widget.value
        )
        assert _text(line.widget.value).startswith("my-run checking · 0.")
        phases.enter(starting(2))
        _wait_for(lambda: "starting 2 processes" in line.widget.value, "the phase change")
        # counts up while it waits
        first = _text(line.widget.value)
        _wait_for(lambda: _text(line.widget.value) != first, "an update of the elapsed time")
        run_dir = RunDir(tmp_path / "run")
        run_dir.path.mkdir()

        class Launched:
            run_dir = tmp_path / "run"

        line.follow(Launched())
        time.sleep(0.2)  # still starting: the phase stays
        assert line.widget.layout.display != "none" and "starting 2 processes" in line.widget.value
        run_dir.set_status(Status.RUNNING)  # the ranks report
        _wait_for(lambda: line.widget.layout.display == "none", "the line giving way")
    finally:
        line.close()


def test_a_line_following_a_queued_cluster_job_says_so_until_its_ranks_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.notebook import live_view
    from workbench.notebook.live_view import PanelLine

    monkeypatch.setattr(live_view, "JOB_POLL_S", 0.05)
    job = {"state": (WAITING_FOR_CLUSTER, "Slurm job 7 PENDING: Priority")}

    class Submitted:
        run_dir = tmp_path / "run"

        def launch_phase(self) -> tuple[str, str]:
            return job["state"]

    RunDir(Submitted.run_dir).path.mkdir()
    phases = LaunchPhases()
    line = PanelLine(phases, "queued", interval=0.05)
    try:
        line.follow(Submitted())
        _wait_for(lambda: "PENDING" in line.widget.value, "the job's state")
        assert re.fullmatch(
            r"run waiting for the cluster \(Slurm job 7 PENDING: Priority\) · [\d.]+ s",
            _text(line.widget.value),
        )
        job["state"] = ("starting 8 processes", "Slurm job 7 RUNNING")
        _wait_for(lambda: "starting 8 processes" in line.widget.value, "the job starting")
        assert [name for name, _ in phases.history] == [
            CHECKING,
            WAITING_FOR_CLUSTER,
            "starting 8 processes",
        ]
    finally:
        line.close()


def test_a_queued_slurm_job_is_waiting_for_the_cluster_and_a_running_one_starting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from workbench.cluster.slurm_run import SlurmRun

    run = SlurmRun(tmp_path, wb.RunConfig(task="digits", num_processes=4), "42")
    monkeypatch.setattr(SlurmRun, "job", lambda self: ("PENDING", "Resources"))
    assert run.launch_phase() == (WAITING_FOR_CLUSTER, "Slurm job 42 PENDING: Resources")
    monkeypatch.setattr(SlurmRun, "job", lambda self: ("RUNNING", ""))
    assert run.launch_phase() == ("starting 4 processes", "Slurm job 42 RUNNING")


@pytest.mark.slow
def test_workbench_train_prints_the_phases_as_lines_in_order(
    runs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workbench.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "task": "digits",
                "num_processes": 2,
                "max_steps": 10,
                "log_every": 5,
                "runs_dir": str(runs_dir),
            }
        )
    )
    assert main(["train", str(config)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("workbench:")]
    assert [re.sub(r" · [\d.]+ s$", "", line) for line in lines] == [
        "workbench: checking",
        "workbench: preparing data",
        "workbench: starting 2 processes",
    ], lines
