"""workbench regress under misuse: two runs on one --out, a notebook that floods its output, one
that leaves processes running in new sessions, one that deletes its own folder.

The notebooks are written by each test (a cell or two, named after what they do); the ones that run
start a real python3 kernel (2-3 s each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
import yaml

from workbench.regress.out_lock import LOCK_NAME, OutInUse, hold_out
from workbench.regress.output_cap import output_size
from workbench.regress.runner import run as run_suite
from workbench.regress.suite import DEFAULT_OUTPUT_LIMIT_MB, load_targets
from workbench.utils.hardware import Hardware


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same device class ('cpu') on every machine, and no probing of its devices."""
    monkeypatch.setattr("workbench.utils.hardware.detect", lambda: Hardware(cpu_count=2))


def write_notebook(path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))
    return path


def write_suite(directory: Path, cases: list[dict[str, Any]]) -> Path:
    path = directory / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "cases": cases}, sort_keys=False))
    return path


def run_one(suite: Path, out: Path) -> tuple[int, dict[str, Any]]:
    code = run_suite(
        [suite], parameters={}, out=out, baselines=None, update_baselines=False, junit=None,
        profile=None,
    )  # fmt: skip
    (case,) = json.loads((out / "results.json").read_text())["cases"]
    return code, case


def wait_for(path: Path, seconds: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the first regress ended (rc {proc.returncode}) before {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {seconds} s")
        time.sleep(0.1)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- one run per --out ---------------------------------------------------------------------------
def test_the_out_lock_refuses_a_second_holder_naming_the_first_pid(tmp_path: Path) -> None:
    with hold_out(tmp_path):
        with pytest.raises(OutInUse, match=rf"--out {tmp_path}: .*\(pid {os.getpid()} on "):
            with hold_out(tmp_path):
                pass
    with hold_out(tmp_path):  # released at the end of the block: the next run takes it
        assert (tmp_path / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")


@pytest.mark.slow
def test_a_second_regress_on_the_same_out_is_refused_and_the_first_completes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The probe: two `workbench regress` on one --out; the second wiped the first's running case
    directory. Now the second is refused, naming the first's pid, and the first completes."""
    from workbench.cli import main

    notebook = write_notebook(
        tmp_path / "waits.ipynb",
        "import pathlib, time\npathlib.Path('started').write_text('1')\ntime.sleep(4)",
        "pathlib.Path('finished').write_text('1')",
    )
    out = tmp_path / "report"
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from workbench.cli import main; sys.exit(main())",
         "regress", str(notebook), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        case_dir = out / "cases" / "waits"
        wait_for(case_dir / "started", 120, first)
        code = main(["regress", str(notebook), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2
        assert f"another `workbench regress` (pid {first.pid} on " in err, err
        output, _ = first.communicate(timeout=120)
        assert first.returncode == 0, output
    finally:
        first.kill()
        first.wait(timeout=30)
    (case,) = json.loads((out / "results.json").read_text())["cases"]
    assert case["status"] == "new" and case["error"] is None
    assert (case_dir / "finished").exists()  # the first's case directory was left alone


# ---- output past the cap -------------------------------------------------------------------------
def test_output_size_counts_the_text_and_data_a_message_adds() -> None:
    assert output_size({"msg_type": "stream", "content": {"text": "abc"}}) == 3
    assert output_size({"msg_type": "display_data", "content": {"data": {"text/plain": "ab"}}}) == 2


@pytest.mark.parametrize("value", [0, -1, "10", True, float("inf")])
def test_a_bad_output_limit_is_rejected_naming_the_field(tmp_path: Path, value: Any) -> None:
    write_notebook(tmp_path / "n.ipynb", "x = 1")
    suite = write_suite(tmp_path, [{"notebook": "n.ipynb", "output_limit_mb": value}])
    with pytest.raises(ValueError, match=r"cases\[0\]: output_limit_mb=.*use MiB > 0, e.g. 50"):
        load_targets([suite])


def test_cases_get_the_default_output_limit_or_their_own(tmp_path: Path) -> None:
    write_notebook(tmp_path / "n.ipynb", "x = 1")
    suite = write_suite(
        tmp_path,
        [{"notebook": "n.ipynb"}, {"notebook": "n.ipynb", "name": "m", "output_limit_mb": 2}],
    )
    assert [c.output_limit_mb for c in load_targets([suite])] == [DEFAULT_OUTPUT_LIMIT_MB, 2.0]


@pytest.mark.slow
def test_a_notebook_printing_past_the_cap_is_an_output_limit_error_not_a_timeout(
    tmp_path: Path,
) -> None:
    """The probe, scaled down: a notebook printing 300 MB was reported as a 300 s timeout after 26 s
    (nbclient's IOPub wait) and kept whole. Here 5 MB against a 1 MiB cap."""
    write_notebook(
        tmp_path / "floods.ipynb",
        "for i in range(5000):\n    print('x' * 1000)",
        "open('after', 'w').write('ran')",
    )
    suite = write_suite(
        tmp_path, [{"notebook": "floods.ipynb", "output_limit_mb": 1, "timeout_s": 300}]
    )
    started = time.monotonic()
    code, case = run_one(suite, tmp_path / "report")
    assert time.monotonic() - started < 120
    assert code == 2
    error = case["error"]
    assert error["kind"] == "output limit", error
    assert "output_limit_mb=1 in cell 1" in error["message"]
    assert error["cell_source"].startswith("for i in range(5000)")
    (executed,) = map(Path, case["executed"])
    assert executed.stat().st_size < 2 * 2**20  # kept up to the cap, not 5 MB
    assert "the output reached output_limit_mb=1" in executed.read_text()
    assert not (executed.parent / "after").exists()  # the kernel was stopped there


def test_output_arriving_after_its_cell_ended_is_an_output_timeout_not_the_case_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nbclient's wait for a finished cell's output (iopub_timeout) is not the case's timeout_s: the
    probe's 300 MB notebook read as 'ran longer than timeout_s=300 s' after 26 s. nbclient's
    own error is raised here in place of papermill's execution, long before timeout_s."""
    import papermill
    from nbclient.exceptions import CellTimeoutError

    from workbench.regress.execution import execute

    cell = nbformat.v4.new_code_cell("print('x' * 300_000_000)")

    def iopub_timeout(*args: Any, **kwargs: Any) -> None:
        raise CellTimeoutError.error_from_timeout_and_cell(
            "Timeout waiting for IOPub output", 30, cell
        )

    monkeypatch.setattr(papermill, "execute_notebook", iopub_timeout)
    notebook = write_notebook(tmp_path / "n.ipynb", cell.source)
    error = execute(notebook, tmp_path / "out.ipynb", tmp_path, {}, timeout_s=300)
    assert error is not None and error.kind == "output timeout", error
    assert "did not all arrive within 30 s" in error.message
    assert "timeout_s" not in error.message


# ---- processes a notebook leaves behind ----------------------------------------------------------
@pytest.mark.slow
def test_a_timed_out_case_kills_children_started_in_new_sessions(tmp_path: Path) -> None:
    """The probe: a child started with start_new_session=True survived the kernel kill. Also one
    detached at once (setsid from a shell that exits), before anything could see it as the
    kernel's descendant."""
    pids = tmp_path / "pids"
    write_notebook(
        tmp_path / "leaves_sleepers.ipynb",
        "import pathlib, subprocess\n"
        "p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        f"subprocess.run(['sh', '-c', 'setsid sleep 601 & echo $! > {pids}'])\n"
        f"with open({str(pids)!r}, 'a') as f:\n"
        "    f.write(f'{p.pid}\\n')",
        "import time\ntime.sleep(60)",
    )
    suite = write_suite(tmp_path, [{"notebook": "leaves_sleepers.ipynb", "timeout_s": 3}])
    try:
        code, case = run_one(suite, tmp_path / "report")
        left = [int(p) for p in pids.read_text().split()]
        assert code == 2 and case["error"]["kind"] == "timeout"
        assert len(left) == 2
        assert [pid for pid in left if not gone(pid)] == []
        (note,) = [n for n in case["notes"] if "left 2 process(es) running" in n]
        assert "sleep 600" in note and "sleep 601" in note
    finally:
        for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
            if not gone(pid):
                os.kill(pid, 9)


# ---- a notebook that deletes its folder ----------------------------------------------------------
@pytest.mark.slow
def test_a_notebook_deleting_its_folder_is_an_error_naming_the_folder(tmp_path: Path) -> None:
    """The probe: FileNotFoundError naming no path (papermill's os.getcwd() in a deleted folder)."""
    write_notebook(
        tmp_path / "deletes_folder.ipynb", "import os, shutil\nshutil.rmtree(os.getcwd())"
    )
    suite = write_suite(tmp_path, [{"notebook": "deletes_folder.ipynb"}])
    here = os.getcwd()
    code, case = run_one(suite, tmp_path / "report")
    assert os.getcwd() == here
    case_dir = tmp_path / "report" / "cases" / "t.deletes_folder"
    assert code == 2
    assert case["error"]["kind"] == "folder deleted"
    assert f"working directory {case_dir} was deleted" in case["error"]["message"]
    assert "shutil.rmtree" in case["error"]["cell_source"]
    (executed,) = map(Path, case["executed"])
    assert "shutil.rmtree" in executed.read_text()  # saved again for the report's link
