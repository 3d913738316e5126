"""The subcommands' arguments for `workbench` (cli.py builds the parser from these and
dispatches)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def estimate_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "estimate",
        help="memory, time and cost per rank before launching, on this machine or an "
        "accelerator to rent",
    )
    e.add_argument("config", type=Path)
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.add_argument(
        "--gpu", default=None, help="catalog name, e.g. H100-SXM-80GB (default: this machine)"
    )
    e.add_argument(
        "--gpus", type=int, default=None, help="GPUs (ranks) per node (default: num_processes)"
    )
    e.add_argument("--nodes", type=int, default=1)
    e.add_argument("--network", choices=["infiniband", "ethernet"], default="infiniband")
    e.add_argument(
        "--compare", action="store_true", help="the same run on every catalog accelerator"
    )
    e.add_argument(
        "--suggest",
        action="store_true",
        help="when it doesn't fit: changes that would, each estimated",
    )


def _result_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the result as JSON here (default: benchmarks/results/BENCH/DATE-MACHINE.json "
        "when ./benchmarks/results exists, as in a workbench checkout)",
    )
    parser.add_argument("--no-json", action="store_true", help="write no result file")


def _config_bench(
    bsub: argparse._SubParsersAction, name: str, text: str, default: str
) -> argparse.ArgumentParser:
    """A bench that runs a RunConfig: an optional YAML (`default` without one), --set overrides,
    --json."""
    parser = bsub.add_parser(name, help=text)
    parser.add_argument(
        "config", type=Path, nargs="?", default=None, help=f"RunConfig YAML (default: {default})"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _result_args(parser)
    return parser


def bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    o = bsub.add_parser(
        "overhead", help="trainer against a hand-written loop (ddp, zero3, tp or pp), side by side"
    )
    o.add_argument(
        "--mode",
        choices=["ddp", "zero3", "tp", "pp"],
        default="ddp",
        help="layout of both loops: ddp (Accelerate, digits MLP), zero3 (FSDP2), tp (tensor "
        "parallel over all ranks) or pp (a 1F1B pipeline, a stage per rank); the last three "
        "on char-gpt 'tiny'",
    )
    o.add_argument("--steps", type=int, default=200)
    o.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="back-to-back pairs of runs (the overhead is the median of their differences)",
    )
    o.add_argument("--num-processes", type=int, default=2)
    o.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default=None,
        help="where both loops train (default: the CPU, whatever the machine has)",
    )
    _result_args(o)
    _run_benches(bsub)
    la = bsub.add_parser(
        "launch",
        help="wb.launch of a 1-step 2-rank run against accelerate.notebook_launcher "
        "running the equivalent function, interleaved",
    )
    la.add_argument("--pairs", type=int, default=8, help="back-to-back pairs, order alternating")
    la.add_argument(
        "--cold-pairs", type=int, default=1, help="first launches in fresh interpreters, each side"
    )
    _result_args(la)
    im = bsub.add_parser(
        "imports",
        help="importing the rank side against `import torch, accelerate`, in fresh "
        "interpreters side by side",
    )
    im.add_argument("--repeats", type=int, default=7, help="interleaved pairs of interpreters")
    _result_args(im)
    _estimate_benches(bsub)
    da = bsub.add_parser(
        "dashboard",
        help="the quickstart run headless against the same run with a live dashboard, "
        "side by side: what the dashboard costs the ranks",
    )
    da.add_argument("--steps", type=int, default=2000)
    da.add_argument("--pairs", type=int, default=4, help="back-to-back pairs, order alternating")
    _result_args(da)
    br = bsub.add_parser(
        "big-run",
        help="reading a run of 200,000 logged steps: workbench status, the last row, "
        "RunResult.metrics, plot() and the dashboard's first view, timed",
    )
    br.add_argument("--rows", type=int, default=200_000, help="training rows of the synthetic run")
    br.add_argument(
        "--keep", type=Path, default=None, help="write the run into this folder and leave it there"
    )
    _result_args(br)


def _run_benches(bsub: argparse._SubParsersAction) -> None:
    """The benches that train a RunConfig of their own (or yours): precision, parallelism, compile,
    mfu, checkpoint."""
    _config_bench(
        bsub,
        "precision",
        "the same run in every precision this machine supports, side by side",
        "char-gpt 'small' on one device, 50 steps",
    )
    pa = _config_bench(
        bsub,
        "parallelism",
        "the same run under every parallel layout (data, tensor, pipeline), side by side",
        "char-gpt 'tiny' on 2 processes, 30 steps",
    )
    pa.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="layouts to run (default: ddp zero1 zero2 zero3 hsdp tp pp zero3xtp ppxddp "
        "ppinterleaved ppzerobubble ppxzero3xtp hsdpxtp)",
    )
    co = _config_bench(
        bsub,
        "compile",
        "eager against torch.compile per layout (ddp, zero3, tp, pp, one process), "
        "side by side: step time, its matmul floor, first step cold and warm, losses",
        "char-gpt 4 x 256, context 128, 2 ranks, 20 steps, compile blocks",
    )
    co.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        help="layouts to run (default: ddp zero3 tp pp one; one: a single process on every core, "
        "micro-batch 16)",
    )
    _config_bench(
        bsub,
        "mfu",
        "model FLOPs utilisation of one device on GPT-2 small's shape (target: 45%% in bf16, "
        "blocks compiled, on one H100)",
        "char-gpt 'gpt2-small', bf16, compile blocks, 30 steps",
    )
    ck = _config_bench(
        bsub,
        "checkpoint",
        "how long each checkpoint stops training, written "
        "synchronously against in the background (checkpoint_async), side by side",
        "char-gpt 'small' on 2 CPU ranks, 16 steps, a checkpoint every 2",
    )
    ck.add_argument(
        "--layouts", nargs="+", default=None, help="layouts to run (default: ddp zero3)"
    )


def _estimate_benches(bsub: argparse._SubParsersAction) -> None:
    """`bench estimate` (its accuracy) and `bench estimate-speed`."""
    es = bsub.add_parser(
        "estimate",
        help="estimated against measured peak per rank, every mode, "
        "two model shapes; then against each published run the catalog cites",
    )
    part = es.add_mutually_exclusive_group()
    part.add_argument(
        "--no-cited", action="store_true", help="leave out the published runs (minutes of tracing)"
    )
    part.add_argument(
        "--cited-only", action="store_true", help="only the published runs: no training here"
    )
    _result_args(es)
    sp = bsub.add_parser(
        "estimate-speed",
        help="the first estimate in a fresh interpreter (library and panel box), "
        "and changes answered from the trace in memory",
    )
    sp.add_argument(
        "--models", nargs="+", default=None, help="digits and/or gpt2-small (default: both)"
    )
    sp.add_argument("--gpu", default="H100-SXM-80GB", help="catalog accelerator of the target")
    sp.add_argument("--gpus", type=int, default=8, help="GPUs per node of the target")
    sp.add_argument(
        "--repeats", type=int, default=3, help="fresh interpreters per model and way in"
    )
    _result_args(sp)


def doctor_parser(sub: argparse._SubParsersAction) -> None:
    dr = sub.add_parser(
        "doctor",
        help="what this machine offers for distributed training (devices, links, "
        "versions, environment, all-reduce bandwidth, input pipeline, data cache) "
        "and what to fix",
    )
    dr.add_argument("--json", action="store_true", help="print the report as JSON")
    dr.add_argument(
        "--quick", action="store_true", help="fewer and smaller all-reduce sizes, shorter timings"
    )
    dr.add_argument(
        "--task",
        default=None,
        help="task whose input pipeline to measure (default: digits, or the "
        "config's), e.g. char-gpt",
    )
    dr.add_argument(
        "--config",
        type=Path,
        default=None,
        help="RunConfig YAML: its task, micro_batch_size, num_workers",
    )
    dr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    dr.add_argument(
        "--ranks", type=int, default=None, help="all-reduce ranks (default: every GPU, or 2 on CPU)"
    )
    dr.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds the all-reduce sweep may take before its ranks are killed (default 120)",
    )
    dr.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="SECTION",
        choices=["devices", "versions", "environment", "allreduce", "input_pipeline", "cache_read"],
        help="leave a section out (repeatable)",
    )


def train_parser(sub: Any) -> None:
    t = sub.add_parser(
        "train", help="train from a RunConfig YAML file (accelerate launch under the hood)"
    )
    t.add_argument("config", type=Path, help="RunConfig YAML")
    t.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set max_steps=200 --set task_options.n_layer=4",
    )
    t.add_argument(
        "--mode",
        choices=["subprocess", "fork"],
        default=None,
        help="deprecated: use --set start_method=subprocess|fork|spawn (default from the shell: "
        "subprocess, accelerate launch / torchrun)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument(
        "--prepare-only",
        action="store_true",
        help="create the run directory and print it, for launching `-m workbench.worker RUN_DIR` "
        "yourself (multi-node, Slurm)",
    )
    t.add_argument(
        "--slurm",
        metavar="KEY=VALUE,...",
        help="submit to Slurm instead of running here, e.g. partition=gpu,nodes=2,gpus_per_node=8 "
        "(time, mem, account, qos, constraint, cpus_per_task, processes_per_node; others are "
        "sbatch options); prints the job id and the run directory",
    )
    t.add_argument(
        "--follow",
        action="store_true",
        help="with --slurm: wait for the job and print how it ended",
    )
