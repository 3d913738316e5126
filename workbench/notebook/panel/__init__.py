"""wb.Panel: pick a run's settings in widgets, see what they imply, launch, stop, and watch it
train.

panel.py (Panel: layout, actions, the one view of the state), state.py (PanelState), controls.py
(the widgets for RunConfig fields and their labels).
"""

from __future__ import annotations

from workbench.notebook.panel.panel import Panel
from workbench.notebook.panel.panel_state import ACTIVE, PanelState

__all__ = ["ACTIVE", "Panel", "PanelState"]
