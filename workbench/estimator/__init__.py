"""Before launching: memory, time and cost per rank of a run, for this machine or an accelerator to
rent.

`estimate(cfg, gpu=..., gpus=..., nodes=...)` traces one training step of the task's model through
the trainer's own parallelism code, under fake tensors and a fake process group of the target world
size (trace/), then prices it: memory against the target's capacity, step time from FLOPs and
collective volumes (timing/, with this machine measured in machine/ for a CPU target), time and cost
to max_steps, with the accelerator catalog (catalog.py).

- estimation.py: wb.estimate itself, trace then price.
- report.py: the Estimate it returns (a RankEstimate per rank), as text, a table and HTML.
- target.py: where a run is planned to go (Target) and check_plan.
- catalog.py: the accelerators (accelerators.yaml, the user's own, this machine);
  efficiency.py: the fraction of their peak published runs reach.
- alternatives.py: what to change when a run doesn't fit, and which accelerator to rent.
- microbatch.py: the launcher's proposal for micro_batch_size='auto'.
- cancel.py: ending an estimate in flight (a launch, Python's exit): its children killed.
- progress.py: what an estimate in flight is doing, and its memory before its time (the panel).
- trace/: the traced step on a fake world, and the cache of traces.
- timing/: a traced step's time on a target, and what a layout adds.
- machine/: this machine's measured profile, for a CPU target.
"""

from __future__ import annotations

from workbench.estimator.catalog import THIS_MACHINE, Accelerator, load_catalog, lookup
from workbench.estimator.estimation import estimate
from workbench.estimator.report import Estimate, RankEstimate

__all__ = [
    "THIS_MACHINE",
    "Accelerator",
    "Estimate",
    "RankEstimate",
    "estimate",
    "load_catalog",
    "lookup",
]
