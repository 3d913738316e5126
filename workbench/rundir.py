"""The run directory: the only channel from ranks back to the user (forked, subprocess or remote ranks alike).

runs/<name>/config.yaml, metrics.jsonl, events.jsonl, summary.json, checkpoints/step_<N>/, errors/rank_<r>.json
JSON files are replaced atomically; JSONL files are appended a whole line at a time, and readers skip a torn
last line, so a crash never leaves a file that can't be read.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from .config import RunConfig, atomic_write_text

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
SUMMARY = "summary.json"
TIMINGS = "timings.json"
CHECKPOINTS = "checkpoints"
ERRORS = "errors"
STOP_REQUEST = "STOP"
COMPLETE_MARKER = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def new_run_name(cfg: RunConfig) -> str:
    return f"{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def prepare(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """Create (or, with resume, reopen) the run directory and store the config that will run.

    Returns the config with run_name filled in.
    """
    if cfg.run_name is None:
        cfg = cfg.replace(run_name=new_run_name(cfg))
    run_dir = Path(cfg.runs_dir) / str(cfg.run_name)
    if cfg.resume:
        if latest_checkpoint(run_dir) is None:
            raise ValueError(f"resume=True: {run_dir} has no complete checkpoint to resume from; "
                             "set resume=False to start over, or pick the run_name of a run that saved one")
        (run_dir / STOP_REQUEST).unlink(missing_ok=True)
        for old in (run_dir / ERRORS).glob("rank_*.json"):
            old.unlink()
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"run_name={cfg.run_name!r}: {run_dir} already exists; pick another run_name, "
                         "leave it None for a fresh one, or set resume=True to continue it")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.to_yaml(run_dir / CONFIG)
    previous = read_json(run_dir / SUMMARY) or {}
    write_json(run_dir / SUMMARY, {**previous, "status": "starting", "run_name": cfg.run_name, "task": cfg.task,
                                   "started_at": time.time()})
    return cfg, run_dir


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    line = json.dumps(obj, default=str) + "\n"
    # One write() on an O_APPEND file: a crash leaves whole lines plus at most one torn last line.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash
    return rows


def set_aside_metrics_after(run_dir: Path, step: int) -> Path | None:
    """On resume from `step`: move later rows (the lost session's) to metrics.after-step-<step>.jsonl.

    The resumed run logs those steps again; keeping both in metrics.jsonl would draw two curves in one.
    """
    rows = read_jsonl(run_dir / METRICS)
    later = [r for r in rows if r.get("step", 0) > step]
    if not later:
        return None
    aside = run_dir / f"metrics.after-step-{step}.jsonl"
    atomic_write_text(aside, "".join(json.dumps(r, default=str) + "\n" for r in later))
    atomic_write_text(run_dir / METRICS, "".join(json.dumps(r, default=str) + "\n" for r in rows
                                                  if r.get("step", 0) <= step))
    return aside


def event(run_dir: Path, kind: str, **fields: Any) -> None:
    append_jsonl(run_dir / EVENTS, {"time": time.time(), "event": kind, **fields})


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. A directory only gets its step_<N> name once fully written."""
    found = []
    for p in (run_dir / CHECKPOINTS).glob("step_*"):
        m = _STEP_DIR.match(p.name)
        if m and (p / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1][1] if found else None


def stop_requested(run_dir: Path) -> bool:
    return (run_dir / STOP_REQUEST).exists()


def request_stop(run_dir: Path) -> None:
    atomic_write_text(run_dir / STOP_REQUEST, f"{time.time()}\n")


def write_rank_error(run_dir: Path, rank: int, exc: BaseException, tb: str) -> None:
    write_json(run_dir / ERRORS / f"rank_{rank}.json", {
        "rank": rank, "type": type(exc).__name__, "message": str(exc), "traceback": tb,
        "time": time.time(), "pid": os.getpid(),
    })


_FALLOUT = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
            "ProcessGroupNCCL", "Timed out waiting", "got signal: 15")


def is_fallout(error: dict[str, Any]) -> bool:
    """An error caused by another rank's death: a collective that lost its peer, or the launcher's SIGTERM."""
    return error.get("type") == "SignalException" or any(s in error.get("message", "") for s in _FALLOUT)


def rank_errors(run_dir: Path) -> list[dict[str, Any]]:
    """Errors of failed ranks, the likely cause first: real errors before fallout, then earliest first."""
    errors = [e for p in (run_dir / ERRORS).glob("rank_*.json") if (e := read_json(p))]
    return sorted(errors, key=lambda e: (is_fallout(e), e.get("time", 0)))
