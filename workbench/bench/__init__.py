"""Benchmarks, each measured side by side in one run: `workbench bench overhead | precision | parallelism |
estimate`."""

from __future__ import annotations

from .estimate import EstimateReport, estimate_accuracy
from .overhead import BENCH, OverheadReport, overhead
from .parallelism import MODES, PARALLELISM_BENCH, ParallelismReport, parallelism
from .precision import PRECISION_BENCH, PrecisionReport, precision

__all__ = ["BENCH", "MODES", "EstimateReport", "estimate_accuracy", "PARALLELISM_BENCH", "PRECISION_BENCH", "OverheadReport", "ParallelismReport",
           "PrecisionReport", "overhead", "parallelism", "precision"]
