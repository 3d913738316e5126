"""Checking a value against a type hint, the way RunConfig's fields are declared: Literal choices,
unions, lists, bool that is not an int. Errors name the field and the value."""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, get_args


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if typing.get_origin(tp) is list and get_args(tp):
        return f"a list of ({type_name(get_args(tp)[0])})"
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "None")


def type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = get_args(tp) or (Any,)
        return isinstance(value, list) and (item is Any or all(type_ok(v, item) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def finite_problem(value: Any) -> str | None:
    """None when `value`, meant as a float, is a finite number (or no number at all: that is a type
    error), else why not ('' when the value, nan or inf, says it). Text counts: YAML 1.1 reads 'nan'
    and '1e400' as strings, and float('1e400') is inf; so does an int past a float's range."""
    overflow = "it overflows a float, whose largest value is about 1.8e308"
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return overflow if value.bit_length() > 1024 else None
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        if not math.isfinite(number) and any(c.isdigit() for c in value):
            return overflow
        value = number
    if isinstance(value, float) and not math.isfinite(value):
        return ""  # nan or inf, as the value shows
    return None


def check_type(name: str, value: Any, tp: Any, example: Any = None) -> None:
    """ValueError naming the field and the value when `value` isn't of type `tp` (for a float field,
    when it isn't finite either); `example` is a value that would work, for the message."""
    problem = finite_problem(value) if tp is float else None
    if problem is not None:
        shown = (
            (value if len(value) <= 40 else f"{value[:40]}...")
            if isinstance(value, str)
            else short_repr(value)
        )
        like = f"; use a value like {example!r}" if example is not None else ""
        why = f" ({problem})" if problem else ""
        raise ValueError(f"{name}={shown}: must be a finite number{why}{like}")
    if type_ok(value, tp):
        return
    origin = typing.get_origin(tp)
    if origin is Literal:
        raise ValueError(f"{name}={value!r}: choose one of {type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        if all(typing.get_origin(a) is Literal or a is type(None) for a in get_args(tp)) or (
            any(typing.get_origin(a) is Literal for a in get_args(tp))
        ):
            choices = " | ".join(type_name(a) for a in get_args(tp))
            raise ValueError(f"{name}={value!r}: choose one of {choices}")
        tp = next(a for a in get_args(tp) if a is not type(None))
    raise ValueError(
        f"{name}={short_repr(value)}: expected {type_name(tp)}, got {type(value).__name__}"
    )


def short_repr(value: Any) -> str:
    """repr(value), but a huge int as its size: repr of one past 4300 digits raises ValueError
    itself."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return (
            f"{'-' if value < 0 else ''}(a {int(value.bit_length() * math.log10(2)) + 1}-digit "
            "integer)"
        )
    return repr(value)


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
