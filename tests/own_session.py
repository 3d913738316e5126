"""`spawned`: a process started in its own session (its own signal dispositions: the test's don't leak
in), killed with everything it started however the test ends. For tests that signal a `workbench train`
or a script as a scheduler would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil

TESTS = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(TESTS), "PYTHONUNBUFFERED": "1"}
"""The environment of a spawned process: the tests' tasks importable, output unbuffered."""


@contextlib.contextmanager
def spawned(args: list[str], cwd: Path, **env: str) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env={**ENV, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
