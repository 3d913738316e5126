"""How numbers are shown to people: bytes, durations and money."""

from __future__ import annotations

import math

MiB = 2**20
GiB = 2**30


def fmt_bytes(n: float | None, unit: str | None = None, spec: str | None = None) -> str:
    """'512 MiB' / '1.50 GiB' / '64.0 KiB' (the unit picked by size unless given); '?' for None."""
    if n is None:
        return "?"
    if n == 0 and unit is None:
        return "0 B"  # not '0 MiB' beside '0.0 KiB'
    unit = unit or ("GiB" if abs(n) >= GiB else "MiB" if abs(n) >= MiB or n == 0 else "KiB")
    if unit == "KiB":
        return f"{n / 1024:{spec or '.1f'}} KiB"
    scale = GiB if unit == "GiB" else MiB
    return f"{n / scale:{spec or ('.2f' if unit == 'GiB' else '.0f')}} {unit}"


def fmt_seconds(seconds: float) -> str:
    """A step-sized span: '412 µs', '26.2 ms', '3.1 s'; from a minute on as fmt_duration, '12 h 17
    min' (not '44256.0 s')."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.1f} s" if seconds < 60 else fmt_duration(seconds)


def fmt_duration(seconds: float | None) -> str:
    """A long span in the largest unit that fits and the next one down: '12 s', '3 min 05 s', '12 h
    17 min', '51 d 5 h' (not '1229 h 19 min'); '?' for None or NaN, '∞' for an infinite one."""
    if seconds is None or math.isnan(seconds):
        return "?"
    if math.isinf(seconds):
        return "∞" if seconds > 0 else "0 s"
    seconds = max(0.0, float(seconds))
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    # whole units cut, not rounded, as a clock shows them; 59.5 s and more reads '1 min 00 s'
    whole = max(60, int(seconds))
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    if whole < 86400:
        return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
    return f"{whole // 86400} d {whole % 86400 // 3600} h"


def fmt_span(seconds: float | None) -> str:
    """A span of any length without rounding short ones away: '0.3 s' (not '0 s'), '12.4 s', '3 min
    05 s'."""
    if seconds is None:
        return "?"
    if seconds < 0.1:
        return fmt_seconds(max(0.0, seconds))
    return f"{seconds:.1f} s" if seconds < 60 else fmt_duration(seconds)


def fmt_money(dollars: float | None) -> str:
    """'$1,234.50'; a cost under a cent reads '< $0.01', not '$0.00' (which reads as free); '?' for
    None."""
    if dollars is None:
        return "?"
    if 0 < dollars < 0.01:
        return "< $0.01"
    return f"${dollars:,.2f}"
