"""The launcher's proposal for micro_batch_size='auto': the largest micro-batch the estimate says
fits each rank of this machine (launch.propose_micro_batch writes it to autobatch.json; the ranks
then confirm it on their devices, training/autobatch.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.tasks import Task

MARGIN = 0.1


def _limit(cfg: RunConfig) -> int:
    """The bytes a rank may hold: its GPU's memory, else the memory budget or a share of what is
    free."""
    import psutil

    from workbench.utils.hardware import detect

    if cfg.device == "cuda":
        return min(g.memory_bytes for g in detect().gpus)
    if cfg.memory_budget_gb:
        return int(cfg.memory_budget_gb * 2**30)
    return int(psutil.virtual_memory().available / cfg.num_processes)


def propose(cfg: RunConfig, task: Task) -> dict[str, Any]:
    """Estimates at micro-batch 1 and 2 give the bytes per sample; the largest size under the limit
    is checked with a third estimate and stepped down until it fits. `cfg.device` is the launch's,
    decided ('cpu' or 'cuda': the launcher resolved it once), not 'auto'."""
    from workbench.estimator import estimate

    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(
            f"device={cfg.device!r}: propose() takes the launch's device as resolved ('cpu' or "
            "'cuda'); resolve it first (workbench.utils.hardware.resolve_device)"
        )

    limit = _limit(cfg)
    usable = limit * (1 - MARGIN)
    # A pipeline's schedule needs its micro-batch count: accumulation stays as set
    # (training/autobatch.py).
    accum = 1 if cfg.target_global_batch and cfg.pp == 1 else cfg.grad_accum_steps

    def peak(m: int) -> int:
        est = estimate(
            cfg.replace(micro_batch_size=m, grad_accum_steps=accum, target_global_batch=0),
            task=task,
        )
        return max(r.tensors for r in est.ranks)

    train, _ = task.build_datasets(cfg)
    # samples each data-parallel rank has (a TP group shares them)
    most = max(1, len(train) // cfg.dims.dp)
    try:
        one, two = peak(1), peak(2)
    except ValueError as e:
        if cfg.pp == 1 and cfg.cp == 1:
            raise
        # A layout the estimate doesn't trace (pipelines it can't, context parallel): the ranks
        # measure sizes 1 and 2 themselves and go on from there (training/autobatch.py).
        return {
            "proposed": None,
            "limit_bytes": limit,
            "estimates": [],
            "how": f"no estimate ({e}); the ranks search from their own trials at micro-batch 1 "
            "and 2",
        }
    per_sample = max(1, two - one)
    m = max(1, min(most, int((usable - one) // per_sample) + 1))
    tries = [
        {"micro_batch": 1, "estimated_peak_bytes": one},
        {"micro_batch": 2, "estimated_peak_bytes": two},
    ]
    while m > 2:
        p = peak(m)
        tries.append({"micro_batch": m, "estimated_peak_bytes": p})
        if p <= usable:
            break
        m = max(2, int(m * usable / p))
    return {
        "proposed": m,
        "limit_bytes": limit,
        "per_sample_bytes": per_sample,
        "estimates": tries,
        "how": "estimated peak per rank (tensors) at micro-batch 1 and 2, extrapolated, then "
        "checked",
    }
