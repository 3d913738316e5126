"""The panel's estimate box: memory per rank against the target, time and cost, what to change when
a run doesn't fit, which settings the figures are for (marked stale until the new settings' estimate
arrives), and during a run the measured figures beside the estimated ones. Recomputed off the UI
thread: a change the traces in memory answer shows at once; one that needs a new trace waits out a
debounce first."""

from __future__ import annotations

import html
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from workbench.estimator.model import GRADS_LEGEND, describe_settings
from workbench.estimator.target import Target
from workbench.utils.units import fmt_bytes, fmt_seconds

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.estimator import Estimate
    from workbench.tasks import Task

log = logging.getLogger("workbench")
COLORS = {
    "params": "#4C72B0",
    "grads": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "buffers": "#8172B3",
    "temporaries": "#937860",
    "runtime": "#BBBBBB",
}
DEBOUNCE_S = 0.6
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
        params, grads_held, grads, optimizer, activations, buffers, temporaries, overhead, peak = (
            row
        )
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
            "estimating the new settings…" if state.status == "estimating" else "not re-estimated"
        )
        line += (
            "<div class='wb-estimate-stale' style='color:#a15c00'><b>stale</b>: these figures are "
            f"for the settings before your change; {doing} "
            f"<small>({html.escape(state.requested)})</small></div>"
        )
    return line


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
            "estimating…"
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
        f"<div class='wb-estimate-time'>{html.escape(est.step_line())}; "
        f"{html.escape(est.run_line())}</div></div>",
    ]
    if not est.fits and not state.stale:
        if state.alternatives:
            items = "".join(
                f"<li>{html.escape(what)}: {html.escape(alt.verdict())}, step "
                f"{fmt_seconds(alt.step_s)}, {html.escape(alt.cost_text())}</li>"
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


class EstimateBox:
    """The estimate HTML and the background worker behind it."""

    def __init__(self) -> None:
        self.state = EstimateState()
        self.html = widgets.HTML(render(self.state))
        self.html.add_class("wb-estimates")
        self.widget = widgets.VBox([self.html])
        self.state.observe(lambda change: setattr(self.html, "value", render(self.state)))
        self._thread: threading.Thread | None = None
        self._working: set[threading.Thread] = set()
        """Threads inside _work (a superseded request's may still run beside the newest)."""
        self._generation = 0
        self._lock = (
            threading.RLock()
        )  # re-entrant: an observer of the state may request again while it is set
        self._changed = threading.Condition(self._lock)
        """Notified on every request and cancel: a request waiting out its debounce gives way at
        once."""

    def request(
        self,
        cfg: RunConfig | None,
        task: Task | None,
        target: Target | None = None,
        *,
        delay: float = DEBOUNCE_S,
    ) -> None:
        """Estimate `cfg` on `target` (default: this machine); None: the controls form no config.
        From the traces in memory the answer shows at once; a new trace waits until `delay` seconds
        pass without a newer request. Until the answer arrives, the figures shown are marked
        stale."""
        target = target or Target()
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._changed.notify_all()
            with self.state.hold_trait_notifications():
                if cfg is None:
                    self.state.status, self.state.result, self.state.stale = "idle", None, False
                    self.state.message, self.state.requested = (
                        "the settings don't form a run yet",
                        "",
                    )
                    self._thread = None
                    return
                settings = describe_settings(cfg.to_dict(), target.world(cfg))
                est = self.state.result
                if est is not None and est.settings() != settings:
                    self.state.measured = {}  # a run's figures belong to the settings it ran with
                self.state.requested = f"{settings} on {target.describe(cfg)}"
                self.state.stale, self.state.status = est is not None, "estimating"
            self._thread = threading.Thread(
                target=self._work,
                args=(generation, cfg, task, target, time.monotonic() + delay),
                name="workbench-estimate",
                daemon=True,
            )
            self._thread.start()

    def mark_stale(self) -> None:
        """A setting changed: the figures shown are for the settings before it. Called first in the
        change's handler, before anything that takes time, so the mark shows at once."""
        with self._lock:
            if self.state.result is not None:
                self.state.stale = True

    def withhold(self, why: str) -> None:
        """No estimate for a plan that can't run: no figures and no verdict, `why` in their
        place."""
        with self._lock:
            self._generation += 1
            self._changed.notify_all()
            with self.state.hold_trait_notifications():
                self.state.status, self.state.result, self.state.stale = "idle", None, False
                self.state.alternatives, self.state.message, self.state.requested = [], why, ""
            self._thread = None

    def show_measured(
        self, step_s: float | None, peak_bytes: int | None, samples_per_s: float | None
    ) -> None:
        """The running run's latest figures, shown beside the estimate's (all None: clear them)."""
        figures = {"step_s": step_s, "peak_bytes": peak_bytes, "samples_per_s": samples_per_s}
        self.state.measured = {k: v for k, v in figures.items() if v is not None}

    def cancel(self, timeout: float = 30.0) -> None:
        """Drop a pending request and end one in flight (a run is starting: its ranks get the
        cores). Returns once the estimate's thread is done: forking the run while that thread builds
        batches or forks its trace child would hand the run's processes locks held mid-use (a hang
        at their start)."""
        from workbench.estimator.trace import abort_trace

        with self._lock:
            self._generation += 1
            self._changed.notify_all()
            # Superseded requests' threads may still be estimating: every one of them is waited for.
            threads = [
                t
                for t in (self._thread, *self._working)
                if t is not None and t.is_alive() and t is not threading.current_thread()
            ]
        if threads:
            abort_trace()
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the panel's estimate did not end within %.0f s of the launch", timeout)
        if self.state.status == "estimating":
            self.state.status = "idle"

    def _work(
        self, generation: int, cfg: RunConfig, task: Task | None, target: Target, not_before: float
    ) -> None:
        from workbench.estimator.trace import allow_traces

        with self._lock:
            if generation != self._generation:  # cancelled (a launch) or superseded before it began
                return
            self._working.add(threading.current_thread())
        # a launch that cancelled an earlier estimate has waited for it: traces may run again
        allow_traces()
        try:
            self._estimate(generation, cfg, task, target, not_before)
        except Exception as e:
            # said in the box in words (the traceback goes to the log): it never breaks the panel
            log.warning("the panel's estimate failed", exc_info=True)
            said = (str(e).strip().splitlines() or [f"the estimator raised {type(e).__name__}"])[0]
            self._publish(generation, result=None, message=said, stale=False, status="error")
        finally:
            with self._lock:
                self._working.discard(threading.current_thread())

    def _estimate(
        self, generation: int, cfg: RunConfig, task: Task | None, target: Target, not_before: float
    ) -> None:
        from workbench.estimator.alternatives import alternatives
        from workbench.estimator.trace_cache import NotCached, cache_only, warm
        from workbench.tasks import get_task

        task = task or get_task(cfg.task)
        try:
            with cache_only():
                est = self._estimate_on(cfg, task, target)
        except NotCached:
            warm()  # the imports every trace child needs, paid while the debounce runs anyway
            with self._lock:
                self._changed.wait_for(
                    lambda: generation != self._generation,
                    timeout=max(0.0, not_before - time.monotonic()),
                )
                if generation != self._generation:
                    return
            est = self._estimate_on(cfg, task, target)
        if not self._publish(generation, result=est, alternatives=[], message="", stale=False):
            return
        found: list[tuple[str, Estimate]] = []
        if not est.fits:
            try:
                found = alternatives(
                    cfg.replace(num_processes=est.gpus * est.nodes),
                    est,
                    task,
                    catalog=target.catalog,
                    progress=lambda so_far: self._publish(generation, alternatives=list(so_far)),
                )
            except Exception:  # the estimate stands without its suggestions
                log.warning("the estimate box found no alternatives", exc_info=True)
        self._publish(generation, alternatives=found, status="done")

    @staticmethod
    def _estimate_on(cfg: RunConfig, task: Task, target: Target) -> Estimate:
        from workbench.estimator import estimate

        return estimate(
            cfg,
            target.gpu,
            target.gpus_per_node or cfg.num_processes,
            target.nodes,
            task=task,
            catalog=target.catalog,
            partition=target.partition,
            cpus_per_node=target.cpus_per_node,
        )

    def _publish(self, generation: int, **traits: Any) -> bool:
        """Set the traits at once if `generation` is still the latest request; False when it
        isn't."""
        with self._lock:
            if generation != self._generation:
                return False
            with self.state.hold_trait_notifications():
                for name, value in traits.items():
                    setattr(self.state, name, value)
            return True

    def wait(self, timeout: float = 120.0) -> None:
        """Block until the latest request is done (tests, notebooks that want the number now)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                thread = self._thread
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
            if self.state.status in ("done", "error", "idle") and (
                thread is None or not thread.is_alive()
            ):
                return
            time.sleep(0.05)
        raise TimeoutError(f"no estimate within {timeout} s")
