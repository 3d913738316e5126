"""Resuming from a checkpoint into this run: the model the checkpoint holds is checked against the
one the task built before anything loads, a load that fails says why in the task's terms, this run's
optimizer settings are kept over the checkpoint's, and a resume on another rank count says where its
curve will differ from an uninterrupted run's (dropout). The Checkpointer calls these in order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from workbench.training.checkpoint.files import (
    CheckpointLoadError,
    ModelMismatchError,
    Shapes,
    failure_summary,
    is_checkpoint_exception,
    model_differences,
    saved_model_shapes,
)

if TYPE_CHECKING:
    from workbench.rundir import RunDir
    from workbench.storage.store_path import Location
    from workbench.training.parallel import Strategy

log = logging.getLogger("workbench")

RESUME_FIX = (
    "The task's code changed since the checkpoint was written (its config, task_options included, "
    "is checked before launch; resume_allow allows config changes, not another model): resume "
    "with the code that wrote it, or start a new run (another run_name, or resume=False)"
)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def has_dropout(model: torch.nn.Module) -> bool:
    return any(
        isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    )


def check_model(ckpt: Location, model: Shapes) -> None:
    """The checkpoint's model entries against the model this run built (`model`: every name and
    full shape), before anything loads: DCP would resume a model that lost a layer without a word,
    and fail on a changed one with a CheckpointException that names neither the parameter nor its
    shapes."""
    differences = model_differences(saved_model_shapes(ckpt / "model"), model)
    if differences:
        raise ModelMismatchError(
            f"resume from {ckpt}: the checkpoint doesn't match the task's model: "
            f"{differences}. {RESUME_FIX}"
        )


def load_into(strategy: Strategy, ckpt: Location) -> None:
    """The strategy's model and optimizer from `ckpt`, resharded to this run's mode and ranks."""
    try:
        strategy.load(ckpt)
    except BaseException as e:
        if not is_checkpoint_exception(e):
            raise
        # e.g. the task's optimizer changed: its message names only the ranks; each rank's
        # failure is inside
        raise CheckpointLoadError(
            f"resume from {ckpt}: the checkpoint could not be loaded into this run: "
            f"{failure_summary(e)}. {RESUME_FIX}"
        ) from e


def keep_configured(
    strategy: Strategy,
    configured: list[dict[str, Any]],
    local: list[dict[str, Any]],
    announce: bool,
) -> None:
    """The checkpoint brings the optimizer's state (moments, step counts); its hyperparameters
    (lr, weight decay, betas, eps) are this run's, which a resume may change where resume_allow
    names them. Loading a state dict would otherwise put back the old run's param groups.
    `announce`: say which settings changed (rank 0)."""
    loaded = hyperparameters(strategy.optimizer)
    for optimizer, wanted in (
        (strategy.optimizer, configured),
        (strategy.local_optimizer(), local),
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
    if changed and announce:
        log.info(
            "resumed with this run's optimizer settings, not the checkpoint's: %s",
            "; ".join(changed),
        )


def note_dropout(
    run: RunDir, model: torch.nn.Module, ckpt: Location, saved: dict[str, Any], world: int
) -> None:
    """Dropout masks come from each rank's random stream, which a run on another rank count
    can't continue: say so (rank 0), since the curve then differs from an uninterrupted run (the
    samples and their order don't)."""
    saved_world = saved.get("world_size")
    if saved_world in (None, world) or not has_dropout(model):
        return
    message = (
        f"resuming on {world} rank(s) from {ckpt.name}, saved by {saved_world}: "
        "dropout masks are drawn from per-rank random streams, so the curve will differ "
        f"from an uninterrupted run on {saved_world} rank(s), though every step sees the "
        "same samples"
    )
    log.warning(message)
    run.event("resume_differs", step=saved.get("step"), reason="dropout", message=message)
