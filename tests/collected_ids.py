"""Test ids that are the same in every process and every second.

pytest-xdist's workers each collect the suite and must agree on every test id. An id built from a parameter's
bytes (a gzip header holds the current second), an object's repr (its memory address) or any long generated value
can differ between workers, and the run then fails at random with "Different tests were collected". conftest.py
marks such tests at collection (mark_unstable_ids) and the hook below fails each, naming why and the fix (`ids=`).
"""

from __future__ import annotations

import re

import pytest

MAX_PARAM_ID = 80
"""Longer parameter ids are generated values, not names someone chose."""
UNSTABLE = (
    (re.compile(r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}"), "escaped bytes"),
    (re.compile(r"0x[0-9a-fA-F]{6,}"), "a memory address"),
    (re.compile(r"<[^<>]* object"), "an object's repr"),
)


def unstable_id(nodeid: str) -> str | None:
    """Why `nodeid` could differ between two collections, or None when it can't."""
    params = nodeid.partition("[")[2].removesuffix("]")
    if not params:
        return None
    for pattern, what in UNSTABLE:
        if pattern.search(params):
            return f"its id holds {what}"
    if len(params) > MAX_PARAM_ID:
        return f"its parameter id is {len(params)} characters long (at most {MAX_PARAM_ID})"
    return None


UNSTABLE_KEY = pytest.StashKey[str]()


def mark_unstable_ids(items: list[pytest.Item]) -> None:
    """Collection: note on each item whose id could differ between collections why (conftest.py calls it)."""
    for item in items:
        why = unstable_id(item.nodeid)
        if why is not None:
            item.stash[UNSTABLE_KEY] = why


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each such test fails, in one process or many (an error raised at collection would crash xdist's workers
    without its message)."""
    why = item.stash.get(UNSTABLE_KEY, None)
    if why is not None:
        pytest.fail(
            f"this test's id could differ between collections (pytest-xdist workers would disagree): {why}; "
            "name each parameter with ids=[...] or pytest.param(..., id=...)",
            pytrace=False,
        )


def brief(fields: dict) -> str:
    """A short id for a case given as config fields: 'lr=nan-seed=-1', each value cut to 24 characters."""

    def cut(value: object) -> str:
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            return f"({value.bit_length()}-bit int)"  # str() of a huge int is slow, and refused past 4,300 digits
        text = str(value)
        return text if len(text) <= 24 else f"{text[:12]}...({len(text)} chars)"

    return "-".join(f"{key}={cut(value)}" for key, value in fields.items()) or "defaults"


def cases(rows: list[tuple], key: int = 0) -> list:
    """`rows` as pytest.params, each named after its `key`-th value: config fields through brief(), text by its
    lines ('lr: 1e400' or 'a: 1; b: 2'), cut to 48 characters, plain lists and numbers as written. Other values
    (objects, functions, bytes) need ids written out."""

    def name(value: object) -> str:
        if isinstance(value, dict):
            return brief(value)
        if not isinstance(value, (str, list, tuple, int, float, type(None))):
            raise TypeError(f"no id for a {type(value).__name__}: write the ids out")
        text = "; ".join(line.strip() for line in str(value).strip().splitlines())
        return text if len(text) <= 48 else f"{text[:40]}...({len(text)} chars)"

    return [pytest.param(*row, id=name(row[key])) for row in rows]
