"""`workbench` command line: parses arguments and calls library functions, nothing more."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from workbench.commands.arguments import (
    check_parser,
    data_parser,
    demo_parser,
    doctor_parser,
    estimate_parser,
    regress_parser,
    status_parser,
    train_parser,
)
from workbench.commands.bench_arguments import bench_parser

log = logging.getLogger("workbench")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    # accelerate narrates every checkpoint file at INFO; keep the terminal for our progress bar.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    # "Executing notebook..." for every case
    logging.getLogger("papermill").setLevel(logging.WARNING)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="workbench", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    train_parser(sub)
    estimate_parser(sub)
    status_parser(sub)
    check_parser(sub)
    demo_parser(sub)
    data_parser(sub)
    regress_parser(sub)
    bench_parser(sub)
    doctor_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args.verbose)
    from workbench.data import DataUnavailableError
    from workbench.rundir import RunDirWriteError

    try:
        return _dispatch(args)
    except ValueError as e:  # validation errors: the message says which field and what would work
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (
        DataUnavailableError,
        RunDirWriteError,
    ) as e:  # the message says what is missing or could not be written
        print(f"error: {e}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    handlers = {
        "train": _train,
        "check": _check,
        "estimate": _estimate,
        "status": _status,
        "demo": _demo,
        "data": _data,
        "regress": _regress,
        "bench": _bench,
        "doctor": _doctor,
    }
    return handlers[args.command](args)


def _train(args: argparse.Namespace) -> int:
    if not args.prepare_only:
        from workbench.utils.preemption import launcher_takes_signals

        # first: a signal while the config, the task and torch load is a preemption too
        launcher_takes_signals(None)
    from workbench.config import RunConfig

    cfg = RunConfig.from_yaml(args.config).with_overrides(args.overrides)
    if getattr(args, "slurm", None) and not args.prepare_only:
        return _submit(cfg, args)
    if getattr(args, "ray", None) is not None and not args.prepare_only:
        return _submit_ray(cfg, args)
    from workbench.launcher.launch import check_launch

    cfg = _shell_start_method(cfg, args.mode)
    if args.prepare_only:
        cfg, _ = check_launch(cfg, None)  # the same checks as a launch
        return _prepare_only(cfg)
    return _launch(cfg, args)  # launch() checks first, and prints that it does


def _check(args: argparse.Namespace) -> int:
    """`workbench check`: the config validated for this machine, or planned for --gpu's."""
    from workbench.config import RunConfig
    from workbench.config.preflight import preflight

    cfg = RunConfig.from_yaml(args.config).with_overrides(args.overrides)
    from workbench.estimator.target import Target, check_plan
    from workbench.launcher.processes import describe_launch

    if args.gpu is None:
        preflight(cfg)
        print(describe_launch(cfg))
        return 0
    per_node = args.gpus_per_node or max(1, cfg.num_processes // args.nodes)
    target = Target(gpu=args.gpu, gpus_per_node=per_node, nodes=args.nodes)
    for warning in check_plan(cfg, target):
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"a valid plan for {target.describe(cfg)}: {cfg.dims.sizes_line()}, global batch "
        f"{cfg.global_batch_size}"
    )
    return 0


def _prepare_only(cfg: Any) -> int:
    """--prepare-only: the run directory made and printed, for launching the ranks yourself."""
    from workbench.rundir import lock, prepare

    _, run, token = prepare(cfg)
    lock.release(run, token)  # rank 0 takes it when the ranks start
    print(run.path)
    return 0


