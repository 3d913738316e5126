"""`workbench doctor`: runs every section (each on its own: one failing never stops the others),
then assembles the "what to fix" list from their findings; as text or JSON."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.commands.doctor.allreduce import build_allreduce
from workbench.commands.doctor.cache_read import build_cache_read
from workbench.commands.doctor.environment import build_environment
from workbench.commands.doctor.findings import Finding, Section, guarded
from workbench.commands.doctor.input_pipeline import build_input_pipeline
from workbench.commands.doctor.topology import build_devices, cpu_counts
from workbench.commands.doctor.versions import build_versions
from workbench.config import RunConfig

SECTIONS = {
    "devices": "Devices and topology",
    "versions": "Versions",
    "environment": "Environment",
    "allreduce": "All-reduce bandwidth",
    "input_pipeline": "Input pipeline",
    "cache_read": "Data cache read speed",
}
_ORDER = {"error": 0, "warn": 1, "info": 2}


@dataclass
class DoctorReport:
    """Every section's lines, data and findings, and the fixes they add up to."""

    sections: list[Section] = field(default_factory=list)
    quick: bool = False

    def section(self, key: str) -> Section:
        return next(s for s in self.sections if s.key == key)

    def fixes(self) -> list[Finding]:
        """Warnings and errors of every section, errors first, each once."""
        seen: dict[tuple[str, str | None], Finding] = {}
        for s in self.sections:
            for f in s.findings:
                if f.level != "info":
                    seen.setdefault((f.text, f.fix), f)
        return sorted(seen.values(), key=lambda f: _ORDER[f.level])

    def to_json(self) -> dict[str, Any]:
        return {
            "quick": self.quick,
            "sections": {s.key: s.to_json() for s in self.sections},
            "fixes": [{"level": f.level, "text": f.text, "fix": f.fix} for f in self.fixes()],
        }

    def json(self) -> str:
        """Strict JSON: a non-finite number (a rate over zero seconds) becomes null."""
        return json.dumps(_finite(self.to_json()), indent=2, default=str, allow_nan=False)

    def text(self) -> str:
        out = ["workbench doctor" + (" (--quick)" if self.quick else "")]
        for s in self.sections:
            out.append(f"\n== {s.title} ==")
            out += [f"  {line}" for line in s.lines]
            if s.error and not s.findings:
                out.append(f"  error: {s.error}")
            out += [f"  {f.line()}" for f in s.findings]
        out.append("\n== What to fix ==")
        fixes = self.fixes()
        out += [
            f"  {i}. {f.text}" + (f"\n     fix: {f.fix}" if f.fix else "")
            for i, f in enumerate(fixes, 1)
        ]
        if not fixes:
            out.append("  nothing: no known problems found")
        return "\n".join(out)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def default_ranks(device: str) -> int:
    """All local GPUs on CUDA; 2 CPU processes otherwise (the smallest real all-reduce)."""
    return torch.cuda.device_count() if device == "cuda" else 2


def run_doctor(
    cfg: RunConfig | None = None,
    *,
    quick: bool = False,
    ranks: int | None = None,
    deadline_s: float = 120.0,
    skip: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    topo_text: str | None = None,
) -> DoctorReport:
    """Check this machine for distributed training.

    cfg: the run whose task, micro_batch_size and num_workers the input-pipeline section measures
    (default: digits with RunConfig's defaults). ranks: all-reduce ranks (default: every GPU, or 2
    on CPU). deadline_s: the most the all-reduce sweep may take before its ranks are killed. skip:
    section keys to leave out. env / topo_text: stand-ins for os.environ and `nvidia-smi topo -m`
    (tests).
    """
    cfg = cfg or RunConfig(task="digits")
    env = os.environ if env is None else env
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = default_ranks(device) if ranks is None else ranks
    report = DoctorReport(quick=quick)
    wanted = [k for k in SECTIONS if k not in skip]

    def add(key: str, build: Any) -> Section | None:
        if key not in wanted:
            return None
        report.sections.append(guarded(key, SECTIONS[key], build))
        return report.sections[-1]

    devices = add("devices", lambda s: build_devices(s, topo_text))
    add("versions", build_versions)
    gpus = len(devices.data.get("gpus", [])) if devices else torch.cuda.device_count()
    add(
        "environment",
        lambda s: build_environment(
            s,
            env,
            cpus=cpu_counts()[0],
            cpu_ranks=ranks if device == "cpu" else 0,
            visible_gpus=gpus,
            physical_gpus=devices.data.get("physical_gpus") if devices else None,
        ),
    )
    nvlink = bool(
        devices and any(v.startswith("NV") for v in devices.data.get("links", {}).values())
    )
    add(
        "allreduce",
        lambda s: build_allreduce(
            s, ranks=ranks, device=device, quick=quick, deadline_s=deadline_s, nvlink=nvlink
        ),
    )
    add(
        "input_pipeline",
        lambda s: build_input_pipeline(s, cfg, quick, ranks if device == "cpu" else 1),
    )
    add("cache_read", lambda s: build_cache_read(s, quick))
    return report
