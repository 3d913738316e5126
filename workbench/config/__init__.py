"""Configuration: `RunConfig` (run_config.py), the one description of a run, with what it needs to stay a leaf.

checks.py validates the fields on construction (ranges, names); preflight.py checks a config against a task
and a machine before a launch; mesh.py owns the rank layout (mesh sizes, data-parallel size, global batch);
precision.py and trackers.py name what the precision and trackers fields mean; typecheck.py checks a value
against a field's type hint. Nothing here imports a task, the trainer or the machine's hardware.
"""

from __future__ import annotations

from workbench.config.mesh import SHARDED, ParallelDims
from workbench.config.run_config import PARALLELISM_MODES, ActivationCheckpointing, Parallelism, Precision, RunConfig

__all__ = ["PARALLELISM_MODES", "SHARDED", "ActivationCheckpointing", "ParallelDims", "Parallelism", "Precision",
           "RunConfig"]
