"""Every process a case's notebook started, found and ended when the case ends.

Killing the kernel kills its process group, but a notebook's child started in a new session
(`subprocess.Popen(..., start_new_session=True)`, a daemon that double-forks) is in another group,
and once the kernel is gone it is no longer the kernel's descendant either. Two ways find it:
- a marker in the environment: the kernel starts with WORKBENCH_REGRESS_CASE_<token>=1, which every
  process it starts inherits, however it detaches; the name carries the token, so a notebook that
  runs `workbench regress` itself keeps both its own marker and the outer one;
- the kernel's descendants, sampled while it runs, for a process that clears its environment.
A process is only ever killed when it is proven to be the case's: it carries the marker, or it is
the very process (pid and start time) seen below the kernel.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading

import psutil

log = logging.getLogger("workbench")

MARKER_PREFIX = "WORKBENCH_REGRESS_CASE_"
_SAMPLE_S = 0.5
_KILL_WAIT_S = 5.0


class CaseProcesses:
    """The processes of one case's execution: mark the kernel's environment (`environment`), watch
    the kernel once started (`watch`), and end whatever is left (`end_leftovers`)."""

    def __init__(self) -> None:
        self.marker = f"{MARKER_PREFIX}{secrets.token_hex(8)}"
        self._seen: dict[int, float] = {}  # pid -> create_time of the kernel's descendants
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def environment(self, env: dict[str, str] | None) -> dict[str, str]:
        """The kernel's environment: `env` (or this process's) with the case's marker."""
        return {**(os.environ if env is None else env), self.marker: "1"}

    def watch(self, kernel_pid: int) -> None:
        """Sample the kernel's descendants until it ends or `end_leftovers` is called."""
        try:
            kernel = psutil.Process(kernel_pid)
        except psutil.Error as e:
            log.debug("kernel %d: can't watch its children (%s)", kernel_pid, e)
            return
        self._thread = threading.Thread(
            target=self._sample,
            args=(kernel,),
            name="workbench-regress-case-processes",
            daemon=True,
        )
        self._thread.start()

    def _sample(self, kernel: psutil.Process) -> None:
        while not self._stop.is_set():
            try:
                children = kernel.children(recursive=True)
            except psutil.Error:  # the kernel ended
                return
            for child in children:
                try:
                    self._seen.setdefault(child.pid, child.create_time())
                except psutil.Error:
                    pass  # already gone
            self._stop.wait(_SAMPLE_S)

    def leftovers(self) -> list[psutil.Process]:
        """The case's processes still running: those with its marker, and those seen below the
        kernel that are still the same process (pid and start time)."""
        found: dict[int, psutil.Process] = {}
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:
                if self.marker in p.environ():
                    found[p.pid] = p
            except psutil.Error:
                continue  # gone, a zombie, or another user's
        for pid, started in list(self._seen.items()):
            if pid in found:
                continue
            try:
                p = psutil.Process(pid)
                if p.create_time() == started:
                    found[pid] = p
            except psutil.Error:
                continue
        alive = []
        for p in found.values():
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                continue
        return alive

    def end_leftovers(self) -> list[str]:
        """Stop watching and SIGKILL the case's processes still running; what was killed, for a
        note ('pid 123: sleep 600')."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        left = self.leftovers()
        described = []
        for p in left:
            try:
                what = " ".join(p.cmdline())[:120] or p.name()
            except psutil.Error:
                what = "?"
            described.append(f"pid {p.pid}: {what}")
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
            except psutil.Error as e:
                log.warning("could not kill pid %d, left running by a notebook: %s", p.pid, e)
        if left:
            _, still = psutil.wait_procs(left, timeout=_KILL_WAIT_S)
            for p in still:
                log.warning("pid %d, left running by a notebook, survived SIGKILL", p.pid)
        return described
