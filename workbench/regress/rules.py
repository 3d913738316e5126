"""Comparison rules: how a recorded metric is judged against its baseline (abs, rel, directional,
exact, info)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.utils.suggest import did_you_mean
from workbench.utils.units import fmt_bytes

DEFAULT_REL = 0.05
MODES = ("abs", "rel", "higher_is_better", "lower_is_better", "exact", "info")
_RULE_KEYS = ("mode", "abs", "rel")


@dataclass(frozen=True)
class Rule:
    """How a metric is judged against its baseline. abs/rel are allowances; directional modes take
    the larger."""

    mode: str
    abs: float | None = None
    rel: float | None = None

    def allowance(self, baseline: float) -> float:
        return max(self.abs or 0.0, (self.rel or 0.0) * abs(baseline))

    def as_text(self) -> str:
        """The rule as a report's table shows it: 'within ±0.05', 'drop <= 15%', ..."""
        amounts = ([f"{self.abs:g}"] if self.abs is not None else []) + (
            [f"{self.rel * 100:g}%"] if self.rel is not None else []
        )
        amount = amounts[0] if len(amounts) == 1 else f"max({', '.join(amounts)})"
        return {
            "abs": f"within ±{amount}",
            "rel": f"within ±{amount} of baseline",
            "higher_is_better": f"drop <= {amount}",
            "lower_is_better": f"rise <= {amount}",
            "exact": "equal",
            "info": "not compared",
        }[self.mode]

    def check(self, current: float, baseline: float, unit: str | None = None) -> tuple[str, str]:
        """('pass' | 'fail' | 'info', reason with the numbers)."""

        def num(v: float) -> str:
            return fmt_bytes(v, "MiB", ".4g") if unit == "bytes" else f"{v:.4g}"

        if self.mode == "info":
            return "info", "reported only"
        if not math.isfinite(baseline):
            return (
                "fail",
                f"baseline is {baseline}; write one from a healthy run with --update-baselines",
            )
        if not math.isfinite(current):
            return "fail", f"current is {current} (baseline {num(baseline)}): the run diverged"
        if self.mode == "exact":
            return (
                ("pass", "equal")
                if current == baseline
                else ("fail", f"{num(current)} != {num(baseline)}")
            )
        delta = current - baseline
        allowed = self.allowance(baseline)
        # Float noise must not fail a change that sits exactly on the tolerance (1.1 - 1.0 > 0.1 in
        # binary).
        slack = 1e-9 * max(abs(baseline), abs(current), allowed) + 1e-12
        pct = f" ({delta / abs(baseline):+.1%})" if baseline else ""
        if delta == 0:
            return "pass", "unchanged"
        if self.mode in ("abs", "rel"):
            moved, what = abs(delta), "changed"
        else:
            better = delta > 0 if self.mode == "higher_is_better" else delta < 0
            if better:
                return (
                    "pass",
                    f"{'rose' if delta > 0 else 'fell'} {num(abs(delta))}{pct}: better, never "
                    "fails",
                )
            moved, what = abs(delta), "drop" if self.mode == "higher_is_better" else "rise"
        if moved <= allowed + slack:
            return "pass", f"{what} {num(moved)}{pct} <= allowed {num(allowed)}"
        return "fail", f"{what} {num(moved)}{pct} > allowed {num(allowed)}"


def default_rule(direction: str | None) -> Rule:
    mode = {"higher": "higher_is_better", "lower": "lower_is_better"}.get(direction or "", "rel")
    return Rule(mode, rel=DEFAULT_REL)


