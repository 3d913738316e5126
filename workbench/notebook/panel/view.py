"""The panel's lines about the settings and the run (global batch, how Launch starts it, the
problem, status and error): HTML derived from the state alone; and saving the settings as YAML."""

from __future__ import annotations

import html
from pathlib import Path

from workbench.config import RunConfig
from workbench.launcher.processes import describe_launch
from workbench.notebook.panel.state import ACTIVE, PanelState
from workbench.rundir import Status


def batch_html(cfg: RunConfig | None) -> str:
    """The global batch, named by what multiplies it: data-parallel ranks, not processes (tp, cp and
    pp ranks share their samples)."""
    if cfg is None:
        return "global batch: –"
    dims = cfg.dims
    ranks = f"{dims.dp} data-parallel rank" + "s" * (dims.dp > 1)
    split = [
        f"tp {dims.tp}" * (dims.tp > 1),
        f"cp {dims.cp}" * (dims.cp > 1),
        f"pp {dims.pp}" * (dims.pp > 1),
    ]
    shared = (
        f" ({cfg.num_processes} processes: each data-parallel rank spans "
        f"{' × '.join(filter(None, split))})"
        if any(split)
        else ""
    )
    total = cfg.global_batch_size or "chosen at launch"
    return (
        f"global batch <b>{total}</b> = {cfg.micro_batch_size} micro-batch × "
        f"{cfg.grad_accum_steps} accumulation × {ranks}{html.escape(shared)}"
    )


def blocked_reason(s: PanelState) -> str:
    """Why Launch is off while the panel is ready ('' when it can launch)."""
    target = s.target
    if s.config is None:
        return s.problem or "the settings don't form a run"
    if s.problem:
        return s.problem
    if not target.launchable:
        return (
            f"planned for {target.describe(s.config)}, not this machine: set the target to 'this "
            "machine' to launch here, or Save as YAML and run `workbench train` where that "
            "hardware is"
        )
    return ""


def status_html(s: PanelState, *, blocked: str = "") -> str:
    name = html.escape(s.run_name)
    resume = "Resume continues it from its last checkpoint, " if s.resumable else ""
    first = blocked.splitlines()[0] if blocked else ""
    text = {
        "ready": (
            f"not launchable: {html.escape(first)}"
            if blocked
            else "ready: pick the settings, then Launch"
        ),
        "launching": "launching…",
        "resuming": f"resuming <b>{name}</b> from its last checkpoint…",
        Status.RUNNING: (
            f"pending <b>{name}</b>: {html.escape(s.job)}; Stop cancels the job"
            if " PENDING" in s.job
            else f"running <b>{name}</b>{' as ' + html.escape(s.job) if s.job else ''}: Stop makes "
            "the ranks save a checkpoint and exit"
        ),
        "stopping": f"stopping <b>{name}</b>: the ranks finish a step, save a checkpoint and exit…",
        Status.COMPLETED: f"completed <b>{name}</b>; change the settings and Launch again to "
        "compare, or raise the steps and Resume",
        Status.STOPPED: f"stopped <b>{name}</b> (checkpoint saved); {resume}Launch starts a new "
        "run",
        Status.PREEMPTED: f"preempted <b>{name}</b> (a signal; checkpoint saved); {resume}Launch "
        "starts a new run",
        Status.DIVERGED: f"diverged <b>{name}</b>: the loss became NaN/inf; the error says where. "
        f"{resume}(lower the learning rate first)",
        Status.FAILED: f"failed: the error is below; {resume}or fix it and Launch again",
    }.get(s.status, html.escape(s.status))
    note = f"<br><small>{html.escape(s.message)}</small>" if s.message else ""
    if blocked and s.status != "ready" and s.status not in ACTIVE:
        # after a run: why Launch is off now
        note = (
            f"<br><span class='wb-status-blocked'>Launch is off: {html.escape(first)}</span>{note}"
        )
    return f"<span class='wb-status' data-status='{html.escape(s.status)}'>{text}</span>{note}"


def launch_html(s: PanelState) -> str:
    """How Launch starts the run: its processes here, the Slurm job it submits, the Ray workers it
    asks for, or only a plan."""
    cfg, target = s.config, s.target
    if cfg is None:
        return ""
    if s.problem:
        return ""
    if target.local:
        return html.escape(describe_launch(cfg))
    if target.partition:
        return f"Launch submits a Slurm job: {html.escape(target.describe(cfg))}"
    if target.launchable:  # a Ray cluster's (ray_controls.RayTarget)
        return f"Launch starts it on Ray: {html.escape(target.describe(cfg))}"
    return f"planned for {html.escape(target.describe(cfg))}"


def problem_html(problems: list[str]) -> str:
    """Every problem of the plan, a line each: all at once, so fixing one reveals no other."""
    return "".join(
        f"<div class='wb-problem-item' style='color:#b00020;white-space:pre-wrap'>"
        f"⚠ {html.escape(problem)}</div>"
        for problem in problems
    )


def error_html(error: str) -> str:
    if not error:
        return ""
    first, _, rest = error.partition("\n")
    detail = (
        f"<pre style='max-height:16em;overflow:auto;font-size:85%'>{html.escape(rest)}</pre>"
        if rest.strip()
        else ""
    )
    return f"<div style='color:#b00020'><b>{html.escape(first)}</b>{detail}</div>"


def save_yaml(cfg: RunConfig, path: str, *, own_task: bool) -> tuple[Path, str]:
    """Write `cfg` to `path` for `workbench train`; returns the file and what to tell the user."""
    raw = path.strip()
    if not raw:
        raise ValueError("YAML file: the path is empty; type a file name such as run.yaml")
    target = Path(raw).expanduser()
    cfg.to_yaml(target)
    note = ""
    if own_task:
        note = (
            f" (task {cfg.task!r} lives in this notebook: for the shell, register it in an "
            "importable module or set task to 'module:ClassName')"
        )
    return target, f"saved {target}; train it from a shell with: workbench train {raw}{note}"
