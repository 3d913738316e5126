"""What an estimate in flight is doing, for whoever waits on it (the panel's box): each phase in
words as it begins ('tracing one step on a fake 8-rank world'), and the memory part of the estimate
as soon as the trace has made it known, before the step is priced (a first measurement of this
machine can take a while there).

Reporting is per thread: the estimate runs in the caller's thread (the panel's worker), which sets
its listeners with reporting(); without them every call here is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.estimator.report import Estimate

__all__ = ["memory_known", "phase", "reporting"]

log = logging.getLogger("workbench")
_LOCAL = threading.local()


@contextlib.contextmanager
def reporting(
    on_phase: Callable[[str], None], on_memory: Callable[[Estimate], None] | None = None
) -> Iterator[None]:
    """Within it (this thread), phase() calls `on_phase` and memory_known() calls `on_memory`."""
    before = getattr(_LOCAL, "listeners", None)
    _LOCAL.listeners = (on_phase, on_memory)
    try:
        yield
    finally:
        _LOCAL.listeners = before


def phase(what: str) -> None:
    """The estimate begins `what` (lower case, no full stop: the box adds the elapsed time)."""
    log.debug("estimate: %s", what)
    listeners = getattr(_LOCAL, "listeners", None)
    if listeners is not None:
        listeners[0](what)


def memory_known(make: Callable[[], Estimate]) -> None:
    """The memory per rank is known; `make` builds an Estimate whose time figures are not priced
    yet (zeros), built only when someone listens."""
    listeners = getattr(_LOCAL, "listeners", None)
    if listeners is not None and listeners[1] is not None:
        listeners[1](make())


def wanted() -> bool:
    """Someone listens for the memory part (building it is then worth its milliseconds)."""
    listeners = getattr(_LOCAL, "listeners", None)
    return listeners is not None and listeners[1] is not None
