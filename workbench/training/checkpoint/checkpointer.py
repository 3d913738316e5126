"""Checkpoints: the full training state under checkpoints/step_<N>/, written atomically, verified on
resume.

    step_<N>/model/, optim/    model and optimizer state keyed by parameter name
                               (torch.distributed.checkpoint: sharded modes write shards; any
                               mode and rank count can load them)
    step_<N>/rank_<r>.pt       each rank's RNG states and loss-scaler state
    step_<N>/trainer_state.json, config.yaml   progress, and the config that wrote it
    step_<N>/manifest.json     every file's size and sha256; written last

Every rank writes into checkpoints/.tmp-step_<N>; the ranks hash the files between them; rank 0
writes the manifest and renames the directory, so a step_<N> name with a manifest always means a
complete checkpoint. On an object store (checkpoint_url='s3://...': `<url>/<run_name>/step_<N>/`,
storage/store_path.py) there is no atomic rename: the ranks write straight into step_<N>/, hash
what the store then holds, and rank 0 writes the manifest object last, so a step_<N>/ counts only
once its manifest exists. One without is never resumed from or loaded, and the next seal sweeps it
(a "checkpoint_swept" event); old steps are deleted, manifest first, only once a newer one is
sealed. Resume verifies the newest one against its manifest and falls back to the
previous on any damage, saying what is wrong; whatever a checkpoint claims (RNG states included)
loads, or the resume fails loudly. With checkpoint_async the model and optimizer are written in the
background (background.py), and sealed the same way once every rank's write is done: a crash
before leaves only .tmp-step_<N>.

What a failed write leaves and says is in failures.py, the rank files in rank_state.py, and the
checks a resume makes before and after loading in resume.py. TrainerState, the progress saved as
trainer_state.json, is defined here with the code that saves and restores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from accelerate.utils import gather_object

from workbench.rundir.run_dir import COMPLETE_MARKER, TRAINER_STATE, RunDir
from workbench.storage.store_path import Location, StorePath, checkpoints_root, remove_tree
from workbench.training.checkpoint.background import BackgroundWriter, Pending, writes_async
from workbench.training.checkpoint.failures import (
    SWEPT,
    disk_full,
    explained_write_failures,
    removed_on_failure,
    write_error,
)
from workbench.training.checkpoint.files import (
    file_problems,
    files_in,
    read_manifest,
    sha256,
    shapes_of,
)
from workbench.training.checkpoint.rank_state import load_rank_state, save_rank_state
from workbench.training.checkpoint.resume import (
    check_model,
    hyperparameters,
    keep_configured,
    load_into,
    note_dropout,
)
from workbench.utils.files import write_json

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.training.parallel import Strategy

log = logging.getLogger("workbench")


@dataclasses.dataclass
class TrainerState:
    """The progress a checkpoint carries (trainer_state.json), enough to continue a run bit for
    bit."""

    step: int = 0
    micro_batches: int = 0
    """Micro-batches each rank has consumed: the position in the deterministic data order."""
    samples: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    train_time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class Checkpointer:
    """Saves and restores the strategy's model and optimizer (DCP), each rank's RNGs, and
    TrainerState."""

    def __init__(
        self, accelerator: Accelerator, run: RunDir, cfg: RunConfig, strategy: Strategy
    ) -> None:
        self.accelerator, self.run, self.cfg, self.strategy = accelerator, run, cfg, strategy
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.root: Location = checkpoints_root(run.path, cfg.checkpoint_url)
        self.remote = isinstance(self.root, StorePath)
        background, self.why = writes_async(cfg, accelerator.device)
        self.background = BackgroundWriter(cfg, accelerator.device) if background else None
        self.pending: Pending | None = None
        self.ends_session = False
        self.stalls: list[float] = []
        """Per checkpoint of this session: seconds the training loop was blocked by it."""
        if accelerator.is_main_process:
            # the default on a CPU (synchronous) is no news: said at debug level
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
    def save(self, state: TrainerState) -> Location:
        """Write a checkpoint of `state` (collective): whole before returning, or (checkpoint_async)
        staged in host memory and written in the background, once the previous write is done."""
        began = time.perf_counter()
        self.wait()  # at most one write in flight
        acc, main, step = self.accelerator, self.accelerator.is_main_process, state.step
        root = self.root
        # on a store the files go straight to step_<N>/ (no rename): unsealed until its manifest
        tmp = root / (f"step_{step}" if self.remote else f".tmp-step_{step}")
        final = root / f"step_{step}"
        with (
            self.run.writing(tmp, f"checkpoint step {step}"),
            removed_on_failure(tmp),
            self._store_errors(tmp),
        ):
            if main:
                remove_tree(tmp)  # a store: an earlier session's step_<N>, sealed or not
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

    def settle(self, timeout_s: float | None = None) -> str | None:
        """Before an ending that names the last sealed checkpoint (a divergence): wait for the write
        in flight, up to `timeout_s` (default: dist_timeout_s, the bound of the write's own
        collectives). None when nothing was in flight or it was sealed; otherwise what became of it,
        for the ending to say: a failed write is named there rather than raised, as the run's ending
        is the divergence, and a write still going is named as in flight (the session's finish
        waits for it again)."""
        pending = self.pending
        if pending is None:
            return None
        where = self.root / (f"step_{pending.step}" if self.remote else f".tmp-step_{pending.step}")
        bound = self.cfg.dist_timeout_s if timeout_s is None else timeout_s
        began = time.perf_counter()
        try:
            done = pending.wait(bound)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001  (DCP's CheckpointException is no Exception)
            self.pending = None
            log.warning("checkpoint step %d's background write failed: %s", pending.step, e)
            return f"the background write of checkpoint step {pending.step} failed: {e}"
        if self.stalls:
            self.stalls[-1] += time.perf_counter() - began
        if not done:
            return (
                f"checkpoint step {pending.step} was still being written ({where}) {bound:g} s "
                "later: it counts only once sealed (a resume takes the newest sealed one)"
            )
        self.pending = None
        return None

    def filled_the_disk(
        self, error: BaseException, timeout_s: float = 60.0
    ) -> BaseException | None:
        """A failure on a full disk (a metrics row, a tracker's file) while a checkpoint is written
        in the background: that write is what filled the disk, and its own failure, naming the
        checkpoint's file, is the run's ending, whichever write hit the full disk first. Waits for
        it up to `timeout_s`; None when no write was in flight, `error` was no ENOSPC, or the write
        went through."""
        pending = self.pending
        if pending is None or not disk_full(error):
            return None
        try:
            pending.wait(timeout_s)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as failed:  # noqa: BLE001  (the write's own failure, to raise)
            self.pending = None
            return failed
        return None

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
        self, writes: list[Future], tmp: Location, final: Location, step: int, began: float
    ) -> None:
        """In a background thread: once every rank's write is done, seal the checkpoint as a
        synchronous save does; a failed write on any rank fails it on every rank, folder removed."""
        assert self.background is not None
        everyone = self.background.everyone
        with self.run.writing(tmp, f"checkpoint step {step}"), removed_on_failure(tmp):
            error = None
            for write in writes:
                try:
                    write.result()
                except BaseException as e:  # noqa: BLE001  (any failure fails the checkpoint)
                    error = error or e
            failed = [rank for rank, bad in enumerate(everyone(error is not None)) if bad]
            if error is not None:
                raise write_error(error, tmp) from error
            if failed:
                raise OSError(errno.EIO, f"{SWEPT} (rank {failed[0]})")
            self._seal(tmp, final, step, everyone, time.perf_counter() - began)

    def _seal(
        self, tmp: Location, final: Location, step: int, everyone: Any, write_s: float
    ) -> None:
        # On a store, reading back and sealing talk to it too: a store gone meanwhile fails the
        # checkpoint naming the store and the step (botocore's errors are no OSError).
        with self._store_errors(tmp):
            self._seal_here(tmp, final, step, everyone, write_s)

    def _store_errors(self, tmp: Location) -> contextlib.AbstractContextManager[None]:
        """On a store, any failure talking to it (botocore's errors are no OSError) as an OSError
        naming the store, the step's prefix and the cause (failures.write_error)."""
        return explained_write_failures(tmp) if self.remote else contextlib.nullcontext()

    def _seal_here(
        self, tmp: Location, final: Location, step: int, everyone: Any, write_s: float
    ) -> None:
        """Hash the files (the ranks share the work); rank 0 writes the manifest, renames the folder
        and drops the checkpoints past keep_checkpoints. On a store: the files are hashed as the
        store holds them, and the manifest, written last, is the seal (no rename)."""
        files = files_in(tmp)
        digests = everyone(
            {
                f: {"size": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)}
                for f in files[self.rank :: self.world]
            }
        )
        if self.accelerator.is_main_process and self.remote:
            manifest = {"step": step, "files": {k: v for part in digests for k, v in part.items()}}
            (final / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1))
            self._sweep_store(step)
            self._saved(step, final, write_s)
        elif self.accelerator.is_main_process:
            manifest = {"step": step, "files": {k: v for part in digests for k, v in part.items()}}
            write_json(tmp / COMPLETE_MARKER, manifest)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for _, old in self.run.checkpoints(root=self.root)[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
            self._saved(step, final, write_s)

    def _saved(self, step: int, final: Location, write_s: float) -> None:
        self.run.event(
            "checkpoint_saved",
            step=step,
            path=str(final),
            write_s=round(write_s, 4),
            background=self.background is not None,
        )

    def _sweep_store(self, sealed: int) -> None:
        """On a store, once step `sealed` is: remove every other step_<N>/ without a manifest (a
        write that failed or was cut off: never used, and named in an event), then the sealed
        steps past keep_checkpoints, each manifest first (unsealed at once, should the deletion
        itself be cut off)."""
        steps = self.run.checkpoints(complete=False, root=self.root)
        sealed_steps = {n for n, _ in self.run.checkpoints(root=self.root)}
        for step, ckpt in steps:
            if step != sealed and step not in sealed_steps:
                log.warning(
                    "checkpoint %s has no %s (its write never finished): swept",
                    ckpt,
                    COMPLETE_MARKER,
                )
                remove_tree(ckpt)
                self.run.event(
                    "checkpoint_swept",
                    step=step,
                    path=str(ckpt),
                    problems=[f"{COMPLETE_MARKER} is missing: its write never finished"],
                )
        kept = self.run.checkpoints(root=self.root)
        for _, old in kept[: -self.cfg.keep_checkpoints]:
            remove_tree(old / COMPLETE_MARKER)
            remove_tree(old)

    def _write_state(
        self, tmp: Location, state: TrainerState, write: Callable[[Strategy, Location], Any]
    ) -> Any:
        """`write` the model and optimizer (what it returns is returned), then each rank's RNG and
        loss-scaler state, and rank 0 the trainer state and the config."""
        with explained_write_failures(tmp):
            written = write(self.strategy, tmp)
            save_rank_state(
                tmp / f"rank_{self.rank}.pt", self.accelerator.device, self.strategy.scaler
            )
        if self.accelerator.is_main_process:
            progress = {
                **state.to_dict(),
                "world_size": self.world,
                "parallelism": self.cfg.parallelism,
            }
            if self.remote:
                with explained_write_failures(tmp):
                    (tmp / TRAINER_STATE).write_text(json.dumps(progress, indent=1))
                    (tmp / "config.yaml").write_text(self.cfg.to_yaml())
            else:
                write_json(tmp / TRAINER_STATE, progress)
                self.cfg.to_yaml(tmp / "config.yaml")
        return written

    # ---- resuming --------------------------------------------------------------------------------
    def problems(self, ckpt: Location) -> list[str]:
        """What is wrong with `ckpt` against its manifest ([] when it verifies). Collective: the
        ranks share the hashing."""
        try:
            files = read_manifest(ckpt)
        except ValueError as e:
            return [str(e)]
        mine = file_problems(ckpt, files, sorted(files)[self.rank :: self.world])
        return sorted(p for part in self._everyone(mine) for p in part)

    def _usable(self) -> Location:
        """The newest checkpoint that verifies; damaged ones are skipped with a warning naming the
        damage."""
        skipped = []
        # A write the run stopped in (killed, or a background write it never waited for): said,
        # never loaded.
        main = self.accelerator.is_main_process
        partials = [] if self.remote or not main else sorted(self.root.glob(".tmp-step_*"))
        for partial in partials:
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
        # On a store, a step_<N>/ without its manifest is a write that never finished: skipped as
        # such (and swept by the next seal).
        for step, ckpt in reversed(self.run.checkpoints(complete=False, root=self.root)):
            found = self.problems(ckpt)
            if not found:
                return ckpt
            skipped.append(f"step_{step}: " + "; ".join(found))
            if self.accelerator.is_main_process:
                log.warning("checkpoint %s is damaged and skipped: %s", ckpt, "; ".join(found))
                self.run.event("checkpoint_skipped", step=step, path=str(ckpt), problems=found)
        raise RuntimeError(
            f"no checkpoint in {self.root} can be used"
            + (": " + " | ".join(skipped) if skipped else " (there is none)")
        )

    def _model_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """Every name and full shape of the model this run built, for check_model. Collective: a
        pipeline rank holds only its stages, so the ranks' entries are put together first."""
        model: dict[str, tuple[int, ...] | None] = {}
        for part in self._everyone(shapes_of(self.strategy.state_dict()["model"])):
            model.update(part)
        return model

    def resume(self) -> tuple[TrainerState, Location]:
        """Load the newest checkpoint that verifies, resharded to this run's mode and ranks."""
        ckpt = self._usable()
        saved = json.loads((ckpt / TRAINER_STATE).read_text())
        strategy, main = self.strategy, self.accelerator.is_main_process
        configured = (
            hyperparameters(strategy.optimizer),
            hyperparameters(strategy.local_optimizer()),
        )
        check_model(ckpt, self._model_shapes())
        load_into(strategy, ckpt)
        keep_configured(strategy, *configured, announce=main)
        if main:
            note_dropout(self.run, strategy.module, ckpt, saved, self.world)
        load_rank_state(
            ckpt, self.rank, saved.get("world_size"), self.accelerator.device, strategy.scaler
        )
        state = TrainerState.from_dict(saved)
        # The data position counts samples, so a resume on another layout (same global batch)
        # continues it.
        state.micro_batches = state.step * self.cfg.grad_accum_steps
        if main:
            self.run.set_aside_metrics_after(state.step)
        return state, ckpt
