"""The estimate box's HTML, a function of its state alone: bars of memory per rank group against the
usable memory, the verdict, time and cost, what would fit instead, the settings the figures are for
(marked stale until the new settings' estimate arrives), and the running run's measured figures
beside the estimated ones."""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any

import traitlets

from workbench.estimator.report import (
    GRADS_LEGEND,
    TIME_WARNING_COLOR,
    step_text,
    time_warning_html,
)
from workbench.utils.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from workbench.estimator import Estimate

COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "buffers": "#8172B3",
    "temporaries": "#937860",
    "runtime": "#BBBBBB",
}
OFF_SCALE = 4
"""Bars span the largest peak when the usable memory is more than this many times it (else they'd be
slivers)."""


class EstimateState(traitlets.HasTraits):
    """What the box shows is a function of these traits alone (one observer re-renders it)."""

    status = traitlets.Unicode("idle")
    """idle | estimating | done | error"""
    result = traitlets.Any(None, allow_none=True)
    """The latest Estimate (for the settings in `requested` unless `stale`)."""
    alternatives = traitlets.List()
    """(what to change, its Estimate) that fit, cheapest first; computed only when the run doesn't
    fit."""
    message = traitlets.Unicode("")
    requested = traitlets.Unicode("")
    """The settings of the latest request, in one line: what the box is (or will be) an estimate
    of."""
    stale = traitlets.Bool(False)
    """`result` is for settings before the latest change; cleared when the new estimate arrives."""
    measured = traitlets.Dict()
    """The running run's latest figures: step_s, peak_bytes, samples_per_s (absent: not measured
    yet)."""
    doing = traitlets.Unicode("")
    """While estimating: what the estimate is doing now, in words ('tracing one step on a fake
    8-rank world')."""
    since = traitlets.Float(0.0)
    """time.monotonic() when the estimate in flight was requested: the box shows the seconds
    since."""
    tick = traitlets.Int(0)
    """Bumped every second while estimating, so the elapsed time shown moves."""
    time_pending = traitlets.Bool(False)
    """`result` has its memory figures, its step not priced yet (its time figures are zeros)."""


def _scale(est: Estimate) -> tuple[float, bool]:
    """Bytes the bars' full width stands for, and whether they are to the device's scale: when the
    usable memory is more than OFF_SCALE times the peak, they span the largest rank's tensors
    instead (the runtime and the usable memory then are numbers beside them), or a small model's
    bars would be slivers."""
    if est.usable <= OFF_SCALE * est.peak:
        return max(est.usable, est.peak) * 1.02, True
    return float(max(1, max(r.tensors for r in est.ranks))), False


def _bar(values: dict[str, int], scale: float, usable: int | None) -> str:
    parts = "".join(
        f"<div class='wb-bar-{k}' title='{k} {fmt_bytes(v)}' style='width:{100 * v / scale:.2f}%;"
        f"min-width:2px;background:{COLORS[k]}'></div>"
        for k, v in values.items()
        if v > 0
    )
    marker = (
        ""
        if usable is None
        else (
            "<div class='wb-usable' "
            f"style='position:absolute;left:{100 * usable / scale:.2f}%;top:-2px;bottom:-2px;"
            "border-left:2px dashed #222' title='usable memory'></div>"
        )
    )
    return (
        "<div class='wb-bar' "
        "style='position:relative;display:flex;height:14px;width:100%;background:#eee;border:1px "
        f"solid #ccc'>{parts}{marker}</div>"
    )


