"""RunDir: the files of one run directory, and the only code that writes them.

runs/<name>/config.yaml (+ config.attempt-<n>.yaml), metrics.jsonl (rows: MetricsRow), events.jsonl,
summary.json, timings.json, model.safetensors, autobatch.json (micro_batch_size='auto'), task.pkl
(a spawned launch's task), slurm.json and slurm-attempt (a cluster run's job and its requeued
attempt), ray.json and ray-attempt (a run on Ray: its driver actor, and the worker group Ray started
last), plot.png (`workbench demo`), checkpoints/step_<N>/, errors/rank_<r>.json,
ranks/rank_<r>.json (heartbeats), stacks/rank_<r>.txt, rank_values/rank_<r>.pt,
profile/rank_<r>.json (profile_steps), tensorboard/ and mlflow/ (trackers), slurm/ (submitit's),
ray/ (Ray Train's storage_path, Ray's log lines and each worker's output and node),
LOCK, STOP. Every file is written by a method here (LOCK and its guard by lock.py, a new directory
by prepare.py); what a library writes (DCP into checkpoints/, torch.profiler into profile/, the
trackers, submitit) goes into the folders named here. JSON files are replaced atomically; JSONL
files are appended a whole line at a time (a line torn by a crash is ended first), and readers skip
a line they can't parse, so a crash never leaves a file that can't be read. A write that fails
(disk full, permissions) raises RunDirWriteError naming the run directory and the file; a file
damaged by something else (summary.json that isn't a JSON object) reads as a ValueError
(DamagedFileError) naming it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.rundir import lock
from workbench.rundir.lock import LOCK
from workbench.rundir.metrics_row import MetricsRow, newest_train_row
from workbench.rundir.rank_files import is_fallout, ranks_at
from workbench.rundir.scheduler import JOB_FILE
from workbench.rundir.summary import Status, Summary
from workbench.utils.files import (
    DamagedFileError,
    append_jsonl,
    atomic_write_bytes,
    atomic_write_text,
    read_json,
    read_json_checked,
    read_jsonl,
    write_json,
    write_jsonl,
)
from workbench.utils.jsonl import tail_jsonl

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.rundir.liveness import Observation
    from workbench.storage.store_path import Location

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
TIMINGS = "timings.json"
CHECKPOINTS = "checkpoints"
ERRORS = "errors"
STOP_REQUEST = "STOP"
RANKS = "ranks"
RANK_VALUES = "rank_values"

"""ranks/rank_<r>.json: each rank's heartbeat (pid, host, step, phase), rewritten every few
seconds."""
STACKS = "stacks"
"""stacks/rank_<r>.txt: a rank's Python stacks, dumped when it hangs past the grace period."""
PROFILE = "profile"
"""profile/rank_<r>.json: each rank's torch.profiler Chrome trace of the steps
RunConfig.profile_steps names."""
WEIGHTS = "model.safetensors"
"""The full weights at the end of a run (any parallelism), loadable without torch.distributed."""
AUTOBATCH = "autobatch.json"
"""micro_batch_size='auto': the caller's proposal, then what each rank measured and the size
chosen."""
TASK = "task.pkl"
"""A spawned run's task, pickled by the caller (cloudpickle) for fresh interpreters to load."""
SLURM_ATTEMPT = "slurm-attempt"
"""A requeued Slurm job: the restart count whose attempt rank 0 has opened (the others wait for
it)."""
RAY_JOB = "ray.json"
"""A run on Ray: the cluster's address, the driver actor's name and namespace, the submission."""
RAY_ATTEMPT = "ray-attempt"
"""A run on Ray: which worker group of which submission rank 0 has opened ('<submission> <n>')."""
RAY_FOLDER = "ray"
"""A run on Ray: Ray Train's storage (its experiment folder), ray.log (Ray's own lines),
rank_<r>.log (each rank's output) and workers/rank_<r>.json (where each rank ran)."""
SLURM_FOLDER = "slurm"
"""submitit's folder of a cluster run: the job's pickled call and each task's stdout and stderr."""
PLOT = "plot.png"
"""The run's curves as a PNG (`workbench demo` saves them)."""
TOKENIZER = "tokenizer"
"""The tokenizer a Hugging Face task trained with (its save_pretrained folder)."""
TRAINER_STATE = "trainer_state.json"
"""In a checkpoint: the progress it carries (step, samples, ...), written by the checkpointer."""
COMPLETE_MARKER = "manifest.json"
"""Written last into a checkpoint (files, sizes, sha256): a step_<N> directory without it is not
complete."""
TAIL_BYTES = 64 * 1024
"""How much of metrics.jsonl's end tail_rows reads at a time: rows are a few hundred bytes."""
log = logging.getLogger("workbench")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_ATTEMPT = re.compile(r"^config\.attempt-(\d+)\.yaml$")


