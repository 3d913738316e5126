"""Task options declared with their types and ranges: checked before anything runs, shown in the
panel."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from workbench.utils.suggest import did_you_mean

OPTION_TYPES: dict[type, str] = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    object: "any value",
}
"""The types an option may declare, and how a message names each; object takes any value
unchecked."""


def _fits(kind: type, value: Any) -> bool:
    # bool is a subclass of int in Python, but True is no layer count; an int is a fine float
    # (dropout: 0).
    if kind is object:
        return True
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


@dataclass(frozen=True)
class TaskOption:
    """One option of a task: its type, default, allowed values and a line of help.

    Declare a task's options as `option_specs = (TaskOption('n_layer', int, 6, 'blocks', min=1,
    max=96), ...)`; `default_options` follows from them, and `Task.check_options` refuses a value
    outside the declaration by name before anything runs: "task_options.n_layer=0: must be an
    integer from 1 to 96".
    """

    name: str
    """The key in RunConfig.task_options."""
    type: type = object
    """int, float, str or bool; object takes any value unchecked (options inferred from a None
    default)."""
    default: Any = None
    """The value when task_options leaves the option out; it must pass this declaration's own
    checks."""
    help: str = ""
    """One line for users: what the option changes (the panel's tooltip)."""
    min: float | None = None
    """Smallest allowed value of an int or float option; None: no lower bound."""
    max: float | None = None
    """Largest allowed value of an int or float option; None: no upper bound."""
    min_exclusive: bool = False
    """min itself is not allowed (eval_fraction: more than 0)."""
    max_exclusive: bool = False
    """max itself is not allowed (dropout: less than 1)."""
    choices: tuple[str, ...] = ()
    """The allowed values of a str option, in the order the panel offers them; empty: any string."""
    unset: str = ""
    """What None means for this option, e.g. "the preset's value"; given, None is allowed (a blank
    box in the panel), empty, None is refused like any other value of the wrong type."""
    inferred: bool = False
    """Made from a default value alone, for a task that sets only default_options: its type, no
    range."""

    def __post_init__(self) -> None:
        where = f"TaskOption {self.name!r}"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(
                f"TaskOption name={self.name!r}: must be a Python identifier, e.g. 'n_layer'"
            )
        if self.type not in OPTION_TYPES:
            raise ValueError(
                f"{where}: type={self.type!r}; use one of int, float, str, bool or object (any "
                "value)"
            )
        if (self.min is not None or self.max is not None) and self.type not in (int, float):
            raise ValueError(
                f"{where}: min/max apply to int and float options, not {self.type.__name__}"
            )
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"{where}: min={self.min} is more than max={self.max}")
        if self.choices and (
            self.type is not str or not all(isinstance(c, str) for c in self.choices)
        ):
            raise ValueError(f"{where}: choices are for str options, as a tuple of strings")
        object.__setattr__(self, "choices", tuple(self.choices))
        problem = self.problem(self.default)
        if problem:
            raise ValueError(
                f"{where}: its default {self.default!r} {problem}; declare a default that is "
                "allowed"
            )

    @classmethod
    def infer(cls, name: str, default: Any) -> TaskOption:
        """The declaration of an option known only by its default: the default's type (any type for
        None and for containers), no range, no help."""
        kind = next((t for t in (bool, int, float, str) if type(default) is t), object)
        return cls(name, kind, default, inferred=True)

    def requirement(self) -> str:
        """What a value must be, in words: 'must be an integer from 1 to 96', "choose one of 'a' |
        'b'"."""
        text = self._allowed() if self.choices else f"must be {self._allowed()}"
        return text + (f", or None (null in YAML) for {self.unset}" if self.unset else "")

    def _allowed(self) -> str:
        if self.choices:
            return "choose one of " + " | ".join(repr(c) for c in self.choices)
        text = f"{OPTION_TYPES[self.type]}{self._range()}"
        return text + (
            f", like its default {self.default!r}"
            if self.inferred and self.type is not object
            else ""
        )

    def _range(self) -> str:
        low, high = self.min, self.max
        if low is None and high is None:
            return ""
        if low is not None and high is not None and not (self.min_exclusive or self.max_exclusive):
            return f" from {_number(low)} to {_number(high)}"
        parts = [
            f"{'>' if self.min_exclusive else '>='} {_number(low)}" if low is not None else "",
            f"{'<' if self.max_exclusive else '<='} {_number(high)}" if high is not None else "",
        ]
        return " " + " and ".join(p for p in parts if p)

    def problem(self, value: Any) -> str:
        """'' when `value` is allowed, else what it must be (see requirement)."""
        if value is None and self.unset:
            return ""
        if self.choices:
            return (
                ""
                if value in self.choices
                else self.requirement() + did_you_mean(value, self.choices)
            )
        if not _fits(self.type, value):
            return self.requirement()
        low_ok = self.min is None or (value > self.min if self.min_exclusive else value >= self.min)
        high_ok = self.max is None or (
            value < self.max if self.max_exclusive else value <= self.max
        )
        return "" if low_ok and high_ok else self.requirement()

    def check(self, value: Any) -> None:
        """ValueError naming the option, the value and what would work, e.g.
        "task_options.n_layer=0: must be an integer from 1 to 96"."""
        problem = self.problem(value)
        if problem:
            raise ValueError(f"task_options.{self.name}={value!r}: {problem}")

    @property
    def tooltip(self) -> str:
        """The help and the allowed values in one line, for the panel (where None is a blank
        box)."""
        allowed = self._allowed() + (f"; blank: {self.unset}" if self.unset else "")
        return f"{self.help} ({allowed})" if self.help else allowed


def option_table(specs: tuple[TaskOption, ...], defaults: dict[str, Any]) -> dict[str, TaskOption]:
    """Every option by name, in the order of `defaults` (the keys a task takes): its declaration in
    `specs` with the default from `defaults` (a subclass may change it), or one inferred from the
    default alone."""
    by_name = {spec.name: spec for spec in specs}
    out: dict[str, TaskOption] = {}
    for name, default in defaults.items():
        spec = by_name.get(name)
        if spec is None:
            out[name] = TaskOption.infer(name, default)
        else:
            same = spec.default == default and type(spec.default) is type(default)
            out[name] = spec if same else replace(spec, default=default)
    return out
