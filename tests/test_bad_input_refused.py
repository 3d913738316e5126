"""Bad input refused clearly (issue 46's partials): a run_name linked outside runs_dir, a runs_dir
that is blank, holds a control character or lies in the kernel's /proc, `workbench check` of a
device, a FIFO or a huge file, an integer setting of 1e300, a badly typed metrics row under
`workbench status`, and a local data file's digest kept out of a mismatch message."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import workbench as wb
from workbench import data
from workbench.cli import main
from workbench.data import IntegrityError
from workbench.rundir import run_dir as rundir
from workbench.utils import files


# ---- run_name and runs_dir ------------------------------------------------------------------------
@pytest.mark.parametrize("resume", [False, "auto"])
def test_a_run_name_linked_outside_runs_dir_is_refused_and_nothing_is_written_there(
    tmp_path: Path, resume: bool | str
) -> None:
    runs, outside = tmp_path / "runs", tmp_path / "outside"
    runs.mkdir()
    outside.mkdir()
    (runs / "victim").symlink_to(outside)
    cfg = wb.RunConfig(task="digits", runs_dir=str(runs), run_name="victim", resume=resume)

    with pytest.raises(
        ValueError,
        match=rf"run_name='victim': {runs / 'victim'} is a symbolic link \(to {outside}\), not a "
        r"run directory.*Pick another run_name, remove the link",
    ):
        wb.launch(cfg, progress=False)
    assert list(outside.iterdir()) == []
    assert (runs / "victim").is_symlink()


@pytest.mark.parametrize(
    ("runs_dir", "message"),
    [
        ("", r"runs_dir='': empty; name the folder run directories go in, e\.g\. runs_dir='runs'"),
        ("\n", r"runs_dir='\\n': blank \(only whitespace\); name the folder"),
        ("runs\n", r"runs_dir='runs\\n': holds the control character '\\n'.*e\.g\. runs_dir="),
        ("/proc/self", r"runs_dir='/proc/self': /proc is a view the kernel makes .*not storage"),
        ("/sys/fs/runs", r"runs_dir='/sys/fs/runs': /sys is a view the kernel makes"),
        ("/dev/null", r"runs_dir='/dev/null': /dev is a view the kernel makes"),
    ],
    ids=["empty", "newline", "trailing-newline", "proc-self", "sys", "dev-null"],
)
def test_a_blank_control_or_kernel_runs_dir_is_refused(runs_dir: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.RunConfig(runs_dir=runs_dir)


def test_storage_under_dev_shm_and_ordinary_folders_pass() -> None:
    for runs_dir in ("/dev/shm/runs", "runs", "~/runs", "/devices/runs"):
        assert wb.RunConfig(runs_dir=runs_dir).runs_dir == runs_dir


def test_a_runs_dir_linked_into_proc_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    link = tmp_path / "runs"
    link.symlink_to("/proc/self")
    cfg = wb.RunConfig(task="digits", runs_dir=str(link), run_name="r")
    with pytest.raises(
        ValueError, match=rf"runs_dir='{link}' is /proc/\d+, on the kernel's proc filesystem"
    ):
        wb.launch(cfg, progress=False)


# ---- config files: `workbench check FILE` ---------------------------------------------------------
def test_workbench_check_dev_zero_returns_at_once_naming_the_device() -> None:
    # the probe: this read /dev/zero for ever; a subprocess, so a regression fails at the deadline
    done = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "check", "/dev/zero"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "error: /dev/zero: is a character device, not a file; pass the path of a RunConfig " in (
        done.stderr
    )


def test_a_fifo_a_directory_and_a_huge_file_are_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)  # opening it to read would wait for a writer: it must not be opened
    huge = tmp_path / "huge.yaml"
    huge.write_text("task: digits\n" + "# padding\n" * 200_000)
    expected = {
        fifo: r"is a FIFO \(named pipe\), not a file",
        tmp_path: "is a directory, not a file",
        huge: r"is 2,000,013 bytes, more than the 1,048,576 a config file can be",
    }
    for path, message in expected.items():
        assert main(["check", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: ") and re.search(message, err)


def test_an_accelerate_or_deepspeed_config_that_is_a_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"/dev/zero: is a character device.*a DeepSpeed config"):
        wb.RunConfig.from_deepspeed("/dev/zero")
    with pytest.raises(ValueError, match=r"/dev/null: is a character device.*accelerate"):
        wb.RunConfig.from_accelerate("/dev/null")


# ---- integer settings given as 1e300 --------------------------------------------------------------
def test_dist_timeout_of_1e300_says_too_large_not_str(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("task: digits\ndist_timeout_s: 1e300\n")  # YAML 1.1 reads it as text
    with pytest.raises(
        ValueError,
        match=r"dist_timeout_s='1e300' \(a number as text.*\): too large; integer settings lie "
        r"within \+-\(2\*\*31-1\) \(2,147,483,647\).*e\.g\. dist_timeout_s=\d+",
    ):
        wb.RunConfig.from_yaml(path)
    with pytest.raises(ValueError, match=r"dist_timeout_s=1e\+300: too large"):
        wb.RunConfig(dist_timeout_s=1e300)  # type: ignore[arg-type]


def test_a_whole_number_written_with_an_exponent_is_the_number(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("task: digits\ndist_timeout_s: 1e3\nmax_steps: 2.5e2\n")
    cfg = wb.RunConfig.from_yaml(path)
    assert (cfg.dist_timeout_s, cfg.max_steps) == (1000, 250)
    assert cfg.with_overrides(["log_every=1e1"]).log_every == 10
    with pytest.raises(ValueError, match=r"dist_timeout_s=1800\.0: dist_timeout_s takes a whole "):
        wb.RunConfig(dist_timeout_s=1800.0)  # type: ignore[arg-type]


# ---- `workbench status` and a badly typed metrics row ---------------------------------------------
def _run_with_rows(tmp_path: Path, rows: list[dict]) -> Path:
    run_dir = tmp_path / "runs" / "typed"
    run_dir.mkdir(parents=True)
    wb.RunConfig(max_steps=10).to_yaml(run_dir / rundir.CONFIG)
    files.write_json(run_dir / rundir.SUMMARY, {"status": "completed", "steps": 4})
    (run_dir / rundir.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"loss": "0.1"}, r"loss='0\.1' is not"),
        ({"samples_per_s": "fast"}, r"samples_per_s='fast' is not"),
        ({"step_time_ms_per_rank": [1.0, "x"]}, r"step_time_ms_per_rank=\[1\.0, 'x'\] is not"),
    ],
    ids=["loss-text", "rate-text", "per-rank-text"],
)
def test_status_skips_a_badly_typed_row_with_a_warning(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    bad: dict,
    problem: str,
) -> None:
    good = [
        {"step": s, "loss": 2.0 - s / 10, "samples_per_s": 100.0 * s, "schema_version": 1}
        for s in (1, 2, 3)
    ]
    run_dir = _run_with_rows(tmp_path, [*good, {**good[-1], "step": 4, **bad}])

    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "typed: completed" in out and "step 3/10, loss 1.7, 300 samples/s" in out
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        str(run_dir / rundir.METRICS) in m and "metrics row at step 4" in m for m in warned
    ), warned
    assert re.search(problem, "\n".join(warned))


def test_the_runs_table_skips_a_badly_typed_row_too(tmp_path: Path) -> None:
    """wb.runs() reads the newest training row as status does: a loss written as text is skipped,
    the row before it shown, and the table renders."""
    good = [{"step": s, "loss": 2.0 - s / 10, "schema_version": 1} for s in (1, 2, 3)]
    _run_with_rows(tmp_path, [*good, {**good[-1], "step": 4, "loss": "0.1"}])
    table = wb.runs(tmp_path / "runs")
    (row,) = table.rows
    assert row["loss"] == pytest.approx(1.7)
    assert "1.7" in repr(table) and "1.7" in table._repr_html_()


# ---- data: a local file's digest is not disclosed ------------------------------------------------
def test_a_local_file_of_the_wrong_size_is_named_without_its_size_or_digest(tmp_path: Path) -> None:
    secret = b"a local file a manifest should not learn about" * 3
    source = tmp_path / "elsewhere" / "secret.bin"
    source.parent.mkdir()
    source.write_bytes(secret)
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "probe.yaml").write_text(
        yaml.safe_dump(
            {
                "schema_version": 1,
                "name": "probe",
                "version": "1",
                "description": "a manifest naming a local file",
                "license": "CC0-1.0",
                "homepage": "",
                "files": [
                    {
                        "path": "blob.bin",
                        "urls": [source.as_uri()],
                        "sha256": "0" * 64,
                        "size": 10**6,
                    }
                ],
            }
        )
    )
    with pytest.raises(
        IntegrityError,
        match=rf"{source.as_uri()}: corrupt: its size differs from the manifest's \(compare "
        rf"`sha256sum {source}` with it\); replace or remove that file",
    ) as info:
        data.resolve(
            "probe",
            extra_dirs=[manifests],
            cache=tmp_path / "cache",
            mirrors=[],
            offline=False,
            progress=False,
        )
    message = str(info.value)
    assert hashlib.sha256(secret).hexdigest() not in message
    assert str(len(secret)) not in message.replace(str(tmp_path), "")
    assert info.value.actual is None
