"""How numbers are shown to people: bytes, durations and money."""

from __future__ import annotations

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
    """A short span: '412 us', '26.2 ms', '3.1 s'."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def fmt_duration(seconds: float | None) -> str:
    """A long span to the second: '12 s', '3 min 05 s', '2 h 10 min'; '?' for None."""
    if seconds is None:
        return "?"
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:02.0f} min"


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