def _bars(est: Estimate) -> str:
    """A stacked bar and the peak per group of identical ranks; what the colours, the scale and the
    gradient figures mean sits behind a details toggle (each bar's tooltip has its breakdown
    too)."""
    scale, to_scale = _scale(est)
    rows, breakdown = [], []
    for label, row in est.rank_groups():
        *parts, peak = row
        params, grads_held, grads, optimizer, activations, buffers, temporaries, overhead = parts
        values = {
            "params": params,
            "grads": grads,
            "optimizer": optimizer,
            "activations": activations,
            "buffers": buffers,
            "temporaries": temporaries,
            "runtime": overhead if to_scale else 0,
        }
        detail = (
            f"rank {label}: {fmt_bytes(peak - overhead)} of tensors + {fmt_bytes(overhead)} "
            f"runtime; grads {fmt_bytes(grads_held)} held, {fmt_bytes(grads)} at peak"
        )
        breakdown.append(html.escape(detail))
        rows.append(
            f"<tr title='{html.escape(detail, quote=True)}'><td "
            f"style='white-space:nowrap;padding-right:6px'>rank {html.escape(label)}</td><td "
            f"style='width:100%'>{_bar(values, scale, est.usable if to_scale else None)}</td><td "
            f"style='white-space:nowrap;padding-left:6px'>{fmt_bytes(peak)}</td></tr>"
        )
    shown = {k: c for k, c in COLORS.items() if to_scale or k != "runtime"}
    legend = " ".join(f"<span style='color:{c}'>■</span> {k}" for k, c in shown.items())
    if to_scale:
        where = (
            f"the dashed line: usable memory, {fmt_bytes(est.usable)} of {fmt_bytes(est.capacity)}"
        )
    else:
        where = (
            "<span class='wb-scale-note'>the bars span the largest rank's tensors "
            f"({fmt_bytes(scale)}), not the device: the peak with the runtime is "
            f"{est.peak / est.usable:.1%} of the usable {fmt_bytes(est.usable)} (of "
            f"{fmt_bytes(est.capacity)})</span>"
        )
    return (
        f"<table style='width:100%;font-size:90%'>{''.join(rows)}</table>"
        f"<details class='wb-bars-details'><summary><small>{legend}</small></summary>"
        f"<small>{where}<br>{'<br>'.join(breakdown)}<br>{html.escape(GRADS_LEGEND)}</small>"
        "</details>"
    )


def _measured(est: Estimate | None, measured: dict[str, Any]) -> str:
    """'measured 12.3 ms/step (estimated 10.1 ms), ...': the running run beside its estimate."""
    parts = []
    step, peak, rate = (
        measured.get("step_s"),
        measured.get("peak_bytes"),
        measured.get("samples_per_s"),
    )
    if step is not None:
        parts.append(
            f"measured {fmt_seconds(step)}/step"
            + (f" (estimated {fmt_seconds(est.step_s)})" if est else "")
        )
    if peak is not None:
        if est is None:
            parts.append(f"peak {fmt_bytes(peak)} per rank")
        elif est.target.kind == "cuda":  # the dashboard's peak is CUDA max allocated: tensors only
            parts.append(
                f"peak {fmt_bytes(peak)} per rank (estimated "
                f"{fmt_bytes(max(r.tensors for r in est.ranks))} of tensors)"
            )
        else:  # on CPU it is the ranks' peak RSS: the runtime included
            parts.append(
                f"peak {fmt_bytes(peak)} per rank (estimated {fmt_bytes(est.peak)} with the "
                "runtime)"
            )
    if rate is not None:
        parts.append(
            f"{rate:,.0f} samples/s" + (f" (estimated {est.samples_per_s:,.0f})" if est else "")
        )
    return (
        f"<div class='wb-estimate-measured'><b>{html.escape(', '.join(parts))}</b></div>"
        if parts
        else ""
    )


def _header(state: EstimateState, est: Estimate) -> str:
    line = (
        f"<b>Estimate</b> on {html.escape(est.where)}<div class='wb-estimate-settings'><small>for "
        f"{html.escape(est.settings())}</small></div>"
    )
    if state.stale:
        doing = (
            f"estimating the new settings: {html.escape(_doing(state))}"
            if state.status == "estimating"
            else "not re-estimated"
        )
        line += (
            "<div class='wb-estimate-stale' style='color:#a15c00'><b>stale</b>: these figures are "
            f"for the settings before your change; {doing} "
            f"<small>({html.escape(state.requested)})</small></div>"
        )
    return line


