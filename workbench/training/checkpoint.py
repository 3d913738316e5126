"""Checkpoints: the full training state under checkpoints/step_<N>/, written atomically, verified on resume.

    step_<N>/model/, optim/    model and optimizer state keyed by parameter name (torch.distributed.checkpoint:
                               sharded modes write shards; any mode and rank count can load them)
    step_<N>/rank_<r>.pt       each rank's RNG states and loss-scaler state
    step_<N>/trainer_state.json, config.yaml   progress, and the config that wrote it
    step_<N>/manifest.json     every file's size and sha256; written last

Every rank writes into checkpoints/.tmp-step_<N>; the ranks hash the files between them; rank 0 writes the
manifest and renames the directory, so a step_<N> name with a manifest always means a complete checkpoint.
Resume verifies the newest one against its manifest and falls back to the previous on any damage, saying
what is wrong; whatever a checkpoint claims (RNG states included) loads, or the resume fails loudly.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object

from workbench.rundir import COMPLETE_MARKER, RunDir
from workbench.training.checkpoint_files import (
    CheckpointLoadError,
    ModelMismatchError,
    failure_summary,
    file_problems,
    files_in,
    is_checkpoint_exception,
    model_differences,
    read_manifest,
    saved_model_shapes,
    sha256,
    shapes_of,
)
from workbench.training.train_state import TrainerState
from workbench.utils.files import write_json

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.training.parallel import Strategy

log = logging.getLogger("workbench")
STATE = "trainer_state.json"


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
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


FULL_BELOW_BYTES = 1 << 20
"""Less room than this left where a write failed: the disk is taken to be full, whatever the writer raised."""


# A rank whose checkpoint write fails removes the whole unfinished checkpoint (_removed_on_failure) while another
# rank may still be writing into it: that rank's error is fallout of the first (rundir's is_fallout knows it).
SWEPT = "its folder was removed as another rank's write failed"


def _write_error(error: BaseException, where: Path) -> OSError:
    """An I/O failure inside torch's writers, as an OSError saying what failed and how much room is left.

    DCP collects each rank's failure as (exception, traceback) in CheckpointException.failures, and torch.save
    on a full disk raises a RuntimeError from its zip writer ('unexpected pos'), not ENOSPC."""
    failures = [f[0] if isinstance(f, tuple) and f else f
                for f in (getattr(error, "failures", None) or {}).values()]
    cause = next((f for f in failures if isinstance(f, OSError)), failures[0] if failures else error)
    try:
        free: int | None = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    code = getattr(cause, "errno", None) or errno.EIO
    if code == errno.ENOENT and not where.exists():
        return OSError(code, SWEPT)
    if isinstance(cause, OSError):
        text = cause.strerror or str(cause)
    elif free is not None and free < FULL_BELOW_BYTES:
        code, text = errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({type(cause).__name__} in torch's writer)"
    else:
        text = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
    room = f"; {free / 2**30:.1f} GiB free there" if free is not None else ""
    return OSError(code, f"{text}{room}")


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """A checkpoint whose writing failed leaves no .tmp-step_<N> behind: on a full disk, its partial files hold
    the room that recording the failure (the rank's error, summary.json) needs."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _has_dropout(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


_RESUME_FIX = ("The task's code changed since the checkpoint was written (its config, task_options included, is "
               "checked before launch; resume_allow allows config changes, not another model): resume with the code "
               "that wrote it, or start a new run (another run_name, or resume=False)")


class Checkpointer:
    """Saves and restores the strategy's model and optimizer (DCP), each rank's RNGs, and TrainerState."""

    def __init__(self, accelerator: Accelerator, run: RunDir, cfg: RunConfig, strategy: Strategy) -> None:
        self.accelerator, self.run, self.cfg, self.strategy = accelerator, run, cfg, strategy
        self.rank, self.world = accelerator.process_index, accelerator.num_processes

    def due(self, step: int, final: bool, stopping: bool) -> bool:
        every = self.cfg.checkpoint_every
        return final or stopping or bool(every and step % every == 0)

    def _everyone(self, mine: Any) -> list[Any]:
        return gather_object([mine]) if self.world > 1 else [mine]

    # ---- saving ---------------------------------------------------------------------------------------
    def save(self, state: TrainerState) -> Path:
        acc, main = self.accelerator, self.accelerator.is_main_process
        root = self.run.checkpoints_path
        tmp, final = root / f".tmp-step_{state.step}", root / f"step_{state.step}"
        with self.run.writing(tmp, f"checkpoint step {state.step}"), _removed_on_failure(tmp):
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            self._write_state(tmp, state)
            acc.wait_for_everyone()
            files = files_in(tmp)
            digests = self._everyone({f: {"size": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)}
                                      for f in files[self.rank::self.world]})
            if main:
                manifest = {"step": state.step, "files": {k: v for part in digests for k, v in part.items()}}
                write_json(tmp / COMPLETE_MARKER, manifest)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                for _, old in self.run.checkpoints()[:-self.cfg.keep_checkpoints]:
                    shutil.rmtree(old, ignore_errors=True)
                self.run.event("checkpoint_saved", step=state.step, path=str(final))
        acc.wait_for_everyone()
        return final

    def _write_state(self, tmp: Path, state: TrainerState) -> None:
        try:
            self.strategy.save(tmp)
            scaler = self.strategy.scaler
            torch.save({"rng": rng_state(self.accelerator.device), "scaler": scaler.state_dict() if scaler else None},
                       tmp / f"rank_{self.rank}.pt")
        except OSError as e:
            if e.errno == errno.ENOENT and not tmp.exists():
                raise OSError(errno.ENOENT, SWEPT) from e
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's writers turn a full disk into a RuntimeError in a CheckpointException
            raise _write_error(e, tmp) from e
        if self.accelerator.is_main_process:
            write_json(tmp / STATE, {**state.to_dict(), "world_size": self.world,
                                     "parallelism": self.cfg.parallelism})
            self.cfg.to_yaml(tmp / "config.yaml")

    # ---- resuming -------------------------------------------------------------------------------------
    def problems(self, ckpt: Path) -> list[str]:
        """What is wrong with `ckpt` against its manifest ([] when it verifies). Collective: the ranks share
        the hashing."""
        try:
            files = read_manifest(ckpt)
        except ValueError as e:
            return [str(e)]
        mine = file_problems(ckpt, files, sorted(files)[self.rank::self.world])
        return sorted(p for part in self._everyone(mine) for p in part)

    def _usable(self) -> Path:
        """The newest checkpoint that verifies; damaged ones are skipped with a warning naming the damage."""
        skipped = []
        # A step_<N> without its manifest (renamed only after the manifest is written) was damaged: named, not
        # passed over.
        for step, ckpt in reversed(self.run.checkpoints(complete=False)):
            found = self.problems(ckpt)
            if not found:
                return ckpt
            skipped.append(f"step_{step}: " + "; ".join(found))
            if self.accelerator.is_main_process:
                log.warning("checkpoint %s is damaged and skipped: %s", ckpt, "; ".join(found))
                self.run.event("checkpoint_skipped", step=step, path=str(ckpt), problems=found)
        raise RuntimeError(f"no checkpoint in {self.run.checkpoints_path} can be used"
                           + (": " + " | ".join(skipped) if skipped else " (there is none)"))

    def _keep_configured(self, configured: list[dict[str, Any]], local: list[dict[str, Any]]) -> None:
        """The checkpoint brings the optimizer's state (moments, step counts); its hyperparameters (lr, weight
        decay, betas, eps) are this run's, which a resume may change where resume_allow names them. Loading a
        state dict would otherwise put back the old run's param groups."""
        loaded = _hyperparameters(self.strategy.optimizer)
        for optimizer, wanted in ((self.strategy.optimizer, configured), (self.strategy.local_optimizer(), local)):
            for group, values in zip(optimizer.param_groups, wanted):
                group.update(values)
        changed = sorted({f"{k}: {old[k]} -> {new[k]}" for old, new in zip(loaded, configured)
                          for k in new if k in old and old[k] != new[k]})
        if changed and self.accelerator.is_main_process:
            log.info("resumed with this run's optimizer settings, not the checkpoint's: %s", "; ".join(changed))

    def _note_dropout(self, ckpt: Path, saved: dict[str, Any]) -> None:
        """Dropout masks come from each rank's random stream, which a run on another rank count can't continue:
        say so, since the curve then differs from an uninterrupted run (the samples and their order don't)."""
        saved_world = saved.get("world_size")
        if not self.accelerator.is_main_process or saved_world in (None, self.world):
            return
        if _has_dropout(self.strategy.module):
            message = (f"resuming on {self.world} rank(s) from {ckpt.name}, saved by {saved_world}: dropout masks "
                       "are drawn from per-rank random streams, so the curve will differ from an uninterrupted "
                       f"run on {saved_world} rank(s), though every step sees the same samples")
            log.warning(message)
            self.run.event("resume_differs", step=saved.get("step"), reason="dropout", message=message)

    def _check_model(self, ckpt: Path) -> None:
        """The checkpoint's model entries against the model this run built, every name and full shape, before
        anything loads: DCP would resume a model that lost a layer without a word, and fail on a changed one with
        a CheckpointException that names neither the parameter nor its shapes. Collective: a pipeline rank holds
        only its stages, so the ranks' entries are put together first."""
        model: dict[str, tuple[int, ...] | None] = {}
        for part in self._everyone(shapes_of(self.strategy.state_dict()["model"])):
            model.update(part)
        differences = model_differences(saved_model_shapes(ckpt / "model"), model)
        if differences:
            raise ModelMismatchError(f"resume from {ckpt}: the checkpoint doesn't match the task's model: "
                                     f"{differences}. {_RESUME_FIX}")

    def resume(self) -> tuple[TrainerState, Path]:
        """Load the newest checkpoint that verifies, resharded to this run's mode and ranks."""
        ckpt = self._usable()
        saved = json.loads((ckpt / STATE).read_text())
        configured = _hyperparameters(self.strategy.optimizer), _hyperparameters(self.strategy.local_optimizer())
        self._check_model(ckpt)
        try:
            self.strategy.load(ckpt)
        except BaseException as e:
            if not is_checkpoint_exception(e):
                raise
            # e.g. the task's optimizer changed: its message names only the ranks; each rank's failure is inside
            raise CheckpointLoadError(f"resume from {ckpt}: the checkpoint could not be loaded into this run: "
                                      f"{failure_summary(e)}. {_RESUME_FIX}") from e
        self._keep_configured(*configured)
        self._note_dropout(ckpt, saved)
        mine = ckpt / f"rank_{self.rank}.pt"
        if mine.exists():
            rank_state = torch.load(mine, weights_only=True)
            set_rng_state(rank_state["rng"], self.accelerator.device)
            if self.strategy.scaler is not None and rank_state.get("scaler"):
                self.strategy.scaler.load_state_dict(rank_state["scaler"])
        elif self.rank < saved.get("world_size", 0):
            raise FileNotFoundError(f"{mine}: the checkpoint was saved by {saved['world_size']} ranks but has no "
                                    f"state for rank {self.rank}")
        else:  # a rank the checkpoint had no state for: what that changes (dropout) _note_dropout said once
            log.debug("[rank %d] %s was saved by %s rank(s): this rank starts with fresh random states", self.rank,
                      ckpt.name, saved.get("world_size"))
        state = TrainerState.from_dict(saved)
        # The data position counts samples, so a resume on another layout (same global batch) continues it.
        state.micro_batches = state.step * self.cfg.grad_accum_steps
        if self.accelerator.is_main_process:
            self.run.set_aside_metrics_after(state.step)
        return state, ckpt
