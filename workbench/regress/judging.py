"""Judging: each metric of a case against its baseline, and the verdict of the case."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.regress.execution import CaseError
from workbench.regress.recording import RecordedMetric, Records, decode_value
from workbench.regress.rules import Rule, median
from workbench.regress.suite import Case

# Case statuses, worst first; exit code 2 for 'error', 1 for 'failed'.
ERROR, FAILED, NEW, PASSED, UPDATED, SKIPPED = (
    "error",
    "failed",
    "new",
    "passed",
    "updated",
    "skipped",
)


@dataclass
class MetricResult:
    """One metric of one case: the numbers, the rule that decided and why."""

    name: str
    verdict: str  # pass | fail | info | new | missing
    reason: str
    rule: Rule | None = None
    rule_source: str = ""
    current: float | None = None
    baseline: float | None = None
    values: list[float] = field(default_factory=list)  # one per repeat
    unit: str | None = None
    direction: str | None = None

    @property
    def failed(self) -> bool:
        return self.verdict in ("fail", "missing")

    @property
    def delta(self) -> float | None:
        if self.current is None or self.baseline is None:
            return None
        return self.current - self.baseline


def compare(
    case: Case,
    runs: Sequence[Records],
    baseline: Mapping[str, Any] | None,
    device_class: str | None = None,
) -> list[MetricResult]:
    """Judge the median over `runs` (one Records per repeat) of every metric against `baseline`, by
    the rules for `device_class`."""
    values: dict[str, list[float]] = {}
    last: dict[str, RecordedMetric] = {}
    for rec in runs:
        for name, m in rec.metrics.items():
            values.setdefault(name, []).append(m.value)
            last[name] = m
    base = {
        k: {**v, "value": decode_value(v["value"])}
        for k, v in (baseline or {}).get("metrics", {}).items()
    }
    results = []
    for name in sorted(values):
        m = last[name]
        rule, source = case.rule_for(name, m.direction, m.tolerance, device_class)
        current = median(values[name])
        res = MetricResult(
            name,
            "new",
            "not in the baseline",
            rule,
            source,
            current,
            None,
            values[name],
            m.unit,
            m.direction,
        )
        if name in base:
            res.baseline = base[name]["value"]
            res.verdict, res.reason = rule.check(current, res.baseline, m.unit)
            if len(values[name]) > 1:
                res.reason = f"median of {len(values[name])}: {res.reason}"
        results.append(res)
    for name in sorted(set(base) - set(values)):
        rule, source = case.rule_for(name, base[name].get("direction"), device_class=device_class)
        verdict = "info" if rule.mode == "info" else "missing"
        results.append(
            MetricResult(
                name,
                verdict,
                "in the baseline but not recorded by this run",
                rule,
                source,
                None,
                base[name]["value"],
                [],
                base[name].get("unit"),
                base[name].get("direction"),
            )
        )
    return results


@dataclass
class CaseResult:
    """What happened to one case: status, per-metric verdicts, curves, executed notebooks, error."""

    case: Case
    status: str
    parameters: dict[str, Any] = field(default_factory=dict)
    metrics: list[MetricResult] = field(default_factory=list)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)
    baseline_curves: dict[str, list[list[float]]] = field(default_factory=dict)
    notebooks: list[Path] = field(default_factory=list)
    error: CaseError | None = None
    duration_s: float = 0.0
    baseline_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed_metrics(self) -> list[MetricResult]:
        return [m for m in self.metrics if m.failed]

    def summary_line(self) -> str:
        if self.status == ERROR and self.error:
            return f"{self.case.id}: ERROR ({self.error.kind}) {self.error.message.splitlines()[0]}"
        if self.status == FAILED:
            return f"{self.case.id}: FAILED {', '.join(m.name for m in self.failed_metrics)}"
        return (
            f"{self.case.id}: {self.status} ({len(self.metrics)} metrics, {self.duration_s:.1f} s)"
        )


def exit_code(results: Sequence[CaseResult]) -> int:
    """2 when a case could not run, else 1 when one regressed, else 0."""
    if any(r.status == ERROR for r in results):
        return 2
    return 1 if any(r.status == FAILED for r in results) else 0
