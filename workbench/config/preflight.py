"""Before a launch: a RunConfig against the task it trains and the machine it runs on. RunConfig
checks itself on construction (checks.py, mesh_checks.py) without either; these checks build the
task's model on the meta device and look at this machine's devices, tools and precisions."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from workbench.config.trackers import missing, pip_command
from workbench.launcher.phases import PREPARING_DATA, announce
from workbench.tasks import Task, get_task
from workbench.tasks.blocks import checkpoint_units, shard_units
from workbench.utils.hardware import Hardware, detect, resolve_device

if TYPE_CHECKING:
    from workbench.config.run_config import RunConfig


def preflight(
    cfg: RunConfig,
    task: Task | None = None,
    hardware: Hardware | None = None,
    device: str | None = None,
) -> None:
    """Check `cfg` against this machine (or `hardware`) and the task (`task`, else the one cfg.task
    names): ValueError naming the field, the value and the fix, before anything starts. launch()
    runs it first, with the `device` it resolved once for the whole launch (resolved here when
    None)."""
    _run_checks(cfg, task, hardware, device, every=False)


def preflight_problems(
    cfg: RunConfig,
    task: Task | None = None,
    hardware: Hardware | None = None,
    device: str | None = None,
) -> list[str]:
    """Every refusal preflight() would give, in its order and words ([] when it passes): the
    panel lists a plan's problems at once, not one per fix. The machine's checks are independent,
    so each is tried; the task's run in order and stop at the first (a model whose options don't
    form it can't be checked for its layout)."""
    return _run_checks(cfg, task, hardware, device, every=True)


# The warnings' stacklevel points past _run_checks and preflight (and passes) at preflight's
# caller.
def _run_checks(
    cfg: RunConfig, task: Task | None, hardware: Hardware | None, device: str | None, *, every: bool
) -> list[str]:
    """preflight's checks in order: raise the first refusal, or (`every`) collect them all."""
    problems: list[str] = []

    def passes(check: Callable[..., None], *args: Any) -> bool:
        try:
            check(*args)
        except ValueError as e:
            if not every:
                raise
            problems.append(str(e))
            return False
        return True

    passes(check_runs_dir, cfg)
    if not every:  # it asks the store (seconds when it is down): at launch, not in a plan's list
        check_checkpoint_store(cfg)
    hw = hardware or detect()
    if not passes(_check_cuda_visible, cfg, hw):
        return problems  # the device the other checks are for doesn't exist
    device = device or resolve_device(cfg, hw)
    passes(check_process_count, cfg, hw, device)
    check_preempt_grace(cfg)
    passes(check_cpu_limits, cfg, device)
    passes(check_tools, cfg, device)
    passes(_check_precision, cfg, hw, device)
    passes(_check_task, cfg, task)
    return problems


def _check_cuda_visible(cfg: RunConfig, hw: Hardware) -> None:
    if cfg.device == "cuda" and not hw.has_cuda:
        raise ValueError(
            f"device='cuda': no CUDA GPU is visible on {hw.where}; use device='auto' or 'cpu'"
        )


def _check_precision(cfg: RunConfig, hw: Hardware, device: str) -> None:
    problem = hw.precision_problem(cfg.precision, device)
    if problem:
        raise ValueError(f"precision={cfg.precision!r} on {hw.device_line(device)}: {problem}")


def _check_task(cfg: RunConfig, task: Task | None) -> None:
    """The task's own checks, then whether it can be split and checkpointed as cfg asks."""
    task = task or get_task(cfg.task)
    task.check_options(cfg)
    # a launch's live line says so: resolving, building and tokenizing a dataset can take minutes
    announce(PREPARING_DATA)
    task.check_data(cfg)
    check_parallel_task(cfg, task)
    if cfg.activation_checkpointing != "none" or cfg.compile == "blocks":
        _check_checkpoint_units(cfg, task)
    if cfg.precision == "fp8":  # the model has Linear layers to swap (imported for fp8 runs only)
        from workbench.training.parallel.float8 import check_task

        check_task(cfg, task)


