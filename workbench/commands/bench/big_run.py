"""`workbench bench big-run`: what reading a run of 200,000 logged steps costs, for each way a user
looks at one.

A synthetic run directory is written first (synthetic_run.py): a completed digits run on 2 ranks
whose metrics.jsonl holds `rows` training rows shaped as a real run's (the keys, value types and
sizes of a digits run's rows: per-rank memory and step-time breakdown, the verdicts, ~1.1 KB a row)
and an eval row every `eval_every` steps. Then each reader is timed on it, each in a fresh fork of
this process (so one's memory or caches never help the next), with the peak memory it added (the
resident high-water mark, reset at its start):

- `workbench status RUN_DIR`, a subprocess of its own: start-up and imports included, as a user runs
  it;
- RunDir.last_train_row(), what a repr and `workbench status` read;
- RunResult.metrics, first access and second (parsed once, then kept);
- RunResult.plot() and its PNG, what a notebook cell shows;
- the Dashboard's first view (built, numbers and figure), its imports (matplotlib, ipywidgets) done
  before, as in a kernel that shows dashboards.

Targets (issue 35): status and the dashboard's first view within 1 s, RunResult.metrics within 3 s,
its memory within 3x the file's size.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.commands.bench.results import write_result
from workbench.commands.bench.synthetic_run import EVAL_EVERY, ROWS, write_big_run

TARGET_S = {"status": 1.0, "dashboard_first_view": 1.0, "metrics_first": 3.0}
"""The most seconds each may take on a 200k-row run (issue 35)."""
MEMORY_TARGET = 3.0
"""RunResult.metrics may add at most this many times the file's size in memory."""


@dataclass
class Measured:
    """One reader, timed in a fresh fork."""

    name: str
    seconds: float
    peak_added_bytes: int | None
    """What the reader added to the resident high-water mark (None where /proc can't say)."""
    note: str = ""


@dataclass
class BigRunReport:
    rows: int
    file_bytes: int
    measured: list[Measured] = field(default_factory=list)

    def get(self, name: str) -> Measured:
        return next(m for m in self.measured if m.name == name)

    @property
    def memory_ratio(self) -> float | None:
        peak = self.get("metrics_first").peak_added_bytes
        return None if peak is None else peak / self.file_bytes

    @property
    def verdicts(self) -> dict[str, bool]:
        found = {name: self.get(name).seconds <= limit for name, limit in TARGET_S.items()}
        ratio = self.memory_ratio
        found["metrics_memory"] = ratio is not None and ratio <= MEMORY_TARGET
        return found

    @property
    def passed(self) -> bool:
        return all(self.verdicts.values())

    def table(self) -> str:
        lines = [
            f"workbench bench big-run: a run of {self.rows:,} rows ({self.file_bytes / 2**20:,.0f} "
            "MiB file)",
            f"  {'reader':28} {'seconds':>8} {'peak added':>11}  target",
        ]
        for m in self.measured:
            target = f"<= {TARGET_S[m.name]:g} s" if m.name in TARGET_S else ""
            peak = "–" if m.peak_added_bytes is None else f"{m.peak_added_bytes / 2**20:,.0f} MiB"
            lines.append(
                f"  {m.name:28} {m.seconds:8.3f} {peak:>11}  "
                f"{target}{'  ' + m.note if m.note else ''}"
            )
        ratio = self.memory_ratio
        lines.append(
            f"  RunResult.metrics memory: {'–' if ratio is None else f'{ratio:.2f}'}x the file "
            f"(target <= {MEMORY_TARGET:g}x)"
        )
        lines.append(
            "  verdict: "
            + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in self.verdicts.items())
        )
        return "\n".join(lines)


def _status_line(name: str) -> int | None:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM), None where there is none."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return None


