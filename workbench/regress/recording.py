"""Metrics a notebook hands to the regression suite: `wb.record(...)` and `record_run(result)`.

A recorded metric is a display_data output with the MIME type
`application/vnd.workbench.metric+json` alone, so it lives in the executed notebook itself (the
suite reads it back with nbformat, and nothing is written beside the notebook) and shows nowhere: no
text/plain fallback, which JupyterLab, nbconvert and the docs would print as a line of raw numbers
in the saved notebook; the suite's report is where people read them. Loss curves travel the same way
as `application/vnd.workbench.curve+json`. They are displayed only where a notebook is executed
headless (`workbench regress`, papermill, nbconvert --execute: see `headless()`); in a person's
notebook nothing would read them back, so nothing is shown, and outside a Jupyter kernel neither:
scripts and tests can call these freely.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.regress.rules import parse_rule
from workbench.utils import kernel
from workbench.utils.units import fmt_bytes

if TYPE_CHECKING:
    import nbformat

    from workbench.launcher.result import RunResult

log = logging.getLogger("workbench")

METRIC_MIME = "application/vnd.workbench.metric+json"
CURVE_MIME = "application/vnd.workbench.curve+json"
DIRECTIONS = ("higher", "lower")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-/]*$")

# What record_run records from summary.json: (key, direction, unit, default tolerance). Losses are
# two-sided on purpose: with a fixed seed, a loss that moved a lot either way means the run changed;
# a real improvement is accepted with --update-baselines. Throughput and memory only fail when they
# get worse. Wall time includes process start and eval, too noisy to judge: reported only. Suites
# override any of these per metric.
_RUN_METRICS: tuple[tuple[str, str | None, str | None, dict[str, Any]], ...] = (
    ("final_loss", "lower", None, {"mode": "abs", "abs": 0.05}),
    ("eval_loss", "lower", None, {"mode": "abs", "abs": 0.05}),
    ("eval_accuracy", "higher", None, {"mode": "abs", "abs": 0.02}),
    ("samples_per_s", "higher", "samples/s", {"mode": "higher_is_better", "rel": 0.2}),
    ("tokens_per_s", "higher", "tokens/s", {"mode": "higher_is_better", "rel": 0.2}),
    ("peak_memory_bytes", "lower", "bytes", {"mode": "lower_is_better", "rel": 0.1}),
    ("wall_time_s", "lower", "s", {"mode": "info"}),
)

# Per kernel: how many runs each prefix has recorded, and which name each run got (so a second
# wait() on the same run doesn't record it twice). Re-executing a notebook starts a new kernel, so
# names repeat run after run.
_prefix_counts: dict[str, int] = {}
_run_names: dict[tuple[str, str], str] = {}

# The label runs are recorded under inside `recorded_as(...)`: "" outside any block, None for "don't
# record".
_label: ContextVar[str | None] = ContextVar("workbench_record_label", default="")


RECORD_ENV = "WORKBENCH_RECORD"
"""1: record in any kernel; 0: never. Unset: only where the notebook runs headless
(`headless()`)."""


def headless() -> bool:
    """Whether this is a Jupyter kernel executing a notebook headless, where recorded metrics serve
    the regression suite: papermill, nbconvert --execute and `workbench regress` run notebooks
    through nbclient, which starts the kernel with an in-memory history
    (--HistoryManager.hist_file=:memory:), where JupyterLab's or an editor's kernel keeps a history
    file. $WORKBENCH_RECORD=1 or 0 says it outright. A shell without IPython's history (not a real
    kernel) can't tell, and counts as headless."""
    said = os.environ.get(RECORD_ENV, "").strip()
    if said in ("0", "1"):
        return said == "1" and kernel.kernel_shell() is not None
    shell = kernel.kernel_shell()
    if shell is None:
        return False
    history = getattr(shell, "history_manager", None)
    return history is None or str(getattr(history, "hist_file", "")) == ":memory:"


