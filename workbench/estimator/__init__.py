"""Before launching: memory, time and cost per rank of a run, for this machine or an accelerator to
rent.

`estimate(cfg, gpu=..., gpus=..., nodes=...)` traces one training step of the task's model through
the trainer's own parallelism code, under fake tensors and a fake process group of the target world
size (trace.py), then prices it: memory against the target's capacity, step time from FLOPs and
collective volumes, time and cost to max_steps (model.py), with the accelerator catalog
(catalog.py).
"""

from __future__ import annotations

from workbench.estimator.catalog import THIS_MACHINE, Accelerator, load_catalog, lookup
from workbench.estimator.estimation import estimate
from workbench.estimator.model import Estimate, RankEstimate

__all__ = [
    "THIS_MACHINE",
    "Accelerator",
    "Estimate",
    "RankEstimate",
    "estimate",
    "load_catalog",
    "lookup",
]
