"""The panel's estimate box: memory per rank against the target, time and cost, what to change when
a run doesn't fit, which settings the figures are for (marked stale until the new settings' estimate
arrives), and during a run the measured figures beside the estimated ones. Recomputed off the UI
thread: a change the traces in memory answer shows at once; one that needs a new trace waits out a
short debounce first. While it works the box says what it is doing and for how long (progress.py's
phases), shows the memory as soon as the trace has made it known and the time when it is priced; a
newer request ends the one before it (its trace child killed: cancel.Scope), so a change never
queues behind a trace nobody will see. The heavy work is the trace, in a child process: the kernel's
thread only renders. The box's HTML is drawn by estimate_html from its state alone."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from workbench.estimator import cancel, progress
from workbench.estimator.report import settings_line
from workbench.estimator.target import Target
from workbench.notebook.panel.estimate_html import EstimateState, render

if TYPE_CHECKING:
    from workbench.config import RunConfig
    from workbench.estimator import Estimate
    from workbench.tasks import Task

log = logging.getLogger("workbench")
DEBOUNCE_S = 0.1
"""A new trace waits this long for the next keystroke. Short: a superseded request's trace is
killed (cancel.Scope), not waited for, so a trace started too early costs little."""
TICK_S = 1.0
"""While estimating, the elapsed time shown moves this often."""
EXIT_WAIT_S = 60.0
"""How long the interpreter's exit waits for a cancelled estimate to reach its next stopping point
(a trace child is killed at once; an import or a batch being built runs to its end)."""

_BOXES: weakref.WeakSet[EstimateBox] = weakref.WeakSet()
"""Every box with an estimate thread started (a running thread keeps its box alive)."""
_EXITING = threading.Event()
"""Set when the interpreter exits: no estimate starts after it."""


def end_estimates_at_exit() -> None:
    """Cancel every estimate in flight and wait for its thread, before the interpreter finalizes.
    An estimate's thread is a daemon (a notebook never waits for it), but one still inside torch's
    C++ when finalization begins is ended by pthread_exit as it asks for the GIL back, and that
    unwinds through a noexcept frame of pybind11: std::terminate ("terminate called without an
    active exception", rc 134). Registered with threading's exit hooks, which run before
    finalization and before atexit's (whose torch handlers may already be tearing down)."""
    _EXITING.set()
    for box in list(_BOXES):
        box.cancel(EXIT_WAIT_S)


# threading's own hook list (what concurrent.futures uses for the same reason): it runs in
# threading._shutdown, while daemon threads still run normally; atexit is the fallback.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    try:
        _register(end_estimates_at_exit)
    except RuntimeError:  # first imported while Python exits: no estimate may start
        _EXITING.set()
else:  # pragma: no cover  (CPython < 3.9)
    import atexit

    atexit.register(end_estimates_at_exit)


class EstimateBox:
    """The estimate HTML and the background worker behind it."""

    def __init__(self, state: EstimateState | None = None) -> None:
        self.state = state if state is not None else EstimateState()
        """What the box shows (the panel passes its own state's `estimate`)."""
        self.html = widgets.HTML(render(self.state))
        self.html.add_class("wb-estimates")
        self.widget = widgets.VBox([self.html])
        self.state.observe(lambda change: setattr(self.html, "value", render(self.state)))
        self._thread: threading.Thread | None = None
        self._working: set[threading.Thread] = set()
        """Threads inside _work (a superseded request's may still run beside the newest)."""
        self._generation = 0
        self._scopes: list[cancel.Scope] = []
        """The requests not yet done: a newer request ends them (their trace children killed)."""
        self._ticker: threading.Thread | None = None
        # re-entrant: an observer of the state may request again while it is set
        self._lock = threading.RLock()
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
            self._end_superseded()
            with self.state.hold_trait_notifications():
                if cfg is None:
                    self._end_superseded()
                    self.state.status, self.state.result, self.state.stale = "idle", None, False
                    self.state.time_pending = False
                    self.state.message, self.state.requested = (
                        "the settings don't form a run yet",
                        "",
                    )
                    self._thread = None
                    return
                settings = settings_line(cfg.to_dict(), target.world(cfg))
                est = self.state.result
                if est is not None and est.settings() != settings:
                    self.state.measured = {}  # a run's figures belong to the settings it ran with
                self.state.requested = f"{settings} on {target.describe(cfg)}"
                self.state.stale, self.state.status = est is not None, "estimating"
                self.state.doing, self.state.since = "", time.monotonic()
            if _EXITING.is_set():  # an observer at exit: nothing would wait for the answer
                self._thread = None
                return
            _BOXES.add(self)
            scope = cancel.Scope("the panel's estimate of the previous settings")
            self._scopes.append(scope)
            self._thread = threading.Thread(
                target=self._work,
                args=(generation, scope, cfg, task, target, time.monotonic() + delay),
                name="workbench-estimate",
                daemon=True,
            )
            self._thread.start()
            self._start_ticker()

    def _end_superseded(self) -> None:
        """End the requests before the newest: their trace children are killed now, so the new
        request's trace doesn't queue behind a trace whose answer nobody will see. Under the
        lock."""
        for scope in self._scopes:
            scope.end()
        self._scopes = []

    def _start_ticker(self) -> None:
        """One thread per box moves the elapsed time shown while an estimate is in flight (a
        trait bump: the HTML re-renders; no work beyond that)."""
        if self._ticker is not None and self._ticker.is_alive():
            return

        def tick() -> None:
            while True:
                time.sleep(TICK_S)
                with self._lock:
                    if self.state.status != "estimating" or _EXITING.is_set():
                        self._ticker = None
                        return
                    self.state.tick += 1

        self._ticker = threading.Thread(target=tick, name="workbench-estimate-tick", daemon=True)
        self._ticker.start()

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
            self._end_superseded()
            with self.state.hold_trait_notifications():
                self.state.status, self.state.result, self.state.stale = "idle", None, False
                self.state.alternatives, self.state.message, self.state.requested = [], why, ""
                self.state.time_pending = False
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
        from workbench.estimator.trace.step import abort_trace

        with self._lock:
            self._generation += 1
            self._changed.notify_all()
            self._scopes = []  # abort_trace() below ends every estimate's children
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
        self,
        generation: int,
        scope: cancel.Scope,
        cfg: RunConfig,
        task: Task | None,
        target: Target,
        not_before: float,
    ) -> None:
        from workbench.estimator.trace.step import allow_traces

        with self._lock:
            # cancelled (a launch, the interpreter's exit) or superseded before it began
            if generation != self._generation or _EXITING.is_set():
                return
            self._working.add(threading.current_thread())
            # a launch that cancelled an earlier estimate has waited for it: traces may run again
            allow_traces()
        try:
            with cancel.scope(scope):
                self._estimate(generation, cfg, task, target, not_before)
        except Exception as e:
            if generation != self._generation:  # cancelled: its trace was ended on purpose
                log.debug("a cancelled estimate ended with %r", e)
                return
            # said in the box in words (the traceback goes to the log): it never breaks the panel
            log.warning("the panel's estimate failed", exc_info=True)
            said = (str(e).strip().splitlines() or [f"the estimator raised {type(e).__name__}"])[0]
            self._publish(generation, result=None, message=said, stale=False, status="error")
        finally:
            with self._lock:
                self._working.discard(threading.current_thread())
                if scope in self._scopes:
                    self._scopes.remove(scope)

    def _estimate(
        self, generation: int, cfg: RunConfig, task: Task | None, target: Target, not_before: float
    ) -> None:
        from workbench.estimator.alternatives import alternatives
        from workbench.estimator.trace.cache import NotCached, cache_only, warm
        from workbench.tasks import get_task

        task = task or get_task(cfg.task)

        def doing(what: str) -> None:
            self._publish(generation, doing=what)

        def memory(partial: Estimate) -> None:
            # the memory is final: shown now, with its verdict; the time follows
            self._publish(
                generation,
                result=partial,
                time_pending=True,
                alternatives=[],
                message="",
                stale=False,
            )

        try:
            with cache_only():
                est = self._estimate_on(cfg, task, target)
        except NotCached:
            if not warm.cache_info().currsize:
                doing("importing what a trace runs (once per interpreter)")
            warm()  # the imports every trace child needs, paid while the debounce runs anyway
            with self._lock:
                self._changed.wait_for(
                    lambda: generation != self._generation,
                    timeout=max(0.0, not_before - time.monotonic()),
                )
                if generation != self._generation:
                    return
            with progress.reporting(doing, memory):
                est = self._estimate_on(cfg, task, target)
        if not self._publish(
            generation, result=est, time_pending=False, alternatives=[], message="", stale=False
        ):
            return
        found: list[tuple[str, Estimate]] = []
        if not est.fits:
            try:
                doing("looking for changes that fit")
                found = alternatives(
                    cfg.replace(num_processes=est.gpus * est.nodes),
                    est,
                    task,
                    catalog=target.catalog,
                    progress=lambda so_far: self._publish(generation, alternatives=list(so_far)),
                )
            except Exception:  # the estimate stands without its suggestions
                if generation != self._generation:
                    return  # cancelled: a trace among the alternatives was ended on purpose
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
