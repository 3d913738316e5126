"""RunConfig fields from the configs users already have: an `accelerate config` YAML and a DeepSpeed
JSON (RunConfig.from_accelerate and from_deepspeed build the config from them).

What has a counterpart in RunConfig is mapped; everything else is listed by key with the reason,
never dropped in silence (`Imported.unmapped`, and a warning from
RunConfig.from_accelerate/from_deepspeed). Keys that hold their tool's neutral default (a single
machine, no debug, no TPU) say nothing and are not listed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.config.config_reading import read_config_bytes, read_config_text
from workbench.utils.files import load_yaml, parse_json

log = logging.getLogger("workbench")

ACCELERATE_TYPES = {
    "NO": "none",
    "MULTI_GPU": "ddp",
    "MULTI_CPU": "ddp",
    "FSDP": "zero3",
    "DEEPSPEED": None,
}
"""accelerate's distributed_type -> parallelism (DEEPSPEED: from its zero_stage)."""
FSDP_STRATEGIES = {
    "FULL_SHARD": "zero3",
    "SHARD_GRAD_OP": "zero2",
    "HYBRID_SHARD": "hsdp",
    "HYBRID_SHARD_ZERO2": "hsdp",
    "NO_SHARD": "ddp",
    "1": "zero3",
    "2": "zero2",
    "3": "ddp",
    "4": "hsdp",
    "5": "hsdp",
}
"""fsdp_sharding_strategy (names, or FSDP1's numbers) -> parallelism."""
ZERO_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}  # fp8: torchao's Float8
NEUTRAL = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "machine_rank": 0,
    "num_machines": 1,
    "main_training_function": "main",
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
    "gpu_ids": "all",
    "downcast_bf16": "no",
    "enable_cpu_affinity": False,
    "main_process_ip": None,
    "main_process_port": None,
    "dynamo_config": {},
    "fsdp_config": {},
    "deepspeed_config": {},
    "megatron_lm_config": {},
}
"""accelerate keys whose value here says nothing a RunConfig would need to hear."""


@dataclass
class Imported:
    """Another tool's config read as RunConfig fields, and what of it has no counterpart."""

    mapped: dict[str, Any] = field(default_factory=dict)
    """The RunConfig fields the file set."""
    unmapped: dict[str, str] = field(default_factory=dict)
    """Key (dotted for nested ones) -> why it has no counterpart."""
    source: str = ""

    def warn(self) -> None:
        if self.unmapped:
            listed = "; ".join(f"{key}: {why}" for key, why in self.unmapped.items())
            log.warning(
                "%s: %d setting(s) have no counterpart in RunConfig and are not used: %s",
                self.source,
                len(self.unmapped),
                listed,
            )


def _read(path: Path, kind: str) -> dict[str, Any]:
    data = (
        parse_json(read_config_bytes(path, kind), path, object)
        if path.suffix == ".json"
        else load_yaml(read_config_text(path, kind), str(path))
    )
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: holds a {type(data).__name__}, not a mapping of settings; pass {kind}"
        )
    return data


def _choose(table: dict[Any, str | None], value: Any, key: str, path: Path) -> str | None:
    if value not in table:
        choices = ", ".join(str(k) for k in table)
        raise ValueError(
            f"{path}: {key}={value!r} is not one workbench knows; expected one of {choices}"
        )
    return table[value]


