"""RunDir: the files of one run directory, and the only code that writes them.

runs/<name>/config.yaml, metrics.jsonl, events.jsonl, summary.json, timings.json, checkpoints/step_<N>/,
errors/rank_<r>.json, STOP. JSON files are replaced atomically; JSONL files are appended a whole line at a
time, and readers skip a torn last line, so a crash never leaves a file that can't be read.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import append_jsonl, atomic_write_text, read_json, read_jsonl, write_json, write_jsonl
from .summary import Status, Summary

if TYPE_CHECKING:
    from ..config import RunConfig

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
TIMINGS = "timings.json"
CHECKPOINTS = "checkpoints"
ERRORS = "errors"
STOP_REQUEST = "STOP"
WEIGHTS = "model.safetensors"
"""The full weights at the end of a run (any parallelism), loadable without torch.distributed."""
COMPLETE_MARKER = "trainer_state.json"
"""Written last into a checkpoint: a step_<N> directory without it is not a checkpoint."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


class RunDir:
    """One run directory. Cheap to make; every read goes to the files, so it always shows the latest state."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    # ---- paths ----------------------------------------------------------------------------------------
    config_path = property(lambda self: self.path / CONFIG)
    metrics_path = property(lambda self: self.path / METRICS)
    events_path = property(lambda self: self.path / EVENTS)
    summary_path = property(lambda self: self.path / SUMMARY)
    timings_path = property(lambda self: self.path / TIMINGS)
    checkpoints_path = property(lambda self: self.path / CHECKPOINTS)
    errors_path = property(lambda self: self.path / ERRORS)
    stop_path = property(lambda self: self.path / STOP_REQUEST)
    weights_path = property(lambda self: self.path / WEIGHTS)

    # ---- reading --------------------------------------------------------------------------------------
    def config(self) -> RunConfig | None:
        """The RunConfig stored here, or None before it is written."""
        from ..config import RunConfig

        return RunConfig.from_yaml(self.config_path) if self.config_path.exists() else None

    def summary(self) -> Summary:
        return Summary.from_dict(read_json(self.summary_path))

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    # ---- writing --------------------------------------------------------------------------------------
    def write_config(self, cfg: RunConfig) -> None:
        cfg.to_yaml(self.config_path)

    def set_status(self, status: Status | str, **fields: Any) -> Summary:
        """Change the run's status (and any other summary fields): the one writer of summary.json.

        Fields not given keep their values; a status other than 'failed' clears an old error (a resumed run).
        wall_time_s runs from started_at to now unless given.
        """
        status = Status(status)
        current = self.summary()
        if status is not Status.FAILED:
            current.error = None
        updated = current.replace(status=status, **fields)
        if updated.started_at is None:
            updated.started_at = time.time()
        if "wall_time_s" not in fields:
            updated.wall_time_s = time.time() - updated.started_at
        write_json(self.summary_path, updated.to_dict())
        return updated

    def append_metrics(self, row: dict[str, Any]) -> None:
        append_jsonl(self.metrics_path, row)

    def event(self, kind: str, **fields: Any) -> None:
        append_jsonl(self.events_path, {"time": time.time(), "event": kind, **fields})

    def write_timings(self, step_times: list[float]) -> None:
        write_json(self.timings_path, {"step_time_s": step_times})

    def set_aside_metrics_after(self, step: int) -> Path | None:
        """On resume from `step`: move later rows (the lost session's) to metrics.after-step-<step>.jsonl.

        The resumed run logs those steps again; keeping both in metrics.jsonl would draw two curves in one.
        """
        rows = self.metrics()
        later = [r for r in rows if r.get("step", 0) > step]
        if not later:
            return None
        aside = self.path / f"metrics.after-step-{step}.jsonl"
        write_jsonl(aside, later)
        write_jsonl(self.metrics_path, [r for r in rows if r.get("step", 0) <= step])
        return aside

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first. A directory only gets its step_<N> name once fully written."""
        found = []
        for p in self.checkpoints_path.glob("step_*"):
            m = _STEP_DIR.match(p.name)
            if m and (p / COMPLETE_MARKER).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    # ---- stop requests --------------------------------------------------------------------------------
    def request_stop(self) -> None:
        atomic_write_text(self.stop_path, f"{time.time()}\n")

    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def clear_stop(self) -> None:
        self.stop_path.unlink(missing_ok=True)

    # ---- rank errors ----------------------------------------------------------------------------------
    def write_rank_error(self, rank: int, error: dict[str, Any]) -> None:
        write_json(self.errors_path / f"rank_{rank}.json", {"rank": rank, "time": time.time(), **error})

    def has_rank_error(self, rank: int) -> bool:
        return (self.errors_path / f"rank_{rank}.json").exists()

    def clear_rank_errors(self) -> None:
        for old in self.errors_path.glob("rank_*.json"):
            old.unlink()

    def rank_errors(self) -> list[dict[str, Any]]:
        """Errors of failed ranks, the likely cause first: real errors before fallout, then earliest first."""
        errors = [e for p in self.errors_path.glob("rank_*.json") if (e := read_json(p))]
        return sorted(errors, key=lambda e: (is_fallout(e), e.get("time", 0)))


_FALLOUT = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
            "ProcessGroupNCCL", "Timed out waiting", "got signal: 15")


def is_fallout(error: dict[str, Any]) -> bool:
    """An error caused by another rank's death: a collective that lost its peer, or the launcher's SIGTERM."""
    return error.get("type") == "SignalException" or any(s in error.get("message", "") for s in _FALLOUT)


def new_run_name(cfg: RunConfig) -> str:
    return f"{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"


def prepare(cfg: RunConfig) -> tuple[RunConfig, RunDir]:
    """Create (or, with resume, reopen) the run directory and store the config that will run.

    Returns the config with run_name filled in, and the run directory.
    """
    if cfg.run_name is None:
        cfg = cfg.replace(run_name=new_run_name(cfg))
    run = RunDir(Path(cfg.runs_dir) / str(cfg.run_name))
    if cfg.resume:
        if run.latest_checkpoint() is None:
            raise ValueError(f"resume=True: {run.path} has no complete checkpoint to resume from; "
                             "set resume=False to start over, or pick the run_name of a run that saved one")
        run.clear_stop()
        run.clear_rank_errors()
    elif run.path.exists() and any(run.path.iterdir()):
        raise ValueError(f"run_name={cfg.run_name!r}: {run.path} already exists; pick another run_name, "
                         "leave it None for a fresh one, or set resume=True to continue it")
    run.path.mkdir(parents=True, exist_ok=True)
    run.write_config(cfg)
    run.set_status(Status.STARTING, run_name=cfg.run_name, task=cfg.task, started_at=time.time())
    return cfg, run
