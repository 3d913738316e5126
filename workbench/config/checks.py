"""RunConfig's validation on construction: types aside (utils/typecheck.py), the ranges of numbers,
the names of runs, signals, trackers and fields, and memory tracking against compile. Every error
names the field, the value and what would work. Checks that need the task or this machine are
preflight.py's."""

from __future__ import annotations

import math
import os
import re
from dataclasses import fields
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from workbench.utils.suggest import unknown_keys
from workbench.utils.typecheck import short_repr, type_ok

if TYPE_CHECKING:
    from workbench.config.run_config import RunConfig

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_WORKERS = 64
MIN_MONITOR_INTERVAL_S = 0.05
PREEMPT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGINT", "SIGQUIT", "SIGXCPU")
MAX_INT = 2**31 - 1
"""Bound on every integer field (step counts, intervals, batch sizes, ranks, workers, timeouts),
both ways: 2**31 optimizer steps is a thousand times the longest training runs there are, and a
value in int32 range is valid wherever it lands (int32 or int64 tensors, CUDA launch sizes, timeouts
in int64 milliseconds), where 10**41 would overflow. Past it a value is a typo, not a plan."""
MAX_BACKOFF_S = 86_400
"""restart_backoff_s: a day before the first restart, doubled for each further one, is already
patient."""
NAME_MAX = 255
"""Bytes in one path component on Linux, macOS and Windows file systems (ext4, XFS, APFS, NTFS): a
longer run name is refused by the OS (ENAMETOOLONG) when the run directory is created."""


def check_whole_number(name: str, value: Any, tp: Any, example: Any) -> None:
    """A float, or a number YAML 1.1 read as text ('1e300': no dot), given to a field that takes a
    whole number: ValueError saying so, and that the number is past any integer setting's range
    when it is (rather than 'expected int, got str'). Anything else (a fraction as a float, text
    that is no number) is left to the type check."""
    if isinstance(value, bool) or not isinstance(value, (float, str)):
        return
    if not type_ok(1, tp) or type_ok(0.5, tp) or type_ok(value, tp):
        return
    try:
        number = float(value)
    except ValueError:
        return  # text, not a number: the type check names it
    if isinstance(value, str):
        shown = repr(value if len(value) <= 40 else f"{value[:40]}...")
        how = " (a number as text: YAML 1.1 reads 1e300 or 1.0e3 so)"
    else:
        shown, how = repr(value), ""
    like = f"; e.g. {name}={example}" if isinstance(example, int) else ""
    if math.isnan(number):
        raise ValueError(f"{name}={shown}: not a number; {name} takes a whole number{like}")
    if math.isinf(number) or abs(number) > MAX_INT:
        raise ValueError(
            f"{name}={shown}{how}: too {'large' if number > 0 else 'small'}; integer settings lie "
            f"within +-(2**31-1) ({MAX_INT:,}), far past any real run{like}"
        )
    if number.is_integer():
        raise ValueError(f"{name}={shown}{how}: {name} takes a whole number; write {int(number)}")
    if isinstance(value, str):
        raise ValueError(f"{name}={shown}{how}: {name} takes a whole number, not a fraction{like}")
    # a fraction as a float: the type check's 'expected int, got float' says it


def check_numbers(cfg: RunConfig) -> None:
    """Ranges of the numeric fields (that floats are finite is checked with their types)."""
    check_int_bounds(cfg)
    check_counts(cfg)
    check_batch_target(cfg)
    check_restarts(cfg)
    check_optimizer(cfg)
    check_monitor(cfg)
    check_loader(cfg)
    check_profile_steps(cfg)


