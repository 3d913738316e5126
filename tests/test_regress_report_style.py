"""The regression report's HTML reads well: a verdict badge is white on a dark colour (WCAG AA contrast, 4.5:1)
and carries a word and, for pass and fail, a symbol (colour is not the only signal); a table row is tinted
lightly if at all, so its dark text stays readable (passing rows were dark text on saturated green)."""

from __future__ import annotations

import re

import pytest

from workbench.regress.report import _CSS


def _luminance(hex_colour: str) -> float:
    channels = (
        [int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        if len(hex_colour) == 7
        else [int(c * 2, 16) / 255 for c in hex_colour[1:]]
    )
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def _contrast(a: str, b: str) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _rules() -> list[tuple[list[str], str]]:
    return [
        ([s.strip() for s in selectors.split(",")], body)
        for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", _CSS)
    ]


VERDICTS = (
    "passed",
    "pass",
    "failed",
    "fail",
    "missing",
    "error",
    "new",
    "updated",
    "skipped",
    "info",
)


@pytest.mark.parametrize("verdict", VERDICTS)
def test_a_verdicts_colours_keep_its_text_readable(verdict: str) -> None:
    for selectors, body in _rules():
        background = re.search(r"background:(#[0-9a-fA-F]{3,6})", body)
        for selector in selectors:
            if (
                not re.search(rf"\.{verdict}\b", selector)
                or background is None
                or "::before" in selector
            ):
                continue
            if ".status" in selector:  # the badge: white text
                assert _contrast("#ffffff", background.group(1)) >= 4.5, (
                    selector,
                    background.group(1),
                )
            else:  # a row or a cell: the page's dark text (#222) on it
                assert _contrast("#222222", background.group(1)) >= 7.0, (
                    selector,
                    background.group(1),
                )


@pytest.mark.parametrize("verdict", ["pass", "fail", "passed", "failed", "missing"])
def test_pass_and_fail_badges_carry_a_symbol_not_only_a_colour(verdict: str) -> None:
    assert any(
        f".status.{verdict}::before" in selectors and "content:" in body
        for selectors, body in ((",".join(s), b) for s, b in _rules())
    )
