"""RunConfig's copies and files: plain dicts, YAML, CLI-style `key=value` overrides and the configs
imported from accelerate and DeepSpeed. Each refuses unknown field names (listed, with the closest
known ones) before RunConfig validates the values, and undoes YAML 1.1's surprises ('3e-4' read as
text, `off` as False) where the field's type says what was meant. RunConfig's methods (`to_dict`,
`from_dict`, `to_yaml`, `from_yaml`, `with_overrides`, ...) forward here; the functions take the
class, so this module doesn't import run_config.py."""

from __future__ import annotations

import functools
import math
import os
import typing
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from workbench.config.checks import MAX_INT
from workbench.config.config_reading import read_config_text
from workbench.utils.files import atomic_write_text, load_yaml
from workbench.utils.suggest import closest
from workbench.utils.typecheck import plain, type_ok

if TYPE_CHECKING:
    from workbench.config.run_config import RunConfig


def field_names(cls: type[RunConfig]) -> list[str]:
    return [f.name for f in fields(cls)]


@functools.cache
def _field_set(cls: type[RunConfig]) -> frozenset[str]:
    """The field names as a set: every RunConfig construction looks its keywords up in it."""
    return frozenset(field_names(cls))


@functools.cache
def field_types(cls: type[RunConfig]) -> dict[str, Any]:
    """{field: its type}, resolved from the annotations once."""
    return typing.get_type_hints(cls)


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return {f.name: plain(getattr(cfg, f.name)) for f in fields(cfg)}


def from_dict(cls: type[RunConfig], data: dict[str, Any], source: str) -> RunConfig:
    if not isinstance(data, dict):
        # a config error: the CLI answers ValueError with exit 2
        raise ValueError(  # noqa: TRY004
            f"{source}: expected a mapping of RunConfig fields, got {type(data).__name__}"
        )
    reject_unknown(cls, data, source)
    return cls(**data)


def to_yaml(cfg: RunConfig, path: str | os.PathLike[str] | None = None) -> str:
    """The config as YAML; written atomically to `path` when given."""
    # libyaml's emitter where PyYAML has it: the same text, 4x faster (each launch and
    # checkpoint writes it)
    text = yaml.dump(
        to_dict(cfg), Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False
    )
    if path is not None:
        atomic_write_text(Path(path), text)
    return text


def from_yaml(cls: type[RunConfig], path: str | os.PathLike[str]) -> RunConfig:
    """Load from YAML; unknown keys are rejected and listed, with the closest field names."""
    source = Path(path).expanduser()
    data = load_yaml(read_config_text(source), str(source)) or {}
    if isinstance(data, dict):
        data = {key: coerce(cls, key, value) for key, value in data.items()}
    return from_dict(cls, data, source=str(path))


def from_accelerate(
    cls: type[RunConfig], path: str | os.PathLike[str], overrides: dict[str, Any]
) -> RunConfig:
    """An `accelerate config` YAML mapped to fields, `overrides` on top; what has no counterpart is
    warned about."""
    from workbench.config.accelerate_deepspeed import read_accelerate

    imported = read_accelerate(path)
    imported.warn()
    return from_dict(cls, {**imported.mapped, **overrides}, source=str(path))


def from_deepspeed(
    cls: type[RunConfig], path: str | os.PathLike[str], overrides: dict[str, Any]
) -> RunConfig:
    """A DeepSpeed JSON mapped to fields, `overrides` on top; what has no counterpart is warned
    about."""
    from workbench.config.accelerate_deepspeed import read_deepspeed

    imported = read_deepspeed(path)
    imported.warn()
    return from_dict(cls, {**imported.mapped, **overrides}, source=str(path))


def with_overrides(cfg: RunConfig, assignments: list[str]) -> RunConfig:
    """Apply CLI-style 'key=value' strings (values parsed as YAML; 'task_options.n_layer=4'
    nests)."""
    cls = type(cfg)
    data = to_dict(cfg)
    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. --set max_steps=200")
        value = coerce(cls, key, load_yaml(raw, f"--set {item!r}") if raw.strip() else None)
        if "." in key:
            head, _, sub = key.partition(".")
            if head != "task_options":
                raise ValueError(f"--set {item!r}: only task_options.<name> can be nested")
            data["task_options"] = {**data["task_options"], sub: value}
        else:
            reject_unknown(cls, {key: value}, "--set")
            data[key] = value
    return from_dict(cls, data, source="--set")


