"""The task's options in the panel: a control per option the task declares, and the model's
parameter count."""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as widgets
import torch

from workbench.config import RunConfig
from workbench.notebook.panel.controls import STYLE
from workbench.tasks import Task, TaskOption
from workbench.utils.files import load_yaml

_WIDE = {"width": "380px"}


def param_count(task: Task, cfg: RunConfig) -> int:
    """Parameters of the model `task` builds for `cfg`, made on the meta device: no memory, no
    initialisation, so GPT-2-sized models count at once. ValueError (the task's own words) when the
    options don't form a model; whatever else the build raises passes through."""
    return model_facts(task, cfg)[1]


def model_facts(task: Task, cfg: RunConfig) -> tuple[str, int, int]:
    """The model `task` builds for `cfg`, made on the meta device (see param_count): its name (a
    transformers model's class, '+ LoRA' when peft wraps it; '' for others), its parameters and
    the ones that train."""
    from workbench.tasks.model_plans import is_transformers_model

    task.check_options(cfg)
    # char-gpt reads its text for the vocabulary: never fetch data from a widget's event
    task.check_datasets(cfg)
    with torch.device("meta"):
        model = task.build_model(cfg)
    # parameters() yields a shared tensor once: char-gpt's head is its token embedding (GPT-2's
    # weight tying).
    params = list(model.parameters())
    name = ""
    if is_transformers_model(model):
        base = getattr(model, "get_base_model", None)
        name = type(base() if callable(base) else model).__name__
        name += " + LoRA" if callable(base) else ""
    return name, sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def count_text(n: int) -> str:
    """'1.23 M parameters', '26.1 k parameters', '840 parameters'."""
    rounded = float(f"{n:.3g}")  # round first, so 999,999 reads '1 M', not '1e+03 k'
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if rounded >= scale:
            return f"{rounded / scale:.3g} {unit} parameters"
    return f"{n} parameter" + ("" if n == 1 else "s")


