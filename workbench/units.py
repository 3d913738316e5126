"""How numbers are shown to people: bytes and durations."""

from __future__ import annotations

MiB = 2**20
GiB = 2**30


def fmt_bytes(n: float | None, unit: str | None = None, spec: str | None = None) -> str:
    """'512 MiB' / '1.50 GiB' (the unit picked by size unless given); '?' for None."""
    if n is None:
        return "?"
    unit = unit or ("GiB" if abs(n) >= GiB else "MiB")
    scale = GiB if unit == "GiB" else MiB
    return f"{n / scale:{spec or ('.2f' if unit == 'GiB' else '.0f')}} {unit}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:02.0f} min"
