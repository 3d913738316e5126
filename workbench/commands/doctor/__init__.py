"""`workbench doctor`: what this machine offers for distributed training, and what to fix.

Sections, each in its own module: devices and topology (``topology``), versions (``versions``),
environment variables and their pitfalls (``environment``), an all-reduce bandwidth sweep over local
ranks (``allreduce``), DataLoader against model throughput (``input_pipeline``) and the data cache's
read speed (``cache_read``); ``report`` runs them and assembles the "what to fix" list.
"""

from __future__ import annotations

from workbench.commands.doctor.allreduce import SweepResult, bus_factor, run_sweep
from workbench.commands.doctor.checkup import SECTIONS, DoctorReport, run_doctor
from workbench.commands.doctor.environment import env_pitfalls, relevant_env
from workbench.commands.doctor.findings import Finding, Section
from workbench.commands.doctor.topology import TopoMatrix, parse_topo_matrix

__all__ = [
    "SECTIONS",
    "DoctorReport",
    "Finding",
    "Section",
    "SweepResult",
    "TopoMatrix",
    "bus_factor",
    "env_pitfalls",
    "parse_topo_matrix",
    "relevant_env",
    "run_doctor",
    "run_sweep",
]