# ---- accelerate ----------------------------------------------------------------------------------
def read_accelerate(path: str | os.PathLike[str]) -> Imported:
    """An `accelerate config` YAML (distributed type, FSDP and DeepSpeed plugin settings, mixed
    precision, process counts) as RunConfig fields."""
    path = Path(path).expanduser()
    data = _read(
        path, "an `accelerate config` YAML (~/.cache/huggingface/accelerate/default_config.yaml)"
    )
    mapped: dict[str, Any] = {}
    unmapped: dict[str, str] = {}
    kind = str(data.get("distributed_type", "NO")).upper()
    mapped["parallelism"] = _choose(ACCELERATE_TYPES, kind, "distributed_type", path)
    if "num_processes" in data:
        mapped["num_processes"] = int(data["num_processes"])
    if int(data.get("num_machines", 1) or 1) > 1:
        unmapped["num_machines"] = (
            f"{data['num_machines']} machines: a RunConfig runs on one machine; start each "
            "node with torchrun (the multi-node recipe) or submit the run to a cluster"
        )
    precision = str(data.get("mixed_precision", "no")).lower()
    if precision in PRECISIONS:
        mapped["precision"] = PRECISIONS[precision]
    else:
        unmapped["mixed_precision"] = f"{precision!r}: workbench trains in fp32, bf16, fp16 or fp8"
    if data.get("use_cpu"):
        mapped["device"] = "cpu"
    if kind == "FSDP":
        _fsdp(data.get("fsdp_config") or {}, mapped, unmapped, path)
    if kind == "DEEPSPEED":
        _deepspeed_plugin(data.get("deepspeed_config") or {}, mapped, unmapped, path)
    handled = {
        "distributed_type",
        "num_processes",
        "num_machines",
        "mixed_precision",
        "use_cpu",
        "fsdp_config",
        "deepspeed_config",
    }
    for key, value in data.items():
        if key not in handled and NEUTRAL.get(key, object()) != value:
            unmapped[key] = (
                f"{value!r}: accelerate's launcher setting; workbench starts the ranks itself"
            )
    return Imported(mapped, unmapped, str(path))


def _fsdp(
    cfg: dict[str, Any], mapped: dict[str, Any], unmapped: dict[str, str], path: Path
) -> None:
    strategy = str(cfg.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    mapped["parallelism"] = _choose(
        FSDP_STRATEGIES, strategy, "fsdp_config.fsdp_sharding_strategy", path
    )
    if cfg.get("fsdp_reshard_after_forward") is False and mapped["parallelism"] == "zero3":
        mapped["parallelism"] = "zero2"  # FSDP2's way of saying SHARD_GRAD_OP
    if cfg.get("fsdp_offload_params"):
        mapped["cpu_offload"] = True
    if cfg.get("fsdp_activation_checkpointing"):
        mapped["activation_checkpointing"] = "full"
    why = {
        "fsdp_auto_wrap_policy": "workbench shards each block of the task's model "
        "(Task.shard_units)",
        "fsdp_transformer_layer_cls_to_wrap": "workbench shards each block of the task's model",
        "fsdp_state_dict_type": "checkpoints are always sharded DCP, and the final weights one "
        "safetensors file",
        "fsdp_backward_prefetch": "FSDP2 prefetches by itself",
        "fsdp_forward_prefetch": "FSDP2 prefetches by itself",
        "fsdp_use_orig_params": "FSDP2 always keeps the original parameters",
        "fsdp_sync_module_states": "every rank builds the model from the same seed",
        "fsdp_cpu_ram_efficient_loading": "the task builds the model on every rank",
    }
    handled = {
        "fsdp_sharding_strategy",
        "fsdp_reshard_after_forward",
        "fsdp_offload_params",
        "fsdp_activation_checkpointing",
        "fsdp_version",
    }
    for key, value in cfg.items():
        if key not in handled:
            unmapped[f"fsdp_config.{key}"] = f"{value!r}: {why.get(key, 'no counterpart')}"


def _deepspeed_plugin(
    cfg: dict[str, Any], mapped: dict[str, Any], unmapped: dict[str, str], path: Path
) -> None:
    if cfg.get("deepspeed_config_file"):
        file = Path(cfg["deepspeed_config_file"]).expanduser()
        inner = read_deepspeed(file if file.is_absolute() else path.parent / file)
        mapped.update(inner.mapped)
        unmapped.update({f"deepspeed_config_file.{k}": v for k, v in inner.unmapped.items()})
    if "zero_stage" in cfg:
        mapped["parallelism"] = _choose(
            ZERO_STAGES, int(cfg["zero_stage"]), "deepspeed_config.zero_stage", path
        )
    if "gradient_accumulation_steps" in cfg and cfg["gradient_accumulation_steps"] != "auto":
        mapped["grad_accum_steps"] = int(cfg["gradient_accumulation_steps"])
    if "gradient_clipping" in cfg and cfg["gradient_clipping"] != "auto":
        mapped["grad_clip"] = float(cfg["gradient_clipping"])
    _offload(
        cfg.get("offload_param_device"),
        cfg.get("offload_optimizer_device"),
        mapped,
        unmapped,
        "deepspeed_config.",
    )
    handled = {
        "deepspeed_config_file",
        "zero_stage",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "offload_param_device",
        "offload_optimizer_device",
    }
    for key, value in cfg.items():
        if key not in handled:
            unmapped[f"deepspeed_config.{key}"] = (
                f"{value!r}: no counterpart (workbench shards with FSDP2)"
            )


def _offload(
    param: Any, optimizer: Any, mapped: dict[str, Any], unmapped: dict[str, str], prefix: str
) -> None:
    param, optimizer = str(param or "none").lower(), str(optimizer or "none").lower()
    if param == "cpu":
        mapped["cpu_offload"] = (
            True  # FSDP2 offloads the parameters with their gradients and optimizer state
        )
    elif param != "none":
        unmapped[f"{prefix}offload_param"] = f"{param!r}: workbench offloads to CPU memory only"
    if optimizer != "none" and param != "cpu":
        unmapped[f"{prefix}offload_optimizer"] = (
            f"{optimizer!r}: the optimizer state alone can't be offloaded; "
            "cpu_offload=True offloads parameters and optimizer state"
        )


# ---- DeepSpeed -----------------------------------------------------------------------------------
SCHEDULERS = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}


