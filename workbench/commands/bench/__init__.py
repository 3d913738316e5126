"""Benchmarks, each measured side by side in one run: `workbench bench overhead | precision | parallelism |
estimate`."""

from __future__ import annotations

from workbench.commands.bench.estimate_accuracy import EstimateReport, estimate_accuracy
from workbench.commands.bench.overhead import BENCH, OverheadReport, overhead
from workbench.commands.bench.parallelism import MODES, PARALLELISM_BENCH, ParallelismReport, parallelism
from workbench.commands.bench.mixed_precision import PRECISION_BENCH, PrecisionReport, precision

__all__ = ["BENCH", "MODES", "EstimateReport", "estimate_accuracy", "PARALLELISM_BENCH", "PRECISION_BENCH", "OverheadReport", "ParallelismReport",
           "PrecisionReport", "overhead", "parallelism", "precision"]
