"""'Did you mean ...?' for names users type: config keys, task names, suite keys, modes."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def closest(word: object, choices: Iterable[str]) -> str | None:
    """The choice closest to `word` (a prefix match counts), or None when none is close."""
    text, options = str(word), list(choices)
    close = difflib.get_close_matches(text, options, n=1) or sorted(
        (c for c in options if text and (text.startswith(c) or c.startswith(text))),
        key=lambda c: abs(len(c) - len(text)),
    )
    return close[0] if close else None


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice (a prefix match counts), or '' when none is
    close."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match is not None else ""


def unknown_keys(keys: Iterable[object], allowed: Sequence[str]) -> list[str]:
    """Each key not in `allowed`, quoted, with its suggestion: ["'lrr' (did you mean 'lr'?)"]."""
    return [f"{k!r}{did_you_mean(k, allowed)}" for k in keys if k not in allowed]


def reject_unknown(
    keys: Iterable[object], allowed: Sequence[str], where: str, what: str = "key"
) -> None:
    """ValueError naming every unknown key (with suggestions) and the allowed ones."""
    unknown = unknown_keys(keys, allowed)
    if unknown:
        plural = what if len(unknown) == 1 else f"{what}s"
        raise ValueError(
            f"{where}: unknown {plural} {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
