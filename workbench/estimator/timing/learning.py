"""Learning from completed runs: an estimate is scaled by the median of measured / estimated step
time over the newest completed runs on the same device class that are most like it: the same task
and layout (parallelism, tp, pp, ranks) first; on a GPU, else the same layout with any task (what
the trainer's layout adds, DDP's hooks or DTensor's bookkeeping, is the task's as much as
another's), else any run on as many ranks, else any run on that device class (the GPU model rests on
a datasheet and a published efficiency, which every run there corrects alike). On this machine's
CPU, whose model is measured here, only the same task and layout teach.

A run's "estimated" is today's model re-applied to its config (config.yaml, with the micro-batch it
ran), so a better model or a new machine profile never leaves stale figures behind; its trace is the
estimate's own cache's, and its figure is kept on disk (~/.cache/workbench/learnt-estimates.json) so
a new process re-traces nothing. Its "measured" is the median of its logged step times after the
first window (warm-up), from metrics.jsonl.

Pipeline runs teach nothing yet: their estimate adds the schedule's bubble on top of the step priced
here, so their ratio would not be of the same thing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.utils.files import (
    DamagedFileError,
    read_json,
    read_json_checked,
    read_jsonl,
    write_json,
)

if TYPE_CHECKING:
    from workbench.config import RunConfig

log = logging.getLogger("workbench")

MAX_RUNS = 5
"""Runs one lesson is drawn from, newest first."""
SCAN = 200
"""Usable runs looked at (completed, on the device class asked about, with a measured step): the
most recently written (their summary.json's modification time), whatever their names, and however
many other runs (failed, stopped, on another device) sit among them."""
_VERDICTS: dict[str, tuple[int, str, str | None]] = {}
"""summary.json path -> (its modification time, status, device class) as last read: a run that can't
teach is passed over by a stat alone until its summary changes, so a folder of many failed runs
costs one read of each, once per process."""
_MAX_VERDICTS = 100_000
MIN_STEPS = 3
NEW_TRACES = 1
"""Past runs a lesson may trace anew per call (about a second each); the rest wait for later
calls."""
_LOCK = threading.Lock()
_LESSONS: dict[tuple[object, ...], Lesson] = {}


@dataclass(frozen=True)
class PastRun:
    name: str
    path: Path
    cfg: RunConfig
    world: int
    measured_s: float
    started_at: float

    @property
    def layout(self) -> tuple[str, int, int, int]:
        return layout_of(self.cfg, self.world)


@dataclass(frozen=True)
class Lesson:
    ratio: float = 1.0
    """Measured / estimated: what the estimate is multiplied by (1.0: nothing learnt)."""
    runs: list[str] = field(default_factory=list)
    note: str = ""


def layout_of(cfg: RunConfig, world: int) -> tuple[str, int, int, int]:
    return (cfg.parallelism, cfg.tp, cfg.pp, world)


def layout_line(layout: tuple[str, int, int, int]) -> str:
    mode, tp, pp, world = layout
    return (
        f"{mode}{f' tp={tp}' if tp > 1 else ''}{f' pp={pp}' if pp > 1 else ''} on {world} rank(s)"
    )


def measured_step_s(path: Path) -> float | None:
    """The run's typical step: the median of its logged windows' step times (each a window's mean)
    after the first window, the warm-up; with fewer than two such windows, the median of
    timings.json's steps after the first fifth. None when it has too few steps for either."""
    windows = [
        row["step_time_s"]
        for row in read_jsonl(path / "metrics.jsonl")
        if row.get("loss") is not None and isinstance(row.get("step_time_s"), (int, float))
    ][1:]
    if len(windows) >= 2:
        return statistics.median(windows)
    times = (read_json(path / "timings.json") or {}).get("step_time_s")
    if not isinstance(times, list):
        return None
    steady = [t for t in times[max(1, len(times) // 5) :] if isinstance(t, (int, float)) and t > 0]
    return statistics.median(steady) if len(steady) >= MIN_STEPS else None


def completed_runs(runs_dir: Path, device_class: str) -> list[PastRun]:
    """The SCAN newest completed runs of `runs_dir` on `device_class` with a measured step time (the
    newest by summary.json's modification time, however many runs of other statuses or devices are
    newer), newest (by recorded start) first."""
    from workbench.rundir import RunDir

    found = []
    for summary_path, modified in newest_summaries(runs_dir):
        if len(found) == SCAN:
            break
        key = str(summary_path)
        seen = _VERDICTS.get(key)
        if (
            seen is not None
            and seen[0] == modified
            and (seen[1] != "completed" or seen[2] != device_class)
        ):
            continue  # unchanged since it was read, and it can't teach
        run = RunDir(summary_path.parent)
        try:
            s = run.summary()
            _remember(key, modified, s.status, s.device_class)
            if s.status != "completed" or s.device_class != device_class or not s.world_size:
                continue
            measured = measured_step_s(run.path)
            cfg = run.config()
        except (
            ValueError,
            OSError,
        ) as e:  # a damaged file (named when that run is read): it teaches nothing
            log.debug("learning: %s skipped: %s", run.path, e)
            continue
        if measured is None or cfg is None:
            continue
        if not isinstance(cfg.micro_batch_size, int) and s.micro_batch_size:
            cfg = cfg.replace(micro_batch_size=s.micro_batch_size)
        found.append(PastRun(run.name, run.path, cfg, s.world_size, measured, s.started_at or 0.0))
    return sorted(found, key=lambda r: r.started_at, reverse=True)


def _remember(key: str, modified: int, status: object, device_class: str | None) -> None:
    with _LOCK:
        if len(_VERDICTS) >= _MAX_VERDICTS:
            _VERDICTS.clear()  # a bound, not a policy: the next scan reads the summaries again
        _VERDICTS[key] = (modified, str(getattr(status, "value", status)), device_class)


def newest_summaries(runs_dir: Path) -> list[tuple[Path, int]]:
    """Every summary.json of `runs_dir`'s run directories, the most recently written first, each
    with its modification time (ns). By age, not by name: run names sort by task and timestamp, so a
    folder holding many runs of a task named later in the alphabet (or of a user's own naming) would
    otherwise hide every other task's runs, however recent. A summary is rewritten at each status
    change, so its time is the run's latest news (its end, for an ended run); one stat per run keeps
    this cheap however many runs the folder holds."""
    dated = []
    for path in Path(runs_dir).expanduser().glob("*/summary.json"):
        try:
            dated.append((path, path.stat().st_mtime_ns))
        except OSError:  # removed since the listing
            continue
    dated.sort(key=lambda item: (item[1], item[0].parent.name), reverse=True)
    return dated


def learn(
    cfg: RunConfig,
    world: int,
    device_class: str,
    runs_dir: Path,
    profile_key: str,
    estimate_of: Callable[[RunConfig, int, bool], float],
) -> Lesson:
    """The lesson for `cfg` on `world` ranks: the median measured / estimated of the comparable
    runs. `estimate_of(run_cfg, world, may_trace)`: today's model's step time for a past run (before
    learning); it may raise (a task that can't be imported here, a trace it may not make now): that
    run is left out, for now. At most NEW_TRACES past runs not estimated before are traced per call,
    so an estimate stays quick when many runs completed since; the rest are estimated by later
    calls. Lessons are kept in memory until a run directory changes."""
    key = (
        str(Path(runs_dir).expanduser().resolve()),
        device_class,
        cfg.task,
        layout_of(cfg, world),
        profile_key,
        _signature(runs_dir),
    )
    with _LOCK:
        if key in _LESSONS:
            return _LESSONS[key]
    lesson, complete = _learn(cfg, world, device_class, runs_dir, profile_key, estimate_of)
    if not complete:
        # a run left out for now (its trace not made yet, under cache_only): ask again next time
        return lesson
    with _LOCK:
        _LESSONS[key] = lesson
        while len(_LESSONS) > 64:
            _LESSONS.pop(next(iter(_LESSONS)))
    return lesson


def _signature(runs_dir: Path) -> tuple[tuple[str, int], ...]:
    """What the lessons of `runs_dir` depend on: its newest runs' summaries and step timings, as of
    now."""
    out = []
    for summary_path, modified in newest_summaries(runs_dir):
        out.append((str(summary_path), modified))
        timings = summary_path.with_name("timings.json")
        try:
            out.append((str(timings), timings.stat().st_mtime_ns))
        except OSError:
            out.append((str(timings), 0))
    return tuple(out)


def _learn(
    cfg: RunConfig,
    world: int,
    device_class: str,
    runs_dir: Path,
    profile_key: str,
    estimate_of: Callable[[RunConfig, int, bool], float],
) -> tuple[Lesson, bool]:
    everything = completed_runs(runs_dir, device_class)
    runs = [r for r in everything if r.cfg.pp == 1]
    piped = len(everything) - len(runs)
    layout = layout_of(cfg, world)
    same = [r for r in runs if r.layout == layout]
    tiers = [
        ([r for r in same if r.cfg.task == cfg.task], f"{cfg.task}, {layout_line(layout)}"),
        (same, f"any task, {layout_line(layout)}"),
        ([r for r in runs if r.world == world], f"any task and layout on {world} rank(s)"),
        (runs, f"any task and layout on {device_class}"),
    ]
    if device_class == "cpu":
        # this machine is measured, and what its model misses is the task's and layout's own:
        # another task's or layout's ratio moved the bench's rows away from the measured more often
        # than towards it
        tiers = tiers[:1]
    chosen, scope = next((tier for tier in tiers if tier[0]), tiers[-1])
    ratios, names, complete, fresh = [], [], True, 0
    for run in chosen:
        if len(ratios) == MAX_RUNS:
            break
        estimated, new = _remembered(run, profile_key, estimate_of, may_trace=fresh < NEW_TRACES)
        fresh += new
        if estimated:
            ratios.append(run.measured_s / estimated)
            names.append(run.name)
        complete = complete and estimated is not None
    if not ratios:
        only = (
            f" of {cfg.task}, {layout_line(layout)} (on this machine only the same task and "
            "layout teach)"
            if device_class == "cpu" and runs
            else ""
        )
        return Lesson(
            note=f"nothing learnt: no completed run{only} on {device_class} in {runs_dir} to learn "
            "from" + (f" ({piped} pipeline run(s) there teach nothing yet)" if piped else "")
        ), complete
    ratio = statistics.median(ratios)
    return Lesson(
        ratio=ratio,
        runs=names,
        note=(
            f"learnt from {len(names)} completed run(s) ({scope}): {', '.join(names)}; measured / "
            f"estimated {', '.join(f'{r:.2f}' for r in ratios)}, so the step is scaled by their "
            f"median, {ratio:.2f}"
        ),
    ), complete


def _remembered(
    run: PastRun,
    profile_key: str,
    estimate_of: Callable[[RunConfig, int, bool], float],
    *,
    may_trace: bool = True,
) -> tuple[float | None, bool]:
    """Today's estimate of a past run, and whether it was made now: from the file of runs already
    estimated with this model and profile, or made now (and written there)."""
    path = memo_path()
    key = f"{run.path.resolve()}|{run.started_at}|{profile_key}"
    with _LOCK:
        try:
            memo = read_json_checked(path) or {}
        except DamagedFileError as e:
            log.warning("%s: estimating past runs again", e)
            memo = {}
        value = memo.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value), False
    try:
        value = estimate_of(run.cfg, run.world, may_trace)
    except Exception as e:  # noqa: BLE001
        # a run that can't be estimated here teaches nothing; say why in the log
        log.debug("learning: can't estimate run %s again: %s", run.name, e)
        return None, False
    with _LOCK:
        try:
            memo = read_json_checked(path) or {}
        except DamagedFileError:
            memo = {}
        try:
            write_json(path, {**dict(list(memo.items())[-999:]), key: value})
        except OSError as e:
            log.debug("learning: %s not written: %s", path, e)
    return value, True


def memo_path() -> Path:
    import platformdirs

    folder = Path(
        os.environ.get("WORKBENCH_CACHE_DIR") or platformdirs.user_cache_dir("workbench")
    ).expanduser()
    return folder / "learnt-estimates.json"


def fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
