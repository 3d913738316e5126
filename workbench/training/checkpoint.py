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

import errno
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object

from workbench.rundir import COMPLETE_MARKER, RunDir
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER)


def _write_error(error: BaseException, where: Path) -> OSError:
    """An I/O failure inside torch's writers, as an OSError saying what failed and how much room is left."""
    failures = list((getattr(error, "failures", None) or {}).values())
    cause = next((f for f in failures if isinstance(f, OSError)), failures[0] if failures else error)
    text = cause.strerror if isinstance(cause, OSError) else f"{type(cause).__name__}: {str(cause).strip()[:300]}"
    try:
        free = f"; {shutil.disk_usage(where).free / 2**30:.1f} GiB free there"
    except OSError:
        free = ""
    return OSError(getattr(cause, "errno", None) or errno.EIO, f"{text}{free}")


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
        with self.run.writing(tmp, f"checkpoint step {state.step}"):
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            self._write_state(tmp, state)
            acc.wait_for_everyone()
            files = _files(tmp)
            digests = self._everyone({f: {"size": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)}
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
        except (OSError, KeyboardInterrupt, SystemExit):
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
            manifest = json.loads((ckpt / COMPLETE_MARKER).read_text())
            files: dict[str, dict[str, Any]] = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [f"{COMPLETE_MARKER} is unreadable ({type(e).__name__}: {e})"]
        mine = []
        for name in sorted(files)[self.rank::self.world]:
            path, want = ckpt / name, files[name]
            if not path.is_file():
                mine.append(f"{name} is missing")
            elif path.stat().st_size != want["size"]:
                mine.append(f"{name} is {path.stat().st_size} bytes, the manifest says {want['size']} (truncated?)")
            elif _sha256(path) != want["sha256"]:
                mine.append(f"{name} does not match its sha256 (damaged)")
        return sorted(p for part in self._everyone(mine) for p in part)

    def _usable(self) -> Path:
        """The newest checkpoint that verifies; damaged ones are skipped with a warning naming the damage."""
        skipped = []
        for step, ckpt in reversed(self.run.checkpoints()):
            found = self.problems(ckpt)
            if not found:
                return ckpt
            skipped.append(f"step_{step}: " + "; ".join(found))
            if self.accelerator.is_main_process:
                log.warning("checkpoint %s is damaged and skipped: %s", ckpt, "; ".join(found))
                self.run.event("checkpoint_skipped", step=step, path=str(ckpt), problems=found)
        raise RuntimeError(f"no checkpoint in {self.run.checkpoints_path} can be used"
                           + (": " + " | ".join(skipped) if skipped else " (there is none)"))

    def resume(self) -> tuple[TrainerState, Path]:
        """Load the newest checkpoint that verifies, resharded to this run's mode and ranks."""
        ckpt = self._usable()
        saved = json.loads((ckpt / STATE).read_text())
        self.strategy.load(ckpt)
        mine = ckpt / f"rank_{self.rank}.pt"
        if mine.exists():
            rank_state = torch.load(mine, weights_only=True)
            set_rng_state(rank_state["rng"], self.accelerator.device)
            if self.strategy.scaler is not None and rank_state.get("scaler"):
                self.strategy.scaler.load_state_dict(rank_state["scaler"])
        elif self.rank < saved.get("world_size", 0):
            raise FileNotFoundError(f"{mine}: the checkpoint was saved by {saved['world_size']} ranks but has no "
                                    f"state for rank {self.rank}")
        else:
            log.warning("[rank %d] %s was saved by %s rank(s): this rank starts with fresh random states, so "
                        "dropout differs from an uninterrupted run", self.rank, ckpt, saved.get("world_size"))
        state = TrainerState.from_dict(saved)
        # The data position counts samples, so a resume on another layout (same global batch) continues it.
        state.micro_batches = state.step * self.cfg.grad_accum_steps
        if self.accelerator.is_main_process:
            self.run.set_aside_metrics_after(state.step)
        return state, ckpt
