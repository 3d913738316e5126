"""What `workbench bench BENCH` runs: the bench's library function called with the parsed
arguments, its table printed, the exit code saying whether it passed (cli.py's `_bench` settles the
result file first and names it after)."""

from __future__ import annotations

import argparse
from typing import Any


def result_name(args: argparse.Namespace) -> str:
    """The folder under benchmarks/results/ a bench keeps its result in: the bench's name, with what
    makes a result of another kind: `estimate --cited-only` (its rows are the published runs) and
    `overhead`'s mode other than ddp (each mode has its own budget: one file per mode and day)."""
    if args.bench_command == "estimate" and getattr(args, "cited_only", False):
        return "estimate-cited"
    if args.bench_command == "overhead" and args.mode != "ddp":
        return f"overhead-{args.mode}"
    if args.bench_command == "launch" and getattr(args, "cluster", None):
        return f"launch-{args.cluster}"
    return args.bench_command


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench `args.bench_command` names and print its table; 1 when it has a verdict and
    failed."""
    from workbench.commands import bench

    if args.bench_command in ("compile", "mfu", "checkpoint", "precision", "parallelism"):
        return _run_config_bench(args)
    if args.bench_command == "imports":
        return _verdict(bench.imports(repeats=args.repeats, json_path=args.json))
    if args.bench_command == "estimate":
        print(
            bench.estimate_accuracy(
                json_path=args.json, measured=not args.cited_only, cited=not args.no_cited
            ).table()
        )
        return 0
    if args.bench_command == "estimate-speed":
        from workbench.commands.bench.estimate_speed import CONDITIONS, MODELS, estimate_speed

        return _verdict(
            estimate_speed(
                tuple(args.models or MODELS),
                gpu=args.gpu,
                gpus=args.gpus,
                repeats=args.repeats,
                json_path=args.json,
                conditions=tuple(args.conditions or CONDITIONS),
            )
        )
    if args.bench_command == "launch" and args.cluster == "ray":
        from workbench.commands.bench.ray_launch import ray_launch

        return _verdict(ray_launch(args.pairs or 2, address=args.address, json_path=args.json))
    if args.bench_command == "launch":
        from workbench.commands.bench.launch_latency import launch_latency

        if args.address is not None:
            raise ValueError(f"--address {args.address}: only with --cluster ray")
        return _verdict(
            launch_latency(args.pairs or 8, cold_pairs=args.cold_pairs, json_path=args.json)
        )
    if args.bench_command == "big-run":
        from workbench.commands.bench.big_run import big_run

        return _verdict(big_run(rows=args.rows, json_path=args.json, keep=args.keep))
    if args.bench_command == "hf-overhead":
        from workbench.commands.bench.hf_overhead import hf_overhead

        return _verdict(
            hf_overhead(
                steps=args.steps,
                pairs=args.pairs,
                num_processes=args.num_processes,
                json_path=args.json,
            )
        )
    if args.bench_command == "dashboard":
        from workbench.commands.bench.dashboard_cost import dashboard_cost

        return _verdict(dashboard_cost(steps=args.steps, pairs=args.pairs, json_path=args.json))
    return _verdict(
        bench.overhead(
            steps=args.steps,
            repeats=args.repeats,
            num_processes=args.num_processes,
            json_path=args.json,
            mode=args.mode,
            device=args.device,
        )
    )


def _run_config_bench(args: argparse.Namespace) -> int:
    """The benches that run a RunConfig: their default one, or a YAML file, with --set overrides."""
    from workbench.commands import bench
    from workbench.config import RunConfig

    if args.bench_command == "compile":
        from workbench.commands.bench.compile_speed import COMPILE_BENCH, LAYOUTS, compile_bench

        cfg = (RunConfig.from_yaml(args.config) if args.config else COMPILE_BENCH).with_overrides(
            args.overrides
        )
        print(compile_bench(cfg, tuple(args.layouts or LAYOUTS), json_path=args.json).table())
        return 0
    if args.bench_command == "mfu":
        from workbench.commands.bench.mfu import MFU_BENCH, mfu

        cfg = (RunConfig.from_yaml(args.config) if args.config else MFU_BENCH).with_overrides(
            args.overrides
        )
        return _verdict(mfu(cfg, json_path=args.json))
    if args.bench_command == "checkpoint":
        from workbench.commands.bench import checkpoint_stall as ck

        cfg = RunConfig.from_yaml(args.config) if args.config else ck.CHECKPOINT_BENCH
        layouts = tuple(args.layouts or ck.LAYOUTS)
        cfg = cfg.with_overrides(args.overrides)
        if args.local_store:
            from workbench.storage.local_server import DESCRIPTION, local_store

            with local_store(args.url or "s3://workbench-bench") as url:
                report = ck.checkpoint_stall(
                    cfg, layouts, args.json, url=url, store=f"{url} on {DESCRIPTION}"
                )
        else:
            report = ck.checkpoint_stall(cfg, layouts, args.json, url=args.url)
        print(report.table())
        return 0
    if args.bench_command in ("precision", "parallelism"):
        default = (
            bench.PRECISION_BENCH if args.bench_command == "precision" else bench.PARALLELISM_BENCH
        )
        cfg = (RunConfig.from_yaml(args.config) if args.config else default).with_overrides(
            args.overrides
        )
        if args.bench_command == "precision":
            print(bench.precision(cfg, json_path=args.json).table())
        else:
            modes = tuple(args.modes) if args.modes else bench.MODES
            print(bench.parallelism(cfg, modes=modes, json_path=args.json).table())
        return 0
    raise AssertionError(f"not a config bench: {args.bench_command}")


def _verdict(report: Any) -> int:
    """Print a bench's table; its exit code: 0 if it passed, else 1."""
    print(report.table())
    return 0 if report.passed else 1
