"""Checkpoints: the full training state under checkpoints/step_<N>/, written atomically, verified on
resume.

    step_<N>/model/, optim/    model and optimizer state keyed by parameter name
    (torch.distributed.checkpoint: sharded modes write shards; any mode and rank count can load
    them) step_<N>/rank_<r>.pt       each rank's RNG states and loss-scaler state
    step_<N>/trainer_state.json, config.yaml   progress, and the config that wrote it
    step_<N>/manifest.json     every file's size and sha256; written last

Every rank writes into checkpoints/.tmp-step_<N>; the ranks hash the files between them; rank 0
writes the manifest and renames the directory, so a step_<N> name with a manifest always means a
complete checkpoint. Resume verifies the newest one against its manifest and falls back to the
previous on any damage, saying what is wrong; whatever a checkpoint claims (RNG states included)
loads, or the resume fails loudly. With checkpoint_async the model and optimizer are written in the
background (checkpoint_async.py), and sealed the same way once every rank's write is done: a crash
before leaves only .tmp-step_<N>.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.utils import gather_object

from workbench.rundir import COMPLETE_MARKER, RunDir
from workbench.training.checkpoint_async import BackgroundWriter, Pending, writes_async
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
    """Every RNG a step may draw from, as plain tensors and numbers (loadable with
    weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


FULL_BELOW_BYTES = 1 << 20
"""Less room than this left where a write failed: the disk is taken to be full, whatever the writer
raised."""


# A rank whose checkpoint write fails removes the whole unfinished checkpoint (_removed_on_failure)
# while another rank may still be writing into it: that rank's error is fallout of the first
# (rundir's is_fallout knows it).
SWEPT = "its folder was removed as another rank's write failed"


def _write_error(error: BaseException, where: Path) -> OSError:
    """An I/O failure inside torch's writers, as an OSError saying what failed and how much room is
    left.

    DCP collects each rank's failure as (exception, traceback) in CheckpointException.failures, and
    torch.save on a full disk raises a RuntimeError from its zip writer ('unexpected pos'), not
    ENOSPC."""
    failures = [
        f[0] if isinstance(f, tuple) and f else f
        for f in (getattr(error, "failures", None) or {}).values()
    ]
    cause = next(
        (f for f in failures if isinstance(f, OSError)), failures[0] if failures else error
    )
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
        code, text = (
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)} ({type(cause).__name__} in torch's writer)",
        )
    else:
        text = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
    room = f"; {free / 2**30:.1f} GiB free there" if free is not None else ""
    return OSError(code, f"{text}{room}")


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """A checkpoint whose writing failed leaves no .tmp-step_<N> behind: on a full disk, its partial
    files hold the room that recording the failure (the rank's error, summary.json) needs."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _has_dropout(model: torch.nn.Module) -> bool:
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    )


_RESUME_FIX = (
    "The task's code changed since the checkpoint was written (its config, task_options included, "
    "is checked before launch; resume_allow allows config changes, not another model): resume "
    "with the code that wrote it, or start a new run (another run_name, or resume=False)"
)


class Checkpointer:
    """Saves and restores the strategy's model and optimizer (DCP), each rank's RNGs, and
    TrainerState."""

    def __init__(
        self, accelerator: Accelerator, run: RunDir, cfg: RunConfig, strategy: Strategy
    ) -> None:
        self.accelerator, self.run, self.cfg, self.strategy = accelerator, run, cfg, strategy
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        background, self.why = writes_async(cfg, accelerator.device)
        self.background = BackgroundWriter(cfg, accelerator.device) if background else None
        self.pending: Pending | None = None
        self.ends_session = False
        self.stalls: list[float] = []
        """Per checkpoint of this session: seconds the training loop was blocked by it."""
        if (
            accelerator.is_main_process
        ):  # the default on a CPU (synchronous) is no news: said at debug level
            quiet = not background and cfg.checkpoint_async == "auto"
            log.log(
                logging.DEBUG if quiet else logging.INFO,
                "checkpoints are written %s (%s)",
                "in the background" if background else "synchronously",
                self.why,
            )

    def due(self, step: int, final: bool, stopping: bool) -> bool:
        every = self.cfg.checkpoint_every
        # A checkpoint that ends the session is waited for at once: the ending and status that
        # follow name it.
        self.ends_session = final or stopping
        return final or stopping or bool(every and step % every == 0)

    def _everyone(self, mine: Any) -> list[Any]:
        return gather_object([mine]) if self.world > 1 else [mine]

    # ---- saving ----------------------------------------------------------------------------------
    def save(self, state: TrainerState) -> Path:
        """Write a checkpoint of `state` (collective): whole before returning, or (checkpoint_async)
        staged in host memory and written in the background, once the previous write is done."""
        began = time.perf_counter()
        self.wait()  # at most one write in flight
        acc, main, step = self.accelerator, self.accelerator.is_main_process, state.step
        root = self.run.checkpoints_path
        tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
        with self.run.writing(tmp, f"checkpoint step {step}"), _removed_on_failure(tmp):
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            if self.background is not None:
                writes = self._write_state(tmp, state, self.background.start)
                self.pending = Pending(
                    step, lambda: self._complete(writes, tmp, final, step, began)
                )
                if self.ends_session:
                    self.wait()
            else:
                self._write_state(tmp, state, lambda strategy, path: strategy.save(path))
                acc.wait_for_everyone()
                self._seal(tmp, final, step, self._everyone, time.perf_counter() - began)
        if self.background is None:
            acc.wait_for_everyone()
        self.stalls.append(time.perf_counter() - began)
        return final

    def wait(self) -> float:
        """Wait for the checkpoint being written in the background, if any: the seconds waited. Its
        failure is raised here, in the training loop, as a synchronous save raises it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return 0.0
        began = time.perf_counter()
        pending.wait()
        return time.perf_counter() - began

    def finish(self) -> dict[str, Any]:
        """At the end of the session: wait for a write still in flight (its wait is the last
        checkpoint's stall), give back the staging buffers; how this session's checkpoints went, for
        the summary."""
        waited = self.wait()
        if self.stalls:
            self.stalls[-1] += waited
        if self.background is not None:
            self.background.close()
        return {
            "async": self.background is not None,
            "why": self.why,
            "stall_s": [round(s, 4) for s in self.stalls],
        }

    def _complete(
        self, writes: list[Future], tmp: Path, final: Path, step: int, began: float
    ) -> None:
        """In a background thread: once every rank's write is done, seal the checkpoint as a
        synchronous save does; a failed write on any rank fails it on every rank, folder removed."""
        assert self.background is not None
        everyone = self.background.everyone
        with self.run.writing(tmp, f"checkpoint step {step}"), _removed_on_failure(tmp):
            error = None
            for write in writes:
                try:
                    write.result()
                except BaseException as e:  # noqa: BLE001  (any failure fails the checkpoint)
                    error = error or e
            failed = [rank for rank, bad in enumerate(everyone(error is not None)) if bad]
            if error is not None:
                raise _write_error(error, tmp) from error
            if failed:
                raise OSError(errno.EIO, f"{SWEPT} (rank {failed[0]})")
            self._seal(tmp, final, step, everyone, time.perf_counter() - began)

    def _seal(self, tmp: Path, final: Path, step: int, everyone: Any, write_s: float) -> None:
        """Hash the files (the ranks share the work); rank 0 writes the manifest, renames the folder
        and drops the checkpoints past keep_checkpoints."""
        files = files_in(tmp)
        digests = everyone(
            {
                f: {"size": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)}
                for f in files[self.rank :: self.world]
            }
        )
        if self.accelerator.is_main_process:
            manifest = {"step": step, "files": {k: v for part in digests for k, v in part.items()}}
            write_json(tmp / COMPLETE_MARKER, manifest)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in self.run.checkpoints()[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            self.run.event(
                "checkpoint_saved",
                step=step,
                path=str(final),
                write_s=round(write_s, 4),
                background=self.background is not None,
            )

    def _write_state(
        self, tmp: Path, state: TrainerState, write: Callable[[Strategy, Path], Any]
    ) -> Any:
        """`write` the model and optimizer (what it returns is returned), then each rank's RNG and
        loss-scaler state, and rank 0 the trainer state and the config."""
        try:
            written = write(self.strategy, tmp)
            scaler = self.strategy.scaler
            torch.save(
                {
                    "rng": rng_state(self.accelerator.device),
                    "scaler": scaler.state_dict() if scaler else None,
                },
                tmp / f"rank_{self.rank}.pt",
            )
        except OSError as e:
            if e.errno == errno.ENOENT and not tmp.exists():
                raise OSError(errno.ENOENT, SWEPT) from e
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except (
            BaseException
        ) as e:  # torch's writers turn a full disk into a RuntimeError in a CheckpointException
            raise _write_error(e, tmp) from e
        if self.accelerator.is_main_process:
            write_json(
                tmp / STATE,
                {**state.to_dict(), "world_size": self.world, "parallelism": self.cfg.parallelism},
            )
            self.cfg.to_yaml(tmp / "config.yaml")
        return written

    # ---- resuming --------------------------------------------------------------------------------
    def problems(self, ckpt: Path) -> list[str]:
        """What is wrong with `ckpt` against its manifest ([] when it verifies). Collective: the
        ranks share the hashing."""
        try:
            files = read_manifest(ckpt)
        except ValueError as e:
            return [str(e)]
        mine = file_problems(ckpt, files, sorted(files)[self.rank :: self.world])
        return sorted(p for part in self._everyone(mine) for p in part)

    def _usable(self) -> Path:
        """The newest checkpoint that verifies; damaged ones are skipped with a warning naming the
        damage."""
        skipped = []
        # A write the run stopped in (killed, or a background write it never waited for): said,
        # never loaded.
        main = self.accelerator.is_main_process
        for partial in sorted(self.run.checkpoints_path.glob(".tmp-step_*")) if main else []:
            log.warning(
                "checkpoint %s is incomplete (its write never finished) and is skipped", partial
            )
            number = partial.name.removeprefix(".tmp-step_")
            self.run.event(
                "checkpoint_skipped",
                step=int(number) if number.isdigit() else number,
                path=str(partial),
                problems=["incomplete: its write never finished"],
            )
        # A step_<N> without its manifest (renamed only after the manifest is written) was damaged:
        # named, not passed over.
        for step, ckpt in reversed(self.run.checkpoints(complete=False)):
            found = self.problems(ckpt)
            if not found:
                return ckpt
            skipped.append(f"step_{step}: " + "; ".join(found))
            if self.accelerator.is_main_process:
                log.warning("checkpoint %s is damaged and skipped: %s", ckpt, "; ".join(found))
                self.run.event("checkpoint_skipped", step=step, path=str(ckpt), problems=found)
        raise RuntimeError(
            f"no checkpoint in {self.run.checkpoints_path} can be used"
            + (": " + " | ".join(skipped) if skipped else " (there is none)")
        )

    def _keep_configured(
        self, configured: list[dict[str, Any]], local: list[dict[str, Any]]
    ) -> None:
        """The checkpoint brings the optimizer's state (moments, step counts); its hyperparameters
        (lr, weight decay, betas, eps) are this run's, which a resume may change where resume_allow
        names them. Loading a state dict would otherwise put back the old run's param groups."""
        loaded = _hyperparameters(self.strategy.optimizer)
        for optimizer, wanted in (
            (self.strategy.optimizer, configured),
            (self.strategy.local_optimizer(), local),
        ):
            for group, values in zip(optimizer.param_groups, wanted):
                group.update(values)
        changed = sorted(
            {
                f"{k}: {old[k]} -> {new[k]}"
                for old, new in zip(loaded, configured)
                for k in new
                if k in old and old[k] != new[k]
            }
        )
        if changed and self.accelerator.is_main_process:
            log.info(
                "resumed with this run's optimizer settings, not the checkpoint's: %s",
                "; ".join(changed),
            )

    def _note_dropout(self, ckpt: Path, saved: dict[str, Any]) -> None:
        """Dropout masks come from each rank's random stream, which a run on another rank count
        can't continue: say so, since the curve then differs from an uninterrupted run (the samples
        and their order don't)."""
        saved_world = saved.get("world_size")
        if not self.accelerator.is_main_process or saved_world in (None, self.world):
            return
        if _has_dropout(self.strategy.module):
            message = (
                f"resuming on {self.world} rank(s) from {ckpt.name}, saved by {saved_world}: "
                "dropout masks are drawn from per-rank random streams, so the curve will differ "
                f"from an uninterrupted run on {saved_world} rank(s), though every step sees the "
                "same samples"
            )
            log.warning(message)
            self.run.event(
                "resume_differs", step=saved.get("step"), reason="dropout", message=message
            )

    def _check_model(self, ckpt: Path) -> None:
        """The checkpoint's model entries against the model this run built, every name and full
        shape, before anything loads: DCP would resume a model that lost a layer without a word, and
        fail on a changed one with a CheckpointException that names neither the parameter nor its
        shapes. Collective: a pipeline rank holds only its stages, so the ranks' entries are put
        together first."""
        model: dict[str, tuple[int, ...] | None] = {}
        for part in self._everyone(shapes_of(self.strategy.state_dict()["model"])):
            model.update(part)
        differences = model_differences(saved_model_shapes(ckpt / "model"), model)
        if differences:
            raise ModelMismatchError(
                f"resume from {ckpt}: the checkpoint doesn't match the task's model: "
                f"{differences}. {_RESUME_FIX}"
            )

    def resume(self) -> tuple[TrainerState, Path]:
        """Load the newest checkpoint that verifies, resharded to this run's mode and ranks."""
        ckpt = self._usable()
        saved = json.loads((ckpt / STATE).read_text())
        configured = (
            _hyperparameters(self.strategy.optimizer),
            _hyperparameters(self.strategy.local_optimizer()),
        )
        self._check_model(ckpt)
        try:
            self.strategy.load(ckpt)
        except BaseException as e:
            if not is_checkpoint_exception(e):
                raise
            # e.g. the task's optimizer changed: its message names only the ranks; each rank's
            # failure is inside
            raise CheckpointLoadError(
                f"resume from {ckpt}: the checkpoint could not be loaded into this run: "
                f"{failure_summary(e)}. {_RESUME_FIX}"
            ) from e
        self._keep_configured(*configured)
        self._note_dropout(ckpt, saved)
        mine = ckpt / f"rank_{self.rank}.pt"
        if mine.exists():
            rank_state = torch.load(mine, weights_only=True)
            set_rng_state(rank_state["rng"], self.accelerator.device)
            if self.strategy.scaler is not None and rank_state.get("scaler"):
                self.strategy.scaler.load_state_dict(rank_state["scaler"])
        elif self.rank < saved.get("world_size", 0):
            raise FileNotFoundError(
                f"{mine}: the checkpoint was saved by {saved['world_size']} ranks but has no "
                f"state for rank {self.rank}"
            )
        else:
            # a rank the checkpoint had no state for: what that changes (dropout) _note_dropout said
            # once
            log.debug(
                "[rank %d] %s was saved by %s rank(s): this rank starts with fresh random states",
                self.rank,
                ckpt.name,
                saved.get("world_size"),
            )
        state = TrainerState.from_dict(saved)
        # The data position counts samples, so a resume on another layout (same global batch)
        # continues it.
        state.micro_batches = state.step * self.cfg.grad_accum_steps
        if self.accelerator.is_main_process:
            self.run.set_aside_metrics_after(state.step)
        return state, ckpt