def coerce(cls: type[RunConfig], key: Any, value: Any) -> Any:
    """YAML 1.1 reads '3e-4' (no dot) as a string; in a YAML file or --set, users mean a number when
    the field is a float. Text that is no finite number ('1e400', 'nan') stays text, for validation
    to name as written; so for a whole-number field ('1e3' is 1000; '1e300' stays text). And it
    reads `off`/`on` as booleans: a choice field that has them (compile) gets the word back."""
    tp = field_types(cls).get(key) if isinstance(key, str) else None
    if tp is float and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    if isinstance(value, str) and _takes_int_not_float(tp) and not type_ok(value, tp):
        # '1e3' for an integer field: the whole number meant, when it is one an int field can
        # hold; else the text stays, for validation to say what is wrong with it as written
        try:
            number = float(value)
        except ValueError:
            return value
        if math.isfinite(number) and number.is_integer() and abs(number) <= MAX_INT:
            return int(number)
        return value
    if isinstance(value, bool) and typing.get_origin(tp) is Literal:
        # YAML 1.1 reads off/on as booleans
        word = "on" if value else "off"
        return word if word in typing.get_args(tp) else value
    return value


def _takes_int_not_float(tp: Any) -> bool:
    """A field whose type admits an int but no float (max_steps, micro_batch_size, seed, ...)."""
    return tp is not None and type_ok(1, tp) and not type_ok(0.5, tp)


class UnknownFieldError(TypeError, ValueError):
    """A RunConfig field name that doesn't exist: a misspelt keyword, YAML key or `--set` name. A
    TypeError, as Python's own unexpected-keyword error is, and a ValueError, as the other config
    errors of a file or the command line are (the CLI answers those with exit 2)."""


def reject_unknown(cls: type[RunConfig], data: dict[str, Any], source: str | None = None) -> None:
    """UnknownFieldError naming every key of `data` that is no field of `cls`, each with the closest
    field; the whole list of fields only when some key has no close one. `source` (a file, '--set',
    'RunConfig.replace()') starts the message."""
    names = _field_set(cls)
    unknown = [key for key in data if key not in names]
    if not unknown:
        return
    known = field_names(cls)
    prefix = f"{source}: " if source else ""
    matches = {key: _closest_field(key, known) for key in unknown}
    if len(unknown) == 1 and matches[unknown[0]] is not None:
        raise UnknownFieldError(
            f"{prefix}{cls.__name__} has no field {unknown[0]!r}; did you mean "
            f"{matches[unknown[0]]!r}?"
        )
    listed = ", ".join(
        f"{key!r}" + (f" (did you mean {matches[key]!r}?)" if matches[key] else "")
        for key in unknown
    )
    message = f"{prefix}{cls.__name__} has no field{'s' if len(unknown) > 1 else ''} {listed}"
    if None in matches.values():
        message += f"; its fields: {', '.join(known)}"
    raise UnknownFieldError(message)


OTHER_NAMES = {
    "learning_rate": "lr",
    "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "max_grad_norm": "grad_clip",
    "nproc_per_node": "num_processes",
    "world_size": "num_processes",
    "mixed_precision": "precision",
    # workbench counts optimizer steps, not epochs
    "steps": "max_steps",
    "epochs": "max_steps",
    "num_epochs": "max_steps",
    "num_train_epochs": "max_steps",
}
"""Names other tools (Hugging Face's Trainer, accelerate, torchrun) give to a RunConfig field, which
spelling alone would not lead to."""


def _closest_field(key: object, known: list[str]) -> str | None:
    if isinstance(key, str) and OTHER_NAMES.get(key) in known:
        return OTHER_NAMES[key]
    return closest(key, known)