def _text_of(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _parse(spec: TaskOption, text: str) -> Any:
    """A text box's value as task_options takes it: blank is None, numbers and true/false/lists are
    parsed as in YAML (as `--set task_options.x=...` does), what doesn't parse stays text for the
    task's check to refuse."""
    text = text.strip() if spec.type is not str else text
    if spec.type is str:
        return None if text == "" and spec.unset else text
    if text == "":
        return None
    try:
        return json.loads(text)  # before YAML, which reads '1e-05' as a string
    except ValueError:
        pass
    try:
        return load_yaml(text, f"task_options.{spec.name}")
    except ValueError:
        return text


def _fits_number(spec: TaskOption, value: Any) -> bool:
    if isinstance(value, bool) or spec.unset:
        return False  # an option that may be None needs a box that can be blank: Text
    return (
        isinstance(value, int)
        if spec.type is int
        else spec.type is float and isinstance(value, (int, float))
    )


def make_control(spec: TaskOption, value: Any) -> widgets.ValueWidget:
    """The control for one option, holding `value`: Dropdown for choices, Checkbox for bool,
    IntText/FloatText for numbers, Text for the rest, for options that may be blank (None), and for
    a value the typed control can't hold (shown as it is, so the check names it). Number boxes are
    unbounded: a bounded one would clamp what the user typed without a word, where the task's check
    says what would work."""
    common = {
        "description": spec.name,
        "tooltip": spec.tooltip,
        "style": STYLE,
        "layout": widgets.Layout(**_WIDE),
    }
    if spec.choices:
        options = [(c, c) for c in spec.choices]
        if value not in spec.choices:
            options.append((f"{value!r} (not allowed)", value))
        control: widgets.ValueWidget = widgets.Dropdown(options=options, value=value, **common)
    elif spec.type is bool and isinstance(value, bool):
        control = widgets.Checkbox(value=value, **common)
    elif _fits_number(spec, value):
        box = widgets.IntText if spec.type is int else widgets.FloatText
        control = box(value=value, **common)
    else:
        placeholder = spec.unset or ("" if spec.type is str else "blank: None")
        control = widgets.Text(
            value=_text_of(value), placeholder=placeholder, continuous_update=False, **common
        )
    control.add_class(f"wb-task-option-{spec.name.replace('_', '-')}")
    return control


def read_control(spec: TaskOption, control: widgets.ValueWidget) -> Any:
    """The option's value as the control holds it."""
    if isinstance(control, widgets.Text):
        return _parse(spec, control.value)
    if isinstance(control, widgets.FloatText):
        return float(control.value)
    return control.value


def _same(a: Any, b: Any) -> bool:
    # 0.0 is the default 0, but True is not the default 1 (bool is an int in Python).
    return a == b and isinstance(a, bool) == isinstance(b, bool) and (a is None) == (b is None)


class TaskControls:
    """The panel's controls for a task's options (Task.declared_options), and a line with the
    model's parameter count, built on the meta device for the options as they stand.

    `widget` is the box to place; `values()` the task_options for RunConfig (what differs from the
    defaults, so a saved YAML stays minimal); `set(task, options)` shows another task's options;
    `on_change(callback)` calls callback(values()) after each edit. Works without a browser: set a
    control's `.value` in tests.
    """

    def __init__(self, task: Task | None, options: Mapping[str, Any] | None = None) -> None:
        self.title = _html("wb-task-options-title")
        self.extra_box = _html("wb-task-options-extra")
        self.count_box = _html("wb-param-count")
        self.widget = widgets.VBox([])
        self.widget.add_class("wb-task-options")
        self.parameters: int | None = None
        self.model_name = ""
        """A transformers model's class (and '+ LoRA'), shown beside the count."""
        """The last parameter count; None when the options don't form a model (count_box says
        why)."""
        self.problem = ""
        """Why there is no count, in words; '' when there is one."""
        self.controls: dict[str, widgets.ValueWidget] = {}
        """The option's control by option name, in the task's order."""
        self._callbacks: list[Callable[[dict[str, Any]], None]] = []
        self._disabled = False
        self.set(task, options)

    def set(self, task: Task | None, options: Mapping[str, Any] | None = None) -> None:
        """Show `task`'s options set to `options` (a RunConfig's task_options; the rest at their
        defaults). Keys the task doesn't take stay in values(), so the task's check refuses them by
        name rather than the panel dropping them; None for a task shows no controls and keeps
        `options` as they are."""
        options = dict(options or {})
        for old in self.controls.values():
            # a stale reference edited later must not count
            old.unobserve(self._on_edit, names="value")
        self.task = task
        self.specs = task.declared_options() if task is not None else {}
        self._extra = {k: v for k, v in options.items() if k not in self.specs}
        self.controls = {
            name: make_control(spec, options.get(name, spec.default))
            for name, spec in self.specs.items()
        }
        for control in self.controls.values():
            control.disabled = self._disabled
            control.observe(self._on_edit, names="value")
        name = html.escape(task.name) if task is not None else "?"
        self.title.value = (
            f"<b>task options</b> <small>({name})</small>"
            if self.specs
            else f"<small>task {name} takes no options</small>"
            if task is not None
            else ""
        )
        self.extra_box.value = (
            ""
            if task is None or not self._extra
            else "<small style='color:#b00020'>not options of this task: "
            f"{html.escape(', '.join(map(repr, self._extra)))}</small>"
        )
        self.widget.children = [self.title, *self.controls.values(), self.extra_box, self.count_box]
        self._refresh()

    def values(self) -> dict[str, Any]:
        """task_options as the controls stand: the options that differ from their defaults, and any
        keys the task doesn't take."""
        out = {}
        for name, control in self.controls.items():
            value = read_control(self.specs[name], control)
            if not _same(value, self.specs[name].default):
                out[name] = value
        return {**out, **self._extra}

    def on_change(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """Call `callback(values())` after each edit of a control (not when set() fills them)."""
        self._callbacks.append(callback)

    @property
    def disabled(self) -> bool:
        """All controls disabled (while a run goes), kept across set()."""
        return self._disabled

    @disabled.setter
    def disabled(self, value: bool) -> None:
        self._disabled = bool(value)
        for control in self.controls.values():
            control.disabled = self._disabled

    def _on_edit(self, change: Any) -> None:
        self._refresh()
        values = self.values()
        for callback in list(self._callbacks):
            callback(values)

    def _refresh(self) -> None:
        """Placeholders from what blank stands for now (the preset's sizes), and the parameter
        count."""
        if self.task is None:
            self.parameters, self.problem, self.count_box.value = None, "", ""
            return
        try:
            cfg = RunConfig(task=self.task.name, task_options=self.values())
            self._placeholders(cfg)
            self.model_name, self.parameters, trained = model_facts(self.task, cfg)
            self.problem = ""
        except ValueError as e:
            self.parameters, self.problem = None, str(e)
        except Exception as e:  # noqa: BLE001
            # a user's build_model: said in words, never a traceback here
            self.parameters = None
            self.problem = f"the model can't be built on the meta device ({type(e).__name__}: {e})"
        if self.parameters is not None:
            named = f"{html.escape(self.model_name)}, " if self.model_name else ""
            frozen = (
                f" ({count_text(trained).replace(' parameters', '')} trained)"
                if trained < self.parameters
                else ""
            )
            self.count_box.value = (
                f"<span title='{self.parameters:,} parameters'>model: {named}"
                f"<b>{count_text(self.parameters)}</b>{frozen}</span>"
            )
        else:
            self.count_box.value = (
                "<small style='color:#b00020'>no parameter count: "
                f"{html.escape(self.problem)}</small>"
            )

    def _placeholders(self, cfg: RunConfig) -> None:
        assert self.task is not None
        try:
            resolved = self.task.resolved_options(cfg)
        except Exception:  # noqa: BLE001
            # options that don't resolve, e.g. a preset that doesn't exist
            resolved = {}
        for name, control in self.controls.items():
            spec = self.specs[name]
            if spec.unset and isinstance(control, widgets.Text):
                shown = resolved.get(name)
                control.placeholder = spec.unset if shown is None else f"{spec.unset}: {shown}"


def _html(css_class: str) -> widgets.HTML:
    box = widgets.HTML()
    box.add_class(css_class)
    return box
