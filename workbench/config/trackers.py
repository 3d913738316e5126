"""Experiment trackers (TensorBoard, MLflow): which are installed, what RunConfig.trackers resolves
to, and where a run directory keeps their files. A leaf module: the config checks (caller side) and
the ranks both use it.

TensorBoard writes event files to <run>/tensorboard/<run name>/; MLflow writes a local file store to
<run>/mlflow (a `file:` URI, never a server). The rank side that feeds them through accelerate is
training/observe/trackers.py.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

Tracker = Literal["tensorboard", "mlflow"]
TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow")
PIP_NAMES = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny"}
"""What to pip install for each tracker: mlflow-skinny is MLflow's client without the server's
dependencies, enough for a local file store."""
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlflow"
MLFLOW_ENV = {
    # MLflow 3 refuses the file store unless asked (it prefers a database), yet a folder of plain
    # files in the run directory is what works offline, on any shared disk, without a database
    # driver.
    "MLFLOW_ALLOW_FILE_STORE": "true",
    # MLflow 3 sends usage telemetry by default: a training run must never contact a server.
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
"""Environment MLflow needs to write and read a run's store offline (set in the ranks; set it to
read one back)."""


def installed(name: str) -> bool:
    """Whether the tracker's package can be imported here (without importing it: tensorboard is slow
    to load)."""
    module = "mlflow" if name == "mlflow" else "tensorboard"
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve(setting: Sequence[str] | str) -> list[str]:
    """The trackers a run uses: 'auto' is TensorBoard when it is installed, else none; a list as
    given."""
    if setting == "auto":
        return ["tensorboard"] if installed("tensorboard") else []
    return list(setting)


def missing(setting: Sequence[str] | str) -> list[str]:
    """Requested trackers whose package isn't installed ('auto' never misses: it asks for what is
    there)."""
    return [] if setting == "auto" else [name for name in setting if not installed(name)]


def pip_command(names: Sequence[str]) -> str:
    return "pip install " + " ".join(PIP_NAMES[n] for n in names)


def mlflow_uri(run_dir: str | os.PathLike[str]) -> str:
    """The `file:` URI of a run's MLflow store, for mlflow.set_tracking_uri or
    MlflowClient(tracking_uri=...)."""
    return (Path(run_dir).resolve() / MLFLOW_DIR).as_uri()
