"""Benchmarks, each measured side by side in one run: `workbench bench overhead | precision | parallelism`."""

from __future__ import annotations

from .overhead import BENCH, OverheadReport, overhead
from .parallelism import MODES, PARALLELISM_BENCH, ParallelismReport, parallelism
from .precision import PRECISION_BENCH, PrecisionReport, precision

__all__ = ["BENCH", "MODES", "PARALLELISM_BENCH", "PRECISION_BENCH", "OverheadReport", "ParallelismReport",
           "PrecisionReport", "overhead", "parallelism", "precision"]