def check_counts(cfg: RunConfig) -> None:
    """Counts and sizes: at least 1 where 0 means nothing, 0 or more elsewhere; seed and workers
    within their own ranges."""
    positive = (
        "num_processes",
        "grad_accum_steps",
        "max_steps",
        "log_every",
        "keep_checkpoints",
        "dist_timeout_s",
        "max_skipped_steps",
        *(("micro_batch_size",) * (cfg.micro_batch_size != "auto")),
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: must be at least 1")
    for name in (
        "warmup_steps",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "num_workers",
        "seed",
        "max_restarts",
        "restart_backoff_s",
        "target_global_batch",
        "memory_budget_gb",
    ):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: must be 0 or more")
    if cfg.seed > 2**32 - 1:
        raise ValueError(f"seed={cfg.seed}: must be between 0 and 2**32-1 (4294967295)")
    if cfg.num_workers > MAX_WORKERS:
        raise ValueError(
            f"num_workers={cfg.num_workers}: more DataLoader workers per rank than any machine "
            f"can feed; use at most {MAX_WORKERS} (typically 2 to 8)"
        )


def check_batch_target(cfg: RunConfig) -> None:
    """target_global_batch: only with an 'auto' micro-batch, and a global batch the data-parallel
    ranks (and a pipeline's accumulation) can split evenly."""
    if cfg.target_global_batch and cfg.micro_batch_size != "auto":
        raise ValueError(
            f"target_global_batch={cfg.target_global_batch}: only micro_batch_size='auto' uses it; "
            "with a fixed micro-batch set grad_accum_steps, or set micro_batch_size='auto'"
        )
    # The ranks of a TP group, a CP group or a pipeline share their batches (a layout that doesn't
    # divide is refused later).
    data_ranks = cfg.num_processes // max(1, cfg.tp * cfg.cp * cfg.pp) or 1
    if cfg.target_global_batch and cfg.target_global_batch % data_ranks:
        what = (
            f"num_processes={cfg.num_processes}"
            if data_ranks == cfg.num_processes
            else f"the data-parallel size {data_ranks} (num_processes={cfg.num_processes} / (pp x "
            "cp x tp))"
        )
        raise ValueError(
            f"target_global_batch={cfg.target_global_batch}: must be a multiple of {what}, e.g. "
            f"{data_ranks * 32}"
        )
    # a pipeline keeps its accumulation: the schedule's micro-batches
    step = data_ranks * cfg.grad_accum_steps
    if cfg.target_global_batch and cfg.pp > 1 and cfg.target_global_batch % step:
        raise ValueError(
            f"target_global_batch={cfg.target_global_batch} with pp={cfg.pp}: a pipeline keeps "
            f"grad_accum_steps={cfg.grad_accum_steps} (its schedule's micro-batches), so the "
            "global batch is a multiple of grad_accum_steps x the data-parallel size "
            f"{data_ranks}; use e.g. target_global_batch={step * 4}"
        )


def check_restarts(cfg: RunConfig) -> None:
    """The waits of restarts and preemptions: a backoff up to a day, a grace period up to an
    hour."""
    if cfg.restart_backoff_s > MAX_BACKOFF_S:
        raise ValueError(
            f"restart_backoff_s={cfg.restart_backoff_s!r}: wait at most {MAX_BACKOFF_S} seconds (a "
            "day) before the first restart (it doubles for each further one); 10 to 60 is "
            "typical"
        )
    if not 1 <= cfg.preempt_grace_s <= 3600:
        raise ValueError(
            f"preempt_grace_s={cfg.preempt_grace_s!r}: use 1 to 3600 seconds (25 by default)"
        )


def check_optimizer(cfg: RunConfig) -> None:
    """AdamW's settings and the learning-rate schedule."""
    if not cfg.lr > 0 or cfg.lr > 10:
        raise ValueError(
            f"lr={cfg.lr!r}: must be a positive learning rate (typically 1e-5 to 1e-2)"
        )
    if cfg.weight_decay < 0:
        raise ValueError(f"weight_decay={cfg.weight_decay!r}: must be 0 or more (0.1 is typical)")
    if cfg.grad_clip < 0:
        raise ValueError(f"grad_clip={cfg.grad_clip!r}: must be positive, or 0 to disable clipping")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise ValueError(
                f"{name}={getattr(cfg, name)!r}: must be in [0, 1), e.g. 0.9 for beta1, 0.999 for "
                "beta2"
            )
    if not 0 < cfg.eps < 1:
        raise ValueError(f"eps={cfg.eps!r}: must be a small positive number, e.g. 1e-8")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio={cfg.min_lr_ratio!r}: must be between 0 and 1")
    if cfg.warmup_steps > cfg.max_steps:
        raise ValueError(
            f"warmup_steps={cfg.warmup_steps}: longer than max_steps={cfg.max_steps}; "
            f"use at most {cfg.max_steps}"
        )


def check_int_bounds(cfg: RunConfig) -> None:
    """Integer fields past +-MAX_INT (seed has its own range): refused before anything uses them (or
    prints them: str() of an int over 4300 digits raises)."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if (
            f.name == "seed"
            or isinstance(value, bool)
            or not isinstance(value, int)
            or abs(value) <= MAX_INT
        ):
            continue
        raise ValueError(
            f"{f.name}={short_repr(value)}: too {'large' if value > 0 else 'small'}; integer "
            f"settings lie within +-(2**31-1) ({MAX_INT:,}), far past any real run; e.g. "
            f"{f.name}={f.default}"
        )


def check_monitor(cfg: RunConfig) -> None:
    """Device monitoring: a sampling interval that costs nothing, a percentage, a duration."""
    interval = cfg.monitor_interval_s
    if interval < 0 or 0 < interval < MIN_MONITOR_INTERVAL_S or interval > 3600:
        raise ValueError(
            f"monitor_interval_s={interval!r}: use {MIN_MONITOR_INTERVAL_S} to 3600 seconds (1 to "
            "10 is plenty; sampling faster only costs CPU), or 0 to turn device monitoring off"
        )
    if not 0 <= cfg.idle_util_pct <= 100:
        raise ValueError(
            f"idle_util_pct={cfg.idle_util_pct!r}: a GPU utilisation percentage, 0 to 100 (e.g. 10)"
        )
    if cfg.idle_after_s < 0:
        raise ValueError(
            f"idle_after_s={cfg.idle_after_s!r}: must be 0 or more seconds (e.g. 300), "
            "0 never warns about idle GPUs"
        )


def check_loader(cfg: RunConfig) -> None:
    """DataLoader settings that only mean something with worker processes."""
    if cfg.prefetch_factor is not None and cfg.prefetch_factor < 1:
        raise ValueError(
            f"prefetch_factor={cfg.prefetch_factor}: must be at least 1 (batches each worker loads "
            "ahead), or None for PyTorch's default of 2"
        )
    if cfg.num_workers == 0:
        if cfg.prefetch_factor is not None:
            raise ValueError(
                f"prefetch_factor={cfg.prefetch_factor} with num_workers=0: only worker processes "
                "prefetch; set num_workers (e.g. 2) or prefetch_factor=None"
            )
        if cfg.persistent_workers is True:
            raise ValueError(
                "persistent_workers=True with num_workers=0: there are no workers to keep; set "
                "num_workers (e.g. 2) or persistent_workers='auto'"
            )


def check_profile_steps(cfg: RunConfig) -> None:
    """profile_steps: [] or [first, last] with 1 <= first <= last <= max_steps."""
    steps = cfg.profile_steps
    if not steps:
        return
    if len(steps) != 2:
        raise ValueError(
            f"profile_steps={steps!r}: give [first, last] (e.g. [3, 5]), or [] for no profile"
        )
    first, last = steps
    if not 1 <= first <= last <= cfg.max_steps:
        raise ValueError(
            f"profile_steps={steps!r}: need 1 <= first <= last <= max_steps={cfg.max_steps} (steps "
            f"count from 1, as in metrics.jsonl), e.g. [{min(3, cfg.max_steps)}, "
            f"{min(5, cfg.max_steps)}]"
        )


def check_memory_tracking(cfg: RunConfig) -> None:
    """track_memory follows eager ops: refused with a compiled model."""
    if cfg.compile != "off" and cfg.track_memory:
        raise ValueError(
            f"track_memory=True with compile={cfg.compile!r}: the memory tracker follows "
            "eager ops, not compiled graphs; set track_memory=False (the process peak is "
            "still reported), or compile='off' to measure by category"
        )


PSEUDO_FILESYSTEM_DIRS = ("/proc", "/sys", "/dev")
"""The kernel's views of processes, devices and itself: nothing is stored there (a run directory
under /proc/self would be refused by the kernel, or land in a process's own entries). /dev/shm, a
tmpfs, is storage and allowed."""


def check_runs_dir(cfg: RunConfig) -> None:
    """runs_dir names a directory: not empty or blank, no control characters (a newline, a NUL),
    not under /proc, /sys or /dev. Where a symbolic link leads is prepare.py's to check, when the
    run directory is made."""
    runs_dir = cfg.runs_dir
    like = "e.g. runs_dir='runs' (the default) or '~/runs'"
    if not runs_dir.strip():
        what = "blank (only whitespace)" if runs_dir else "empty"
        raise ValueError(
            f"runs_dir={runs_dir!r}: {what}; name the folder run directories go in, {like}"
        )
    control = next((c for c in runs_dir if ord(c) < 32 or ord(c) == 127), None)
    if control is not None:
        raise ValueError(
            f"runs_dir={runs_dir!r}: holds the control character {control!r}, which no shell or "
            f"listing shows as typed (a stray newline from a file or a paste?); {like}"
        )
    path = os.path.normpath(os.path.expanduser(runs_dir))
    inside = next(
        (
            top
            for top in PSEUDO_FILESYSTEM_DIRS
            if (path == top or path.startswith(top + "/"))
            and not (path == "/dev/shm" or path.startswith("/dev/shm/"))
        ),
        None,
    )
    if inside is not None:
        raise ValueError(
            f"runs_dir={runs_dir!r}: {inside} is a view the kernel makes of processes and "
            f"devices, not storage; {like}"
        )


def check_names(cfg: RunConfig, field_names: list[str]) -> None:
    """Names: runs directory, run name, task, preempt signal, resume_allow."""
    check_runs_dir(cfg)
    check_path_lengths(cfg)
    if cfg.run_name is not None and not _RUN_NAME.fullmatch(cfg.run_name):
        raise ValueError(
            f"run_name={cfg.run_name!r}: use letters, digits, '.', '_' and '-' only, "
            "starting with a letter or digit"
        )
    if cfg.resume and cfg.run_name is None:
        raise ValueError(
            f"resume={cfg.resume!r} needs run_name: the run directory to continue "
            "(runs_dir/run_name)"
        )
    if not cfg.task:
        raise ValueError("task='': name a task, e.g. 'digits' or 'char-gpt'")
    if cfg.preempt_signal is not None and cfg.preempt_signal not in PREEMPT_SIGNALS:
        raise ValueError(
            f"preempt_signal={cfg.preempt_signal!r}: choose one of {', '.join(PREEMPT_SIGNALS)} "
            "(SIGTERM and SIGHUP are always handled)"
        )
    if cfg.trackers != "auto" and len(set(cfg.trackers)) != len(cfg.trackers):
        raise ValueError(
            f"trackers={cfg.trackers!r}: name each tracker once, e.g. {sorted(set(cfg.trackers))!r}"
        )
    unknown = [name for name in cfg.resume_allow if name not in (*field_names, "global_batch_size")]
    if unknown:
        raise ValueError(
            f"resume_allow: unknown field(s) {', '.join(unknown_keys(unknown, field_names))}"
        )


def check_path_lengths(cfg: RunConfig) -> None:
    """run_name, and each directory of runs_dir, fit in one path component (NAME_MAX bytes)."""
    if cfg.run_name is not None and _size(cfg.run_name) > NAME_MAX:
        size = _size(cfg.run_name)
        raise ValueError(
            f"run_name={cfg.run_name[:40]!r}... is {size} bytes long: a file or directory name can "
            f"be at most {NAME_MAX} bytes, and the run directory is named after it; use a shorter "
            f"run_name (e.g. {cfg.run_name[:64]!r}), or leave it None for '<task>-<timestamp>'"
        )
    long = [part for part in PurePath(cfg.runs_dir).parts if _size(part) > NAME_MAX]
    if long:
        raise ValueError(
            f"runs_dir={cfg.runs_dir[:60]!r}...: its directory name {long[0][:40]!r}... is "
            f"{_size(long[0])} bytes long, over the {NAME_MAX} bytes a file system allows in one "
            "path component; use a shorter directory"
        )


def _size(name: str) -> int:
    """Bytes of `name` as a file name (UTF-8; a lone surrogate counted, not raised on)."""
    return len(name.encode("utf-8", "surrogatepass"))
