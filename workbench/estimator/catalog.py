"""The accelerators an estimate can target: a catalog shipped as data (accelerators.yaml), the
user's own entries (WORKBENCH_ACCELERATORS=file.yaml, or `extra=`), and "this machine", measured."""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.estimator.efficiency import (
    Efficiency,
    Measurement,
    parse_efficiency,
    parse_measurement,
    resolve,
)
from workbench.utils.files import read_yaml
from workbench.utils.suggest import did_you_mean

BUILTIN = Path(__file__).with_name("accelerators.yaml")
THIS_MACHINE = "this-machine"
FIELDS = (
    "name",
    "memory_gib",
    "peak_tflops",
    "memory_bandwidth_gbs",
    "link",
    "price_per_hour",
    "price_source",
)
"""Each entry's required fields; `efficiency` and `efficiency_from` are optional (efficiency.py)."""
NETWORKS = {"infiniband": 50e9, "ethernet": 12.5e9}
"""Bandwidth per GPU between nodes (bytes/s): 400 Gb/s InfiniBand NDR per GPU, 100 Gb/s Ethernet per
GPU."""


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model, as the time and cost model needs it."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by precision ('fp32', 'bf16', 'fp16', 'fp8')."""
    memory_bandwidth: float
    """Bytes/s."""
    link: str
    """What connects the devices of one node: NVLink, PCIe, or shared memory."""
    link_bandwidth: float
    """Bytes/s per direction, per device."""
    price_per_hour: float | None
    price_source: str
    kind: str = "cuda"
    """'cuda' for a GPU, 'cpu' for this machine's CPU."""
    notes: tuple[str, ...] = field(default=())
    """How figures were obtained when not from a datasheet (this machine)."""
    efficiency: tuple[Efficiency, ...] = field(default=())
    """The fraction of the peak its matrix multiplies reach, by precision and model size, each
    value citing the published runs it comes from (efficiency.py); () for none (the estimate then
    says what it takes)."""

    def peak(self, precision: str) -> float | None:
        return self.peak_flops.get(precision)


def _parse(entry: Any, source: str) -> Accelerator:
    if not isinstance(entry, dict):
        raise ValueError(
            f"{source}: each accelerator is a mapping with {', '.join(FIELDS)}; got {entry!r}"
        )
    where = f"{source}: accelerator {entry.get('name', '?')!r}"
    missing = [f for f in FIELDS if f not in entry]
    if missing:
        raise ValueError(
            f"{where}: missing field(s) {', '.join(missing)} (each entry needs {', '.join(FIELDS)})"
        )
    link, peaks = entry["link"], entry["peak_tflops"]
    if not isinstance(link, dict) or not {"kind", "gbs"} <= set(link):
        raise ValueError(
            f"{where}: link={link!r}: use {{kind: NVLink, gbs: 450}} (GB/s per direction)"
        )
    if not isinstance(peaks, dict) or not all(
        isinstance(v, (int, float)) and v > 0 for v in peaks.values()
    ):
        raise ValueError(
            f"{where}: peak_tflops={peaks!r}: use {{fp32: 67, bf16: 989}} (dense TFLOP/s)"
        )
    for key in ("memory_gib", "memory_bandwidth_gbs"):
        if not isinstance(entry[key], (int, float)) or entry[key] <= 0:
            raise ValueError(f"{where}: {key}={entry[key]!r}: must be a positive number")
    price = entry["price_per_hour"]
    if price is not None and (not isinstance(price, (int, float)) or price < 0):
        raise ValueError(
            f"{where}: price_per_hour={price!r}: use dollars per GPU-hour, or null when unknown"
        )
    efficiency = (
        parse_efficiency(entry["efficiency"], where, peaks) if "efficiency" in entry else ()
    )
    return Accelerator(
        name=str(entry["name"]),
        memory_bytes=int(entry["memory_gib"] * 2**30),
        peak_flops={k: float(v) * 1e12 for k, v in peaks.items()},
        memory_bandwidth=float(entry["memory_bandwidth_gbs"]) * 1e9,
        link=str(link["kind"]),
        link_bandwidth=float(link["gbs"]) * 1e9,
        price_per_hour=None if price is None else float(price),
        price_source=str(entry["price_source"]),
        efficiency=efficiency,
    )


def _read(path: Path) -> tuple[list[Accelerator], dict[str, str], dict[str, Measurement]]:
    """A catalog file's accelerators, which of them take another's efficiency (efficiency_from),
    and its published measurements."""
    data = read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("accelerators"), list):
        raise ValueError(f"{path}: expected 'accelerators:' with a list of entries")
    measured = data.get("measurements") or []
    if not isinstance(measured, list):
        raise ValueError(f"{path}: measurements={measured!r}: expected a list of entries")
    accelerators = [_parse(entry, str(path)) for entry in data["accelerators"]]
    inherit = {
        str(e["name"]): str(e["efficiency_from"])
        for e in data["accelerators"]
        if e.get("efficiency_from")
    }
    runs = (parse_measurement(e, str(path)) for e in measured)
    return accelerators, inherit, {m.id: m for m in runs}


