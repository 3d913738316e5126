"""A misspelt RunConfig field gets a did-you-mean wherever it is typed (Python keywords,
cfg.replace, a YAML file, --set on the command line), and RunConfig's errors come with a traceback
whose first frame below the caller is one short line, not the generated __init__ with its 60
parameters."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

import workbench as wb
from workbench.cli import main
from workbench.config.config_files import UnknownFieldError


def test_a_misspelt_keyword_is_a_type_error_with_did_you_mean() -> None:
    # the probe of issue 47
    with pytest.raises(
        TypeError, match=r"^RunConfig has no field 'num_proceses'; did you mean 'num_processes'\?$"
    ) as caught:
        wb.RunConfig(num_proceses=2)
    # and a ValueError, as the config errors of files and the CLI are
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, UnknownFieldError)


def test_replace_names_the_misspelt_field_and_the_right_one() -> None:
    with pytest.raises(
        TypeError,
        match=r"^RunConfig.replace\(\): RunConfig has no field 'num_proceses'; did you mean "
        r"'num_processes'\?$",
    ):
        wb.RunConfig().replace(num_proceses=2)


def test_a_yaml_file_with_a_misspelt_key_says_did_you_mean(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("task: digits\nnum_proceses: 2\n")
    with pytest.raises(
        ValueError,
        match=r"run.yaml: RunConfig has no field 'num_proceses'; did you mean 'num_processes'\?$",
    ):
        wb.RunConfig.from_yaml(path)


def test_set_on_the_command_line_says_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 5\n")
    assert main(["check", str(path), "--set", "num_proceses=2"]) == 2
    err = capsys.readouterr().err
    assert (
        "error: --set: RunConfig has no field 'num_proceses'; did you mean 'num_processes'?" in err
    )


def test_every_unknown_name_is_listed_at_once_with_the_fields_when_one_has_no_match() -> None:
    with pytest.raises(
        TypeError,
        match=r"^RunConfig has no fields 'max_step' \(did you mean 'max_steps'\?\), "
        r"'learning_rate' \(did you mean 'lr'\?\), 'colour'; its fields: task, num_processes, ",
    ):
        wb.RunConfig(max_step=10, learning_rate=0.1, colour="red")


def test_positional_arguments_are_refused_with_the_keyword_form() -> None:
    with pytest.raises(TypeError, match=r"keyword arguments only, got 1 positional: write Run"):
        wb.RunConfig("digits")  # type: ignore[misc]


def _frames_below_caller(error: BaseException) -> list[traceback.FrameSummary]:
    return traceback.extract_tb(error.__traceback__)[1:]  # [0] is this test's frame


def test_a_value_error_has_one_short_frame_below_the_caller() -> None:
    with pytest.raises(ValueError, match=r"^num_processes=0: must be at least 1$") as caught:
        wb.RunConfig(num_processes=0)
    frames = _frames_below_caller(caught.value)
    # not the generated __init__ (file '<string>'), __post_init__ and the checks: one frame
    assert [(Path(f.filename).name, f.name) for f in frames] == [("run_config.py", "__init__")]
    text = "".join(traceback.format_exception(caught.value))
    assert "parallelism, dp_shard" not in text
    assert "num_processes=0: must be at least 1" in text


def test_replace_and_yaml_errors_have_no_generated_init_frame(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^max_steps=0: must be at least 1$") as caught:
        wb.RunConfig().replace(max_steps=0)
    assert [f.name for f in _frames_below_caller(caught.value)] == ["replace"]
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 0\n")
    with pytest.raises(ValueError, match=r"^max_steps=0: must be at least 1$") as caught:
        wb.RunConfig.from_yaml(path)
    names = [f.filename for f in _frames_below_caller(caught.value)]
    assert "<string>" not in names and not any(n.endswith("checks.py") for n in names), names


def test_jupyter_traceback_does_not_show_the_sixty_parameters() -> None:
    # what a notebook shows: IPython heads each frame with the function's parameter list
    ultratb = pytest.importorskip("IPython.core.ultratb")
    with pytest.raises(ValueError, match="must be at least 1") as caught:
        wb.RunConfig(num_processes=0)
    formatter = ultratb.AutoFormattedTB(mode="Context", color_scheme="NoColor")
    text = "\n".join(
        formatter.structured_traceback(type(caught.value), caught.value, caught.value.__traceback__)
    )
    assert "in __init__(self, *args, **values)" in text
    assert "task, num_processes, parallelism" not in text
    assert "num_processes=0: must be at least 1" in text
