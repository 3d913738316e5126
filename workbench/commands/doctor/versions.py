"""Versions: python, torch and what it was built with (CUDA, cuDNN, NCCL), accelerate, the NVIDIA
driver."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any

import torch

from workbench.commands.doctor.findings import Section
from workbench.commands.doctor.topology import nvidia_smi


def versions() -> dict[str, Any]:
    """Versions as strings (None where not applicable, e.g. NCCL in a CPU build of torch)."""
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": None,
        "nccl": None,
        "accelerate": _package_version("accelerate"),
        "driver": None,
    }
    if torch.backends.cuda.is_built():
        if torch.backends.cudnn.is_available():
            found["cudnn"] = str(torch.backends.cudnn.version())
        try:
            nccl = torch.cuda.nccl.version()
            found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except (RuntimeError, AttributeError):  # built without NCCL (Windows, some ROCm builds)
            pass
    out = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    if out and out.strip():
        found["driver"] = out.strip().splitlines()[0].strip()
    return found


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def build_versions(section: Section) -> None:
    v = versions()
    section.data.update(v)
    section.lines.append(f"python {v['python']} ({v['python_executable']})")
    if v["torch_cuda"]:
        section.lines.append(
            f"torch {v['torch']}, built with CUDA {v['torch_cuda']}, cuDNN {v['cudnn'] or '-'}, "
            f"NCCL {v['nccl'] or '-'}"
        )
    else:
        section.lines.append(f"torch {v['torch']} (CPU build: no CUDA, no NCCL; gloo only)")
    section.lines.append(f"accelerate {v['accelerate'] or 'not installed'}")
    section.lines.append(
        f"NVIDIA driver {v['driver']}" if v["driver"] else "NVIDIA driver: none (no nvidia-smi)"
    )
