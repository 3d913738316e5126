"""RunConfig.from_accelerate and from_deepspeed: the configs users already have, mapped where RunConfig has a
counterpart, and every other setting listed by key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from collected_ids import cases

import workbench as wb
from workbench.config.accelerate_deepspeed import read_accelerate, read_deepspeed

FSDP2 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: Block
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

DEEPSPEED = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 0.5,
    "steps_per_print": 20,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "overlap_comm": True},
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": 3e-4,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "torch_adam": True,
        },
    },
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {
            "warmup_num_steps": 100,
            "total_num_steps": 5000,
            "cos_min_ratio": 0.05,
            "warmup_min_ratio": 0.0,
        },
    },
    "wall_clock_breakdown": False,
}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_an_fsdp2_accelerate_config_maps_mode_precision_processes_and_lists_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "fsdp.yaml", FSDP2)
    with caplog.at_level(logging.WARNING, logger="workbench"):
        cfg = wb.RunConfig.from_accelerate(path, task="char-gpt", max_steps=50)
    assert (cfg.parallelism, cfg.precision, cfg.num_processes) == ("zero2", "bf16", 8), (
        "reshard_after_forward: false is FSDP2's SHARD_GRAD_OP"
    )
    assert cfg.activation_checkpointing == "full" and not cfg.cpu_offload
    assert (cfg.task, cfg.max_steps) == ("char-gpt", 50)
    unmapped = read_accelerate(path).unmapped
    assert sorted(unmapped) == [
        "fsdp_config.fsdp_auto_wrap_policy",
        "fsdp_config.fsdp_cpu_ram_efficient_loading",
        "fsdp_config.fsdp_state_dict_type",
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap",
    ]
    assert "checkpoints are always sharded DCP" in unmapped["fsdp_config.fsdp_state_dict_type"]
    assert (
        "4 setting(s) have no counterpart in RunConfig" in caplog.text
        and "fsdp_auto_wrap_policy" in caplog.text
    )


@pytest.mark.parametrize(
    "text,expected",
    cases(
        [
            (
                "distributed_type: MULTI_GPU\nnum_processes: 4\nmixed_precision: fp16\n",
                {"parallelism": "ddp", "precision": "fp16"},
            ),
            (
                "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n  fsdp_offload_params: true\n",
                {"parallelism": "hsdp", "cpu_offload": True},
            ),
            (
                "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 1\n",
                {"parallelism": "zero3"},
            ),
            (
                "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 1\n  gradient_accumulation_steps: 4\n"
                "  gradient_clipping: 1.0\n",
                {"parallelism": "zero1", "grad_accum_steps": 4, "grad_clip": 1.0},
            ),
            (
                "distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n",
                {"parallelism": "ddp", "device": "cpu"},
            ),
        ]
    ),
)
def test_accelerate_settings_with_a_counterpart_are_mapped(
    tmp_path: Path, text: str, expected: dict
) -> None:
    mapped = read_accelerate(write(tmp_path, "a.yaml", text)).mapped
    assert {k: mapped[k] for k in expected} == expected


def test_a_deepspeed_plugin_file_and_a_second_machine_are_carried_or_named(tmp_path: Path) -> None:
    write(
        tmp_path,
        "ds.json",
        json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}),
    )
    path = write(
        tmp_path,
        "a.yaml",
        "distributed_type: DEEPSPEED\nnum_machines: 2\nnum_processes: 16\n"
        "deepspeed_config:\n  deepspeed_config_file: ds.json\n",
    )
    imported = read_accelerate(path)
    assert imported.mapped["parallelism"] == "zero2" and imported.mapped["precision"] == "bf16"
    assert "a RunConfig runs on one machine" in imported.unmapped["num_machines"]


def test_a_deepspeed_json_maps_zero_precision_batch_optimizer_and_schedule(tmp_path: Path) -> None:
    path = write(tmp_path, "ds.json", json.dumps(DEEPSPEED))
    cfg = wb.RunConfig.from_deepspeed(path, task="char-gpt")
    assert (cfg.parallelism, cfg.precision, cfg.cpu_offload) == ("zero3", "fp16", True)
    assert (cfg.micro_batch_size, cfg.grad_accum_steps, cfg.num_processes) == (8, 4, 8), (
        "256 = 8 x 4 x 8 ranks"
    )
    assert cfg.global_batch_size == 256
    assert (cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay) == (3e-4, 0.9, 0.95, 1e-8, 0.1)
    assert (cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio, cfg.grad_clip, cfg.log_every) == (
        100,
        5000,
        0.05,
        0.5,
        20,
    )
    assert sorted(read_deepspeed(path).unmapped) == [
        "fp16.initial_scale_power",
        "optimizer.params.torch_adam",
        "scheduler.params.warmup_min_ratio",
        "wall_clock_breakdown",
        "zero_optimization.overlap_comm",
    ]


def test_deepspeed_auto_values_and_a_static_loss_scale(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "ds.json",
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "fp16": {"enabled": True, "loss_scale": 128},
                "zero_optimization": {"stage": 1},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            }
        ),
    )
    imported = read_deepspeed(path)
    assert "micro_batch_size" not in imported.mapped and "grad_accum_steps" not in imported.mapped
    assert imported.mapped["min_lr_ratio"] == 1.0, "WarmupLR holds the lr after the warm-up"
    assert "workbench scales dynamically" in imported.unmapped["fp16.loss_scale"]


@pytest.mark.parametrize(
    "name,text,message",
    cases(
        [
            (
                "a.yaml",
                "distributed_type: MEGATRON_LM\n",
                r"a.yaml: distributed_type='MEGATRON_LM' is not one workbench "
                r"knows; expected one of NO, MULTI_GPU, MULTI_CPU, FSDP, DEEPSPEED",
            ),
            ("a.yaml", "- a list\n", r"a.yaml: holds a list, not a mapping of settings"),
            (
                "ds.json",
                '{"zero_optimization": {"stage": 4}}',
                r"zero_optimization.stage=4 is not one workbench knows",
            ),
            ("ds.json", "{not json", r"ds.json: not valid JSON"),
        ],
        key=1,
    ),
)
def test_what_cannot_be_read_is_refused_naming_the_file_and_key(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = write(tmp_path, name, text)
    reader = wb.RunConfig.from_deepspeed if name.endswith(".json") else wb.RunConfig.from_accelerate
    with pytest.raises(ValueError, match=message):
        reader(path)


def test_a_missing_file_says_which_kind_of_file_to_pass(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"nope.yaml: no such file; pass the path of an `accelerate config` YAML"
    ):
        wb.RunConfig.from_accelerate(tmp_path / "nope.yaml")