def parse_rule(
    spec: Mapping[str, Any] | str | None, direction: str | None = None, *, where: str = "tolerance"
) -> Rule:
    """A Rule from a tolerance spec: {'abs': x} | {'rel': x} | {'mode': m, 'abs'/'rel': x} | 'exact'
    | 'info'.

    Without `mode`, a direction ('higher'/'lower') makes the check one-sided; otherwise abs or rel
    is two-sided.
    """
    if spec is None:
        return default_rule(direction)
    spec = _spec_mapping(spec, where)
    a, r = _amounts(spec, where)
    mode = _mode(spec, direction, a, r, where)
    _check_amounts(mode, a, r, where)
    return Rule(mode, a, r)


def _spec_mapping(spec: Any, where: str) -> Mapping[str, Any]:
    """The spec as a mapping of known keys ('exact' and 'info' are short for {mode: ...})."""
    if isinstance(spec, str):
        spec = {"mode": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"{where}={spec!r}: use a mapping such as {{abs: 0.05}} or "
            "{mode: higher_is_better, rel: 0.5}, or one of 'exact', 'info'"
        )
    for key in spec:
        if key not in _RULE_KEYS:
            raise ValueError(
                f"{where}: unknown key {key!r}{did_you_mean(str(key), _RULE_KEYS)}; "
                f"allowed: {', '.join(_RULE_KEYS)}"
            )
    return spec


def _amounts(spec: Mapping[str, Any], where: str) -> tuple[float | None, float | None]:
    """The spec's abs and rel allowances as floats (None where not given), each checked >= 0."""
    amounts: dict[str, float | None] = {}
    for key in ("abs", "rel"):
        value = spec.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise ValueError(
                f"{where}: {key}={value!r}: must be a number >= 0 (rel is a fraction: 0.05 is 5%)"
            )
        amounts[key] = None if value is None else float(value)
    return amounts["abs"], amounts["rel"]


def _mode(
    spec: Mapping[str, Any], direction: str | None, a: float | None, r: float | None, where: str
) -> str:
    """The spec's mode, or without one the metric's direction's, else abs or rel by the allowance
    given."""
    mode = spec.get("mode")
    if mode is None:
        if direction in ("higher", "lower"):
            mode = f"{direction}_is_better"
        elif a is not None and r is not None:
            raise ValueError(
                f"{where}: both abs and rel but no mode: set mode (abs or rel for a two-sided "
                "check with one of them, higher_is_better/lower_is_better to allow the larger)"
            )
        elif a is not None or r is not None:
            mode = "abs" if a is not None else "rel"
        else:
            raise ValueError(
                f"{where}={dict(spec)!r}: give abs or rel (e.g. {{rel: 0.05}}), or a mode"
            )
    if mode not in MODES:
        raise ValueError(
            f"{where}: mode={mode!r}{did_you_mean(str(mode), MODES)}; choose one of "
            f"{', '.join(MODES)}"
        )
    return mode


def _check_amounts(mode: str, a: float | None, r: float | None, where: str) -> None:
    """The allowances `mode` takes: abs or rel exactly its own, the directional modes at least
    one, exact and info none."""
    if (mode == "abs" and (a is None or r is not None)) or (
        mode == "rel" and (r is None or a is not None)
    ):
        raise ValueError(
            f"{where}: mode={mode!r} takes exactly {mode!r} (a two-sided check with one "
            f"allowance), e.g. {{mode: {mode}, {mode}: 0.05}}"
        )
    if mode.endswith("_is_better") and a is None and r is None:
        raise ValueError(
            f"{where}: mode={mode!r} needs abs and/or rel: how much worse is still fine, "
            f"e.g. {{mode: {mode}, rel: 0.2}}"
        )
    if mode in ("exact", "info") and (a is not None or r is not None):
        raise ValueError(f"{where}: mode={mode!r} takes no abs/rel")


def median(values: Sequence[float]) -> float:
    """The median of repeats, the way asv and pytest-benchmark summarise noisy timings. A NaN in any
    repeat is returned as NaN: one diverged repeat is a regression, not an outlier to hide."""
    if any(isinstance(v, float) and math.isnan(v) for v in values):
        return math.nan
    return statistics.median(values)