def encode_value(value: float) -> float | int | str:
    """JSON has no NaN/inf, and a diverged loss is exactly what must survive the trip: non-finite
    become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf', '-inf'
    return value


def decode_value(value: Any) -> float | int:
    if isinstance(value, str):
        return float(value)
    return value


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"{what}={name!r}: use letters, digits, '_', '.', '-' or '/', starting with a letter, "
            "digit or '_' (e.g. 'val_loss')"
        )
    return name


def _number(name: str, value: Any) -> float | int:
    if isinstance(value, (bool, str)) or value is None:
        raise ValueError(f"record({name!r}, {value!r}): value must be a number, e.g. float(loss)")
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        return float(value)  # numpy scalars, 0-d tensors
    except (TypeError, ValueError):
        raise ValueError(
            f"record({name!r}, {value!r}): value must be a number (or a 0-d tensor), "
            f"not {type(value).__name__}"
        ) from None


def _display(bundle: dict[str, Any]) -> None:
    from IPython.display import display

    display(bundle, raw=True)


def _metric(
    name: str,
    value: Any,
    direction: str | None,
    tolerance: Mapping[str, Any] | str | None,
    unit: str | None,
) -> tuple[dict[str, Any], str]:
    """The validated payload of one metric and its one-line text for people."""
    _check_name(name, "name")
    value = _number(name, value)
    if direction is not None and direction not in DIRECTIONS:
        raise ValueError(
            f"record({name!r}): direction={direction!r}: use 'higher', 'lower' or None"
        )
    if tolerance is not None:
        parse_rule(tolerance, direction, where=f"record({name!r}) tolerance")
    if unit is not None and not isinstance(unit, str):
        raise ValueError(f"record({name!r}): unit={unit!r}: use a string such as 's' or 'bytes'")
    payload = {
        "name": name,
        "value": encode_value(value),
        "direction": direction,
        "tolerance": dict(tolerance) if isinstance(tolerance, Mapping) else tolerance,
        "unit": unit,
    }
    shown = (
        fmt_bytes(value, "MiB", ".1f")
        if unit == "bytes"
        else f"{value:.6g}" + (f" {unit}" if unit else "")
    )
    return payload, f"{name} = {shown}"


def record(
    name: str,
    value: float,
    *,
    direction: str | None = None,
    tolerance: Mapping[str, Any] | str | None = None,
    unit: str | None = None,
) -> None:
    """Record a metric for the regression suite (`workbench regress`) in this notebook's output.

    direction: 'higher' or 'lower' is better; with a tolerance that has no `mode`, the check is
    one-sided. tolerance: {'abs': 0.1} | {'rel': 0.05} | {'mode': 'lower_is_better', 'rel': 0.1} |
    'exact' | 'info'. The suite's tolerances, when it sets one for this metric, take precedence.
    Kept (and shown) only where the notebook is executed headless (`headless()`); set
    WORKBENCH_RECORD=1 to see it in your own notebook.
    """
    payload, text = _metric(name, value, direction, tolerance, unit)
    if direction:
        text += f" ({direction} is better)"
    if not headless():
        log.info(
            "recorded %s (not a notebook executed headless: nothing is kept for the regression "
            "suite)",
            text,
        )
        return
    _display({METRIC_MIME: payload})


def record_curve(
    name: str, points: Sequence[Sequence[float]], *, x: str = "step", y: str = "loss"
) -> None:
    """Record a curve, [[x, y], ...], that reports overlay on the baseline's (no pass/fail of its
    own)."""
    _check_name(name, "name")
    clean = [[p[0], encode_value(float(p[1]))] for p in points]
    if not headless():
        log.debug(
            "curve %s: %d points (not a notebook executed headless: nothing recorded)",
            name,
            len(clean),
        )
        return
    _display({CURVE_MIME: {"name": name, "x": x, "y": y, "points": clean}})


def _new_run_name(prefix: str) -> str:
    i = _prefix_counts.get(prefix, 0)
    _prefix_counts[prefix] = i + 1
    # run, run1, run2 ... ; a prefix ending in a digit gets '_' so fp32 + 1 doesn't read as fp321.
    return prefix if i == 0 else f"{prefix}{'_' if prefix[-1].isdigit() else ''}{i}"


@contextmanager
def recorded_as(label: str | None) -> Iterator[None]:
    """Record the runs that end inside this block as `<label>.*` instead of run.*, run1.*, ...

    A notebook comparing runs names its recorded metrics after what it compares, so a baseline reads
    `bf16.samples_per_s`, not `run1.samples_per_s`. A second run under one label is `<label>_1` (or
    `<label>1`), as with prefixes. `recorded_as(None)` records none of them: repeats a notebook
    measures for itself, whose numbers would only double the baseline.

        with recorded_as("bf16"):
            half = wb.launch(cfg.replace(precision="bf16"))
    """
    if label is not None:
        # now, not after the run: a bad name must not turn a good run into an error
        _check_name(label, "label")
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


def record_run(result: RunResult, prefix: str = "") -> str | None:
    """Record a run's summary (loss, eval, throughput, memory, wall time) and its loss curve as
    `<prefix>.*`.

    prefix '' means the label of the enclosing `recorded_as(...)` block, or else 'run'; the second
    run recorded under one prefix in a kernel is 'run1', then 'run2', in launch order, so names are
    the same each time the notebook is executed. Recording the same run again is a no-op. Where no
    notebook runs headless (`headless()`: a person's notebook, a script), or inside
    `recorded_as(None)` without a prefix, this does nothing and returns None; otherwise it returns
    the name used.
    """
    label = _label.get()
    if not headless() or (label is None and not prefix):
        return None
    base = _check_name(prefix or label or "run", "prefix")
    key = (str(Path(result.run_dir).resolve()), base)
    if key in _run_names:
        return _run_names[key]
    name = _run_names[key] = _new_run_name(base)
    summary = result.summary
    known = {k for k, *_ in _RUN_METRICS}
    extra_eval = [
        (
            k,
            "higher" if "acc" in k else "lower" if "loss" in k or "perplexity" in k else None,
            None,
            {"mode": "rel", "rel": 0.05},
        )
        for k in sorted(summary)
        if k.startswith("eval_") and k not in known
    ]
    payloads, texts = [], []
    for key, direction, unit, tolerance in (*_RUN_METRICS, *extra_eval):
        value = summary.get(key)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            payload, text = _metric(f"{name}.{key}", value, direction, tolerance, unit)
            payloads.append(payload)
            texts.append(text.removeprefix(f"{name}."))
    if payloads:  # one output per run: a notebook shows one line, not one per metric
        _display(
            {METRIC_MIME: {"metrics": payloads, "text": f"recorded {name}: " + ", ".join(texts)}}
        )
    points = [[row.step, row.loss] for row in result.dir.metrics_rows() if row.loss is not None]
    if points:
        record_curve(f"{name}.loss", points)
    return name


# ---- reading back --------------------------------------------------------------------------------
@dataclass
class RecordedMetric:
    """One wb.record() call as found in an executed notebook."""

    name: str
    value: float | int
    direction: str | None = None
    tolerance: Mapping[str, Any] | str | None = None
    unit: str | None = None


@dataclass
class Records:
    """Everything a notebook recorded. A name recorded twice keeps its last value and is listed in
    `repeated`."""

    metrics: dict[str, RecordedMetric] = field(default_factory=dict)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)
    repeated: list[str] = field(default_factory=list)


def read_records(nb: str | Path | nbformat.NotebookNode) -> Records:
    """The metrics and curves recorded in an executed notebook (a path or an nbformat node)."""
    import nbformat

    if not isinstance(nb, nbformat.NotebookNode):
        nb = nbformat.read(str(nb), as_version=4)
    found = Records()
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") not in ("display_data", "execute_result"):
                continue
            data = output.get("data", {})
            if METRIC_MIME in data:
                bundle = data[METRIC_MIME]
                for m in bundle.get("metrics", [bundle]):
                    # record_run puts a run's metrics in one output
                    if m["name"] in found.metrics:
                        found.repeated.append(m["name"])
                    found.metrics[m["name"]] = RecordedMetric(
                        m["name"],
                        decode_value(m["value"]),
                        m.get("direction"),
                        m.get("tolerance"),
                        m.get("unit"),
                    )
            if CURVE_MIME in data:
                c = data[CURVE_MIME]
                found.curves[c["name"]] = [[p[0], decode_value(p[1])] for p in c["points"]]
    return found
