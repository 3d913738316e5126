"""`workbench regress`: execute every case, judge it, and write the reports."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.regress.baselines import baseline_path, load_baseline
from workbench.regress.case_run import run_case
from workbench.regress.execution import CaseError
from workbench.regress.judging import (
    ERROR,
    FAILED,
    NEW,
    PASSED,
    SKIPPED,
    UPDATED,
    CaseResult,
    exit_code,
)
from workbench.regress.out_lock import hold_out
from workbench.regress.report import write_junit, write_report
from workbench.regress.suite import Case, load_targets, parse_parameters, select_profile
from workbench.utils.hardware import detect

if TYPE_CHECKING:
    from workbench.cluster import Slurm
    from workbench.utils.hardware import Hardware

log = logging.getLogger("workbench")


def unusable_baselines(cases: list[Case], device_class: str) -> dict[str, str]:
    """Case id -> what is wrong with its baseline file, for every case whose baseline exists but
    can't be used.

    Looked at before anything runs, so a broken file is reported at once rather than after hours of
    notebooks; each such case is then an error of its own, and the other cases still run."""
    broken = {}
    for case in cases:
        try:
            load_baseline(baseline_path(case, device_class))
        except ValueError as e:
            broken[case.id] = str(e)
            log.warning(
                "%s: %s; this case is reported as an error and its notebook is not run", case.id, e
            )
    return broken


def _bad_baseline(
    case: Case, overrides: Mapping[str, Any], device_class: str, problem: str
) -> CaseResult:
    result = CaseResult(
        case,
        ERROR,
        {**case.parameters, **overrides},
        baseline_path=baseline_path(case, device_class),
    )
    result.error = CaseError("bad baseline", problem)
    result.notes.append("not run: its baseline can't be compared with")
    return result


def _check_writable(directory: Path, option: str) -> None:
    """The nearest existing directory must be writable, or the run would fail only at the end."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ValueError(
            f"{option} {directory}: can't write there ({existing} is not a writable directory)"
        )


def run(
    targets: list[Path],
    *,
    parameters: dict[str, str],
    out: Path,
    baselines: Path | None,
    update_baselines: bool,
    junit: Path | None,
    profile: str | None,
    slurm: Slurm | None = None,
) -> int:
    """`workbench regress`: execute every case, compare to baselines, write the report; returns the
    exit code. `slurm`: every case as a task of one Slurm job array (regress/on_slurm.py); the
    report is written here."""
    # every ValueError before anything runs
    cases = select_profile(load_targets(targets, baselines), profile)
    overrides = parse_parameters(parameters)
    hw = detect()
    out = Path(out).resolve()
    _check_writable(out, "--out")
    if junit is not None:
        _check_writable(Path(junit).resolve().parent, "--junit")
    # --update-baselines rewrites
    broken = {} if update_baselines else unusable_baselines(cases, hw.device_class)
    out.mkdir(parents=True, exist_ok=True)
    with hold_out(out):  # a second run on this --out would delete this one's case directories
        if slurm is not None:
            return _run_on_slurm(
                cases, overrides, out, slurm, update_baselines, broken, junit, hw.device_class
            )
        return _run_here(cases, overrides, out, update_baselines, broken, junit, hw)


def _run_here(
    cases: list[Case],
    overrides: dict[str, Any],
    out: Path,
    update_baselines: bool,
    broken: dict[str, str],
    junit: Path | None,
    hw: Hardware,
) -> int:
    """Every case one after the other in this process, then the report."""
    results = []
    for i, case in enumerate(cases, 1):
        log.info("[%d/%d] %s: %s", i, len(cases), case.id, case.notebook)
        if case.id in broken:
            result = _bad_baseline(case, overrides, hw.device_class, broken[case.id])
        else:
            result = run_case(
                case,
                overrides,
                out,
                device_class=hw.device_class,
                has_cuda=hw.has_cuda,
                update_baselines=update_baselines,
            )
        log.info("  %s", result.summary_line())
        results.append(result)
    return _report(results, out, junit, hw.device_class)


def _run_on_slurm(
    cases: list[Case],
    overrides: dict[str, Any],
    out: Path,
    slurm: Slurm,
    update_baselines: bool,
    broken: dict[str, str],
    junit: Path | None,
    here: str,
) -> int:
    from workbench.regress.on_slurm import run_cases_on_slurm

    runnable = [c for c in cases if c.id not in broken]
    ran, device_class = (
        run_cases_on_slurm(runnable, overrides, out, slurm, update_baselines)
        if runnable
        else ([], None)
    )
    by_id = {r.case.id: r for r in ran}
    results = [
        by_id.get(c.id) or _bad_baseline(c, overrides, device_class or here, broken[c.id])
        for c in cases
    ]
    return _report(results, out, junit, device_class or here)


def _report(results: list[CaseResult], out: Path, junit: Path | None, device_class: str) -> int:
    report = write_report(results, out, device_class=device_class)
    if junit is not None:
        try:
            write_junit(results, Path(junit))
        except OSError as e:
            raise ValueError(
                f"--junit {junit}: could not write it ({e.strerror or e}); the report is in {out}"
            ) from e
    code = exit_code(results)
    counts = {
        s: sum(r.status == s for r in results)
        for s in (PASSED, FAILED, ERROR, NEW, UPDATED, SKIPPED)
    }
    log.info("%s; report: %s", ", ".join(f"{n} {s}" for s, n in counts.items() if n), report)
    if counts[NEW]:
        log.info(
            "%d case(s) have no baseline for %s: check the report, then run again with "
            "--update-baselines",
            counts[NEW],
            device_class,
        )
    return code
