"""RunConfig: the one description of a run that the panel, CLI, papermill and run directory
share."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from workbench.config import config_files
from workbench.config.checks import (
    check_memory_tracking,
    check_names,
    check_numbers,
    check_whole_number,
)
from workbench.config.choices import (
    ActivationCheckpointing,
    Device,
    GradCompression,
    Parallelism,
    PipelineSchedule,
)
from workbench.config.mesh import ParallelDims
from workbench.config.mesh_checks import check_layout
from workbench.config.precision import Fp8Recipe, Precision, check_fp8_recipe
from workbench.config.trackers import Tracker
from workbench.storage.remote import check_url
from workbench.utils.typecheck import check_type

if TYPE_CHECKING:
    from workbench.utils.hardware import Hardware


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Everything that determines a run. Validated on construction; `check()` adds this machine's
    limits."""

    task: str = "digits"
    """Registered task name (see `workbench.tasks.available()`) or an import path
    'package.module:ClassName'."""
    num_processes: int = 1
    """Ranks to start on this machine: one per GPU, or CPU processes talking over gloo."""
    parallelism: Parallelism = "ddp"
    """'ddp' replicates the model and all-reduces gradients; 'zero1' also shards the optimizer
    state; 'zero2' shards optimizer state and gradients (FSDP2, parameters kept gathered from
    forward to backward); 'zero3' (alias 'fsdp') shards parameters too; 'hsdp' shards within groups
    of dp_shard ranks and replicates across groups; 'none' is a single plain process."""
    dp_shard: int = 0
    """hsdp: ranks in one shard group (a divisor of the data-parallel size, the rest replicate); 0
    otherwise."""
    tp: int = 1
    """Tensor-parallel size, Megatron-style: each matrix of the task's plan is split over tp
    neighbouring ranks. The data-parallel size is num_processes / (pp x cp x tp); above 1 TP
    combines with zero2/zero3 (FSDP x TP), hsdp (a 3-D mesh) or ddp (FSDP2's replicate); not with
    zero1, whose optimizer can't broadcast DTensors."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks that see the same batch (PyTorch's
    ring attention for F.scaled_dot_product_attention; CUDA only), parameters sharded over dp_shard
    x cp (zero2/zero3/hsdp). The data-parallel size is num_processes / (pp x cp x tp)."""
    pp: int = 1
    """Pipeline stages: the task's blocks split over pp ranks (Task.pipeline_stages), pp outermost.
    Inside each stage the other dimensions apply as without a pipeline: num_processes / pp ranks per
    stage, tp of them splitting matrices and the rest data-parallel (replicated pipelines with
    'ddp', sharded with zero2, zero3 or hsdp)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule over the step's grad_accum_steps micro-batches: 'gpipe' (all forwards, then
    all backwards), '1f1b' (needs grad_accum_steps >= pp), or with several model chunks per rank
    (virtual stages, pp_virtual_stages) 'interleaved_1f1b' or 'zero_bubble' (backward split into
    input and weight gradients, the weight part filling the bubble); both need grad_accum_steps a
    multiple of pp."""
    pp_virtual_stages: int = 0
    """Model chunks per rank under a pipeline: the task is split into pp x this many stages, rank r
    holding stages r, r + pp, ... (PyTorch's loop placement). 0 means the schedule's own: 1 for
    gpipe and 1f1b, 2 for the interleaved ones."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """Recompute activations in backward, per shard unit: 'full' keeps only each block's input,
    'selective' also keeps matmul and attention outputs. Less memory, more compute; same losses."""
    compile: Literal["off", "model", "blocks"] = "off"
    """torch.compile: 'blocks' compiles each repeated block (torchtitan's way: after tensor parallel
    and activation checkpointing, before FSDP); 'model' the whole model once it is parallel; 'off'
    trains eagerly. The first steps compile (seconds to a minute, cached for later launches): it
    pays on long runs (the docs' Compile guide)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile's backend: 'inductor' generates fused kernels; 'aot_eager' traces forward and
    backward without generating code (a quick check that a model compiles); 'eager' captures graphs
    only."""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions run on TF32 tensor cores (7x the fp32 peak on an H100,
    10-bit mantissa products, fp32 accumulation), as PyTorch advises for training; False keeps full
    fp32. No effect on CPU or on bf16/fp16 compute."""
    cpu_offload: bool = False
    """zero3/hsdp on GPUs, with or without tp: keep sharded parameters and optimizer state in CPU
    memory (FSDP2 offload; pure tensor parallelism has no FSDP to offload)."""
    grad_compression: GradCompression = "none"
    """ddp/zero1 without tp: compress gradients for DDP's all-reduce ('fp16', 'bf16' on NCCL,
    'powersgd' low rank)."""
    find_unused_parameters: bool = False
    """ddp/zero1 without tp or pp: DDP's own switch for a model some of whose parameters a step may
    leave out of the loss (a branch, a head used on some batches); DDP then looks for them after
    every forward. Refused elsewhere."""
    precision: Precision = "fp32"
    """Compute precision: 'bf16'/'fp16' autocast, or parameters cast by FSDP2 (fp16 with dynamic
    loss scaling, in every layout tp included); 'fp8': the blocks' Linear layers matmul in fp8
    (torchao's Float8, GPUs of compute capability 8.9+, `pip install 'workbench[fp8]'`), the rest in
    bf16."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """precision='fp8': torchao's scaling recipe, 'tensorwise' (one scale per tensor, fastest; with
    FSDP2 the weights are all-gathered in fp8) or 'rowwise' (a scale per row of each operand, more
    accurate; weights all-gathered in bf16)."""
    device: Device = "auto"
    """'auto' picks CUDA when present, else CPU."""
    start_method: Literal["auto", "fork", "spawn", "subprocess"] = "auto"
    """How ranks start: 'fork' (tasks as they are, fast), 'spawn' (fresh interpreters, the task
    pickled with cloudpickle), 'subprocess' (`accelerate launch`/torchrun, tasks by name). 'auto':
    from Python, fork unless the run uses CUDA, then spawn; from `workbench train`, subprocess.
    Clusters: `cluster=` of wb.start."""
    micro_batch_size: int | Literal["auto"] = 32
    """Samples per rank per forward/backward; 'auto' picks the largest that fits (see
    target_global_batch; the ranks of a TP group take the same size, as they share batches)."""
    target_global_batch: int = 0
    """With micro_batch_size='auto': choose grad_accum_steps so the global batch is this (0: keep
    it)."""
    memory_budget_gb: float = 0.0
    """With micro_batch_size='auto' on CPU: memory a rank may use (0: an equal share of this
    machine's)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step; gradients are all-reduced only on the last
    one."""
    max_steps: int = 100
    """Optimizer steps to train for."""
    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 0
    """Linear warm-up steps before cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio on the last step."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (not biases or norms)."""
    beta1: float = 0.9
    """AdamW's first-moment decay (the default optimizer; a Task's configure_optimizers may read it
    too)."""
    beta2: float = 0.999
    """AdamW's second-moment decay; 0.95-0.99 is common for transformers (nanoGPT: 0.99 on small
    data)."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the denominator."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    eval_every: int = 0
    """Evaluate every N steps (and at the end); 0 evaluates at the end only."""
    eval_batches: int = 0
    """Cap on eval micro-batches per rank; 0 uses the whole eval set."""
    log_every: int = 10
    """Write a metrics row (and check for a stop request) every N steps."""
    trackers: list[Tracker] | Literal["auto"] = "auto"
    """Experiment trackers fed the metrics rows and the config (rank 0, files in the run directory):
    'tensorboard' (<run>/tensorboard/), 'mlflow' (a local file store, <run>/mlflow); 'auto' is
    TensorBoard when the tensorboard package is installed, else none; [] turns tracking off. A
    requested one that isn't installed is refused before launch."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps; 0 saves only at the end (and on stop)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    checkpoint_async: Literal["auto", "on", "off"] = "auto"
    """'on': checkpoints are copied to host memory (pinned on GPUs) and written in the background
    while training goes on (DCP's async_save), one at a time; 'off': written whole before training
    goes on; 'auto': on GPUs, off on CPU."""
    checkpoint_url: str | None = None
    """Where checkpoints go: None, the run directory's checkpoints/; or an fsspec URL such as
    's3://bucket/prefix' (the `s3` extra), under which each run writes <run_name>/step_<N>/, sealed
    by a manifest written last. Endpoint and credentials come from the environment as for boto
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws), never from
    here; the rest of the run directory stays on its filesystem."""
    seed: int = 0
    """Seeds model init, data order and dropout; same seed, same run."""
    runs_dir: str = "runs"
    """Directory holding run directories."""
    run_name: str | None = None
    """Run directory name under runs_dir; None makes '<task>-<timestamp>'."""
    resume: bool | Literal["auto"] = False
    """Continue the run named run_name from its newest complete checkpoint that verifies; 'auto'
    resumes when there is one and starts fresh otherwise, so a scheduler can resubmit the same
    command line."""
    resume_allow: list[str] = field(default_factory=list)
    """Fields a resume may change although they change the training trajectory (e.g. ['lr',
    'max_steps']); others that differ from the checkpoint's config are refused, listed."""
    max_restarts: int = 0
    """Restart a failed or preempted run from its newest checkpoint up to this many times."""
    restart_backoff_s: float = 10.0
    """Seconds to wait before the first restart; doubled for each further one."""
    preempt_signal: str | None = None
    """A signal besides SIGTERM and SIGHUP that means 'checkpoint and exit now', e.g. 'SIGUSR1' for
    Slurm's --signal=USR1@120."""
    preempt_grace_s: float = 25.0
    """After a preemption signal, how long a rank may take to reach a step, checkpoint and exit
    before it is reported as hung (with its stack) and ends; torch elastic kills ranks 30 s after
    forwarding a signal."""
    max_skipped_steps: int = 20
    """fp16: this many consecutive steps skipped by the loss scaler (overflow) end the run as
    diverged."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    pin_memory: bool | Literal["auto"] = "auto"
    """Page-locked host batches, so copies to the GPU can overlap compute; 'auto' pins on CUDA. No
    effect on CPU."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead (num_workers > 0 only); None keeps PyTorch's default, 2."""
    persistent_workers: bool | Literal["auto"] = "auto"
    """Keep the DataLoader workers alive from one epoch to the next (num_workers > 0 only); 'auto':
    on when num_workers > 0."""
    oversubscribe: bool = False
    """CPU: allow more processes than cores (warned, slow); e.g. to try a 2 x 2 hsdp layout on a
    2-core box."""
    track_memory: bool = False
    """Trace the first step with PyTorch's memory tracker: bytes per rank by category (parameters,
    gradients, optimizer state, activations, temporaries) in the summary. That step runs slower."""
    monitor_interval_s: float = 2.0
    """Sample each rank's device every this many seconds in a background thread, into the metrics
    rows: on a GPU utilisation, memory used, power and temperature (NVML, `pip install
    'workbench[gpu]'`), and always the process's CPU % and RSS. 0 turns monitoring off."""
    idle_util_pct: float = 10.0
    """GPU utilisation (%) under which a rank's GPU counts as idle, for idle_after_s."""
    idle_after_s: float = 300.0
    """A GPU under idle_util_pct this long gets one 'gpu_idle' warning event per episode (0: never
    warn). GPU runs only: on CPU nobody pays for an accelerator standing still."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: record a torch.profiler trace of these optimizer steps (1-based, as in
    metrics.jsonl) on every rank, to <run>/profile/rank_<r>.json (Chrome trace: chrome://tracing or
    ui.perfetto.dev); [] is off."""
    dist_timeout_s: int = 300
    """How long a collective may block before the run fails instead of hanging."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Task-specific settings, e.g. model size for char-gpt; unknown keys are rejected by the
    task."""

    # ---- derived ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_processes

    @property
    def dims(self) -> ParallelDims:
        """The rank layout over num_processes ranks (mesh.py owns its arithmetic)."""
        return ParallelDims.of(self)

    @property
    def dp_size(self) -> int:
        """Data-parallel size: ranks that see different batches (num_processes / (pp * cp * tp))."""
        return self.dims.dp

    @property
    def mesh(self) -> dict[str, int]:
        """The rank layout as named dimension sizes ('pp', 'dp_replicate', 'dp_shard', 'cp',
        'tp')."""
        return self.dims.sizes

    def resolved_device(self, hardware: Hardware) -> str:
        """Deprecated: `workbench.utils.hardware.resolve_device(cfg, hardware)`, which also detects
        this machine when no hardware is given."""
        warnings.warn(
            "RunConfig.resolved_device(hw) is deprecated: use "
            "workbench.utils.hardware.resolve_device(cfg, hw)",
            DeprecationWarning,
            stacklevel=2,
        )
        if self.device != "auto":
            return self.device
        return "cuda" if hardware.has_cuda else "cpu"

    def check(self, *args: Any, **kwargs: Any) -> None:
        """Moved: the checks against a task and this machine are `preflight(cfg, task=...,
        hardware=...)` (workbench.config.preflight), so that RunConfig imports neither."""
        raise AttributeError(
            "RunConfig.check() moved: use `from workbench.config.preflight import preflight` "
            "and `preflight(cfg, task=task, hardware=hw)`; wb.launch() and the panel run it "
            "before every launch"
        )

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step over all ranks: micro_batch_size x grad_accum_steps x
        data-parallel size (with an 'auto' micro-batch: target_global_batch, or None until the ranks
        have chosen)."""
        if self.micro_batch_size == "auto":
            return self.target_global_batch or None
        return self.dims.global_batch(self.micro_batch_size, self.grad_accum_steps)

    @property
    def runs_dir_path(self) -> Path:
        """runs_dir with '~' expanded."""
        return Path(self.runs_dir).expanduser()

    @property
    def run_dir(self) -> Path | None:
        return self.runs_dir_path / self.run_name if self.run_name else None

    # ---- validation ------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        types = config_files.field_types(RunConfig)
        for f in fields(self):
            # a value that works, for messages
            example = None if f.default is dataclasses.MISSING else f.default
            check_whole_number(f.name, getattr(self, f.name), types[f.name], example)
            check_type(f.name, getattr(self, f.name), types[f.name], example)
        check_numbers(self)
        check_layout(self)
        check_memory_tracking(self)
        check_names(self, config_files.field_names(RunConfig))
        check_fp8_recipe(self)
        check_url("checkpoint_url", self.checkpoint_url)

    # ---- copies and files (config_files.py) ------------------------------------------------------
    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with `changes` applied; unknown field names are rejected."""
        try:
            config_files.reject_unknown(RunConfig, changes, "RunConfig.replace()")
            return dataclasses.replace(self, **changes)
        except (TypeError, ValueError) as error:
            # the frames of dataclasses' replace and of the checks (the generated __init__
            # among them) would only bury the message, which names field, value and fix
            raise error.with_traceback(None)

    def to_dict(self) -> dict[str, Any]:
        return config_files.to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        return config_files.from_dict(cls, data, source)

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """The config as YAML; written atomically to `path` when given."""
        return config_files.to_yaml(self, path)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> RunConfig:
        """Load from YAML; unknown keys are rejected and listed, with the closest field names."""
        return config_files.from_yaml(cls, path)

    @classmethod
    def from_accelerate(cls, path: str | os.PathLike[str], **fields: Any) -> RunConfig:
        """From an `accelerate config` YAML: distributed type and FSDP/DeepSpeed plugin settings,
        mixed precision, process counts. `fields` add or override (task, max_steps, ...). What has
        no counterpart is listed by key in a warning."""
        return config_files.from_accelerate(cls, path, fields)

    @classmethod
    def from_deepspeed(cls, path: str | os.PathLike[str], **fields: Any) -> RunConfig:
        """From a DeepSpeed JSON: ZeRO stage and offload, fp16 or bf16, clipping, micro-batch,
        accumulation, AdamW and its warm-up schedule. `fields` add or override. What has no
        counterpart is listed by key in a warning."""
        return config_files.from_deepspeed(cls, path, fields)

    def with_overrides(self, assignments: list[str]) -> RunConfig:
        """Apply CLI-style 'key=value' strings (values parsed as YAML; 'task_options.n_layer=4'
        nests)."""
        return config_files.with_overrides(self, assignments)


_dataclass_init = RunConfig.__init__


def __init__(self: RunConfig, *args: Any, **values: Any) -> None:
    """RunConfig.__init__: the dataclass-generated one, after a check of the keyword names (each
    unknown one named with the closest field), its errors raised with their traceback cut to this
    frame. Jupyter heads the generated __init__'s frame with its whole signature, 60 parameters
    that bury the message, which already names the field, the value and what would work. Defined
    at module level, as `__init__`, for tracebacks to name it so."""
    try:
        if args:
            raise TypeError(
                f"RunConfig takes keyword arguments only, got {len(args)} positional: write "
                "RunConfig(task='digits', num_processes=2, ...)"
            )
        config_files.reject_unknown(RunConfig, values)
        _dataclass_init(self, **values)
    except (TypeError, ValueError) as error:
        # the message names the field, its value and what would work
        raise error.with_traceback(None)


# set after the class, so that type checkers and IDEs still see the dataclass's signature;
# functools.wraps keeps it for inspect.signature(RunConfig) too
RunConfig.__init__ = functools.wraps(_dataclass_init)(__init__)  # type: ignore[method-assign]
del __init__
