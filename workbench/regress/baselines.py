"""Baselines: per device class, one JSON file per case, written for review (one key per line)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.regress.recording import encode_value
from workbench.regress.suite import Case
from workbench.utils.files import DamagedFileError, atomic_write_text, read_json_checked
from workbench.version import __version__

if TYPE_CHECKING:
    from workbench.regress.judging import MetricResult


def baseline_path(case: Case, device_class: str) -> Path:
    return case.baselines / device_class / f"{case.id}.json"


_SHAPE = "{'metrics': {name: {'value': number}}, 'curves': {name: [[step, value], ...]}}"
_FIX = "fix it or rewrite it with --update-baselines"


def _number(value: Any) -> bool:
    """A metric or curve value as baselines store it: a number, or 'nan'/'inf'/'-inf' (JSON has no
    NaN)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or value in (
        "nan",
        "inf",
        "-inf",
    )


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem(data: dict[str, Any]) -> str | None:
    """What keeps a parsed baseline from being used, or None when it can be."""
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        if "metrics" not in data:
            return f"no 'metrics' (its keys: {', '.join(map(str, data)) or 'none'})"
        return (
            f"'metrics' is {_shown(metrics)}, not a mapping of metric name to {{'value': number}}"
        )
    if not metrics:
        # a baseline that compares nothing would pass every case, whatever the notebook records
        return "'metrics' is empty: a baseline compares at least one metric"
    for name, metric in metrics.items():
        if not isinstance(metric, dict) or "value" not in metric:
            return f"metrics[{name!r}] is {_shown(metric)}, not {{'value': number, ...}}"
        if not _number(metric["value"]):
            return (
                f"metrics[{name!r}].value={metric['value']!r}: must be a number (or 'nan', 'inf')"
            )
    curves = data.get("curves", {})
    if not isinstance(curves, dict):
        return f"'curves' is {_shown(curves)}, not a mapping of curve name to [[step, value], ...]"
    for name, points in curves.items():
        if not isinstance(points, list) or not all(
            isinstance(p, list) and len(p) == 2 and _number(p[0]) and _number(p[1]) for p in points
        ):
            return f"curves[{name!r}] is {_shown(points)}: use a list of [step, value] pairs"
    return None


class _Parsed(dict):  # type: ignore[type-arg]
    """A JSON object as parsed, with the keys it held more than once: (key, first value, later
    value)."""

    duplicates: list[tuple[str, Any, Any]]


def _keeping_duplicates(pairs: list[tuple[str, Any]]) -> _Parsed:
    out, duplicates = _Parsed(), []
    for key, value in pairs:
        if key in out:
            duplicates.append((key, out[key], value))
        out[key] = value
    out.duplicates = duplicates
    return out


def _first_duplicate(node: Any, where: str) -> str | None:
    if isinstance(node, _Parsed):
        if node.duplicates:
            key, first, then = node.duplicates[0]
            return (
                f"key {key!r} is written twice in {where or 'the top-level object'} (first "
                f"{_shown(first)}, then {_shown(then)}); JSON would silently keep the last, so "
                "write each key once"
            )
        children: Any = ((f"{where}[{k!r}]" if where else k, v) for k, v in node.items())
    elif isinstance(node, list):
        children = ((f"{where}[{i}]", v) for i, v in enumerate(node))
    else:
        return None
    return next(
        (found for path, child in children if (found := _first_duplicate(child, path))), None
    )


def _duplicate_key(path: Path) -> str | None:
    """Where the (valid JSON) file holds a key twice in one object, or None. json keeps the last of
    two equal keys without a word, so a hand edit that adds a metric's value again would silently
    decide the case; refused, as suite YAML files refuse theirs."""
    try:
        parsed = json.loads(
            Path(path).read_bytes().decode("utf-8"), object_pairs_hook=_keeping_duplicates
        )
    except (OSError, ValueError):  # replaced or damaged since it was read: what was read is judged
        return None
    return _first_duplicate(parsed, "")


def load_baseline(path: Path) -> dict[str, Any] | None:
    """A baseline file, or None when there is none yet. ValueError naming the file and what is wrong
    with it when it exists but can't be used (so the runner can report that case as an error and go
    on)."""
    try:
        data = read_json_checked(path)
    except DamagedFileError as e:
        raise ValueError(f"baseline {path}: {e.problem}; expected {_SHAPE}; {_FIX}") from None
    if data is None:
        return None
    problem = _duplicate_key(path) or _problem(data)
    if problem is not None:
        raise ValueError(f"baseline {path}: {problem}; {_FIX}")
    return data


def _to_json(obj: Any, indent: str = "") -> str:
    """JSON for review: one key per line, but lists of plain values (curve points) on one line
    each."""
    inner = indent + "  "
    if isinstance(obj, dict) and obj:
        items = [
            f"{inner}{json.dumps(str(k))}: {_to_json(v, inner)}" for k, v in sorted(obj.items())
        ]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(obj, list) and obj and any(isinstance(v, (list, dict)) for v in obj):
        return "[\n" + ",\n".join(inner + _to_json(v, inner) for v in obj) + f"\n{indent}]"
    return json.dumps(obj)


def write_baseline(
    path: Path,
    case: Case,
    parameters: Mapping[str, Any],
    metrics: Sequence[MetricResult],
    curves: Mapping[str, list[list[float]]],
    device_class: str,
) -> None:
    """Write the baseline of `case`; ValueError (nothing written) when no metric has a value to
    store, since load_baseline refuses a baseline that compares nothing."""
    if not any(m.current is not None for m in metrics):
        raise ValueError(
            f"baseline {path}: not written: the notebook of {case.id} recorded no metrics, and a "
            "baseline compares at least one; call wb.record(name, value) in it, or launch a run "
            "there"
        )
    data = {
        "case": case.id,
        "notebook": case.notebook.name,
        "device_class": device_class,
        "parameters": dict(parameters),
        "repeats": case.repeats,
        "workbench_version": __version__,
        "updated": datetime.date.today().isoformat(),
        "metrics": {
            m.name: {"value": encode_value(m.current), "direction": m.direction, "unit": m.unit}
            for m in metrics
            if m.current is not None
        },
        "curves": {name: [[p[0], encode_value(p[1])] for p in pts] for name, pts in curves.items()},
    }
    atomic_write_text(path, _to_json(data) + "\n")
