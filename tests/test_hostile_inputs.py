"""Hostile configuration files at the command line: each is refused as one error line with exit 2 (a
config error), before a run directory is created, never as an OSError from deep inside a launch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from collected_ids import cases

import workbench as wb
from workbench.cli import main


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", [["train"], ["train", "--prepare-only"], ["check"]])
def test_a_run_name_too_long_for_the_file_system_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    # Before: "[Errno 36] File name too long" (exit 1) from creating the run directory.
    path = tmp_path / "run.yaml"
    path.write_text(
        f"task: digits\ndevice: cpu\nruns_dir: {tmp_path / 'runs'}\nrun_name: {'x' * 300}\n"
    )
    assert main([command[0], str(path), *command[1:]]) == 2
    err = one_error_line(capsys)
    assert re.search(
        r"run_name='x{40}'\.\.\. is 300 bytes long: a file or directory name can be at most 255 bytes"
        r".*use a shorter run_name",
        err,
    ), err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "runs_dir,where", [("taken", "taken"), ("taken/runs", "taken, on its path,")]
)
def test_runs_dir_that_is_a_file_is_exit_2_before_anything_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], runs_dir: str, where: str
) -> None:
    # Before: "[Errno 17] File exists" (or "[Errno 20] Not a directory") when the run directory was created.
    (tmp_path / "taken").write_text("a file")
    path = tmp_path / "run.yaml"
    wb.RunConfig(
        task="digits", device="cpu", runs_dir=str(tmp_path / runs_dir), run_name="r"
    ).to_yaml(path)
    for command in (["train", "--prepare-only"], ["check"]):
        assert main([command[0], str(path), *command[1:]]) == 2
        err = one_error_line(capsys)
        assert (
            f"runs_dir={str(tmp_path / runs_dir)!r}: {tmp_path / where} is a file, not a directory"
            in err
        ), err
    assert (tmp_path / "taken").read_text() == "a file"


@pytest.mark.parametrize(
    "text,message",
    cases(
        [
            (
                "lr: 1e400\n",
                r"lr=1e400: must be a finite number \(it overflows a float.*\); use a value like 0\.001",
            ),
            (
                "max_steps: 100000000000000000000000000000000000000000\n",
                r"max_steps=10{41}: too large",
            ),
            (
                "lr: 0.001\nlr: 0.1\n",
                r"run\.yaml: not valid YAML \(line 2, column 1\): duplicate key 'lr' \(first on line 1\)",
            ),
        ]
    ),
)
def test_hostile_values_in_a_config_file_are_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["check", str(path)]) == 2
    err = one_error_line(capsys)
    assert re.search(message, err), err
