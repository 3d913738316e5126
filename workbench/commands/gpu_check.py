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
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.commands.capped_steps import MARGIN_S, REPO, Step, dry_run, run

CLI = [sys.executable, "-m", "workbench.cli"]
DEFAULT_BUDGET_S = 540
"""One device command may run 600 s: 540 leaves a minute for the install before it and the copy-back
after."""


def plan(gpus: int, out: Path, tag: str = "gpu") -> list[Step]:
    """The steps for a machine with `gpus` CUDA GPUs, in the order they run, writing their JSON
    under `out`."""
    stamp = f"{datetime.date.today().isoformat()}-{tag}.json"
    bench = functools.partial(_bench_step, out / "results", stamp)
    return [*_one_gpu_steps(gpus, bench), *_two_gpu_steps(gpus, bench)]


def _bench_step(
    results: Path,
    stamp: str,
    name: str,
    bench_name: str,
    args: list[str],
    typical: int,
    cap: int,
    skipped: str = "",
) -> Step:
    """`workbench bench ARGS`, its JSON written to results/<bench_name>/<stamp>."""
    result = results / bench_name / stamp
    return Step(
        name,
        [*CLI, "bench", *args, "--json", str(result)],
        cap,
        skipped=skipped,
        typical_s=typical,
        result=result,
    )


def _one_gpu_steps(gpus: int, bench: Callable[..., Step]) -> list[Step]:
    """What one GPU runs, first."""
    # Caps (typical, max in s) for one H100/H200; the one-GPU steps' caps add up to 525 = 540 -
    # MARGIN_S.
    return [
        # GPT-2 small's shape, bf16, blocks compiled, one GPU: the MFU target (bench/mfu.py).
        bench("bench mfu", "mfu", ["mfu"], 60, 90),
        _gpu_tests(),
        # the published runs' part is the same on any machine (estimates only): run it on a CPU
        bench("bench estimate", "estimate", ["estimate", "--no-cited"], 60, 90),
        bench("bench precision", "precision", ["precision"], 45, 75),
        # ddp runs on one GPU too (its ranks, the trainer's and the hand loop's, as many as there
        # are, up to 2).
        bench(
            "bench overhead ddp",
            "overhead-ddp",
            _overhead_args("ddp", min(max(gpus, 1), 2)),
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
        Step("doctor", [*CLI, "doctor", "--quick"], 30, table=False, typical_s=15),
    ]


def _two_gpu_steps(gpus: int, bench: Callable[..., Step]) -> list[Step]:
    """The layouts that need 2 GPUs, last: skipped, saying why, on fewer."""
    two = (
        ""
        if gpus >= 2
        else f"needs 2 GPUs for its layouts (tp, pp, sharding over ranks); this machine has {gpus}"
    )
    return [
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
                _overhead_args(mode, 2),
                60,
                120,
                skipped=two,
            )
            for mode in ("zero3", "tp", "pp")
        ),
    ]


def _gpu_tests() -> Step:
    """The `gpu`-marked tests."""
    # -n 0: one test at a time (the suite's two workers would share the GPUs)
    return Step(
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
    )


def _overhead_args(mode: str, processes: int) -> list[str]:
    """`bench overhead --mode MODE` on CUDA over `processes` ranks, 5 pairs."""
    return [
        "overhead",
        "--mode",
        mode,
        "--device",
        "cuda",
        "--num-processes",
        str(processes),
        "--repeats",
        "5",
    ]


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
    parser = _arguments()
    args = parser.parse_args(argv)
    started = time.monotonic()
    gpus = gpu_count()
    steps = _steps_for(gpus, args, parser)
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
    return _run_and_summarise(steps, args, device, started)


def _arguments() -> argparse.ArgumentParser:
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
    return parser


def _steps_for(gpus: int, args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Step]:
    """The plan for this machine with --skip's steps skipped; a --skip naming no step, or a
    --budget that leaves nothing, is refused (parser.error)."""
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
    return steps


def _run_and_summarise(
    steps: list[Step], args: argparse.Namespace, device: str, started: float
) -> int:
    """Run the steps in what is left of the budget, write the summary JSON and print the counts;
    1 if any step failed."""
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