def _launch(cfg: Any, args: argparse.Namespace) -> int:
    """The run trained here: launched, waited for, its summary printed."""
    from workbench.launcher.launch import launch
    from workbench.launcher.preempted import EXIT_PREEMPTED
    from workbench.rundir import RunFailedError, RunPreemptedError
    from workbench.utils.preemption import before_launch, launcher_takes_signals

    launcher_takes_signals(cfg)  # and cfg.preempt_signal
    try:
        result = launch(cfg, progress=not args.no_progress)
    except RunPreemptedError as e:
        print(
            f"preempted: {e.exc_message} (run the same command with --set resume=auto, or resume: "
            "auto in the YAML, to continue)",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    except RunFailedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        before_launch.take()  # delivered again by the launch once the ranks were safe: acted on
    _print_summary(result.summary, result.run_dir)
    return 0


def _submit(cfg: Any, args: argparse.Namespace) -> int:
    from workbench.cluster.slurm import from_spec
    from workbench.cluster.submit import submit

    run = submit(cfg, from_spec(args.slurm))
    print(f"submitted: Slurm job {run.job_id}")
    print(run.run_dir)
    return _follow(run, args.follow)


def _submit_ray(cfg: Any, args: argparse.Namespace) -> int:
    """--ray: the run's ranks as Ray Train workers on the cluster; its driver outlives this command
    (follow it with `workbench status RUN_DIR`)."""
    from workbench.cluster.raytrain.spec import from_spec

    spec = from_spec(args.ray)  # a misspelt key is refused before Ray is imported
    try:
        from workbench.cluster.raytrain.submit import submit

        run = submit(cfg, spec)
    except ImportError as e:  # Ray isn't installed here: the message says how to install it
        print(f"error: {e}", file=sys.stderr)
        return 1
    job = run.job
    print(f"started on Ray: driver {job['actor']} at {job['address']}, {job['workers']} worker(s)")
    print(run.run_dir)
    return _follow(run, args.follow)


def _follow(run: Any, follow: bool) -> int:
    """--follow: wait for a submitted run and print how it ended."""
    from workbench.rundir import RunFailedError, RunPreemptedError

    if not follow:
        return 0
    try:
        result = run.wait()
    except (RunFailedError, RunPreemptedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print_summary(result.summary, result.run_dir)
    return 0


def _shell_start_method(cfg: Any, mode: str | None) -> Any:
    """start_method 'auto' from the shell is 'subprocess' (accelerate launch / torchrun); --mode is
    the older spelling of --set start_method, warned about and forwarded."""
    if mode is not None:
        print(
            f"workbench train: --mode {mode} is deprecated; use --set start_method="
            f"{'subprocess' if mode == 'subprocess' else 'fork'}",
            file=sys.stderr,
        )
        return cfg.replace(start_method="subprocess" if mode == "subprocess" else "fork")
    return cfg.replace(start_method="subprocess") if cfg.start_method == "auto" else cfg


def _estimate(args: argparse.Namespace) -> int:
    from workbench.config import RunConfig
    from workbench.estimator import estimate
    from workbench.estimator.alternatives import alternatives, compare, compare_table
    from workbench.tasks import get_task
    from workbench.utils.units import fmt_seconds

    cfg = RunConfig.from_yaml(args.config).with_overrides(args.overrides)
    task = get_task(cfg.task)
    if args.compare:
        gpus = args.gpus or cfg.num_processes
        print(f"{cfg.task} on {args.nodes} x {gpus} GPUs of each accelerator in the catalog:")
        print(compare_table(compare(cfg, task, gpus=gpus, nodes=args.nodes, network=args.network)))
        return 0
    est = estimate(cfg, args.gpu, args.gpus, args.nodes, task=task, network=args.network)
    print(est.table())
    if args.suggest and not est.fits:
        for what, alt in alternatives(cfg, est, task, network=args.network):
            print(f"  would fit with {what}: {alt.verdict()}, step {fmt_seconds(alt.step_s)}")
    return 0 if est.fits else 1


def _status(args: argparse.Namespace) -> int:
    from workbench.commands.status import describe_run

    text, code = describe_run(args.run_dir)
    print(text)
    return code


def _demo(args: argparse.Namespace) -> int:
    from workbench.commands.demo import run_demo

    return run_demo(runs_dir=args.runs_dir, num_processes=args.num_processes, steps=args.steps)


def _data(args: argparse.Namespace) -> int:
    from workbench import data

    if args.data_command == "list":
        manifests = data.list_manifests()
        width = max((len(m.name) for m in manifests), default=0)
        for m in manifests:
            print(f"{m.name:{width}}  v{m.version}  {m.license}\n{'':{width}}  {m.description}")
    elif args.data_command == "show":
        print(data.load_manifest(args.name).describe())
    elif args.data_command == "fetch":
        print(data.fetch(args.name).root)
    elif args.data_command == "path":
        print(data.resolve(args.name).root)
    elif args.data_command == "verify":
        checks = data.verify(args.name)
        for c in checks:
            print(c)
        return 0 if all(c.ok for c in checks) else 1
    return 0


def _regress(args: argparse.Namespace) -> int:
    from workbench.cluster.slurm import from_spec
    from workbench.regress.runner import run

    return run(
        args.targets,
        parameters=dict(args.parameter),
        out=args.out,
        baselines=args.baselines,
        update_baselines=args.update_baselines,
        junit=args.junit,
        profile=args.profile,
        slurm=from_spec(args.slurm) if args.slurm else None,
    )


def _bench(args: argparse.Namespace) -> int:
    from workbench.commands.bench.results import default_result_path
    from workbench.commands.bench_command import result_name, run_bench

    if args.no_json:
        args.json = None
    elif args.json is None:
        args.json = default_result_path(result_name(args))
    code = run_bench(args)
    if args.json is not None and Path(args.json).exists():
        print(f"result: {args.json}")
    return code


def _doctor(args: argparse.Namespace) -> int:
    from workbench.commands.doctor import run_doctor
    from workbench.config import RunConfig

    cfg = RunConfig.from_yaml(args.config) if args.config else RunConfig(task=args.task or "digits")
    cfg = cfg.with_overrides(([f"task={args.task}"] if args.task else []) + args.overrides)
    report = run_doctor(
        cfg, quick=args.quick, ranks=args.ranks, deadline_s=args.timeout, skip=tuple(args.skip)
    )
    print(report.json() if args.json else report.text())
    return 0


def _print_summary(summary: dict, run_dir: Path) -> None:
    keys = (
        "status",
        "steps",
        "final_loss",
        "eval_loss",
        "eval_accuracy",
        "samples_per_s",
        "tokens_per_s",
        "peak_memory_bytes",
        "wall_time_s",
        "world_size",
        "precision",
        "device",
    )
    print(f"run directory: {run_dir}")
    for k in keys:
        if summary.get(k) is not None:
            v = summary[k]
            print(f"  {k:18} {v:.4g}" if isinstance(v, float) else f"  {k:18} {v}")


if __name__ == "__main__":
    sys.exit(main())