class RunDirWriteError(OSError):
    """A file of the run directory could not be written; says which, where, and why."""


class RunDir:
    """One run directory. Cheap to make; every read goes to the files, so it always shows the latest
    state."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    # ---- paths -----------------------------------------------------------------------------------
    config_path = property(lambda self: self.path / CONFIG)
    metrics_path = property(lambda self: self.path / METRICS)
    events_path = property(lambda self: self.path / EVENTS)
    summary_path = property(lambda self: self.path / SUMMARY)
    timings_path = property(lambda self: self.path / TIMINGS)
    errors_path = property(lambda self: self.path / ERRORS)
    stop_path = property(lambda self: self.path / STOP_REQUEST)
    weights_path = property(lambda self: self.path / WEIGHTS)
    tokenizer_path = property(lambda self: self.path / TOKENIZER)
    lock_path = property(lambda self: self.path / LOCK)
    ranks_path = property(lambda self: self.path / RANKS)
    stacks_path = property(lambda self: self.path / STACKS)
    rank_values_path = property(lambda self: self.path / RANK_VALUES)
    profile_path = property(lambda self: self.path / PROFILE)
    task_path = property(lambda self: self.path / TASK)
    job_path = property(lambda self: self.path / JOB_FILE)
    slurm_path = property(lambda self: self.path / SLURM_FOLDER)
    ray_path = property(lambda self: self.path / RAY_FOLDER)
    plot_path = property(lambda self: self.path / PLOT)

    @contextlib.contextmanager
    def writing(self, path: Path, what: str) -> Iterator[None]:
        """Turn an OSError while writing `path` into one that names the run directory and the
        file."""
        try:
            yield
        except RunDirWriteError:
            raise
        except OSError as e:
            raise RunDirWriteError(
                e.errno,
                f"could not write {what} ({path}) in run directory {self.path}: {e.strerror or e}",
            ) from e

    # ---- reading ---------------------------------------------------------------------------------
    def config_paths(self) -> list[Path]:
        """The config of every attempt, first to last: config.yaml, then config.attempt-2.yaml,
        ..."""
        attempts = sorted(
            (int(m.group(1)), p)
            for p in self.path.glob("config.attempt-*.yaml")
            if (m := _ATTEMPT.match(p.name))
        )
        return ([self.config_path] if self.config_path.exists() else []) + [p for _, p in attempts]

    def config(self) -> RunConfig | None:
        """The RunConfig of the latest attempt, or None before one is written."""
        from workbench.config import RunConfig

        paths = self.config_paths()
        return RunConfig.from_yaml(paths[-1]) if paths else None

    def summary(self) -> Summary:
        """summary.json (a new run's defaults before it is written); DamagedFileError, a ValueError
        naming the file, when it is there but isn't a JSON object: never a status it doesn't say."""
        try:
            return Summary.from_dict(read_json_checked(self.summary_path))
        except DamagedFileError as e:
            raise DamagedFileError(
                e.path,
                f"{e.problem}. The run summary is only ever replaced whole, so something "
                "else changed it: restore it from a copy, or delete it (resuming the run "
                "writes a new one)",
            ) from None

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl as plain dicts, as written."""
        return read_jsonl(self.metrics_path)

    def last_train_row(self) -> dict[str, Any] | None:
        """The newest metrics row with a loss that fits the schema (one that doesn't is skipped
        with a warning); None before the first."""
        return newest_train_row(self.tail_rows(limit=None), self.metrics_path)

    def tail_rows(self, limit: int | None = TAIL_BYTES) -> Iterator[dict[str, Any]]:
        """The rows of metrics.jsonl from the newest back, those of its last `limit` bytes (None: as
        far back as they are asked for), read from the file's end and parsed as they are asked for:
        a repr, `workbench status` or a table of 2,000 runs costs the rows it shows, not each run's
        whole history."""
        return tail_jsonl(self.metrics_path, TAIL_BYTES, limit)

    def metrics_rows(self) -> list[MetricsRow]:
        """The rows of metrics.jsonl, typed; a row that doesn't fit the schema raises ValueError
        (saying which row)."""
        return [_typed_row(row, i + 1, self.metrics_path) for i, row in enumerate(self.metrics())]

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    def profile_traces(self) -> list[Path]:
        """The profile traces written so far (profile_steps), in rank order."""
        found = [
            (int(m.group(1)), p)
            for p in self.profile_path.glob("rank_*.json")
            if (m := re.fullmatch(r"rank_(\d+)\.json", p.name))
        ]
        return [p for _, p in sorted(found)]

    def lock_owner(self) -> dict[str, Any] | None:
        """Who holds the lock (host, pid, ...); None when no one does, or LOCK can't be read."""
        return lock.owner(self)

    def job(self) -> dict[str, Any] | None:
        """slurm.json: the Slurm job that runs this run (scheduler.JOB_FILE); None for a run that
        isn't one, or before it is written."""
        found = read_json(self.job_path)
        return found if isinstance(found, dict) else None

    def slurm_attempt(self) -> int | None:
        """The Slurm restart count whose attempt rank 0 has opened; None before one is."""
        try:
            return int((self.path / SLURM_ATTEMPT).read_text().strip())
        except (OSError, ValueError):
            return None

    def observe(self, settle: bool = False) -> Observation:
        """Whether the run's processes are still there (heartbeats, recorded pids, its Slurm job).
        `settle`: a one-shot reader (`workbench status`) may re-read heartbeats for a few seconds
        before judging them."""
        from workbench.rundir.liveness import observe

        return observe(self, settle=settle)

    def observed_status(self, settle: bool = False) -> tuple[Status, str]:
        """The status, corrected for a run whose processes are all gone without recording an ending;
        with why, or with what is in doubt for a run still starting or running (its Slurm controller
        can't be asked, its heartbeats can't be judged yet). Never 'failed' from a doubt: only from
        processes seen gone."""
        status = self.summary().status
        if status in (Status.STARTING, Status.RUNNING):
            seen = self.observe(settle)
            if seen.alive is False:
                return Status.FAILED, (
                    f"status says {status.value}, but {seen.reason} (last heartbeat at step "
                    f"{seen.last_step}); resume it from its newest checkpoint"
                )
            if seen.doubt:
                return status, f"unknown: {seen.doubt}"
        return status, ""

    # ---- writing ---------------------------------------------------------------------------------
    def write_config(self, cfg: RunConfig) -> Path:
        """Store the config of a new attempt; earlier attempts' configs are kept, never
        overwritten."""
        n = len(self.config_paths()) + 1
        path = self.config_path if n == 1 else self.path / f"config.attempt-{n}.yaml"
        with self.writing(path, "the run's config"):
            cfg.to_yaml(path)
        return path

    def set_status(self, status: Status | str, **fields: Any) -> Summary:
        """Change the run's status (and any other summary fields): the one writer of summary.json.

        Fields not given keep their values; a status other than 'failed' clears an old error, and
        other than 'preempted'/'diverged' an old ending (a resumed run). wall_time_s runs from
        started_at to now unless given.
        """
        status = Status(status)
        current = self.summary()
        if status is not Status.FAILED:
            current.error = None
        if status not in (Status.PREEMPTED, Status.DIVERGED):
            current.ending = None
        updated = current.replace(status=status, **fields)
        if updated.started_at is None:
            updated.started_at = time.time()
        if "wall_time_s" not in fields:
            updated.wall_time_s = time.time() - updated.started_at
        with self.writing(self.summary_path, "the run summary"):
            write_json(self.summary_path, updated.to_dict())
        return updated

    def end_preempted(self, signal_name: str, why: str, **extra: Any) -> None:
        """Record 'preempted' for a run whose ranks could not end it themselves (they never started
        training, or the signal reached them first): resumable from its newest checkpoint. `extra`
        non-empty values join the ending."""
        found = self.checkpoints()
        step, ckpt = found[-1] if found else (0, None)
        resume = (
            f"it resumes from {ckpt}" if ckpt else "it has no checkpoint: a resume starts it over"
        )
        at, where = ranks_at(self.ranks_path)
        ending = {
            "step": step,
            "checkpoint": str(ckpt) if ckpt else None,
            "signal": signal_name,
            "message": f"{signal_name} {why}{where}; {resume}",
            **({"ranks_at_step": at} if where else {}),
            **{k: v for k, v in extra.items() if v},
        }
        self.set_status(Status.PREEMPTED, ending=ending)
        self.event(Status.PREEMPTED.value, **ending)

    def append_metrics(self, row: MetricsRow) -> None:
        if not isinstance(row, MetricsRow):
            raise TypeError(f"append_metrics takes a MetricsRow, not {type(row).__name__}")
        row.validate()  # again: a writer may have set fields after building it
        with self.writing(self.metrics_path, "a metrics row"):
            append_jsonl(self.metrics_path, row.to_dict())

    def event(self, kind: str, **fields: Any) -> None:
        with self.writing(self.events_path, f"the {kind!r} event"):
            append_jsonl(self.events_path, {"time": time.time(), "event": kind, **fields})

    def write_timings(self, step_times: list[float]) -> None:
        with self.writing(self.timings_path, "step timings"):
            write_json(self.timings_path, {"step_time_s": step_times})

    def write_metrics(self, rows: Iterable[dict[str, Any]]) -> None:
        """metrics.jsonl written whole from plain rows, one JSON line each: a run directory made
        without training (bench big-run's synthetic run). A run's own rows are appended one at a
        time (append_metrics)."""
        with self.writing(self.metrics_path, "the metrics"):
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    def write_heartbeat(self, rank: int, beat: dict[str, Any]) -> None:
        path = self.ranks_path / f"rank_{rank}.json"
        with self.writing(path, f"rank {rank}'s heartbeat"):
            write_json(path, {"rank": rank, "time": time.time(), **beat})

    def set_aside_metrics_after(self, step: int) -> Path | None:
        """On resume from `step`: move later rows (the lost session's) to
        metrics.after-step-<step>.jsonl.

        The resumed run logs those steps again; keeping both in metrics.jsonl would draw two curves
        in one.
        """
        rows = self.metrics_rows()
        later = [r.to_dict() for r in rows if r.step > step]
        if not later:
            return None
        aside = self.path / f"metrics.after-step-{step}.jsonl"
        with self.writing(aside, "the earlier session's metrics"):
            write_jsonl(aside, later)
            write_jsonl(self.metrics_path, [r.to_dict() for r in rows if r.step <= step])
        return aside

    def autobatch(self) -> dict[str, Any] | None:
        """autobatch.json: the caller's proposal and, once the ranks chose, their record."""
        found = read_json(self.path / AUTOBATCH)
        return found if isinstance(found, dict) else None

    def write_autobatch(self, record: dict[str, Any]) -> None:
        path = self.path / AUTOBATCH
        with self.writing(path, "the micro-batch choice"):
            write_json(path, record)

    def write_stacks(self, rank: int, text: str) -> Path:
        """stacks/rank_<r>.txt: a hung rank's Python stacks; returns the file."""
        path = self.stacks_path / f"rank_{rank}.txt"
        with self.writing(path, f"rank {rank}'s stacks"):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, text)
        return path

    def profile_trace_path(self, rank: int) -> Path:
        """profile/rank_<r>.json, its folder made: torch.profiler writes the trace there itself."""
        path = self.profile_path / f"rank_{rank}.json"
        with self.writing(path.parent, "the profile folder"):
            path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def write_rank_value(self, rank: int, data: bytes) -> None:
        """rank_values/rank_<r>.pt: what Task.rank_value returned on that rank (torch.save'd)."""
        path = self.rank_values_path / f"rank_{rank}.pt"
        with self.writing(path, f"rank {rank}'s value"):
            atomic_write_bytes(path, data)

    def write_weights(self, data: bytes) -> None:
        """model.safetensors: the full weights at the end of a session."""
        with self.writing(self.weights_path, "the exported weights"):
            atomic_write_bytes(self.weights_path, data)

    def drop_exports(self) -> bool:
        """Remove what an earlier session exported at its end (model.safetensors, rank_values/): a
        new session moves the weights on, and one that ends without exporting (diverged, failed,
        killed) must not leave them passing as its own. True when there was something to remove."""
        found = self.weights_path.exists() or self.rank_values_path.exists()
        with self.writing(self.weights_path, "the earlier session's weights (removing them)"):
            self.weights_path.unlink(missing_ok=True)
            shutil.rmtree(self.rank_values_path, ignore_errors=True)
        return found

    def write_tokenizer(self, tokenizer: Any) -> None:
        """tokenizer/: a transformers tokenizer's save_pretrained folder, written once (the first
        process to get here; the folder appears whole, by a rename)."""
        if self.tokenizer_path.is_dir():
            return
        staging = self.path / f".{TOKENIZER}.{os.getpid()}.tmp"
        with self.writing(self.tokenizer_path, "the tokenizer"):
            tokenizer.save_pretrained(staging)
            try:
                staging.rename(self.tokenizer_path)
            except OSError:
                # another rank's rename won: its folder is the same tokenizer
                shutil.rmtree(staging, ignore_errors=True)
                if not self.tokenizer_path.is_dir():
                    raise

    def write_task(self, payload: bytes) -> None:
        """task.pkl: the pickled task a spawned rank loads."""
        with self.writing(self.task_path, "the pickled task"):
            atomic_write_bytes(self.task_path, payload)

    def write_job(self, record: dict[str, Any]) -> None:
        """slurm.json: the Slurm job a submission made (its id, who it is, where its files go)."""
        with self.writing(self.job_path, "the Slurm job"):
            write_json(self.job_path, record)

    def open_slurm_attempt(self, restart: int) -> None:
        """slurm-attempt: rank 0 has opened the attempt of Slurm restart count `restart`."""
        path = self.path / SLURM_ATTEMPT
        with self.writing(path, "the Slurm attempt"):
            atomic_write_text(path, str(restart))

    def ray_job(self) -> dict[str, Any] | None:
        """ray.json: the Ray submission that runs this run; None for a run that isn't one."""
        found = read_json(self.path / RAY_JOB)
        return found if isinstance(found, dict) else None

    def write_ray_job(self, record: dict[str, Any]) -> None:
        """ray.json: where a run on Ray went (address, driver actor, submission)."""
        path = self.path / RAY_JOB
        with self.writing(path, "the Ray submission"):
            write_json(path, record)

    def ray_attempt(self) -> tuple[str, int] | None:
        """(submission, worker group) rank 0 has opened last; None before one is."""
        try:
            submission, number = (self.path / RAY_ATTEMPT).read_text().split()
            return submission, int(number)
        except (OSError, ValueError):
            return None

    def open_ray_attempt(self, submission: str, number: int) -> None:
        """ray-attempt: rank 0 has opened worker group `number` (0 first) of `submission`."""
        path = self.path / RAY_ATTEMPT
        with self.writing(path, "the Ray attempt"):
            atomic_write_text(path, f"{submission} {number}")

    def write_ray_worker(self, rank: int, record: dict[str, Any]) -> None:
        """ray/workers/rank_<r>.json: the node and process a Ray Train worker runs a rank on."""
        path = self.ray_path / "workers" / f"rank_{rank}.json"
        with self.writing(path, f"rank {rank}'s Ray worker"):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, record)

    def ray_rank_log_path(self, rank: int) -> Path:
        """ray/rank_<r>.log: a rank's output on Ray, every attempt's, appended."""
        return self.ray_path / f"rank_{rank}.log"

    @contextlib.contextmanager
    def ray_rank_log(self, rank: int) -> Iterator[io.BufferedWriter]:
        """ray/rank_<r>.log opened for appending: the file a rank's child process writes to."""
        path = self.ray_rank_log_path(rank)
        with self.writing(path, f"rank {rank}'s Ray log"):
            path.parent.mkdir(parents=True, exist_ok=True)
            log = open(path, "ab")  # noqa: SIM115  (held open by the caller's block)
        try:
            yield log
        finally:
            log.close()

    @property
    def ray_log_path(self) -> Path:
        """ray/ray.log: Ray's own lines (the connection's, the driver's, Ray Train's controller)."""
        return self.ray_path / "ray.log"

    def append_ray_log(self, data: bytes) -> None:
        """ray/ray.log: Ray's own lines, appended."""
        path = self.ray_log_path
        with self.writing(path, "Ray's log"):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as out:
                out.write(data)

    def ray_workers(self) -> list[dict[str, Any]]:
        """Where each rank of a run on Ray ran last, by rank."""
        found = [read_json(p) for p in (self.ray_path / "workers").glob("rank_*.json")]
        return sorted((f for f in found if isinstance(f, dict)), key=lambda f: f.get("rank", 0))

    def write_plot(self, figure: Any) -> Path:
        """plot.png: `figure` (a matplotlib Figure: imported by the caller, not here) as a PNG at
        100 dpi; returns the file."""
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)
        with self.writing(self.plot_path, "the plot"):
            atomic_write_bytes(self.plot_path, buffer.getvalue())
        return self.plot_path

    # ---- checkpoints -----------------------------------------------------------------------------
    @property
    def checkpoints_path(self) -> Location:
        """Where the run's checkpoints are: checkpoints/ here, or where the config's checkpoint_url
        puts them (`<url>/<run_name>`, storage.store_path.checkpoints_root)."""
        from workbench.storage.store_path import checkpoints_root

        return checkpoints_root(self.path, self.checkpoint_url())

    def checkpoint_url(self) -> str | None:
        """The latest attempt's checkpoint_url (None: checkpoints/ here), read from its config.yaml
        alone: listing checkpoints must not need a config that validates."""
        import yaml

        paths = self.config_paths()
        if not paths:
            return None
        try:
            data = yaml.safe_load(paths[-1].read_text())
        except (OSError, yaml.YAMLError) as e:
            log.warning(
                "%s can't be read (%s): looking for checkpoints in %s",
                paths[-1],
                e,
                self.path / CHECKPOINTS,
            )
            return None
        url = data.get("checkpoint_url") if isinstance(data, dict) else None
        return str(url) if url else None

    def checkpoints(
        self, complete: bool = True, root: Location | None = None
    ) -> list[tuple[int, Location]]:
        """Complete checkpoints (with their manifest), oldest first; resume still verifies their
        contents. complete=False: every step_<N> directory, a damaged one without its manifest
        too. `root`: where to look (default: checkpoints_path)."""
        found = []
        for p in (self.checkpoints_path if root is None else root).glob("step_*"):
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and (not complete or (p / COMPLETE_MARKER).is_file()):
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest_checkpoint(self) -> Location | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    # ---- stop requests ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        with self.writing(self.stop_path, "the stop request"):
            atomic_write_text(self.stop_path, f"{time.time()}\n")

    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def clear_stop(self) -> None:
        self.stop_path.unlink(missing_ok=True)

    # ---- rank errors -----------------------------------------------------------------------------
    def write_rank_error(self, rank: int, error: dict[str, Any]) -> None:
        write_json(
            self.errors_path / f"rank_{rank}.json", {"rank": rank, "time": time.time(), **error}
        )

    def has_rank_error(self, rank: int) -> bool:
        return (self.errors_path / f"rank_{rank}.json").exists()

    def clear_rank_errors(self) -> None:
        for old in self.errors_path.glob("rank_*.json"):
            old.unlink()

    def rank_errors(self) -> list[dict[str, Any]]:
        """Errors of failed ranks, the likely cause first: real errors before fallout, then earliest
        first."""
        errors = [
            e
            for p in self.errors_path.glob("rank_*.json")
            if isinstance(e := read_json(p), dict) and e
        ]
        return sorted(errors, key=lambda e: (is_fallout(e), e.get("time", 0)))


def _typed_row(row: dict[str, Any], number: int, path: Path) -> MetricsRow:
    try:
        return MetricsRow.from_dict(row)
    except ValueError as e:
        raise ValueError(f"{path}, row {number}: {e}") from None


def new_run_name(cfg: RunConfig) -> str:
    task = (
        re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.task.rpartition(":")[2] or cfg.task).strip("-._")
        or "run"
    )
    return f"{task}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
