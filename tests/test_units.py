"""How spans read: micro-seconds as 'µs', and long spans in the largest unit that fits (issue 47:
'164 us', 'step 44256.0 s' and '1229 h 19 min' were shown)."""

from __future__ import annotations

import pytest

from workbench.utils.units import fmt_duration, fmt_seconds, fmt_span


@pytest.mark.parametrize(
    "seconds,text",
    [
        pytest.param(164e-6, "164 µs", id="micro-seconds"),
        (0.0262, "26.2 ms"),
        (3.14, "3.1 s"),
        (59.4, "59.4 s"),
        (44256.0, "12 h 17 min"),  # the CPU bf16 step of issue 47
    ],
)
def test_fmt_seconds_reads_micro_seconds_as_mu_s_and_long_steps_as_durations(
    seconds: float, text: str
) -> None:
    assert fmt_seconds(seconds) == text


@pytest.mark.parametrize(
    "seconds,text",
    [
        (12.2, "12 s"),
        (59.7, "1 min 00 s"),  # rounded up to a minute, not '60 s'
        (185, "3 min 05 s"),
        (3599.9, "59 min 59 s"),
        (7800, "2 h 10 min"),
        (44256, "12 h 17 min"),
        (1229 * 3600 + 19 * 60, "51 d 5 h"),  # issue 47's '1229 h 19 min'
        (86400, "1 d 0 h"),
        (None, "?"),
        (float("nan"), "?"),
        pytest.param(float("inf"), "∞", id="infinite"),
        (-3, "0 s"),
    ],
)
def test_fmt_duration_uses_the_largest_unit_that_fits(seconds: float | None, text: str) -> None:
    assert fmt_duration(seconds) == text


def test_fmt_span_keeps_short_spans_and_shows_long_ones_in_days() -> None:
    assert fmt_span(0.3) == "0.3 s"
    assert fmt_span(0.0004) == "400 µs"
    assert fmt_span(100 * 44256.0) == "51 d 5 h"
