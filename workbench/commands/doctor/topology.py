"""Devices and topology: CPU cores, NUMA nodes, GPUs (torch.cuda), the links between GPUs
(`nvidia-smi topo -m`) and each GPU's CPU affinity.

The doctor runs its own ranks as fresh interpreters on CUDA (see allreduce.py), so unlike
hardware.py it may initialise CUDA here to read each device's properties.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.commands.doctor.findings import Finding, Section
from workbench.utils.units import fmt_bytes

NODE_DIR = Path("/sys/devices/system/node")
# nvidia-smi underlines the header row when writing to a terminal
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

LINKS = {
    "X": "self",
    "SOC": "crosses the CPU socket interconnect (old drivers' name for SYS)",
    "SYS": "crosses PCIe and the interconnect between NUMA nodes (QPI/UPI)",
    "NODE": "crosses PCIe and the host bridges within one NUMA node",
    "PHB": "crosses PCIe and a PCIe host bridge (the CPU)",
    "PXB": "crosses several PCIe switches, not the host bridge",
    "PIX": "crosses at most one PCIe switch",
}
"""The legend `nvidia-smi topo -m` prints (NV# is a bonded set of # NVLinks), slowest first."""


@dataclass
class TopoMatrix:
    """`nvidia-smi topo -m`, parsed: the link between every pair of devices and each GPU's
    affinities."""

    devices: list[str] = field(default_factory=list)
    """Column devices in order: GPU0.., then NICs (NIC0.. or mlx5_0..)."""
    links: dict[tuple[str, str], str] = field(default_factory=dict)
    """(row, column) -> 'NV12', 'PIX', 'SYS', ...; 'X' on the diagonal."""
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    """GPU -> CPU list, e.g. '0-15,32-47'."""
    numa_affinity: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if re.fullmatch(r"GPU\d+", d)]

    def gpu_pairs(self) -> list[tuple[str, str, str]]:
        """(a, b, link) for every unordered pair of GPUs."""
        gpus = self.gpus
        return [
            (a, b, self.links.get((a, b), "?")) for i, a in enumerate(gpus) for b in gpus[i + 1 :]
        ]


def describe_link(cell: str) -> str:
    """'NV12' -> 'NVLink x12'; 'PIX' -> the legend's words."""
    m = re.fullmatch(r"NV(\d+)", cell)
    if m:
        return f"NVLink x{m.group(1)}"
    return LINKS.get(cell, cell)


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the matrix `nvidia-smi topo -m` prints (tab- or space-separated, with or without the
    terminal's underline codes). Rows after the matrix (the legend, the NIC legend) are ignored."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    # The header names the devices; unlike every row of the matrix, it has no 'X' (self) cell.
    header = next(
        (i for i, line in enumerate(lines) if "GPU0" in line.split() and "X" not in line.split()),
        None,
    )
    topo = TopoMatrix()
    if header is None:
        return topo
    names = lines[header].split()
    # Device columns come first; the header's words after them are 'CPU Affinity', 'NUMA Affinity',
    # ...
    topo.devices = names[: _device_columns(names)]
    for line in lines[header + 1 :]:
        cells = line.split()
        if not cells or cells[0] not in topo.devices:
            if cells and cells[0].startswith("Legend"):
                break
            continue
        row, links, rest = (
            cells[0],
            cells[1 : 1 + len(topo.devices)],
            cells[1 + len(topo.devices) :],
        )
        for col, link in zip(topo.devices, links):
            topo.links[(row, col)] = link
        if re.fullmatch(r"GPU\d+", row):
            if rest:
                topo.cpu_affinity[row] = rest[0]
            if len(rest) > 1:
                topo.numa_affinity[row] = rest[1]
    return topo


def _device_columns(names: list[str]) -> int:
    for i, name in enumerate(names):
        if (
            name in ("CPU", "NUMA", "GPU")
            and i + 1 < len(names)
            and names[i + 1] in ("Affinity", "NUMA")
        ):
            return i
    return len(names)


def numa_nodes(root: Path = NODE_DIR) -> dict[int, str]:
    """NUMA node -> its CPU list, from sysfs; {} where sysfs has no node directory (macOS, some
    containers)."""
    nodes = {}
    for path in sorted(root.glob("node[0-9]*")) if root.is_dir() else []:
        cpulist = path / "cpulist"
        nodes[int(path.name[4:])] = cpulist.read_text().strip() if cpulist.is_file() else "?"
    return nodes


def nvidia_smi(*args: str, timeout: float = 15.0) -> str | None:
    """nvidia-smi's stdout, or None when it isn't installed or fails (a CPU box, a broken
    driver)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def torch_gpus() -> list[dict[str, Any]]:
    """The CUDA devices torch sees (after CUDA_VISIBLE_DEVICES): name, memory, compute
    capability."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "memory_bytes": int(p.total_memory),
                "capability": f"{p.major}.{p.minor}",
            }
        )
    return gpus


