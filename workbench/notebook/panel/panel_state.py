"""The panel's state: what it shows is a function of these traits alone."""

from __future__ import annotations

import traitlets

from workbench.config import RunConfig
from workbench.rundir import Status

ACTIVE = ("launching", "resuming", Status.RUNNING.value, "stopping")
"""Statuses during which the settings are frozen and Launch is off."""


class PanelState(traitlets.HasTraits):
    """What the panel shows is a function of these traits alone."""

    config = traitlets.Instance(RunConfig, allow_none=True)
    """The RunConfig the controls form, or None when they don't form one (see `problem`)."""
    problem = traitlets.Unicode("")
    """Why the controls can't launch: RunConfig's own ValueError message; '' when they can."""
    status = traitlets.Unicode("ready")
    """ready | launching | stopping, or the run's own Status (running, completed, stopped,
    failed)."""
    error = traitlets.Unicode("")
    """The last failure: a rank's RunFailedError text, or an exception raised by a button's
    action."""
    message = traitlets.Unicode("")
    """A note for the user, e.g. where the YAML went."""
    job = traitlets.Unicode("")
    """A submitted run's Slurm job as Slurm tells it: 'Slurm job 42 PENDING (Resources)'; '' for a
    local run."""
    busy = traitlets.Bool(False)
    """A button's action is running: every button is off until it returns."""
