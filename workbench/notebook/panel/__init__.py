"""wb.Panel: pick a run's settings in widgets, see what they imply, launch, stop, and watch it
train.

panel.py (Panel: its widgets and the one observer that re-derives the view), panel_state.py
(PanelState, the traits that view is a function of), panel_config.py (the controls and the RunConfig
they form, kept in step), panel_widgets.py (where the widgets go), controls.py, task_controls.py,
target_controls.py and slurm_controls.py (the widgets for RunConfig fields, the task's options and
where the run goes), estimates.py and estimate_html.py (the estimate box and its HTML), mesh_view.py
(the ranks as a picture), view.py (status and error lines), running.py (the buttons and what they
start).
"""

from __future__ import annotations

from workbench.notebook.panel.panel import Panel
from workbench.notebook.panel.panel_state import ACTIVE, PanelState

__all__ = ["ACTIVE", "Panel", "PanelState"]
