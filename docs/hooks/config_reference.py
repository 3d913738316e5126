"""The RunConfig field reference, generated at build time from the dataclass in workbench/config/run_config.py.

A page holding the marker below gets a table with one row per field: name, type, default, choices and the
field's docstring (the string literal under each field, read from the source with `ast`, as griffe reads
attribute docstrings). Types, defaults and choices come from the dataclass itself, so a new field, a new
choice or a changed default shows up without editing the docs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import types
import typing

MARKER = "<!-- generated: runconfig-fields -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, fields_table())
    return markdown


def fields_table() -> str:
    from workbench.config.run_config import RunConfig

    hints = typing.get_type_hints(RunConfig)
    docs = _attribute_docstrings(RunConfig)
    lines = [
        "| Field | Type | Default | Choices | What it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in dataclasses.fields(RunConfig):
        hint = hints[f.name]
        choices = _literals(hint)
        whole_literal = choices and all(
            _is_literal(arg) or arg is type(None) for arg in _union_args(hint)
        )
        type_text = _type_text(hint, inline_literals=not whole_literal)
        cells = [
            f'<span id="{f.name}"></span>`{f.name}`',
            f"`{type_text}`",
            f"`{_default(f)!r}`",
            ", ".join(f"`{c!r}`" for c in choices) if whole_literal else "",
            _cell(docs.get(f.name, "")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """{field: the string literal right under its annotated assignment} in the class body."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    found = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            found[node.target.id] = inspect.cleandoc(following.value.value)
    return found


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _union_args(hint) -> tuple:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _is_literal(hint) -> bool:
    return typing.get_origin(hint) is typing.Literal


def _literals(hint) -> list:
    """The Literal values anywhere in a type, in order (the choices a field offers)."""
    if _is_literal(hint):
        return list(typing.get_args(hint))
    return [value for arg in typing.get_args(hint) for value in _literals(arg)]


def _type_text(hint, inline_literals: bool) -> str:
    if hint is type(None):
        return "None"
    if _is_literal(hint):
        values = typing.get_args(hint)
        return " | ".join(map(repr, values)) if inline_literals else type(values[0]).__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        parts = [_type_text(a, inline_literals) for a in args]
        return " | ".join(dict.fromkeys(parts))
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_text(a, True) for a in args)}]"
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _cell(text: str) -> str:
    """A docstring as one table cell: one line, pipes escaped, `<` and `>` shown as text outside code spans."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(
        p if p.startswith("`") else p.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
        for p in parts
    )