def check_preempt_grace(cfg: RunConfig) -> None:
    """A preemption ends 'preempted' only if the ranks agree (within about half a second, or right
    after the checkpoint in progress), write one checkpoint and finish within preempt_grace_s; the
    hang watchdog ends them otherwise. Warned about before launch from what an earlier session of
    this run measured (a resume: its steps and its checkpoints' write times); a fresh run has no
    such times yet. A background write in flight is waited for before the ending's own, so with
    checkpoint_async a checkpoint counts twice. checkpoint_every doesn't enter: the ranks vote
    after every checkpoint, so at most one is written after a signal, however often they come."""
    if not cfg.resume or cfg.run_dir is None or not cfg.run_dir.is_dir():
        return
    from workbench.rundir import RunDir

    run = RunDir(cfg.run_dir)
    try:
        saved = [e for e in run.events() if e.get("event") == "checkpoint_saved"][-3:]
        row = run.last_train_row()
    except (OSError, ValueError):
        return  # a damaged history is the resume's to report, with its path
    if not saved:
        return
    write_s = max(float(e.get("write_s") or 0.0) for e in saved)
    writes = 2 if any(e.get("background") for e in saved) else 1
    step_s = float((row or {}).get("step_time_s") or 0.0)
    need = writes * write_s + 2 * step_s + 0.5
    if need <= cfg.preempt_grace_s:
        return
    warnings.warn(
        f"preempt_grace_s={cfg.preempt_grace_s:g}: this run's checkpoints took up to "
        f"{write_s:.1f} s to write{' in the background' if writes == 2 else ''} and its steps "
        f"{step_s:.2f} s, so ending on a preemption needs about {need:.0f} s "
        f"({writes} checkpoint write(s) and a step or two); a signal would end as a hang. Raise "
        f"preempt_grace_s to {math.ceil(1.5 * need)} or more (with the scheduler's notice to "
        "match, e.g. Slurm's --signal=USR1@SECONDS), or make checkpoints faster",
        stacklevel=4,
    )


def check_process_count(cfg: RunConfig, hw: Hardware, device: str) -> None:
    """num_processes fits the machine: one rank per GPU, or per CPU core unless oversubscribe
    (then warned about)."""
    limit = hw.max_processes(device)
    if cfg.num_processes > limit:
        if device == "cpu" and cfg.oversubscribe:
            warnings.warn(
                f"num_processes={cfg.num_processes} on {limit} CPU core(s) (oversubscribe=True): "
                "the ranks share cores and run slower than they would on their own",
                stacklevel=5,
            )
        else:
            what = f"{limit} GPU(s)" if device == "cuda" else f"{limit} CPU core(s)"
            extra = (
                ""
                if device == "cuda"
                else ", or set oversubscribe=True to run more ranks than cores"
            )
            raise ValueError(
                f"num_processes={cfg.num_processes}: {hw.where} has {what}; "
                f"use num_processes={limit} or fewer{extra}"
            )


def check_cpu_limits(cfg: RunConfig, device: str) -> None:
    """What a run on the CPU can't do: offload to itself, context parallel, bf16 compression."""
    if cfg.cpu_offload and device != "cuda":
        raise ValueError(
            "cpu_offload=True on CPU: offload moves sharded parameters and optimizer state from "
            "GPU memory to the CPU, and this run is on the CPU already; set cpu_offload=False"
        )
    if cfg.cp > 1 and device != "cuda":
        raise ValueError(
            f"cp={cfg.cp} on CPU: PyTorch's context parallel (torch {torch.__version__}) runs ring "
            "attention through the CUDA kernels of scaled_dot_product_attention (flash, "
            "efficient, cuDNN); the CPU's kernel has no context-parallel rule ('Operator "
            "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
            "strategy registered'). Run on CUDA GPUs, or set cp=1"
        )
    if cfg.grad_compression == "bf16" and device != "cuda" and cfg.num_processes > 1:
        raise ValueError(
            "grad_compression='bf16' on CPU: DDP's bf16 compression hook needs NCCL (CUDA GPUs); "
            "use grad_compression='fp16' or 'powersgd' on CPU"
        )


