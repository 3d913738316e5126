"""A benchmark's JSON result, stamped with where and when it was measured: a figure means little
without the machine, the date and the versions beside it (the benchmark history is these files, not
the README)."""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path
from typing import Any

from workbench.utils.files import write_json

RESULTS_DIR = Path("benchmarks") / "results"
"""Where a bench run from a workbench checkout keeps its result:
RESULTS_DIR/<bench>/<date>-<machine>.json (the benchmarks page shows the newest per machine; older
ones stay in the files)."""


def device_tag(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the device part of a result's file name."""
    words = [
        w
        for w in re.split(r"[^a-z0-9]+", name.lower())
        if w and w not in {"nvidia", "tesla", "geforce"}
    ]
    return "-".join(words[:3]) or "gpu"


def machine_tag() -> str:
    """This machine in a result's file name: 'h100-sxm-80gb', 'h100-sxm-80gbx8', or 'cpu-2cores'."""
    from workbench.utils.hardware import detect

    gpus = detect().gpus
    if gpus:
        return device_tag(gpus[0].name) + (f"x{len(gpus)}" if len(gpus) > 1 else "")
    return f"cpu-{os.cpu_count()}cores"


def default_result_path(bench: str, results: Path = RESULTS_DIR) -> Path | None:
    """Where `workbench bench <bench>` writes its result without --json: under `results` (relative
    to the current folder) when that folder exists, else nowhere. One file per machine and day: a
    rerun the same day replaces it."""
    if not results.is_dir():
        return None
    return results / bench / f"{datetime.date.today().isoformat()}-{machine_tag()}.json"


def measured_on() -> dict[str, Any]:
    """The date (UTC), the machine (CPU model, cores, GPUs), the load average and the versions."""
    import torch

    from workbench.estimator.machine.cache import machine_id
    from workbench.utils.hardware import detect
    from workbench.version import __version__

    hardware = detect()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **machine_id(),
        "gpus": [g.name for g in hardware.gpus],
        "device_class": hardware.device_class,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
        "workbench": __version__,
    }


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """`result` under "measured_on", written whole (a reader never sees half a file)."""
    write_json(Path(path), {"measured_on": measured_on(), **result})