def _in_a_fork(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`work()` in a fresh fork of this process, with the resident memory it added at its peak."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports through the pipe, never returns into the caller's code
        code = 0
        try:
            os.close(read_fd)
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark back to what is resident now
            before = _status_line("VmRSS")
            out = work()
            peak = _status_line("VmHWM")
            out["peak_added_bytes"] = (
                None if before is None or peak is None else max(0, peak - before)
            )
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            out, code = {"error": f"{type(e).__name__}: {e}"}, 1
        with os.fdopen(write_fd, "w") as pipe:
            pipe.write(json.dumps(out))
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    out = json.loads(text) if text else {"error": "the child died without a word"}
    if "error" in out:
        raise RuntimeError(f"bench big-run: a reader failed in its fork: {out['error']}")
    return out


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


_TIME_IT = """import os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:])
_, status, usage = os.wait4(proc.pid, 0)
code = os.waitstatus_to_exitcode(status)
print(time.perf_counter() - start, usage.ru_maxrss * 1024, code, file=sys.stderr)
"""
"""Runs a command and says its seconds, peak resident bytes and exit code. A small process of its
own starts it: a process forked from this one (matplotlib loaded, a run's rows read) would count
this one's memory as its own until it execs, and the kernel's peak for it would be ours."""


def _status(run_dir: Path) -> Measured:
    """`workbench status RUN_DIR` as a user runs it: a process of its own, imports included."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _TIME_IT,
            sys.executable,
            "-m",
            "workbench.cli",
            "status",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        seconds, peak, code = done.stderr.strip().splitlines()[-1].split()
    except (IndexError, ValueError):
        raise RuntimeError(
            f"bench big-run: timing workbench status failed: {done.stderr}"
        ) from None
    if int(code) != 0:
        raise RuntimeError(
            f"bench big-run: workbench status {run_dir} exited {code}: {done.stdout}{done.stderr}"
        )
    return Measured(
        "status",
        float(seconds),
        int(peak),
        "its whole process (interpreter and imports included); "
        + done.stdout.splitlines()[1].strip(),
    )


def _last_row(run_dir: Path) -> dict[str, Any]:
    from workbench.rundir import RunDir

    return {"seconds": _timed(RunDir(run_dir).last_train_row)}


def _metrics(run_dir: Path) -> dict[str, Any]:
    from workbench.launcher.result import RunResult

    result = RunResult.load(run_dir)
    first = _timed(lambda: result.metrics)
    return {"seconds": first, "second": _timed(lambda: result.metrics), "rows": len(result.metrics)}


def _plot(run_dir: Path) -> dict[str, Any]:
    import io

    from workbench.launcher.result import RunResult

    return {
        "seconds": _timed(
            lambda: RunResult.load(run_dir).plot().savefig(io.BytesIO(), format="png")
        )
    }


def _dashboard(run_dir: Path) -> dict[str, Any]:
    from workbench.notebook.dashboard import Dashboard

    made: list[Dashboard] = []
    seconds = _timed(lambda: made.append(Dashboard(run_dir)))
    return {"seconds": seconds, "rows": len(made[0].rows), "figures": made[0].figures_drawn}


def big_run(
    rows: int = ROWS,
    eval_every: int = EVAL_EVERY,
    json_path: Path | None = None,
    keep: Path | None = None,
) -> BigRunReport:
    """Write a `rows`-row run, then time each reader on it (module docstring). `keep`: write the run
    there and leave it (default: a temporary folder, removed after)."""
    if rows < 2:
        raise ValueError(f"rows={rows}: at least 2 (the benchmark's own run has {ROWS:,})")
    # Loaded here once, as a kernel showing dashboards has them: the forks measure reading, not
    # importing.
    import matplotlib

    matplotlib.use("Agg")
    import workbench.launcher.result
    import workbench.notebook.dashboard
    import workbench.notebook.plots  # noqa: F401

    with contextlib.ExitStack() as stack:
        folder = keep or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="wb-bench-big-run-"))
        )
        run_dir = folder / "big-run"
        path = write_big_run(run_dir, rows, eval_every)
        report = BigRunReport(rows=rows, file_bytes=path.stat().st_size)
        report.measured += _readers(run_dir)
    if json_path is not None:
        write_result(
            json_path,
            {
                **asdict(report),
                "memory_ratio": report.memory_ratio,
                "targets_s": TARGET_S,
                "memory_target": MEMORY_TARGET,
                "verdicts": report.verdicts,
                "passed": report.passed,
            },
        )
    return report


def _readers(run_dir: Path) -> list[Measured]:
    """Each reader timed on the run in `run_dir`, in the module docstring's order."""
    measured = [_status(run_dir)]
    row = _in_a_fork(lambda: _last_row(run_dir))
    measured.append(Measured("last_train_row", row["seconds"], row["peak_added_bytes"]))
    got = _in_a_fork(lambda: _metrics(run_dir))
    measured += [
        Measured("metrics_first", got["seconds"], got["peak_added_bytes"], f"{got['rows']:,} rows"),
        Measured("metrics_second", got["second"], None, "the same object again"),
    ]
    drawn = _in_a_fork(lambda: _plot(run_dir))
    measured.append(Measured("plot_png", drawn["seconds"], drawn["peak_added_bytes"]))
    dash = _in_a_fork(lambda: _dashboard(run_dir))
    measured.append(
        Measured(
            "dashboard_first_view",
            dash["seconds"],
            dash["peak_added_bytes"],
            f"{dash['rows']:,} rows read, {dash['figures']} figure",
        )
    )
    return measured
