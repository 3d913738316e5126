"""`scripts/gpu-check`: on a machine with CUDA GPUs, everything that only a GPU can check, in one
command that fits one device call (`--budget`, default 540 s: a 10-minute command less a margin).

Its steps run in the order of what they tell us: the MFU of GPT-2 small's shape (bf16, each block
compiled, one GPU), the `gpu`-marked tests, the estimate against `torch.cuda.max_memory_allocated`,
precision, the overhead against a hand-written ddp loop, compile, then `workbench doctor --quick`;
the layouts that need 2 GPUs come last. Each step declares a typical and a maximum duration (its
cap); a step runs only if its cap fits what is left of the budget, else it is listed as skipped with
the seconds left and needed. A step that outlives its cap is killed, its whole process group, and
reported as timed out; the rest go on. Each step's output goes to `--out/<step>.log`, each bench's
JSON to `--out/results/<bench>/<date>-<device>.json` (the layout of benchmarks/results/), and one
summary, `--out/gpu-check.json` (device, versions, date, each step's status and seconds), through
bench.results's `write_result`. `--dry-run` lists the steps, their caps and what the budget would
skip (on any machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

DEFAULT_BUDGET_S = 540
"""One device command may run 600 s: 540 leaves a minute for the install before it and the copy-back
after."""
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


def plan(gpus: int, out: Path, tag: str = "gpu") -> list[Step]:
    """The steps for a machine with `gpus` CUDA GPUs, in the order they run, writing their JSON
    under `out`."""
    cli = [sys.executable, "-m", "workbench.cli"]
    two = (
        ""
        if gpus >= 2
        else f"needs 2 GPUs for its layouts (tp, pp, sharding over ranks); this machine has {gpus}"
    )
    stamp = f"{datetime.date.today().isoformat()}-{tag}.json"

    def bench(
        name: str, bench_name: str, args: list[str], typical: int, cap: int, skipped: str = ""
    ) -> Step:
        result = out / "results" / bench_name / stamp
        return Step(
            name,
            [*cli, "bench", *args, "--json", str(result)],
            cap,
            skipped=skipped,
            typical_s=typical,
            result=result,
        )

    # Caps (typical, max in s) for one H100/H200; the one-GPU steps' caps add up to 525 = 540 -
    # MARGIN_S.
    return [
        # GPT-2 small's shape, bf16, blocks compiled, one GPU: the MFU target (bench/mfu.py).
        bench("bench mfu", "mfu", ["mfu"], 60, 90),
        # -n 0: one test at a time (the suite's two workers would share the GPUs)
        Step(
            "gpu tests",
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-n",
                "0",
                "-q",
                "-rA",
                "-p",
                "no:cacheprovider",
                str(REPO / "tests"),
            ],
            120,
            table=False,
            typical_s=60,
        ),
        # the published runs' part is the same on any machine (estimates only): run it on a CPU
        bench("bench estimate", "estimate", ["estimate", "--no-cited"], 60, 90),
        bench("bench precision", "precision", ["precision"], 45, 75),
        # ddp runs on one GPU too (its ranks, the trainer's and the hand loop's, as many as there
        # are, up to 2).
        bench(
            "bench overhead ddp",
            "overhead-ddp",
            [
                "overhead",
                "--mode",
                "ddp",
                "--device",
                "cuda",
                "--num-processes",
                str(min(max(gpus, 1), 2)),
                "--repeats",
                "5",
            ],
            40,
            60,
        ),
        bench(
            "bench compile",
            "compile",
            [
                "compile",
                "--set",
                f"num_processes={2 if gpus >= 2 else 1}",
                *(["--layouts", "ddp"] if gpus < 2 else []),
            ],
            40,
            60,
        ),
        Step("doctor", [*cli, "doctor", "--quick"], 30, table=False, typical_s=15),
        bench(
            "bench parallelism",
            "parallelism",
            ["parallelism", "--set", f"num_processes={min(max(gpus, 2), 8)}"],
            120,
            240,
            skipped=two,
        ),
        *(
            bench(
                f"bench overhead {mode}",
                f"overhead-{mode}",
                [
                    "overhead",
                    "--mode",
                    mode,
                    "--device",
                    "cuda",
                    "--num-processes",
                    "2",
                    "--repeats",
                    "5",
                ],
                60,
                120,
                skipped=two,
            )
            for mode in ("zero3", "tp", "pp")
        ),
    ]


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


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_name(gpus: int) -> str:
    import torch

    return torch.cuda.get_device_name(0) if gpus else "no CUDA GPU"


def device_line(gpus: int) -> str:
    import torch

    return (
        f"{gpus} x {gpu_name(gpus)}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{datetime.date.today().isoformat()}"
    )


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


def write_summary(
    path: Path, device: str, budget_s: float, seconds: float, outcomes: list[dict[str, Any]]
) -> None:
    """The one JSON a device call brings back: device, versions and date (`measured_on`), each
    step's outcome."""
    import platform

    import torch

    from workbench.commands.bench.results import write_result

    write_result(
        path,
        {
            "bench": "gpu-check",
            "device": device,
            "budget_s": budget_s,
            "seconds": round(seconds, 1),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
            },
            "steps": outcomes,
        },
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the steps, their caps and what the budget skips",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help=f"never run longer than this (default {DEFAULT_BUDGET_S}: one device call)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("gpu-check"), help="folder for the logs and JSON"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="STEP",
        help="leave a step out, by name (repeatable), e.g. --skip doctor",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    gpus = gpu_count()
    from workbench.commands.bench.results import device_tag

    steps = plan(gpus, args.out, device_tag(gpu_name(gpus)) if gpus else "gpu")
    names = {step.name for step in steps}
    if unknown := [name for name in args.skip if name not in names]:
        parser.error(
            f"--skip {unknown[0]!r}: no such step; the steps are {', '.join(sorted(names))}"
        )
    if args.budget <= MARGIN_S:
        parser.error(f"--budget {args.budget:g}: leaves nothing after the {MARGIN_S} s margin")
    for step in steps:
        step.skipped = "--skip" if step.name in args.skip else step.skipped
    device = device_line(gpus)
    print(f"gpu-check on {device}; budget {args.budget:g} s ({MARGIN_S} s kept for the summary)")
    if args.dry_run:
        print("\n".join(dry_run(steps, args.budget)))
        return 0
    if not gpus:
        print(
            "gpu-check: no CUDA GPU is visible here (torch.cuda.is_available() is False); run it "
            "on a GPU machine, or use --dry-run to see the steps",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    outcomes: list[dict[str, Any]] = []
    failed = run(steps, args.out, args.budget - (time.monotonic() - started), outcomes)
    summary = args.out / "gpu-check.json"
    write_summary(summary, device, args.budget, time.monotonic() - started, outcomes)
    counts = {
        s: sum(o["status"] == s for o in outcomes)
        for s in ("passed", "failed", "timed out", "skipped")
    }
    print(
        f"\ngpu-check: {', '.join(f'{n} {s}' for s, n in counts.items())} in "
        f"{time.monotonic() - started:.0f} s; summary {summary}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
