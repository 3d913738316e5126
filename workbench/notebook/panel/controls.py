"""The panel's controls: one widget per RunConfig field the panel edits, and their labels."""

from __future__ import annotations

import html
import re
from typing import Any, get_args

import ipywidgets as widgets

from workbench.config import PARALLELISM_MODES, ActivationCheckpointing, Parallelism
from workbench.config.precision import NOT_TRAINED_YET, Precision
from workbench.tasks import Task, available
from workbench.utils.hardware import Hardware, detect

PARALLELISM_LABELS = {
    "none": "none (one process)",
    "ddp": "ddp (replicas)",
    "zero1": "zero1 (optimizer sharded)",
    "zero2": "zero2 (grads + optimizer sharded)",
    "zero3": "zero3 (all sharded, FSDP2)",
    "fsdp": "fsdp (= zero3)",
    "hsdp": "hsdp (shard groups, replicated)",
}
"""Every mode with a few words that fit the dropdown; the full line (PARALLELISM_MODES) shows below
it."""
assert set(PARALLELISM_LABELS) == set(PARALLELISM_MODES)

STYLE = {"description_width": "140px"}


def short_reason(precision: str, problem: str) -> str:
    """'fp16 needs a CUDA GPU: on CPU, ...' -> 'needs a CUDA GPU': short enough for a dropdown
    label."""
    reason = problem.removeprefix(f"{precision} ")
    return re.split(r"[:;]", reason, maxsplit=1)[0].strip()


