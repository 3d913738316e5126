"""wb.Panel: pick a run's settings in widgets, see what they imply, launch, stop, and watch it
train.

panel.py (Panel: its widgets, its buttons and the one observer that re-derives the view), state.py
(PanelState, all the traits that view is a function of), settings.py (SettingsForm: the controls and
the RunConfig they form, kept in step), running.py (RunControl: launch, watch, stop and wait for the
run, recorded in the state), widgets.py (where the widgets go), controls.py, task_controls.py,
target_controls.py and slurm_controls.py (the widgets for RunConfig fields, the task's options and
where the run goes), estimates.py and estimate_html.py (the estimate box and its HTML), mesh_view.py
(the ranks as a picture), view.py (the batch, launch, problem, status and error lines).
"""

from __future__ import annotations

from workbench.notebook.panel.panel import Panel
from workbench.notebook.panel.state import ACTIVE, PanelState

__all__ = ["ACTIVE", "Panel", "PanelState"]
