"""The choices of RunConfig's fields that take one of a few names: parallelism modes (with a line
each, as the panel and `workbench check` show them), activation checkpointing, pipeline schedules,
gradient compression, devices. Precisions are precision.py's."""

from __future__ import annotations

from typing import Literal

Parallelism = Literal["none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
ActivationCheckpointing = Literal["none", "full", "selective"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
GradCompression = Literal["none", "fp16", "bf16", "powersgd"]
Device = Literal["auto", "cpu", "cuda"]

PARALLELISM_MODES: dict[str, str] = {
    "none": "one plain process",
    "ddp": "full replica per rank, gradients all-reduced (DDP)",
    "zero1": "replicas, optimizer state sharded over ranks (ZeRO-1)",
    "zero2": (
        "gradients and optimizer state sharded; parameters gathered from forward to backward "
        "(FSDP2)"
    ),
    "zero3": "parameters, gradients and optimizer state sharded (FSDP2)",
    "fsdp": "same as zero3: parameters, gradients and optimizer state sharded (FSDP2)",
    "hsdp": "sharded within groups of dp_shard ranks, replicated across groups (FSDP2, 2-D mesh)",
}
"""One line per parallelism mode, as the panel and `workbench check` show them."""