def read_deepspeed(path: str | os.PathLike[str]) -> Imported:
    """A DeepSpeed JSON (ZeRO stage and offload, fp16 with its loss scaling or bf16, clipping,
    micro-batch, accumulation, AdamW and its warm-up schedule) as RunConfig fields; 'auto' values
    are left to RunConfig."""
    path = Path(path).expanduser()
    data = {k: v for k, v in _read(path, "a DeepSpeed config JSON").items() if v != "auto"}
    mapped: dict[str, Any] = {}
    unmapped: dict[str, str] = {}
    _ds_batch(data, mapped, unmapped)
    if "gradient_clipping" in data:
        mapped["grad_clip"] = float(data["gradient_clipping"])
    if "steps_per_print" in data:
        mapped["log_every"] = int(data["steps_per_print"])
    _ds_precision(data, mapped, unmapped)
    zero = data.get("zero_optimization") or {}
    mapped["parallelism"] = _choose(
        ZERO_STAGES, int(zero.get("stage", 0)), "zero_optimization.stage", path
    )
    _offload(
        (zero.get("offload_param") or {}).get("device"),
        (zero.get("offload_optimizer") or {}).get("device"),
        mapped,
        unmapped,
        "zero_optimization.",
    )
    for key, value in zero.items():
        if key not in {"stage", "offload_param", "offload_optimizer"}:
            unmapped[f"zero_optimization.{key}"] = (
                f"{value!r}: a DeepSpeed tuning knob; FSDP2 has its own"
            )
    _ds_optimizer(data.get("optimizer"), mapped, unmapped)
    _ds_scheduler(data.get("scheduler"), mapped, unmapped)
    handled = {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "steps_per_print",
        "fp16",
        "bf16",
        "zero_optimization",
        "optimizer",
        "scheduler",
    }
    for key, value in data.items():
        if key not in handled:
            unmapped[key] = f"{value!r}: no counterpart in workbench"
    return Imported(mapped, unmapped, str(path))


