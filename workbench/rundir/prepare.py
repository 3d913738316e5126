"""Preparing a launch: create or reopen the run directory under its lock, decide whether to resume,
and refuse a resume whose config would change the training trajectory (unless the user allows the
change).

Every attempt keeps its own config (config.yaml, config.attempt-2.yaml, ...): nothing is
overwritten.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

from workbench.rundir import lock
from workbench.rundir.run_dir import CONFIG, SUMMARY, TRAINER_STATE, RunDir, new_run_name
from workbench.rundir.summary import Status
from workbench.storage.store_path import StorePath, stored_config
from workbench.utils.files import read_json
from workbench.utils.mounts import filesystem_type

if TYPE_CHECKING:
    from workbench.config import RunConfig

TRAJECTORY = (
    "task",
    "task_options",
    "seed",
    "precision",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
    "max_steps",
)
"""Fields that change what a resumed run computes; the layout (ranks, micro-batch, accumulation,
mode) may change as long as the global batch stays, since the checkpoint is resharded and the data
order follows samples."""


def config_changes(saved: RunConfig, new: RunConfig, step: int) -> list[str]:
    """What in `new` would make the resumed run differ from continuing `saved` from `step`."""
    changes = [
        f"{name}: {getattr(saved, name)!r} -> {getattr(new, name)!r}"
        for name in TRAJECTORY
        if getattr(saved, name) != getattr(new, name) and name not in new.resume_allow
    ]
    if new.max_steps < step:
        changes.append(f"max_steps={new.max_steps} is below the checkpoint's step {step}")
    if new.global_batch_size is None:
        changes.append(
            "micro_batch_size='auto' without target_global_batch may change the global batch (the "
            f"checkpoint's is {saved.global_batch_size}); set "
            f"target_global_batch={saved.global_batch_size}"
        )
    elif (
        saved.global_batch_size != new.global_batch_size
        and "global_batch_size" not in new.resume_allow
    ):
        changes.append(
            f"global batch: {saved.global_batch_size} ({saved.micro_batch_size} x "
            f"{saved.grad_accum_steps} x {saved.num_processes}) -> {new.global_batch_size} "
            f"({new.micro_batch_size} x {new.grad_accum_steps} x {new.num_processes})"
        )
    return changes


def _check_resume(cfg: RunConfig, run: RunDir) -> None:
    ckpt = run.latest_checkpoint()
    assert ckpt is not None
    from workbench.config import RunConfig

    saved_path = ckpt / CONFIG
    if isinstance(ckpt, StorePath):  # checkpoint_url on a store: read there
        saved = stored_config(saved_path) or run.config()
        step = int(json.loads((ckpt / TRAINER_STATE).read_text()).get("step", 0))
    else:
        saved = RunConfig.from_yaml(saved_path) if saved_path.exists() else run.config()
        step = int((read_json(ckpt / TRAINER_STATE) or {}).get("step", 0))
    changes = config_changes(saved, cfg, step) if saved is not None else []
    if changes:
        allow = sorted(
            {
                c.split(":")[0].split("=")[0].replace("global batch", "global_batch_size")
                for c in changes
            }
        )
        raise ValueError(
            f"resume of {run.path} from step {step}: the config changes the training trajectory: "
            + "; ".join(changes)
            + f". Keep the checkpoint's values, or allow the changes with "
            f"resume_allow={allow}"
        )


def _wants_resume(cfg: RunConfig, run: RunDir, existed: bool) -> bool:
    if cfg.resume == "auto":
        return run.latest_checkpoint() is not None
    if cfg.resume:
        if run.latest_checkpoint() is None:
            raise ValueError(
                f"resume=True: {run.path} has no complete checkpoint to resume from; set "
                "resume=False to start over, resume='auto' to start over when there is none, or "
                "pick the run_name of a run that saved one"
            )
        return True
    if existed and any(p.name not in (lock.LOCK, lock.LOCK_GUARD) for p in run.path.iterdir()):
        raise ValueError(
            f"run_name={cfg.run_name!r}: {run.path} already exists; pick another run_name, leave "
            "it None for a fresh one, or set resume=True (or 'auto') to continue it"
        )
    return False


def prepare(cfg: RunConfig, token: str | None = None) -> tuple[RunConfig, RunDir, str]:
    """Create (or reopen) the run directory, holding its lock, and store the config of this attempt.

    Returns the config that will run (run_name filled in, resume decided), the run directory and the
    lock token; the caller releases the lock when the run has ended.
    """
    if cfg.run_name is None:
        cfg = cfg.replace(run_name=new_run_name(cfg))
    run = RunDir(cfg.runs_dir_path / str(cfg.run_name))
    _refuse_pseudo_filesystem(cfg)
    with run.writing(run.path, "the run directory"):
        run.path.parent.mkdir(parents=True, exist_ok=True)
        existed = False
        try:
            run.path.mkdir()
        except FileExistsError:
            existed = True
    # before anything is written into it (the lock first)
    _refuse_link(cfg, run)
    token = lock.acquire(run, token)
    try:
        resume = _wants_resume(cfg, run, existed)
        if resume:
            _check_resume(cfg, run)
        cfg = cfg.replace(resume=resume)
        run.clear_stop()
        run.clear_rank_errors()
        attempt = len(run.config_paths()) + 1
        run.write_config(cfg)
        run.set_status(
            Status.STARTING,
            run_name=cfg.run_name,
            task=cfg.task,
            started_at=time.time(),
            attempt=attempt,
        )
    except BaseException:
        lock.release(run, token)
        if not existed:
            _remove_if_unused(run)
        raise
    return cfg, run, token


PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "configfs",
        "bpf",
        "pstore",
        "efivarfs",
        "mqueue",
        "fusectl",
        "binfmt_misc",
    }
)
"""Filesystem types the kernel makes up (processes, devices, its own settings): nothing a run
writes can be stored there."""


def _refuse_pseudo_filesystem(cfg: RunConfig) -> None:
    """runs_dir, where its links lead (checks.py refused /proc, /sys and /dev as written), on a
    kernel filesystem: ValueError naming it, before any directory is made."""
    where = os.path.realpath(cfg.runs_dir_path)
    kind = filesystem_type(where)
    if kind in PSEUDO_FILESYSTEMS:
        raise ValueError(
            f"runs_dir={cfg.runs_dir!r} is {where}, on the kernel's {kind} filesystem (a view of "
            "processes and devices, not storage); set runs_dir to a folder on a disk, e.g. "
            "'runs' or '~/runs'"
        )


def _refuse_link(cfg: RunConfig, run: RunDir) -> None:
    """A run directory that is a symbolic link: ValueError, nothing followed. A link could lead
    anywhere (outside runs_dir, into another run), and the run would write, resume and clean up
    there; runs_dir itself may be a link (that is the user's choice of where runs go)."""
    if run.path.is_symlink():
        target = os.readlink(run.path)
        raise ValueError(
            f"run_name={cfg.run_name!r}: {run.path} is a symbolic link (to {target}), not a run "
            "directory; a run is written only into a real directory inside runs_dir. Pick another "
            "run_name, remove the link, or name the real directory with runs_dir and run_name "
            f"({os.path.realpath(run.path)})"
        )
    if not run.path.is_dir():
        raise ValueError(
            f"run_name={cfg.run_name!r}: {run.path} exists and is not a directory; pick another "
            "run_name or move the file away"
        )


def _remove_if_unused(run: RunDir) -> None:
    """A launch that failed while preparing leaves nothing behind in a directory it created."""
    import shutil

    leftovers: list[Any] = [
        p for p in run.path.iterdir() if p.name not in (CONFIG, SUMMARY, lock.LOCK, lock.LOCK_GUARD)
    ]
    if not leftovers:
        shutil.rmtree(run.path, ignore_errors=True)
