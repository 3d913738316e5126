"""Baselines: per device class, one JSON file per case, written for review (one key per line)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.regress.recording import encode_value
from workbench.regress.suite import Case
from workbench.utils.files import atomic_write_text
from workbench.version import __version__

if TYPE_CHECKING:
    from workbench.regress.judging import MetricResult


def baseline_path(case: Case, device_class: str) -> Path:
    return case.baselines / device_class / f"{case.id}.json"


def load_baseline(path: Path) -> dict[str, Any] | None:
    """A baseline file, or None when there is none yet. ValueError when it exists but can't be used."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"baseline {path} is not valid JSON ({e}); fix it or rewrite it with "
                         "--update-baselines") from None
    if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict) or \
            not all(isinstance(m, dict) and "value" in m for m in data["metrics"].values()):
        raise ValueError(f"baseline {path}: expected {{'metrics': {{name: {{'value': ...}}}}}}; rewrite it with "
                         "--update-baselines")
    for name, metric in data["metrics"].items():
        value = metric["value"]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number and value not in ("nan", "inf", "-inf"):
            raise ValueError(f"baseline {path}: metrics[{name!r}].value={value!r}: must be a number (or 'nan', "
                             "'inf'); fix it or rewrite it with --update-baselines")
    return data


def _to_json(obj: Any, indent: str = "") -> str:
    """JSON for review: one key per line, but lists of plain values (curve points) on one line each."""
    inner = indent + "  "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {_to_json(v, inner)}" for k, v in sorted(obj.items())]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(obj, list) and obj and any(isinstance(v, (list, dict)) for v in obj):
        return "[\n" + ",\n".join(inner + _to_json(v, inner) for v in obj) + f"\n{indent}]"
    return json.dumps(obj)


def write_baseline(path: Path, case: Case, parameters: Mapping[str, Any], metrics: Sequence[MetricResult],
                   curves: Mapping[str, list[list[float]]], device_class: str) -> None:
    data = {
        "case": case.id, "notebook": case.notebook.name, "device_class": device_class,
        "parameters": dict(parameters), "repeats": case.repeats, "workbench_version": __version__,
        "updated": datetime.date.today().isoformat(),
        "metrics": {m.name: {"value": encode_value(m.current), "direction": m.direction, "unit": m.unit}
                    for m in metrics if m.current is not None},
        "curves": {name: [[p[0], encode_value(p[1])] for p in pts] for name, pts in curves.items()},
    }
    atomic_write_text(path, _to_json(data) + "\n")