def _ds_batch(data: dict[str, Any], mapped: dict[str, Any], unmapped: dict[str, str]) -> None:
    """train_batch_size = micro-batch x accumulation x ranks: the ranks follow when the other two
    are given."""
    micro, accum = (
        data.get("train_micro_batch_size_per_gpu"),
        data.get("gradient_accumulation_steps"),
    )
    if micro is not None:
        mapped["micro_batch_size"] = int(micro)
    if accum is not None:
        mapped["grad_accum_steps"] = int(accum)
    total = data.get("train_batch_size")
    if total is None:
        return
    per_rank = int(micro or 0) * int(accum or 1)
    if micro is not None and per_rank and int(total) % per_rank == 0:
        mapped["num_processes"] = int(total) // per_rank
    elif micro is None:
        mapped["target_global_batch"] = int(total)
    else:
        unmapped["train_batch_size"] = (
            f"{total}: not a multiple of micro-batch x accumulation ({per_rank}); "
            "the global batch follows from those and num_processes"
        )


def _ds_precision(data: dict[str, Any], mapped: dict[str, Any], unmapped: dict[str, str]) -> None:
    fp16, bf16 = data.get("fp16") or {}, data.get("bf16") or {}
    if bf16.get("enabled"):
        mapped["precision"] = "bf16"
    if fp16.get("enabled"):
        mapped["precision"] = "fp16"
        if float(fp16.get("loss_scale", 0) or 0) > 0:
            unmapped["fp16.loss_scale"] = (
                f"{fp16['loss_scale']!r}: a static loss scale; workbench scales "
                "dynamically (torch.amp.GradScaler)"
            )
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            if key in fp16:
                unmapped[f"fp16.{key}"] = f"{fp16[key]!r}: GradScaler's defaults apply"
    if data.get("amp", {}).get("enabled") if isinstance(data.get("amp"), dict) else False:
        unmapped["amp"] = "NVIDIA apex AMP: use precision fp16 or bf16"


def _ds_optimizer(opt: Any, mapped: dict[str, Any], unmapped: dict[str, str]) -> None:
    if not isinstance(opt, dict):
        return
    kind, params = (
        str(opt.get("type", "")),
        {k: v for k, v in (opt.get("params") or {}).items() if v != "auto"},
    )
    if kind.lower() not in {"adam", "adamw"}:
        unmapped["optimizer.type"] = (
            f"{kind!r}: workbench uses AdamW (or the task's configure_optimizers)"
        )
        return
    if "lr" in params:
        mapped["lr"] = float(params.pop("lr"))
    if "betas" in params:
        mapped["beta1"], mapped["beta2"] = (float(b) for b in params.pop("betas"))
    for key in ("eps", "weight_decay"):
        if key in params:
            mapped[key] = float(params.pop(key))
    for key, value in params.items():
        unmapped[f"optimizer.params.{key}"] = f"{value!r}: no counterpart"


def _ds_scheduler(sched: Any, mapped: dict[str, Any], unmapped: dict[str, str]) -> None:
    if not isinstance(sched, dict):
        return
    kind, params = (
        str(sched.get("type", "")),
        {k: v for k, v in (sched.get("params") or {}).items() if v != "auto"},
    )
    if kind not in SCHEDULERS:
        unmapped["scheduler.type"] = f"{kind!r}: workbench warms up linearly, then decays by cosine"
        return
    if kind == "WarmupLR":
        mapped["min_lr_ratio"] = 1.0  # constant after the warm-up: a cosine from lr down to lr
    elif kind == "WarmupDecayLR":
        unmapped["scheduler.type"] = (
            "'WarmupDecayLR' decays linearly to 0; workbench decays by cosine to min_lr_ratio"
        )
    if "warmup_num_steps" in params:
        mapped["warmup_steps"] = int(params.pop("warmup_num_steps"))
    if "total_num_steps" in params:
        mapped["max_steps"] = int(params.pop("total_num_steps"))
    if "warmup_max_lr" in params:
        mapped["lr"] = float(params.pop("warmup_max_lr"))
    if "cos_min_ratio" in params:
        mapped["min_lr_ratio"] = float(params.pop("cos_min_ratio"))
    for key, value in params.items():
        unmapped[f"scheduler.params.{key}"] = f"{value!r}: no counterpart"