def precision_options(
    device: str, hw: Hardware | None = None, shown: str | None = None
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(label, value) pairs for the precision dropdown, and the full reason for each precision
    unavailable on `hw` (default: this machine; a planned target's hardware otherwise). A precision
    workbench doesn't train yet is offered only as `shown`, the config's own value. The labels stay
    short ('fp16 (unavailable)'): a dropdown clips longer ones, and can't give an option a tooltip;
    the reasons go to the dropdown's tooltip and the note under it (`precision_note_html`)."""
    hw = hw or detect()
    options, reasons = [], {}
    for precision in get_args(Precision):
        if precision in NOT_TRAINED_YET and precision != shown:
            continue
        problem = hw.precision_problem(precision, device)
        if problem:
            reasons[precision] = problem
            options.append((f"{precision} (unavailable)", precision))
        else:
            options.append((precision, precision))
    return options, reasons


def precision_tooltip(reasons: dict[str, str]) -> str | None:
    """Each unavailable precision's full reason, a line each: the dropdown's tooltip where a
    frontend shows one (JupyterLab shows none on a Dropdown with a description), and the tooltip of
    the note under it, which every frontend shows."""
    return "\n".join(reasons.values()) or None


def precision_note_html(reasons: dict[str, str]) -> str:
    """The line under the precision dropdown: why each unavailable precision is, in a few words
    (the full reason in its tooltip); '' when all are available."""
    if not reasons:
        return ""
    short = "; ".join(f"{p}: {short_reason(p, problem)}" for p, problem in reasons.items())
    return (
        f"<small title='{html.escape(precision_tooltip(reasons) or '')}' "
        "style='color:#666;margin-left:144px;display:block;max-width:236px;line-height:1.35'>"
        f"unavailable here: {html.escape(short)}</small>"
    )


def _wide() -> widgets.Layout:
    # one Layout per control: a shared one would hide every control when one of them is hidden
    return widgets.Layout(width="380px")


def build_controls(
    device: str, task_options: list[tuple[str, str]]
) -> tuple[dict[str, widgets.ValueWidget], dict[str, str]]:
    """The controls, keyed by RunConfig field, and the reasons unavailable precisions are
    unavailable."""
    precisions, reasons = precision_options(device)
    controls: dict[str, Any] = {
        "task": widgets.Dropdown(
            options=task_options, description="task", style=STYLE, layout=_wide()
        ),
        **_world_controls(),
        **_split_controls(),
        **_step_controls(precisions, reasons),
        **_length_controls(),
    }
    for name, control in controls.items():
        control.add_class(f"wb-{name.replace('_', '-')}")
    return controls, reasons


def _world_controls() -> dict[str, Any]:
    """The processes and how they share the model: the parallelism mode and hsdp's shard group."""
    return {
        # Plain number boxes, no bounds: a bounded widget clamps what the user typed without a word;
        # here RunConfig refuses it and the panel says why (num_processes=3: this machine has 2 CPU
        # cores...).
        "num_processes": widgets.IntText(
            description="processes", style=STYLE, layout=widgets.Layout(width="220px")
        ),
        "oversubscribe": widgets.Checkbox(
            description="let ranks share cores",
            indent=False,
            tooltip="more processes than cores: each rank runs slower",
            layout=widgets.Layout(margin="0 0 0 144px", width="auto"),
        ),
        "parallelism": widgets.Dropdown(
            options=[(PARALLELISM_LABELS.get(p, p), p) for p in get_args(Parallelism)],
            description="parallelism",
            style=STYLE,
            layout=_wide(),
        ),
        "dp_shard": widgets.IntText(
            description="hsdp shard group",
            style=STYLE,
            layout=_wide(),
            tooltip="hsdp only: ranks that shard one copy of the model",
        ),
    }


def _split_controls() -> dict[str, Any]:
    """The ranks that split the model: tensor, context and pipeline parallel, and the pipeline's
    schedule."""
    return {
        "tp": widgets.IntText(
            description="tensor parallel",
            style=STYLE,
            layout=_wide(),
            tooltip="ranks that split each matrix of the task's plan (1: off)",
        ),
        "cp": widgets.IntText(
            description="context parallel",
            style=STYLE,
            layout=_wide(),
            tooltip="ranks that split each sequence, ring attention (CUDA only; 1: off)",
        ),
        "pp": widgets.IntText(
            description="pipeline stages",
            style=STYLE,
            layout=_wide(),
            tooltip="ranks that each run a slice of the model's blocks (1: off)",
        ),
        "pp_schedule": widgets.Dropdown(
            options=[
                ("1F1B", "1f1b"),
                ("GPipe", "gpipe"),
                ("interleaved 1F1B", "interleaved_1f1b"),
                ("zero bubble", "zero_bubble"),
            ],
            description="pipeline schedule",
            style=STYLE,
            layout=_wide(),
            tooltip="1F1B needs grad accumulation >= stages; the interleaved ones run "
            "several model chunks per rank (a smaller bubble)",
        ),
        "pp_virtual_stages": widgets.IntText(
            description="chunks per rank",
            style=STYLE,
            layout=_wide(),
            tooltip="virtual stages of the interleaved schedules (0: 2)",
        ),
    }


def _step_controls(precisions: list[tuple[str, str]], reasons: dict[str, str]) -> dict[str, Any]:
    """How a step runs: activation checkpointing, torch.compile, precision."""
    return {
        "activation_checkpointing": widgets.Dropdown(
            options=list(get_args(ActivationCheckpointing)),
            description="activation ckpt",
            style=STYLE,
            layout=_wide(),
        ),
        "compile": widgets.Dropdown(
            options=[
                ("off (eager)", "off"),
                ("each block", "blocks"),
                ("the whole model", "model"),
            ],
            description="torch.compile",
            style=STYLE,
            layout=_wide(),
            tooltip="the first steps compile (cached for later launches); pays on long "
            "runs, see the docs' Compile guide",
        ),
        "precision": widgets.Dropdown(
            options=precisions,
            description="precision",
            style=STYLE,
            layout=_wide(),
            tooltip=precision_tooltip(reasons),
        ),
    }


def _length_controls() -> dict[str, Any]:
    """The batch, how long the run trains and how fast it learns, and its name."""
    return {
        # Text, not a number box: 'auto' (the largest that fits, chosen by the ranks) is a value
        # too.
        "micro_batch_size": widgets.Combobox(
            options=["auto"],
            ensure_option=False,
            placeholder="a number, or auto",
            description="micro-batch size",
            style=STYLE,
            layout=_wide(),
        ),
        "grad_accum_steps": widgets.IntText(
            description="grad accumulation", style=STYLE, layout=_wide()
        ),
        "max_steps": widgets.IntText(description="steps", style=STYLE, layout=_wide()),
        "lr": widgets.FloatText(description="learning rate", style=STYLE, layout=_wide()),
        "run_name": widgets.Text(
            description="run name",
            placeholder="automatic: <task>-<time>",
            style=STYLE,
            layout=_wide(),
        ),
    }


def task_options(user_task: Task | None, selected: str) -> list[tuple[str, str]]:
    """(label, name) pairs for the task dropdown: the user's own task first, then the registry's."""
    options = [(name, name) for name in available() if not (user_task and name == user_task.name)]
    if user_task is not None:
        options.insert(0, (f"{user_task.name} (your task)", user_task.name))
    if selected not in [value for _, value in options]:
        options.append((selected, selected))  # an import path 'module:Class' from a YAML file
    return options


def read_micro_batch(text: str) -> int | str:
    """The micro-batch box's text as RunConfig takes it: a whole number, or the text itself ('auto',
    or what RunConfig will refuse by name)."""
    text = str(text).strip()
    return int(text) if text.lstrip("+-").isdigit() else text
