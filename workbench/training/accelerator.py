"""The rank's Accelerator: process group, device and autocast, and really what the config asks
for."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

from workbench.config.precision import accelerate_mixed_precision
from workbench.config.trackers import TENSORBOARD_DIR, pip_command
from workbench.config.trackers import resolve as resolve_trackers
from workbench.utils.distributed import FORKED_RANKS
from workbench.utils.hardware import detect, resolve_device

if TYPE_CHECKING:
    from workbench.config import RunConfig

log = logging.getLogger("workbench")


def build_accelerator(cfg: RunConfig, run_dir: Path | None = None) -> Accelerator:
    """An Accelerator that really is what cfg asks for, with the config's trackers writing into
    `run_dir`.

    Two accelerate behaviours are corrected here: without cpu=True, forked CPU ranks never form a
    process group (N separate copies), and the precision is passed explicitly rather than through
    notebook_launcher, whose mixed_precision argument never reaches the workers.
    """
    device = resolve_device(cfg)
    share = detect().threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", cfg.num_processes)))
    if os.environ.get(FORKED_RANKS):
        # rank_main already limited a forked rank to one thread (OpenMP after fork): keep it, and
        # say so.
        if share > 1 and int(os.environ.get("RANK", "0")) == 0:
            log.info(
                "forked ranks use 1 CPU thread each (OpenMP can't be used after a fork); "
                "start_method='spawn' gives each rank its share of %d",
                share,
            )
    elif device == "cpu":
        # N ranks x all cores of OpenMP threads would oversubscribe the machine: each gets its
        # share.
        torch.set_num_threads(share)
    trackers = resolve_trackers(cfg.trackers) if run_dir is not None else []
    accelerator = Accelerator(
        cpu=device == "cpu",
        mixed_precision=accelerate_mixed_precision(cfg.precision),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist_timeout_s))],
        # File-based trackers write under logging_dir/<project name>: <run>/tensorboard/<run name>/.
        log_with=trackers or None,
        project_config=ProjectConfiguration(
            project_dir=str(run_dir), logging_dir=str(run_dir / TENSORBOARD_DIR)
        )
        if run_dir is not None
        else None,
    )
    if sorted(str(t) for t in accelerator.log_with) != sorted(trackers):
        # accelerate drops what it can't import
        raise RuntimeError(
            f"trackers {trackers}: accelerate could start only {accelerator.log_with}; "
            f"`{pip_command(trackers)}`"
        )
    if accelerator.device.type == "cuda":
        set_cuda_numerics(cfg)
    # A launcher that sets WORLD_SIZE (torchrun, elastic, multi-node) knows the real size; else it's
    # ours.
    expected = int(os.environ.get("WORLD_SIZE", cfg.num_processes))
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"expected {expected} ranks but accelerate formed a group of "
            f"{accelerator.num_processes}: the processes would train as separate copies, "
            "not one distributed job"
        )
    return accelerator


def set_cuda_numerics(cfg: RunConfig) -> None:
    """fp32 matmuls and convolutions on TF32 tensor cores unless cfg.tf32 is off: PyTorch keeps them
    in full fp32 unless asked. The trainer's ranks and the hand-written loops it is benchmarked
    against both call this."""
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = cfg.tf32
