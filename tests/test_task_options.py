"""Task options declared with types and ranges (TaskOption): checked by name before anything runs, inferred for
tasks that set only default_options, and shown in the panel's TaskControls with the model's parameter count."""

from __future__ import annotations

from typing import Any, ClassVar

import ipywidgets as widgets
import pytest
import torch
from collected_ids import cases

import workbench as wb
from workbench.config.preflight import preflight
from workbench.notebook.panel.task_controls import TaskControls, count_text, param_count
from workbench.tasks import Task, TaskOption, get_task
from workbench.tasks.char_gpt import CharGPTTask


def check(task: str, options: dict[str, Any]) -> None:
    get_task(task).check_options(wb.RunConfig(task=task, task_options=options))


def cpu_count(task: Task, options: dict[str, Any]) -> int:
    """The parameter count of the model really built, on the CPU: what the meta-device count must equal."""
    model = task.build_model(wb.RunConfig(task=task.name, task_options=options))
    return sum(p.numel() for p in model.parameters())


# ---- declarations validate -----------------------------------------------------------------------
BAD = [
    (
        "char-gpt",
        {"n_layer": 0},
        r"^task_options\.n_layer=0: must be an integer from 1 to 96, or None \(null in YAML\) for the preset's value$",
    ),
    ("char-gpt", {"n_layer": "4"}, r"^task_options\.n_layer='4': must be an integer from 1 to 96"),
    ("char-gpt", {"n_layer": 4.0}, r"^task_options\.n_layer=4\.0: must be an integer from 1 to 96"),
    ("char-gpt", {"n_head": True}, r"^task_options\.n_head=True: must be an integer from 1 to 128"),
    (
        "char-gpt",
        {"block_size": 40000},
        r"^task_options\.block_size=40000: must be an integer from 1 to 32768",
    ),
    (
        "char-gpt",
        {"preset": "smal"},
        r"^task_options\.preset='smal': choose one of 'tiny' \| 'small' \| 'gpt2-small' \(did you mean 'small'\?\)$",
    ),
    (
        "char-gpt",
        {"preset": None},
        r"^task_options\.preset=None: choose one of 'tiny' \| 'small' \| 'gpt2-small'$",
    ),
    ("char-gpt", {"dropout": 1.0}, r"^task_options\.dropout=1\.0: must be a number >= 0 and < 1$"),
    (
        "char-gpt",
        {"dropout": float("nan")},
        r"^task_options\.dropout=nan: must be a number >= 0 and < 1$",
    ),
    (
        "char-gpt",
        {"eval_fraction": 0},
        r"^task_options\.eval_fraction=0: must be a number > 0 and < 1$",
    ),
    ("char-gpt", {"bias": 1}, r"^task_options\.bias=1: must be true or false$"),
    ("char-gpt", {"train_stride": 0}, r"^task_options\.train_stride=0: must be an integer >= 1$"),
    ("char-gpt", {"dataset": 3}, r"^task_options\.dataset=3: must be a string$"),
    ("digits", {"hidden": 0}, r"^task_options\.hidden=0: must be an integer from 1 to 65536$"),
    ("digits", {"dropout": -0.1}, r"^task_options\.dropout=-0\.1: must be a number >= 0 and < 1$"),
    (
        "digits",
        {"eval_fraction": 1},
        r"^task_options\.eval_fraction=1: must be a number > 0 and < 1$",
    ),
    # cross-field checks stay in the task and run after the declarations
    (
        "char-gpt",
        {"n_embd": 100, "n_head": 3},
        r"^task_options\.n_embd=100 is not divisible by n_head=3; use a",
    ),
    (
        "digits",
        {"hiden": 3},
        r"^task_options: unknown key\(s\) \['hiden'\] for task 'digits'.*did you mean 'hidden'",
    ),
]