def check_checkpoint_store(cfg: RunConfig) -> None:
    """checkpoint_url on an object store: reachable, the credentials accepted, the bucket there and
    writable (a probe object), before anything starts; StorageError (a ValueError) with the fix."""
    from workbench.storage.remote import check_writable, is_remote

    if is_remote(cfg.checkpoint_url):
        check_writable(cfg.checkpoint_url, "checkpoint_url")


def check_runs_dir(cfg: RunConfig) -> None:
    """runs_dir is a directory, or can become one: not a file, nor under one (the OS would only say
    'File exists' or 'Not a directory' when the run directory is created, after the other
    checks)."""
    path = cfg.runs_dir_path
    for where in (path, *path.parents):
        if not os.path.lexists(where):
            continue  # to be created, under the nearest existing directory
        if where.is_dir():
            return
        what = "a broken symbolic link" if where.is_symlink() and not where.exists() else "a file"
        which = f"{where}" if where == path else f"{where}, on its path,"
        raise ValueError(
            f"runs_dir={cfg.runs_dir!r}: {which} is {what}, not a directory; point runs_dir at a "
            "directory (or at a path that doesn't exist yet, to be created), e.g. runs_dir='runs'"
        )


def check_tools(cfg: RunConfig, device: str) -> None:
    """Trackers that aren't installed are refused before launch (accelerate would drop them
    silently); pinned memory on CPU is warned about, as it does nothing there."""
    absent = missing(cfg.trackers)
    if absent:
        raise ValueError(
            f"trackers={cfg.trackers!r}: {', '.join(absent)} not installed here; "
            f"`{pip_command(absent)}`, or leave {' and '.join(absent)} out of trackers"
        )
    if cfg.pin_memory is True and device != "cuda":
        warnings.warn(
            "pin_memory=True on CPU: pinned memory only speeds up copies to a GPU; it is not used "
            "on this run (set pin_memory='auto' to silence this)",
            stacklevel=5,
        )


def _check_checkpoint_units(cfg: RunConfig, task: Any) -> None:
    """Activation checkpointing and compile='blocks' need blocks: look at the model built on the
    meta device (no memory, no data loaded into it)."""
    try:
        with torch.device("meta"):
            model = task.build_model(cfg)
    except Exception:  # noqa: BLE001
        # a model that can't be built on meta is checked in the ranks instead
        return
    from workbench.tasks.model_plans import ModelPlan

    units = checkpoint_units(
        model, shard_units(model, ModelPlan(task)), cfg.activation_checkpointing
    )
    if cfg.compile == "blocks" and not units:
        raise ValueError(
            f"compile='blocks': the {cfg.task} model has no repeated blocks to compile (no "
            "ModuleList of blocks); set compile='model' to compile it whole, or define "
            "Task.shard_units(model) to name them"
        )


def check_parallel_task(cfg: RunConfig, task: Any) -> None:
    """Before launch: the task can be split as tp, pp and cp ask (a plan, pipeline stages, sequence
    tensors)."""
    if cfg.tp > 1:
        check_tensor_parallel_task(cfg, task)
    if cfg.pp > 1:
        check_pipeline_task(cfg, task)
    if cfg.cp > 1:
        check_context_parallel_task(cfg, task)


