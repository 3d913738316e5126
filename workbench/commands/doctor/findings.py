"""What every doctor section returns: the lines to show, the numbers behind them, and findings with
their fix."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

log = logging.getLogger("workbench")

Level = Literal["info", "warn", "error"]


@dataclass(frozen=True)
class Finding:
    """Something worth acting on: what is wrong (or notable) and, when there is one, the fix."""

    level: Level
    text: str
    fix: str | None = None

    def line(self) -> str:
        return f"[{self.level}] {self.text}" + (f" -> {self.fix}" if self.fix else "")


@dataclass
class Section:
    """One part of the doctor's report."""

    key: str
    """Stable name used as the JSON key, e.g. 'allreduce'."""
    title: str
    lines: list[str] = field(default_factory=list)
    """Readable text, one entry per line."""
    data: dict[str, Any] = field(default_factory=dict)
    """The measured or detected values, JSON-serialisable."""
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None
    """Set when the section could not run; the message says why (no traceback)."""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "lines": self.lines,
            "data": self.data,
            "findings": [asdict(f) for f in self.findings],
            "error": self.error,
            "seconds": round(self.seconds, 3),
        }


def guarded(key: str, title: str, build: Callable[[Section], None]) -> Section:
    """Run one section's `build` on a fresh Section; an exception becomes the section's error line,
    so one failing section never stops the others (the traceback goes to the debug log, not the
    report)."""
    section = Section(key, title)
    start = time.perf_counter()
    try:
        build(section)
    except Exception as e:  # noqa: BLE001
        # whatever went wrong is reported as this section's error
        log.debug("doctor: section %s failed\n%s", key, traceback.format_exc())
        section.error = f"{type(e).__name__}: {e}".splitlines()[0]
        section.findings.append(Finding("error", f"{title}: could not run ({section.error})"))
    section.seconds = time.perf_counter() - start
    return section