@pytest.mark.parametrize("task,options,message", BAD, ids=[f"{t}-{o}" for t, o, _ in BAD])
def test_values_outside_the_declaration_are_refused_by_name(
    task: str, options: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check(task, options)


@pytest.mark.parametrize(
    "task,options",
    cases(
        [
            ("char-gpt", {"n_layer": None, "preset": "small"}),
            # an int is a fine float
            ("char-gpt", {"dropout": 0, "n_layer": 96, "bias": True, "eval_fraction": 0.5}),
            ("digits", {"hidden": 1, "dropout": 0.0, "eval_fraction": 0.01}),
        ],
        key=1,
    ),
)
def test_values_inside_the_declaration_pass(task: str, options: dict) -> None:
    check(task, options)  # raises ValueError for a value outside its declaration
    used = get_task(task).options(wb.RunConfig(task=task, task_options=options))
    assert {key: used[key] for key in options} == options, "kept as given, not dropped or coerced"


def test_the_declaration_is_checked_before_launch() -> None:
    with pytest.raises(
        ValueError, match=r"^task_options\.n_layer=0: must be an integer from 1 to 96"
    ):
        preflight(wb.RunConfig(task="char-gpt", task_options={"n_layer": 0}))


def test_builtin_tasks_declare_their_options_and_derive_default_options() -> None:
    specs = CharGPTTask().declared_options()
    assert list(specs) == [
        "preset",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
        "dropout",
        "bias",
        "dataset",
        "eval_fraction",
        "train_stride",
    ]
    assert all(spec.help and not spec.inferred for spec in specs.values())
    assert CharGPTTask.default_options == {
        "preset": "tiny",
        "n_layer": None,
        "n_head": None,
        "n_embd": None,
        "block_size": None,
        "dropout": 0.0,
        "bias": False,
        "dataset": "tinyshakespeare",
        "eval_fraction": 0.1,
        "train_stride": 1,
    }
    assert get_task("digits").default_options == {
        "hidden": 128,
        "dropout": 0.1,
        "eval_fraction": 0.2,
    }
    # the help says how an explicit size meets the preset: it overrides that one value of any preset
    assert (
        "override" in specs["preset"].help
        and "tiny 2, small 6, gpt2-small 12" in specs["n_layer"].help
    )


def test_an_explicit_size_overrides_that_value_of_the_preset_alone() -> None:
    task = CharGPTTask()
    sizes = task.model_options(
        wb.RunConfig(task="char-gpt", task_options={"preset": "small", "n_layer": 2})
    )
    assert (sizes["n_layer"], sizes["n_head"], sizes["n_embd"], sizes["block_size"]) == (
        2,
        6,
        384,
        256,
    )


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: TaskOption("n", int, 0, min=1),
            r"^TaskOption 'n': its default 0 must be an integer >= 1; declare",
        ),
        (
            lambda: TaskOption("mode", str, "c", choices=("a", "b")),
            r"^TaskOption 'mode': its default 'c' choose one of",
        ),
        (
            lambda: TaskOption("n", list, []),
            r"^TaskOption 'n': type=<class 'list'>; use one of int, float, str, bool",
        ),
        (
            lambda: TaskOption("s", str, "a", min=1),
            r"^TaskOption 's': min/max apply to int and float options, not str",
        ),
        (
            lambda: TaskOption("n", int, 1, min=5, max=2),
            r"^TaskOption 'n': min=5 is more than max=2",
        ),
        (
            lambda: TaskOption("n", int, 1, choices=("1",)),
            r"^TaskOption 'n': choices are for str options",
        ),
        (
            lambda: TaskOption("n-layers", int, 1),
            r"^TaskOption name='n-layers': must be a Python identifier",
        ),
    ],
    ids=[
        "default-below-min",
        "default-not-a-choice",
        "list-type",
        "min-on-str",
        "min-above-max",
        "choices-on-int",
        "name-not-identifier",
    ],
)
def test_a_declaration_that_contradicts_itself_is_refused(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_task_declaring_an_option_twice_is_refused_where_it_is_written() -> None:
    with pytest.raises(
        ValueError, match=r"^Twice\.option_specs: \['n'\] declared more than once; keep one of each"
    ):
        type("Twice", (Task,), {"option_specs": (TaskOption("n", int, 1), TaskOption("n", int, 2))})


# ---- tasks written against the old API -----------------------------------------------------------
class OldStyle(Task):
    """A user task from before TaskOption: only default_options."""

    name = "old-style"
    default_options: ClassVar[dict[str, Any]] = {
        "width": 8,
        "scale": 0.5,
        "tag": None,
        "label": "a",
        "flag": False,
    }

    def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
        return torch.nn.Linear(4, self.options(cfg)["width"])


def test_old_style_tasks_get_options_inferred_from_their_defaults() -> None:
    specs = OldStyle().declared_options()
    assert {n: (s.type, s.default, s.min, s.max, s.inferred) for n, s in specs.items()} == {
        "width": (int, 8, None, None, True),
        "scale": (float, 0.5, None, None, True),
        "tag": (object, None, None, None, True),
        "label": (str, "a", None, None, True),
        "flag": (bool, False, None, None, True),
    }
    assert OldStyle.default_options == {
        "width": 8,
        "scale": 0.5,
        "tag": None,
        "label": "a",
        "flag": False,
    }
    task, run = OldStyle(), lambda options: wb.RunConfig(task="old-style", task_options=options)
    task.check_options(
        run({"width": 100_000, "scale": 2, "tag": [1, 2], "label": "b", "flag": True})
    )
    assert task.options(run({"width": 3}))["width"] == 3
    with pytest.raises(
        ValueError, match=r"^task_options\.width=1\.5: must be an integer, like its default 8$"
    ):
        task.check_options(run({"width": 1.5}))
    with pytest.raises(
        ValueError, match=r"^task_options: unknown key\(s\) \['widht'\] for task 'old-style'"
    ):
        task.check_options(run({"widht": 3}))


def test_subclasses_extend_and_override_declared_options_through_default_options() -> None:
    class Wider(CharGPTTask):
        default_options: ClassVar[dict[str, Any]] = {
            **CharGPTTask.default_options,
            "preset": "small",
            "extra": 3,
        }

    specs = Wider().declared_options()
    assert specs["preset"].default == "small" and specs["preset"].choices == (
        "tiny",
        "small",
        "gpt2-small",
    )
    assert specs["extra"].inferred and specs["extra"].type is int
    with pytest.raises(
        ValueError, match=r"^TaskOption 'preset': its default 'huge' choose one of 'tiny'"
    ):
        type(
            "Huge",
            (CharGPTTask,),
            {"default_options": {**CharGPTTask.default_options, "preset": "huge"}},
        )

    class MoreSpecs(OldStyle):
        option_specs = (TaskOption("depth", int, 2, "layers", min=1),)

    # the parent's keys stay
    assert MoreSpecs.default_options == {**OldStyle.default_options, "depth": 2}
    with pytest.raises(ValueError, match=r"^task_options\.depth=0: must be an integer >= 1$"):
        MoreSpecs().check_options(wb.RunConfig(task="x", task_options={"depth": 0}))


# ---- the panel's controls ------------------------------------------------------------------------
def test_task_controls_build_one_control_per_char_gpt_option() -> None:
    task = CharGPTTask()
    controls = TaskControls(task)
    c = controls.controls
    assert list(c) == list(task.declared_options())
    assert (
        type(c["preset"]),
        type(c["n_layer"]),
        type(c["dropout"]),
        type(c["bias"]),
        type(c["train_stride"]),
    ) == (widgets.Dropdown, widgets.Text, widgets.FloatText, widgets.Checkbox, widgets.IntText)
    assert [value for _, value in c["preset"].options] == ["tiny", "small", "gpt2-small"]
    assert c["preset"].value == "tiny"
    assert c["n_layer"].value == "" and c["n_layer"].placeholder == "the preset's value: 2"
    assert (
        c["n_layer"].tooltip.startswith("transformer blocks")
        and "an integer from 1 to 96" in c["n_layer"].tooltip
    )
    assert list(controls.widget.children[1:-2]) == list(c.values())
    assert controls.values() == {}
    assert controls.parameters == cpu_count(task, {}) == 106_880
    assert "107 k parameters" in controls.count_box.value


def test_changing_n_layer_changes_values_and_the_parameter_count() -> None:
    task = CharGPTTask()
    controls, heard = TaskControls(task, {"preset": "tiny", "dropout": 0.0}), []
    controls.on_change(heard.append)
    assert controls.values() == {}  # defaults are left out, so a saved YAML stays minimal
    before = controls.parameters
    controls.controls["n_layer"].value = "4"
    assert controls.values() == {"n_layer": 4} and heard == [{"n_layer": 4}]
    assert controls.parameters == cpu_count(task, {"n_layer": 4}) != before
    controls.controls["preset"].value = "small"
    assert controls.values() == {"preset": "small", "n_layer": 4}
    assert controls.controls["n_head"].placeholder == "the preset's value: 6"
    assert controls.parameters == cpu_count(task, {"preset": "small", "n_layer": 4})
    controls.controls["n_layer"].value = ""  # blank again: the preset's 6
    assert controls.values() == {"preset": "small"} and controls.parameters == cpu_count(
        task, {"preset": "small"}
    )


def test_a_choice_from_a_yaml_file_that_is_not_allowed_is_shown_as_such() -> None:
    controls = TaskControls(CharGPTTask(), {"preset": "huge"})
    assert controls.controls["preset"].label == "'huge' (not allowed)" and controls.values() == {
        "preset": "huge"
    }
    assert controls.problem.startswith(
        "task_options.preset='huge': choose one of 'tiny' | 'small' | 'gpt2-small'"
    )
    controls.controls["preset"].value = "small"
    assert controls.values() == {"preset": "small"} and controls.parameters is not None


def test_options_that_form_no_model_show_why_instead_of_a_count() -> None:
    controls = TaskControls(CharGPTTask())
    controls.controls["n_head"].value = "3"
    assert controls.parameters is None and controls.values() == {"n_head": 3}
    assert controls.problem.startswith("task_options.n_embd=64 is not divisible by n_head=3")
    assert "no parameter count: task_options.n_embd=64 is not divisible" in controls.count_box.value
    controls.controls["n_head"].value = "many"
    assert controls.values() == {"n_head": "many"}  # kept as typed, for the check to name it
    assert controls.problem.startswith(
        "task_options.n_head='many': must be an integer from 1 to 128"
    )


def test_switching_task_rebuilds_the_controls() -> None:
    controls, heard = TaskControls(CharGPTTask(), {"n_layer": 3}), []
    controls.on_change(heard.append)
    old_n_layer = controls.controls["n_layer"]
    controls.set(get_task("digits"), {"hidden": 32})
    assert list(controls.controls) == ["hidden", "dropout", "eval_fraction"]
    assert (
        isinstance(controls.controls["hidden"], widgets.IntText)
        and controls.controls["hidden"].value == 32
    )
    assert controls.values() == {"hidden": 32} and heard == []  # set() fills, it is no edit
    assert controls.parameters == (64 * 32 + 32) + (32 * 32 + 32) + (32 * 10 + 10)
    assert "digits" in controls.title.value and old_n_layer not in controls.widget.children
    old_n_layer.value = "5"  # the old task's control no longer speaks for the options
    assert heard == [] and controls.values() == {"hidden": 32}
    controls.controls["dropout"].value = 0.3
    assert heard == [{"hidden": 32, "dropout": 0.3}]


def test_keys_the_task_does_not_take_are_kept_and_named() -> None:
    controls = TaskControls(get_task("digits"), {"hiden": 64})
    # the panel's check refuses it by name rather than dropping it
    assert controls.values() == {"hiden": 64}
    assert "not options of this task: &#x27;hiden&#x27;" in controls.extra_box.value
    assert controls.parameters is None and "unknown key(s) ['hiden']" in controls.problem


def test_old_style_task_controls_and_a_failing_build() -> None:
    controls = TaskControls(OldStyle(), {"tag": [1, 2]})
    c = controls.controls
    assert (
        type(c["width"]),
        type(c["scale"]),
        type(c["tag"]),
        type(c["label"]),
        type(c["flag"]),
    ) == (widgets.IntText, widgets.FloatText, widgets.Text, widgets.Text, widgets.Checkbox)
    assert c["tag"].value == "[1, 2]" and controls.values() == {"tag": [1, 2]}
    assert controls.parameters == 4 * 8 + 8
    c["tag"].value = ""
    assert controls.values() == {}

    class Broken(OldStyle):
        def build_model(self, cfg: wb.RunConfig) -> torch.nn.Module:
            raise RuntimeError("no weights file")

    controls.set(Broken())
    assert controls.parameters is None
    assert (
        controls.problem
        == "the model can't be built on the meta device (RuntimeError: no weights file)"
    )


def test_disabled_holds_across_set() -> None:
    controls = TaskControls(CharGPTTask())
    controls.disabled = True
    controls.set(get_task("digits"))
    assert all(control.disabled for control in controls.controls.values())
    controls.disabled = False
    assert not any(control.disabled for control in controls.controls.values())


def test_param_count_builds_on_the_meta_device() -> None:
    task, built = CharGPTTask(), []
    build = task.build_model
    task.build_model = lambda cfg: built.append(build(cfg)) or built[-1]  # type: ignore[method-assign]
    n = param_count(task, wb.RunConfig(task="char-gpt", task_options={"preset": "gpt2-small"}))
    # GPT-2 small's blocks, a char vocabulary, the head tied to the token embedding
    assert n == 85_790_208
    assert {p.device.type for p in built[0].parameters()} == {"meta"}


def test_a_count_on_the_meta_device_leaves_the_text_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The count is often the first to read char-gpt's text in a kernel, under torch.device('meta'); the text
    read then is kept for the process, and a copy on meta broke every later trace and launch (an estimate of
    tp x pp: 'found at least two devices, cpu and meta')."""
    from workbench.tasks import char_gpt

    monkeypatch.setattr(char_gpt, "_LAST", None)  # as in a fresh kernel
    cfg = wb.RunConfig(task="char-gpt")
    param_count(CharGPTTask(), cfg)
    train, _ = CharGPTTask().build_datasets(cfg)
    x, y = train[0]
    assert (
        x.device.type == "cpu"
        and y.device.type == "cpu"
        and int(x.max()) < len(CharGPTTask().vocab(cfg))
    )


@pytest.mark.parametrize(
    "n,text",
    [
        (1_234_567, "1.23 M parameters"),
        (999_999, "1 M parameters"),
        (26_122, "26.1 k parameters"),
        (840, "840 parameters"),
        (1, "1 parameter"),
        (7_100_000_000, "7.1 B parameters"),
    ],
)
def test_count_text(n: int, text: str) -> None:
    assert count_text(n) == text
