"""Benchmarks, each measured side by side in one run: `workbench bench overhead | hf-overhead |
precision | parallelism | compile | launch | estimate | estimate-speed | dashboard | big-run |
imports`."""

from __future__ import annotations

from workbench.commands.bench.estimate_accuracy import EstimateReport, estimate_accuracy
from workbench.commands.bench.imports import ImportReport, imports
from workbench.commands.bench.mixed_precision import PRECISION_BENCH, PrecisionReport, precision
from workbench.commands.bench.overhead import BENCH, OverheadReport, overhead
from workbench.commands.bench.parallelism import (
    MODES,
    PARALLELISM_BENCH,
    ParallelismReport,
    parallelism,
)

__all__ = [
    "BENCH",
    "MODES",
    "PARALLELISM_BENCH",
    "PRECISION_BENCH",
    "EstimateReport",
    "ImportReport",
    "OverheadReport",
    "ParallelismReport",
    "PrecisionReport",
    "estimate_accuracy",
    "imports",
    "overhead",
    "parallelism",
    "precision",
]
