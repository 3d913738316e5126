"""The subcommands' arguments for `workbench` (bench_arguments.py has `workbench bench`'s; cli.py
builds the parser from these and dispatches)."""

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


def status_parser(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser(
        "status",
        help="how a run stands: status (a run whose processes are gone says so), "
        "progress, ending or error, checkpoints",
    )
    st.add_argument("run_dir", type=Path)


def check_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "check",
        help="validate a RunConfig YAML for this machine (or --gpu: the hardware it is "
        "planned for) and show what it implies",
    )
    c.add_argument("config", type=Path)
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument(
        "--gpu",
        default=None,
        help="plan for a catalog accelerator (see `workbench estimate --compare`)",
    )
    c.add_argument(
        "--gpus-per-node", type=int, default=0, help="with --gpu (default: num_processes / nodes)"
    )
    c.add_argument("--nodes", type=int, default=1, help="with --gpu")


def demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo", help="the README's main job: digits on 2 CPU processes of DDP, offline"
    )
    d.add_argument("--runs-dir", default="runs")
    d.add_argument("--num-processes", type=int, default=2)
    d.add_argument("--steps", type=int, default=300)


def data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="datasets declared in data-manifests/")
    dsub = data.add_subparsers(dest="data_command", required=True)
    dsub.add_parser("list", help="the declared datasets")
    for name, text in (
        ("show", "a manifest in full"),
        ("fetch", "fill the cache (mirror or URLs)"),
        ("path", "the local directory of a dataset, fetched if needed"),
    ):
        dsub.add_parser(name, help=text).add_argument("name")
    dsub.add_parser(
        "verify", help="re-hash the cache; exit 1 if any file is missing or corrupt"
    ).add_argument("name", nargs="?")


def regress_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "regress", help="run notebooks headless with papermill and compare to baselines"
    )
    r.add_argument(
        "targets", nargs="+", type=Path, help="notebooks (.ipynb) or suite files (.yaml)"
    )
    r.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="papermill parameter for every case",
    )
    r.add_argument("--out", type=Path, required=True, help="report directory")
    r.add_argument(
        "--baselines", type=Path, default=None, help="baseline directory (default: suite's)"
    )
    r.add_argument("--update-baselines", action="store_true", help="write baselines from this run")
    r.add_argument("--junit", type=Path, default=None, help="also write a JUnit XML file")
    r.add_argument("--profile", default=None, help="only cases of this profile (e.g. smoke, full)")
    r.add_argument(
        "--slurm",
        metavar="KEY=VALUE,...",
        default=None,
        help="run each case as a task of one Slurm job array "
        "(partition=gpu,gpus_per_node=1,time=60, ...); the report and JUnit file are written "
        "here",
    )


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
    # one engine per run: argparse refuses both, naming them
    where = t.add_mutually_exclusive_group()
    where.add_argument(
        "--slurm",
        metavar="KEY=VALUE,...",
        help="submit to Slurm instead of running here, e.g. partition=gpu,nodes=2,gpus_per_node=8 "
        "(time, mem, account, qos, constraint, cpus_per_task, processes_per_node; others are "
        "sbatch options); prints the job id and the run directory",
    )
    where.add_argument(
        "--ray",
        metavar="KEY=VALUE,...",
        help="run the ranks as Ray Train workers on a Ray cluster instead of here, e.g. "
        "address=10.0.0.1:6379,max_failures=1 (workers, use_gpu, placement_strategy, namespace, "
        "resources_per_worker=CPU:8;GPU:1; address: $RAY_ADDRESS or the cluster `ray start` "
        "brought up here when not given); prints the driver and the run directory",
    )
    t.add_argument(
        "--follow",
        action="store_true",
        help="with --slurm or --ray: wait for the run and print how it ended",
    )