def _load(
    extra: str | os.PathLike[str] | None,
) -> tuple[dict[str, Accelerator], dict[str, Measurement]]:
    catalog: dict[str, Accelerator] = {}
    inherit: dict[str, str] = {}
    measured: dict[str, Measurement] = {}
    for path in [BUILTIN, *filter(None, [os.environ.get("WORKBENCH_ACCELERATORS"), extra])]:
        accelerators, taken, found = _read(Path(path).expanduser())
        for a in accelerators:  # a later file's entry replaces the whole one, efficiency_from too
            catalog[a.name] = a
            inherit.pop(a.name, None)
        inherit.update(taken)
        measured.update(found)
    return resolve(catalog, measured, inherit), measured


def load_catalog(extra: str | os.PathLike[str] | None = None) -> dict[str, Accelerator]:
    """The built-in catalog, then WORKBENCH_ACCELERATORS and `extra` (their entries win by name)."""
    return _load(extra)[0]


def load_measurements(extra: str | os.PathLike[str] | None = None) -> dict[str, Measurement]:
    """The published training runs the catalogs cite (the built-in one's, then
    WORKBENCH_ACCELERATORS' and `extra`'s), by id."""
    return _load(extra)[1]


def lookup(name: str, catalog: dict[str, Accelerator] | None = None) -> Accelerator:
    """The accelerator named `name`; 'this-machine' measures this one. ValueError listing the
    catalog."""
    if name == THIS_MACHINE:
        return this_machine()
    catalog = catalog if catalog is not None else load_catalog()
    if name not in catalog:
        # A GPU's marketing name ('NVIDIA H100 80GB HBM3') finds its entry by model.
        from workbench.utils.hardware import gpu_model

        match = by_model(name, catalog) if gpu_model(name) != name else None
        if match is not None:
            return catalog[match]
        raise ValueError(
            f"gpu={name!r}: not in the accelerator catalog{did_you_mean(name, list(catalog))}; "
            f"known: {', '.join(sorted(catalog))}, or {THIS_MACHINE!r} (add your own with "
            "WORKBENCH_ACCELERATORS=file.yaml)"
        )
    return catalog[name]


def peak_flops(gpu_name: str, precision: str, *, tf32: bool = False) -> float | None:
    """The catalog's dense datasheet peak for this GPU (by model: 'NVIDIA H100 80GB HBM3' is the
    H100 entry) in `precision` (fp32 on TF32 tensor cores with tf32); None when the catalog has no
    entry for it."""
    try:
        accel = lookup(gpu_name)
    except ValueError:
        return None
    return (tf32 and precision == "fp32" and accel.peak("tf32")) or accel.peak(precision)


def by_model(gpu_type: str, catalog: dict[str, Accelerator]) -> str | None:
    """The catalog entry for a GPU model as Slurm's GRES names it ('h100', 'a100_80g',
    'nvidia_h100_80gb_hbm3'): the first entry of that model, or None when the catalog has none (or
    no type)."""
    from workbench.utils.hardware import gpu_model

    model = gpu_model(gpu_type.replace("_", " ")).upper() if gpu_type else ""
    return next((name for name in catalog if model and name.upper().split("-")[0] == model), None)


@functools.cache
def _cpu_matmul_flops(dtype_name: str) -> float:
    """FLOP/s this process reaches on a mid-sized matmul: the CPU's practical peak (about 0.2 s to
    measure)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.15:
        a @ b
        n += 1
    return 2 * 512**3 * n / (time.perf_counter() - start)


def this_machine() -> Accelerator:
    """This machine: its GPUs from the catalog (by model), or its CPU with a measured matmul
    peak."""
    from workbench.utils.hardware import detect

    hw = detect()
    if hw.gpus:
        return lookup(hw.gpus[0].name)
    import psutil

    peaks = {"fp32": _cpu_matmul_flops("float32"), "bf16": _cpu_matmul_flops("bfloat16")}
    return Accelerator(
        name=f"this machine: CPU ({hw.cpu_count} cores)",
        memory_bytes=psutil.virtual_memory().total,
        peak_flops=peaks,
        memory_bandwidth=10e9,
        link="shared memory (gloo)",
        link_bandwidth=2e9,
        price_per_hour=None,
        price_source="no price for this machine",
        kind="cpu",
        notes=(
            "peak: a 512x512 matmul measured in this process, shared by all ranks; the step time "
            "rests on this machine's measured profile instead (estimator/machine/profile.py)",
        ),
    )
