"""Checkpoints: the full training state under checkpoints/step_<N>/, written atomically.

    step_<N>/model_optim/      model and optimizer state keyed by parameter name (torch.distributed.checkpoint:
                               sharded modes write shards, any mode and rank count can load it)
    step_<N>/rank_<r>.pt       each rank's RNG states and loss-scaler state
    step_<N>/trainer_state.json   progress; written last, by rank 0

Every rank writes into checkpoints/.tmp-step_<N>; rank 0 renames the directory once everything is there, so
a step_<N> name always means a complete checkpoint and a crash leaves the last good one.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..files import read_json, write_json
from ..rundir import COMPLETE_MARKER, RunDir
from .state import TrainerState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..config import RunConfig
    from .parallel import Strategy

log = logging.getLogger("workbench")
MODEL_OPTIM = "model_optim"


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG a step may draw from, as plain tensors and numbers (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                                       "has_gauss": has_gauss, "gauss": gauss}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Checkpointer:
    """Saves and restores the strategy's model and optimizer (DCP), each rank's RNGs, and TrainerState."""

    def __init__(self, accelerator: Accelerator, run: RunDir, cfg: RunConfig, strategy: Strategy) -> None:
        self.accelerator, self.run, self.cfg, self.strategy = accelerator, run, cfg, strategy
        self.rank = accelerator.process_index

    def due(self, step: int, final: bool, stopping: bool) -> bool:
        every = self.cfg.checkpoint_every
        return final or stopping or bool(every and step % every == 0)

    def _rank_state(self) -> dict[str, Any]:
        scaler = self.strategy.scaler
        return {"rng": rng_state(self.accelerator.device), "scaler": scaler.state_dict() if scaler else None}

    def save(self, state: TrainerState) -> Path:
        acc, main = self.accelerator, self.accelerator.is_main_process
        root = self.run.checkpoints_path
        tmp, final = root / f".tmp-step_{state.step}", root / f"step_{state.step}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        self.strategy.save(tmp / MODEL_OPTIM)
        torch.save(self._rank_state(), tmp / f"rank_{self.rank}.pt")
        acc.wait_for_everyone()
        if main:
            write_json(tmp / COMPLETE_MARKER, {**state.to_dict(), "world_size": acc.num_processes,
                                               "parallelism": self.cfg.parallelism})
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in self.run.checkpoints()[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            self.run.event("checkpoint_saved", step=state.step, path=str(final))
        acc.wait_for_everyone()
        return final

    def resume(self) -> tuple[TrainerState, Path]:
        """Load the newest complete checkpoint, resharded to this run's mode and ranks."""
        ckpt = self.run.latest_checkpoint()
        if ckpt is None:
            raise FileNotFoundError(f"resume=True but {self.run.path} has no complete checkpoint")
        saved = read_json(ckpt / COMPLETE_MARKER) or {}
        self.strategy.load(ckpt / MODEL_OPTIM)
        mine = ckpt / f"rank_{self.rank}.pt"
        if mine.exists():
            rank_state = torch.load(mine, weights_only=True)
            set_rng_state(rank_state["rng"], self.accelerator.device)
            if self.strategy.scaler is not None and rank_state.get("scaler"):
                self.strategy.scaler.load_state_dict(rank_state["scaler"])
        else:
            log.warning("[rank %d] %s was saved by %s rank(s): this rank starts with fresh random states, so "
                        "dropout differs from an uninterrupted run", self.rank, ckpt, saved.get("world_size", "?"))
        if self.accelerator.is_main_process:
            self.run.set_aside_metrics_after(int(saved.get("step", 0)))
        return TrainerState.from_dict(saved), ckpt