def physical_gpu_count() -> int | None:
    """GPUs the driver has, whatever CUDA_VISIBLE_DEVICES says (nvidia-smi ignores it); None without
    one."""
    out = nvidia_smi("-L")
    return None if out is None else sum(1 for line in out.splitlines() if line.startswith("GPU "))


def cpu_counts() -> tuple[int, int]:
    """(CPUs this process may run on, CPUs the machine has)."""
    total = os.cpu_count() or 1
    try:
        return len(os.sched_getaffinity(0)), total
    except AttributeError:  # macOS
        return total, total


def build_devices(section: Section, topo_text: str | None = None) -> None:
    """Fill the devices-and-topology section. `topo_text` replaces running `nvidia-smi topo -m`
    (tests)."""
    usable, total = cpu_counts()
    nodes = numa_nodes()
    section.lines.append(
        f"CPU: {usable} usable cores of {total}"
        + (
            f", {len(nodes)} NUMA node(s): "
            + "; ".join(f"node{n} cpus {c}" for n, c in nodes.items())
            if nodes
            else ", NUMA nodes unknown (no sysfs)"
        )
    )
    gpus = torch_gpus()
    section.data.update(
        cpu_usable=usable,
        cpu_total=total,
        numa_nodes={str(k): v for k, v in nodes.items()},
        gpus=gpus,
        physical_gpus=physical_gpu_count(),
    )
    if not gpus:
        _cpu_only(section)
        return
    for g in gpus:
        section.lines.append(
            f"GPU{g['index']}: {g['name']}, {fmt_bytes(g['memory_bytes'])}, "
            f"compute capability {g['capability']}"
        )
    text = topo_text if topo_text is not None else nvidia_smi("topo", "-m")
    if text is None:
        section.lines.append("GPU links: unknown (`nvidia-smi topo -m` not available)")
        return
    add_topology(section, parse_topo_matrix(text))


def _cpu_only(section: Section) -> None:
    if not torch.backends.cuda.is_built():
        why = f"torch {torch.__version__} is a CPU-only build"
    else:
        why = "torch is built with CUDA but finds no usable GPU"
    section.lines.append(
        f"GPUs: none ({why}). This is a CPU-only box: distributed runs use gloo over CPU processes."
    )
    if section.data.get("physical_gpus"):
        section.findings.append(
            Finding(
                "warn",
                f"nvidia-smi lists {section.data['physical_gpus']} GPU(s) but torch can't use them "
                f"({why})",
                "install the CUDA build of PyTorch for this driver (pip install torch --index-url "
                "https://download.pytorch.org/whl/cu<version>), or check CUDA_VISIBLE_DEVICES",
            )
        )


def add_topology(section: Section, topo: TopoMatrix) -> None:
    """GPU-to-GPU links and CPU affinity, with findings for slow paths."""
    section.data["links"] = {f"{a}-{b}": link for a, b, link in topo.gpu_pairs()}
    section.data["cpu_affinity"] = topo.cpu_affinity
    section.data["numa_affinity"] = topo.numa_affinity
    for a, b, link in topo.gpu_pairs():
        section.lines.append(f"{a} <-> {b}: {link} ({describe_link(link)})")
    for gpu in topo.gpus:
        if gpu in topo.cpu_affinity:
            numa = topo.numa_affinity.get(gpu)
            section.lines.append(
                f"{gpu} CPU affinity: {topo.cpu_affinity[gpu]}"
                + (f" (NUMA node {numa})" if numa and numa != "N/A" else "")
            )
    pairs = topo.gpu_pairs()
    if pairs and not any(link.startswith("NV") for _, _, link in pairs):
        section.findings.append(
            Finding(
                "info",
                "no NVLink between GPUs: all-reduce goes over PCIe, expect a few "
                "to ~25 GB/s bus bandwidth",
            )
        )
    cross = [f"{a}-{b}" for a, b, link in pairs if link in ("SYS", "SOC")]
    if cross:
        section.findings.append(
            Finding(
                "info",
                f"GPU pairs {', '.join(cross)} cross the NUMA interconnect (SYS)",
                "for jobs on fewer GPUs than the node has, pick GPUs of one NUMA node "
                "(CUDA_VISIBLE_DEVICES) and bind each rank to its GPU's CPU affinity",
            )
        )
