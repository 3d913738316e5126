"""Checkpoints: the full training state under checkpoints/step_<N>/, written atomically.

Every rank takes part in writing into checkpoints/.tmp-step_<N>; rank 0 adds trainer_state.json last and
renames the directory, so a step_<N> name always means a complete checkpoint and a crash leaves the last
good one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import read_json, write_json
from ..rundir import COMPLETE_MARKER, RunDir
from .state import TrainerState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..config import RunConfig


class Checkpointer:
    """Saves and restores the state accelerate holds (model, optimizer, scaler, RNGs) plus TrainerState."""

    def __init__(self, accelerator: Accelerator, run: RunDir, cfg: RunConfig) -> None:
        self.accelerator, self.run, self.cfg = accelerator, run, cfg

    def due(self, step: int, final: bool, stopping: bool) -> bool:
        every = self.cfg.checkpoint_every
        return final or stopping or bool(every and step % every == 0)

    def save(self, state: TrainerState) -> Path:
        """Accelerate's full state into checkpoints/.tmp-step_N, then renamed: a crash leaves the last good one."""
        acc, main = self.accelerator, self.accelerator.is_main_process
        root = self.run.checkpoints_path
        tmp, final = root / f".tmp-step_{state.step}", root / f"step_{state.step}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if main:
            write_json(tmp / COMPLETE_MARKER, state.to_dict())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in self.run.checkpoints()[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            self.run.event("checkpoint_saved", step=state.step, path=str(final))
        acc.wait_for_everyone()
        return final

    def resume(self) -> tuple[TrainerState, Path]:
        """Load the newest complete checkpoint; returns its TrainerState and path."""
        ckpt = self.run.latest_checkpoint()
        if ckpt is None:
            raise FileNotFoundError(f"resume=True but {self.run.path} has no complete checkpoint")
        self.accelerator.load_state(str(ckpt))
        state = TrainerState.from_dict(read_json(ckpt / COMPLETE_MARKER) or {})
        if self.accelerator.is_main_process:
            self.run.set_aside_metrics_after(state.step)
        return state, ckpt
