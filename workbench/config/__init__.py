"""Configuration: `RunConfig` (run_config.py), the one description of a run, with what it needs to
stay a leaf.

config_files.py reads and writes configs (dicts, YAML, --set overrides); accelerate_deepspeed.py
maps an `accelerate config` YAML or a DeepSpeed JSON onto RunConfig's fields; checks.py validates
the fields on construction (ranges, names); preflight.py checks a config against a task and a
machine before a launch; mesh.py owns the rank layout (mesh sizes, data-parallel size, global
batch); choices.py, precision.py and trackers.py name what the choice, precision and trackers
fields mean. RunConfig and what it imports need no task, trainer or machine: preflight.py alone
looks at those, and nothing here imports it.
"""

from __future__ import annotations

from workbench.config.choices import PARALLELISM_MODES, ActivationCheckpointing, Parallelism
from workbench.config.mesh import SHARDED, ParallelDims
from workbench.config.precision import Precision
from workbench.config.run_config import RunConfig

__all__ = [
    "PARALLELISM_MODES",
    "SHARDED",
    "ActivationCheckpointing",
    "ParallelDims",
    "Parallelism",
    "Precision",
    "RunConfig",
]
