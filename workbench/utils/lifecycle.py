"""How a workbench process ends with the parent that started it (launcher processes with their
caller, ranks with their launcher). The signals that mean "preempted" are preemption.py's."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG, _PR_GET_PDEATHSIG = 1, 2


def ending_with_parent(
    sig: int, parent: int, *, keep_existing: bool = False
) -> Callable[[], None] | None:
    """Linux: a function that has the kernel send `sig` to the process calling it when its parent
    dies, and exits that process at once if its parent is no longer `parent` (it died before the
    kernel could be asked: the process is an orphan already). `keep_existing`: a parent-death signal
    already set stays. None where the kernel can't be asked. prctl is looked up here, so the
    function can run between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arrange() -> None:
        current = ctypes.c_int(0)
        if keep_existing:
            prctl(_PR_GET_PDEATHSIG, ctypes.byref(current))
        if not current.value:
            prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)

    return arrange