def _slow_mark(est: Estimate) -> str:
    """', slow' in amber after a suggestion whose plan is slow, its time verdict in the tooltip."""
    warning = est.time_verdict()
    if warning is None:
        return ""
    return (
        f", <span class='wb-suggestion-slow' style='color:{TIME_WARNING_COLOR}' "
        f"title='{html.escape(warning, quote=True)}'>slow</span>"
    )


def _doing(state: EstimateState) -> str:
    """'tracing one step on a fake 8-rank world… 3 s': what the estimate in flight is doing, and
    for how long it has been asked for."""
    elapsed = max(0.0, time.monotonic() - state.since) if state.since else 0.0
    return f"{state.doing or 'estimating'}… {elapsed:.0f} s"


def _time_line(state: EstimateState, est: Estimate) -> str:
    """The step time and the run's time and cost, or, while the step is priced, what is under way
    (the memory above is final)."""
    if state.time_pending:
        return (
            "<div class='wb-estimate-time wb-estimate-time-pending'><i>step time and cost: "
            f"{html.escape(_doing(state))}</i></div></div>"
        )
    return (
        f"<div class='wb-estimate-time'>{html.escape(est.step_line())}; "
        f"{html.escape(est.run_line())}</div></div>"
    )


def render(state: EstimateState) -> str:
    """The box's HTML: bars per rank group, the verdict, time and cost, the settings they are
    for."""
    if state.status == "error":
        return (
            f"<div class='wb-estimate-error' style='color:#b00020'><b>Estimate</b>: none, "
            f"{html.escape(state.message)}</div>"
        )
    est: Estimate | None = state.result
    if est is None:
        waiting = (
            f"<span class='wb-estimate-doing'>{html.escape(_doing(state))}</span>"
            if state.status == "estimating"
            else html.escape(state.message or "no estimate yet")
        )
        return (
            "<div class='wb-estimate-pending'><b>Estimate</b>: "
            f"{waiting}{_measured(None, state.measured)}</div>"
        )
    color = "#2e7d32" if est.fits else "#b00020"
    faded = " style='opacity:0.55'" if state.stale else ""
    lines = [
        _header(state, est),
        _measured(est, state.measured),
        f"<div{faded}>{_bars(est)}",
        "<div class='wb-estimate-verdict' "
        f"style='color:{color}'><b>{html.escape(est.verdict())}</b></div>",
        # amber, beside the memory verdict: a slow plan isn't just green
        "" if state.time_pending else time_warning_html(est),
        _time_line(state, est),
    ]
    if not est.fits and not state.stale and not state.time_pending:
        if state.alternatives:
            items = "".join(
                f"<li>{html.escape(what)}: {html.escape(alt.verdict())}, step "
                f"{step_text(alt.step_s)}, {html.escape(alt.cost_text())}{_slow_mark(alt)}</li>"
                for what, alt in state.alternatives
            )
            lines.append(
                "<div class='wb-estimate-suggestions'>would fit with:<ul "
                f"style='margin:0'>{items}</ul></div>"
            )
        elif state.status == "done":
            lines.append(
                "<div class='wb-estimate-suggestions'>no single change found that fits: try more "
                "GPUs with zero3, or a smaller model</div>"
            )
        if state.status == "estimating":
            lines.append(
                "<div class='wb-estimate-looking'><i>looking for changes that fit…</i></div>"
            )
    lines.append(
        "<details><summary><small>assumptions</small></summary><small>"
        + "<br>".join(html.escape(a) for a in est.assumptions)
        + "</small></details>"
    )
    return (
        f"<div class='wb-estimate{' wb-estimate-is-stale' if state.stale else ''}'>"
        + "".join(lines)
        + "</div>"
    )