def check_context_parallel_task(cfg: RunConfig, task: Any) -> None:
    """cp > 1: the task names its sequence tensors (Task.context_parallel_buffers), and its sequence
    splits into 2 x cp chunks: PyTorch's load balancing pairs a chunk from the head with one from
    the tail on each rank, so every rank gets the same share of causal attention's work. A
    transformers model is refused without the hook, saying why (ModelPlan.missing): context
    parallel for it is not proven equal to one process."""
    if type(task).context_parallel_buffers is Task.context_parallel_buffers:
        from workbench.tasks.model_plans import ModelPlan, is_transformers_model

        try:
            with torch.device("meta"):
                model = task.build_model(cfg)
        except Exception:  # noqa: BLE001
            # a model that can't be built on meta: the refusal below, without its name
            model = None
        if model is not None and is_transformers_model(model):
            raise ValueError(
                f"cp={cfg.cp}: " + ModelPlan(task).missing(model, "context-parallel buffers")
            )
        raise ValueError(
            f"cp={cfg.cp}: task {task.name!r} doesn't say where its sequence dimension is "
            f"({type(task).__name__}.context_parallel_buffers returns None); set cp=1, or "
            "implement context_parallel_buffers(model, batch) returning [(tensor, sequence dim), "
            "...]"
        )
    length = task.tokens_per_sample(cfg)
    if length is not None and length % (2 * cfg.cp):
        raise ValueError(
            f"cp={cfg.cp}: task {task.name!r} has sequences of {length} tokens, which context "
            f"parallel's load balancing can't split into 2 x cp = {2 * cfg.cp} equal chunks; use a "
            f"sequence length that is a multiple of {2 * cfg.cp} (char-gpt: "
            f"task_options.block_size={2 * cfg.cp * max(1, length // (2 * cfg.cp))}), or another "
            "cp"
        )


def check_pipeline_task(cfg: RunConfig, task: Any) -> None:
    """pp > 1: Task.pipeline_stages gives a stage for every stage index (pp x chunks per rank),
    built on the meta device."""
    from workbench.config.mesh import virtual_stages
    from workbench.tasks.model_plans import ModelPlan, is_transformers_model

    total = cfg.pp * virtual_stages(cfg)
    declared = ModelPlan(task)
    for stage in range(total):
        with torch.device("meta"):
            model = task.build_model(cfg)
        part = declared.pipeline_stages(model, cfg, stage, total)
        if part is None and is_transformers_model(model):
            raise ValueError(f"pp={cfg.pp}: " + declared.missing(model, "pipeline stages"))
        if part is None:
            raise ValueError(
                f"pp={cfg.pp}: task {task.name!r} can't be split into pipeline stages "
                f"({type(task).__name__}.pipeline_stages returns None); set pp=1, or implement "
                "pipeline_stages(model, cfg, stage, stages) returning the stage's nn.Module"
            )


def check_tensor_parallel_task(cfg: RunConfig, task: Any) -> None:
    """Before launch, with tp > 1: the task has a plan (Task.tensor_parallel_plan) that names real
    submodules, looked up on the model built on the meta device."""
    from workbench.tasks.model_plans import ModelPlan, is_transformers_model

    with torch.device("meta"):
        model = task.build_model(cfg)
    declared = ModelPlan(task)
    plan = declared.tensor_parallel_plan(model, cfg)
    if plan is None and is_transformers_model(model):
        raise ValueError(f"tp={cfg.tp}: " + declared.missing(model, "tensor-parallel plan"))
    if plan is None:
        raise ValueError(
            f"tp={cfg.tp}: task {task.name!r} has no tensor-parallel plan "
            f"({type(task).__name__}.tensor_parallel_plan returns None), so its model can't be "
            "split over ranks; set tp=1 (and use parallelism='zero3' to shard it instead), or "
            "implement tensor_parallel_plan(model, cfg) returning {submodule name: "
            "ColwiseParallel()/RowwiseParallel()}"
        )
    names = {name for name, _ in model.named_modules()}
    missing = [key for key in plan if "*" not in key and key not in names]
    if missing:
        raise ValueError(
            f"tp={cfg.tp}: {type(task).__name__}.tensor_parallel_plan names submodule(s) the model "
            f"doesn't have: {', '.join(missing[:5])}"
        )
