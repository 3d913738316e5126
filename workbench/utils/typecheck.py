"""Checking a value against a type hint, the way RunConfig's fields are declared: Literal choices, unions,
lists, bool that is not an int. Errors name the field and the value."""

from __future__ import annotations

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


def check_type(name: str, value: Any, tp: Any) -> None:
    if type_ok(value, tp):
        return
    origin = typing.get_origin(tp)
    if origin is Literal:
        raise ValueError(f"{name}={value!r}: choose one of {type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        if all(typing.get_origin(a) is Literal or a is type(None) for a in get_args(tp)) or (
                any(typing.get_origin(a) is Literal for a in get_args(tp))):
            choices = " | ".join(type_name(a) for a in get_args(tp))
            raise ValueError(f"{name}={value!r}: choose one of {choices}")
        tp = next(a for a in get_args(tp) if a is not type(None))
    raise ValueError(f"{name}={value!r}: expected {type_name(tp)}, got {type(value).__name__}")


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
