"""One case of a regression suite: its notebook executed (every repeat) under the report directory,
and judged against the baseline of the device class it ran on. The same wherever it runs: here, or
as a Slurm array task."""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.regress.baselines import baseline_path, load_baseline, write_baseline
from workbench.regress.execution import CaseError, execute
from workbench.regress.judging import (
    ERROR,
    FAILED,
    NEW,
    PASSED,
    SKIPPED,
    UPDATED,
    CaseResult,
    compare,
)
from workbench.regress.recording import Records, decode_value, read_records
from workbench.regress.suite import Case


def _execute(
    case: Case, params: dict[str, Any], case_dir: Path, result: CaseResult
) -> list[Records]:
    """Every repeat of `case` under case_dir, the records of each; stops at the first that fails
    (result.error)."""
    if case_dir.exists():  # a previous report in the same --out: its runs must not mix with these
        shutil.rmtree(case_dir)
    runs = []
    for k in range(case.repeats):
        work = case_dir if case.repeats == 1 else case_dir / f"repeat{k + 1}"
        work.mkdir(parents=True)
        executed = work / case.notebook.name
        result.notebooks.append(executed)
        error = execute(
            case.notebook,
            executed,
            work,
            params,
            case.timeout_s,
            output_limit_mb=case.output_limit_mb,
            notes=result.notes,
        )
        if error is not None:
            result.status, result.error = ERROR, error
            break
        runs.append(read_records(executed))
    return runs


def run_case(
    case: Case,
    overrides: Mapping[str, Any],
    out: Path,
    *,
    device_class: str,
    has_cuda: bool,
    update_baselines: bool,
) -> CaseResult:
    """Execute one case (all its repeats) under out/cases/<id>/ and judge it; never raises for the
    case's faults."""
    params = {**case.parameters, **overrides}
    result = CaseResult(case, SKIPPED, params, baseline_path=baseline_path(case, device_class))
    if case.needs_gpu and not has_cuda:
        result.notes.append("skipped: needs_gpu is set and this machine has no CUDA GPU")
        return result
    started = time.monotonic()
    runs = _execute(case, params, out / "cases" / case.id, result)
    result.duration_s = time.monotonic() - started
    if result.error is not None:
        return result
    baseline = _baseline(result, update_baselines)
    if result.error is not None:
        return result
    _compare(result, runs, baseline, device_class)
    _conclude(result, baseline, device_class, update_baselines)
    return result


def _baseline(result: CaseResult, update_baselines: bool) -> dict[str, Any] | None:
    """The case's baseline on this device class: None when there is none yet, or when an unusable
    one is about to be rewritten; an unusable one otherwise is the case's error."""
    try:
        return load_baseline(result.baseline_path)
    except ValueError as e:  # changed while the notebook ran, or about to be rewritten
        if not update_baselines:
            result.status, result.error = ERROR, CaseError("bad baseline", str(e))
            return None
        result.notes.append(f"the old baseline could not be used and is replaced: {e}")
        return None


def _compare(
    result: CaseResult, runs: list[Records], baseline: dict[str, Any] | None, device_class: str
) -> None:
    """The verdict per metric against `baseline`, the curves of both, and notes on what makes the
    comparison doubtful."""
    params = result.parameters
    result.metrics = compare(result.case, runs, baseline, device_class)
    result.curves = runs[0].curves
    result.baseline_curves = {
        k: [[p[0], decode_value(p[1])] for p in v]
        for k, v in (baseline or {}).get("curves", {}).items()
    }
    for name in sorted({n for rec in runs for n in rec.repeated}):
        result.notes.append(
            f"{name} was recorded more than once in one execution; the last value counts"
        )
    if not result.metrics:
        result.notes.append(
            "the notebook recorded no metrics: call wb.record(name, value) or launch a run"
        )
    if baseline is not None and baseline.get("parameters", params) != params:
        result.notes.append(
            f"parameters differ from the baseline's ({baseline.get('parameters')}): the "
            "comparison may be meaningless"
        )


def _conclude(
    result: CaseResult, baseline: dict[str, Any] | None, device_class: str, update_baselines: bool
) -> None:
    """The case's status: its baseline rewritten (updated), none yet (new), or passed/failed by
    its metrics."""
    if update_baselines:
        try:
            write_baseline(
                result.baseline_path,
                result.case,
                result.parameters,
                result.metrics,
                result.curves,
                device_class,
            )
        except ValueError as e:
            # nothing to store: a baseline that compares nothing would pass any later run
            result.status, result.error = ERROR, CaseError("no metrics", str(e))
            return
        result.status = UPDATED
        result.notes.append(f"baseline written to {result.baseline_path}")
    elif baseline is None:
        result.status = NEW
        result.notes.append(
            f"no baseline for {device_class} yet ({result.baseline_path}): run again with "
            "--update-baselines to create it"
        )
    else:
        result.status = FAILED if result.failed_metrics else PASSED
