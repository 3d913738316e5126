"""A benchmark's JSON result, stamped with where and when it was measured: a figure means little without the
machine, the date and the versions beside it (the benchmark history is these files, not the README)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

from workbench.utils.files import write_json


def measured_on() -> dict[str, Any]:
    """The date (UTC), the machine (CPU model, cores, GPUs), the load average and the versions."""
    import torch

    from workbench.estimator.machine_cache import machine_id
    from workbench.utils.hardware import detect
    from workbench.version import __version__

    hardware = detect()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **machine_id(), "gpus": [g.name for g in hardware.gpus], "device_class": hardware.device_class,
            "load_average_1min": round(os.getloadavg()[0], 2), "platform": platform.platform(),
            "cuda": torch.version.cuda, "workbench": __version__}


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """`result` under "measured_on", written whole (a reader never sees half a file)."""
    write_json(Path(path), {"measured_on": measured_on(), **result})
