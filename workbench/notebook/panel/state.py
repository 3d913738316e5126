"""The panel's state: what it shows is a function of these traits alone. The run's handle, how it
ended and what the run directory said of it are read into them by the code that handles the run;
the estimate box's own traits hang here too, so the whole panel is one state object."""

from __future__ import annotations

import threading

import traitlets

from workbench.config import RunConfig
from workbench.estimator.target import Target
from workbench.launcher.result import RunResult
from workbench.notebook.dashboard import Dashboard
from workbench.notebook.panel.estimate_html import EstimateState
from workbench.rundir import Status
from workbench.rundir.run_files import RunFiles

ACTIVE = ("launching", "resuming", Status.RUNNING.value, "stopping")
"""Statuses during which the settings are frozen and Launch is off."""

RESUMABLE = (
    Status.COMPLETED.value,
    Status.STOPPED.value,
    Status.PREEMPTED.value,
    Status.FAILED.value,
    Status.DIVERGED.value,
)
"""Endings after which Resume continues the run from its newest checkpoint (when it has one)."""


class PanelState(traitlets.HasTraits):
    """What the panel shows is a function of these traits alone."""

    # ---- the settings ----------------------------------------------------------------------------
    config = traitlets.Instance(RunConfig, allow_none=True)
    """The RunConfig the controls form, or None when they don't form one (see `problem`)."""
    problem = traitlets.Unicode("")
    """Why the controls can't launch: RunConfig's own ValueError message, or every refusal of the
    plan's checks, a line each (`problems`); '' when they can."""
    problems = traitlets.List(traitlets.Unicode())
    """`problem` as its separate refusals, each actionable on its own: all of them at once."""
    target = traitlets.Instance(Target, args=())
    """The hardware the settings are planned for, as the target controls stood at the last
    change."""
    notes = traitlets.Dict()
    """What the last change moved in other controls, keyed by the moved control's field
    ('num_processes', 'gpus_per_node'): shown beside that control, cleared by the next change, so
    no value changes without a word."""
    processes_here = traitlets.Int(None, allow_none=True)
    """The processes box's value on this machine while the target is elsewhere (restored on
    return); None while the target is this machine."""

    # ---- the buttons and their run ---------------------------------------------------------------
    status = traitlets.Unicode("ready")
    """ready | launching | stopping, or the run's own Status (running, completed, stopped,
    failed)."""
    error = traitlets.Unicode("")
    """The last failure: a rank's RunFailedError text, or an exception raised by a button's
    action."""
    message = traitlets.Unicode("")
    """A note for the user, e.g. where the YAML went."""
    job = traitlets.Unicode("")
    """A submitted run's Slurm job as Slurm tells it: 'Slurm job 42 PENDING (Resources)', or a run
    on Ray's driver as Ray tells it: 'Ray driver workbench-r-ab12 alive, 2 rank(s) on 2 node(s)';
    '' for a local run."""
    busy = traitlets.Bool(False)
    """A button's action is running: every button is off until it returns."""
    run = traitlets.Instance(RunFiles, allow_none=True)
    """The last run launched (or resumed) from the panel: its Run, or SlurmRun / RayRun for a
    submitted one; None before the first."""
    run_name = traitlets.Unicode("")
    """That run's directory name ('' before the first run)."""
    dashboard = traitlets.Instance(Dashboard, allow_none=True)
    """That run's live dashboard."""
    result = traitlets.Instance(RunResult, allow_none=True)
    """How the run ended, once it has and didn't fail."""
    failure = traitlets.Instance(BaseException, allow_none=True)
    """What the run's wait raised (RunFailedError, or anything else), once it has ended so."""
    finished = traitlets.Instance(threading.Event, args=())
    """Set once the run has ended and `result` or `failure` say how (a new Event per run)."""
    checkpoint = traitlets.Bool(False)
    """The ended run saved a checkpoint (read from its run directory when it ended)."""
    final_shown = traitlets.Bool(False)
    """wait() has displayed the run's final figure."""

    # ---- the estimate box ------------------------------------------------------------------------
    estimate = traitlets.Instance(EstimateState, args=())
    """The estimate box's state (estimate_html.py): its own observer draws the box from it."""

    @property
    def resumable(self) -> bool:
        """Resume can continue the last run: it ended so, and saved a checkpoint."""
        return self.run is not None and self.status in RESUMABLE and self.checkpoint
