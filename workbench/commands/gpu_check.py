"""`scripts/gpu-check`: on a machine with CUDA GPUs, everything that only a GPU can check, in one command.

It runs the `gpu`-marked tests, `workbench doctor`, and the benches whose figures the README keeps per device
(precision, MFU of GPT-2 small's shape compiled, estimate against measured, compile, overhead against hand-written
loops, parallelism where there are GPUs enough), saves each step's full output under --out, and ends with each
bench's table headed by the device and the date, ready for the README. A step the machine can't run is listed as
skipped with the reason, never left out silently. `--dry-run` lists the steps without running them (on any
machine).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    skipped: str = ""
    """Why this machine can't run it ("" when it runs)."""
    table: bool = True
    """Its output ends with a table for the README."""


MFU_SHAPE = ["task_options.preset=gpt2-small", "compile=blocks", "micro_batch_size=16", "max_steps=30"]
"""The MFU target's run (45% in bf16 on one H100): GPT-2 small's shape, each block compiled, nanoGPT's batch."""


def plan(gpus: int, out: Path) -> list[Step]:
    """The steps for a machine with `gpus` CUDA GPUs, writing their JSON under `out`."""
    cli = [sys.executable, "-m", "workbench.cli"]
    two = "" if gpus >= 2 else f"needs 2 GPUs for its layouts (tp, pp, sharding over ranks); this machine has {gpus}"
    return [
        # -n 0: one test at a time (the suite's two workers would share the GPUs)
        Step("gpu tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-q", "-rA", "-p",
                           "no:cacheprovider", str(REPO / "tests")], 600, table=False),
        Step("doctor", [*cli, "doctor", "--quick"], 180, table=False),
        Step("bench precision", [*cli, "bench", "precision", "--json", str(out / "precision.json")], 600),
        Step("bench mfu", [*cli, "bench", "precision", *(a for kv in MFU_SHAPE for a in ("--set", kv)),
                           "--json", str(out / "mfu.json")], 900),
        Step("bench estimate", [*cli, "bench", "estimate", "--json", str(out / "estimate.json")], 900),
        Step("bench compile", [*cli, "bench", "compile", "--set", f"num_processes={2 if gpus >= 2 else 1}",
                               *(["--layouts", "ddp"] if gpus < 2 else []), "--json", str(out / "compile.json")],
             900),
        Step("bench parallelism", [*cli, "bench", "parallelism", "--set", f"num_processes={min(max(gpus, 2), 8)}",
                                   "--json", str(out / "parallelism.json")], 900, skipped=two),
        # ddp runs on one GPU too (its ranks, the trainer's and the hand loop's, as many as there are, up to 2).
        *(Step(f"bench overhead {mode}", [*cli, "bench", "overhead", "--mode", mode, "--device", "cuda",
                                          "--num-processes", str(min(max(gpus, 1), 2)), "--repeats", "5",
                                          "--json", str(out / f"overhead-{mode}.json")], 900,
               skipped="" if mode == "ddp" else two) for mode in ("ddp", "zero3", "tp", "pp")),
    ]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_line(gpus: int) -> str:
    import torch

    name = torch.cuda.get_device_name(0) if gpus else "no CUDA GPU"
    return (f"{gpus} x {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"{datetime.date.today().isoformat()}")


def run(steps: list[Step], out: Path) -> int:
    """Run each step in turn (a failing one doesn't stop the rest); returns how many failed."""
    failed, tables = 0, []
    for step in steps:
        if step.skipped:
            print(f"== {step.name}: skipped ({step.skipped})", flush=True)
            continue
        print(f"== {step.name}: {' '.join(step.argv[1:])}", flush=True)
        started = time.monotonic()
        log = out / f"{step.name.replace(' ', '-')}.log"
        try:
            done = subprocess.run(step.argv, capture_output=True, text=True, timeout=step.timeout_s, cwd=REPO)
            stdout, err, code = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            stdout, err, code = _text(e.stdout), f"{_text(e.stderr)}\ntimed out after {step.timeout_s} s", -1
        log.write_text(stdout + err)
        failed += code != 0
        print(f"   exit {code} in {time.monotonic() - started:.0f} s; log {log}", flush=True)
        print("\n".join("   " + line for line in (stdout + err).splitlines()[-3:]), flush=True)
        if step.table:  # the benches print their table on stdout, progress and warnings on stderr
            tables.append((step.name, [line for line in stdout.splitlines() if line.strip()
                                       and not line.startswith("launching")]))
    for name, lines in tables:
        print(f"\n### {name}\n" + "\n".join(lines[-30:]))
    return failed


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the steps and exit")
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder for the logs and JSON")
    parser.add_argument("--skip", action="append", default=[], metavar="STEP",
                        help="leave a step out, by name (repeatable), e.g. --skip doctor")
    args = parser.parse_args(argv)
    gpus = gpu_count()
    steps = plan(gpus, args.out)
    names = {step.name for step in steps}
    if unknown := [name for name in args.skip if name not in names]:
        parser.error(f"--skip {unknown[0]!r}: no such step; the steps are {', '.join(sorted(names))}")
    for step in steps:
        step.skipped = "--skip" if step.name in args.skip else step.skipped
    print(f"gpu-check on {device_line(gpus)}")
    if args.dry_run:
        width = max(len(step.name) for step in steps)
        for step in steps:
            state = f"skipped: {step.skipped}" if step.skipped else f"up to {step.timeout_s} s"
            print(f"  {step.name:{width}}  {' '.join(step.argv[1:])}  ({state})")
        return 0
    if not gpus:
        print("gpu-check: no CUDA GPU is visible here (torch.cuda.is_available() is False); run it on a GPU machine, "
              "or use --dry-run to see the steps", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return 1 if run(steps, args.out) else 0


if __name__ == "__main__":
    sys.exit(main())
