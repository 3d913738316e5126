"""Ending a run's processes for kill(): the process that runs the ranks, everything it started, and
the process groups those lead.

The ranks need not share their launcher's group: torchrun (`workbench train`, spawned ranks) starts
each worker in a session of its own, so one killpg of the launcher's group leaves them training
until their parent-death signal lands. Here the launcher is frozen first (SIGSTOP: it starts
nothing new, and its children can't be re-parented out of sight while the tree is read), then every
process found under it is killed, with each group that one of them leads, and the call returns once
they are all gone. Only groups led by a process of that tree are signalled: never a group a file
names, never the caller's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import psutil

log = logging.getLogger("workbench")

_POLL_S = 0.05


def end_tree(root: psutil.Process, timeout: float, reap_root: bool = True) -> list[psutil.Process]:
    """SIGKILL `root`, its descendants and the process groups any of them leads; wait up to
    `timeout` seconds for them to be gone. Returns the ones still there (none: all gone; a zombie
    counts as gone). `reap_root=False`: `root` is the caller's child, reaped by the caller's own
    handle (multiprocessing, Popen), so it is not waited for here."""
    with contextlib.suppress(psutil.Error):
        root.suspend()
    try:
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        members = [root]
    mine = {os.getpid(), os.getpgrp()}
    groups = set()
    for proc in members:
        with contextlib.suppress(OSError):
            if os.getpgid(proc.pid) == proc.pid and proc.pid not in mine:
                groups.add(proc.pid)
    for group in sorted(groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for proc in members:
        if proc.pid != os.getpid():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)  # checks the start time: never a reused pid
    waited = members if reap_root else members[1:]
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in waited if _running(p)]
        if not left or time.monotonic() >= deadline:
            if left and timeout > 0:
                log.warning(
                    "processes %s still there %.0f s after SIGKILL",
                    ", ".join(str(p.pid) for p in left),
                    timeout,
                )
            return left
        time.sleep(_POLL_S)


def _running(proc: psutil.Process) -> bool:
    """Still there, and not a zombie (a zombie runs nothing: it waits for its parent to reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
