"""What this machine can run, found without initialising CUDA.

Forking ranks (notebook_launcher) breaks once the parent has a CUDA context, so nothing here may
call into the CUDA runtime: GPUs are described by `nvidia-smi`, the way accelerate's own
`get_gpu_info` does.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from workbench.config.precision import cpu_precision_advice, torchao_problem
from workbench.utils.units import MiB

if TYPE_CHECKING:
    from workbench.config import RunConfig


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One CUDA device as nvidia-smi reports it."""

    name: str
    """Marketing name, e.g. 'NVIDIA H100 80GB HBM3'."""
    compute_capability: tuple[int, int]
    """(major, minor); bf16 needs 8.0+, fp8 8.9+."""
    memory_bytes: int
    """Total device memory."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The devices a run could use on this machine."""

    cpu_count: int
    """Logical CPUs available to this process."""
    gpus: tuple[GPU, ...] = field(default=())
    """CUDA devices (of one node), empty on a CPU-only machine."""
    nodes: int = 1
    """Machines of this kind the run spans (a planned target; this machine is one)."""
    planned: str = ""
    """'' for this machine; for hardware a run is planned for, what it is ('8 x H100-SXM-80GB')."""

    @property
    def where(self) -> str:
        """Who has these devices, for messages: 'this machine', or 'the target 8 x
        H100-SXM-80GB'."""
        return f"the target {self.planned}" if self.planned else "this machine"

    @property
    def has_cuda(self) -> bool:
        return bool(self.gpus)

    @property
    def device_class(self) -> str:
        """'cpu' or 'cuda-<model>' (e.g. 'cuda-H100', 'cuda-RTX4090'), the key baselines are stored
        under.

        WORKBENCH_DEVICE_CLASS overrides it, e.g. to give a CI fleet's CPU runners their own
        baselines.
        """
        override = os.environ.get("WORKBENCH_DEVICE_CLASS")
        if override:
            return override
        if not self.gpus:
            return "cpu"
        return "cuda-" + gpu_model(self.gpus[0].name)

    def threads_per_rank(self, local_ranks: int) -> int:
        """CPU threads each of `local_ranks` ranks on this machine should use: OMP_NUM_THREADS when
        the user set it, else an equal share of the cores (forked ranks otherwise inherit the whole
        pool)."""
        return int(os.environ.get("OMP_NUM_THREADS") or max(1, self.cpu_count // local_ranks))

    def max_processes(self, device: str) -> int:
        """How many ranks fit: one per GPU, or one per CPU core on CPU (over all nodes)."""
        return (len(self.gpus) if device == "cuda" else self.cpu_count) * self.nodes

    def precision_problem(self, precision: str, device: str) -> str | None:
        """Why `precision` can't run on `device` here, or None when it can."""
        if precision == "fp32":
            return None
        if precision == "fp8":
            cc = [g.compute_capability for g in self.gpus]
            if device != "cuda" or not cc or min(cc) < (8, 9):
                return (
                    "fp8 needs a CUDA GPU of compute capability 8.9+ (H100/L40/4090): its "
                    "matmuls run on their fp8 tensor cores (torch._scaled_mm); "
                    + (cpu_precision_advice() if device == "cpu" else "use bf16")
                )
            # A planned target is priced, not run here: torchao is needed where the run will train.
            return None if self.planned else torchao_problem()
        if device == "cpu":
            if precision == "fp16":
                return (
                    "fp16 needs a CUDA GPU: on CPU, accelerate runs fp16 as fp32 without telling "
                    "you; " + cpu_precision_advice()
                )
            return None
        if precision == "bf16" and any(g.compute_capability < (8, 0) for g in self.gpus):
            return "bf16 needs compute capability 8.0+ (A100 and newer); use fp16 or fp32"
        return None

    def device_line(self, device: str) -> str:
        """`device` ('cpu' or 'cuda') on this machine in one line: '2 x NVIDIA H100 80GB HBM3' or
        'CPU (16 cores)' (a planned target's own words when it is one)."""
        if self.planned:
            return self.planned
        if device == "cuda" and self.gpus:
            return f"{len(self.gpus)} x {self.gpus[0].name}"
        return f"CPU ({self.cpu_count} cores)"


def gpu_model(name: str) -> str:
    """A GPU's model from its marketing name: 'NVIDIA A100-SXM4-80GB' -> 'A100', 'NVIDIA GeForce RTX
    4090' -> 'RTX4090', 'Tesla V100-SXM2-16GB' -> 'V100'. Memory size and form factor don't make a
    new class."""
    words = [w for w in re.split(r"[\s_]+", name) if w and w.upper() not in _VENDOR_WORDS]
    if not words:
        return "gpu"
    if words[0].upper() in ("RTX", "GTX", "TITAN") and len(words) > 1:
        return words[0].upper() + words[1].split("-")[0]
    return words[0].split("-")[0]


_VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _query_gpus() -> tuple[GPU, ...]:
    if not torch.backends.cuda.is_built() or shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,compute_cap,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = []
    for line in out.strip().splitlines():
        name, cap, mem = (p.strip() for p in line.split(","))
        major, _, minor = cap.partition(".")
        gpus.append(
            GPU(
                name=name,
                compute_capability=(int(major), int(minor or 0)),
                memory_bytes=int(mem) * MiB,
            )
        )
    if visible is not None:
        ids = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        gpus = [gpus[i] for i in ids if i < len(gpus)]
    return tuple(gpus)


@functools.cache
def detect() -> Hardware:
    """This machine's hardware (cached: it doesn't change while a kernel runs)."""
    return Hardware(cpu_count=_cpu_count(), gpus=_query_gpus())


def resolve_device(cfg: RunConfig, hardware: Hardware | None = None) -> str:
    """'cpu' or 'cuda': cfg.device, with 'auto' resolved on this machine (or `hardware`)."""
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if (hardware or detect()).has_cuda else "cpu"
