"""gpu-check's steps run one after another within a budget (gpu_check.py plans them): each in a
process group of its own, killed at its cap; a step whose cap no longer fits what is left of the
budget is skipped, with the seconds left and needed. `dry_run` plans the same way, as if every step
ran to its cap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

MARGIN_S = 15
"""Kept from the budget for starting processes, killing one and writing the summary."""


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    """Its cap: the most it may run before its process group is killed (also what the budget plans
    with)."""
    skipped: str = ""
    """Why this machine can't run it ("" when it runs)."""
    table: bool = True
    """Its output ends with a table of what each step found."""
    typical_s: int = 0
    """How long it usually takes (0: not declared); only shown, the plan uses the cap."""
    result: Path | None = None
    """The JSON it writes, if any."""


def for_time(step: Step, left: float) -> str:
    """Why `step` can't run with `left` seconds of the budget left ("" when its cap fits)."""
    return (
        ""
        if step.timeout_s <= left
        else f"{max(left, 0):.0f} s left, needs up to {step.timeout_s} s"
    )


def dry_run(steps: list[Step], budget_s: float) -> list[str]:
    """Each step's line, planned as if every step ran to its cap."""
    left, width, lines = budget_s - MARGIN_S, max(len(step.name) for step in steps), []
    for step in steps:
        if not (why := step.skipped or for_time(step, left)):
            left -= step.timeout_s
        typical = f", typically {step.typical_s} s" if step.typical_s else ""
        state = f"skipped: {why}" if why else f"up to {step.timeout_s} s{typical}"
        lines.append(f"  {step.name:{width}}  {' '.join(step.argv[1:])}  ({state})")
    return lines


def run(
    steps: list[Step],
    out: Path,
    budget_s: float | None = None,
    outcomes: list[dict[str, Any]] | None = None,
) -> int:
    """Run each step in turn within `budget_s` (less MARGIN_S; a failing one doesn't stop the rest),
    appending each step's outcome to `outcomes`. Returns how many failed or timed out."""
    deadline = time.monotonic() + (budget_s - MARGIN_S if budget_s is not None else float("inf"))
    failed, tables, outcomes = 0, [], ([] if outcomes is None else outcomes)
    for step in steps:
        outcome: dict[str, Any] = {
            "step": step.name,
            "cap_s": step.timeout_s,
            "typical_s": step.typical_s,
            "command": step.argv[1:],
        }
        outcomes.append(outcome)
        if why := step.skipped or for_time(step, deadline - time.monotonic()):
            print(f"== {step.name}: skipped ({why})", flush=True)
            outcome.update(status="skipped", reason=why)
            continue
        print(f"== {step.name} (up to {step.timeout_s} s): {' '.join(step.argv[1:])}", flush=True)
        started = time.monotonic()
        log = out / f"{step.name.replace(' ', '-')}.log"
        if step.result:
            step.result.parent.mkdir(parents=True, exist_ok=True)
        stdout, err, code, timed_out = _run_capped(step.argv, step.timeout_s)
        seconds = time.monotonic() - started
        log.write_text(stdout + err)
        failed += code != 0
        status = "timed out" if timed_out else "passed" if code == 0 else "failed"
        outcome.update(
            status=status,
            exit_code=code,
            seconds=round(seconds, 1),
            log=str(log),
            result=str(step.result) if step.result and step.result.is_file() else None,
        )
        print(f"   {status} (exit {code}) in {seconds:.0f} s; log {log}", flush=True)
        print("\n".join("   " + line for line in (stdout + err).splitlines()[-3:]), flush=True)
        if step.table:  # the benches print their table on stdout, progress and warnings on stderr
            tables.append(
                (
                    step.name,
                    [
                        line
                        for line in stdout.splitlines()
                        if line.strip() and not line.startswith("launching")
                    ],
                )
            )
    for name, lines in tables:
        print(f"\n### {name}\n" + "\n".join(lines[-30:]))
    return failed


def _run_capped(argv: list[str], cap_s: float) -> tuple[str, str, int, bool]:
    """stdout, stderr, exit code and whether it was killed: its own process group, SIGKILLed at
    `cap_s`. Output goes to files, not pipes, so a grandchild still holding them can't keep us
    waiting."""
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, cwd=REPO, start_new_session=True)
        timed_out = False
        try:
            code = proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = proc.wait()
        o.seek(0), e.seek(0)
        stdout, err = _text(o.read()), _text(e.read())
    if timed_out:
        err += f"\ntimed out after {cap_s} s: killed its process group\n"
    return stdout, err, code, timed_out


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""
