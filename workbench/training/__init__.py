"""Training on one rank: the loop and the components it calls.

loop.py (Trainer, train), parallel.py (where the model is made parallel), checkpoint.py, logger.py
(metrics rows and stop agreement), evaluation.py, batches.py (data order), optim.py (optimizer and LR
schedule), accelerator.py (process group and device), report.py (summary fields), state.py.
"""

from __future__ import annotations

from workbench.training.batches import ShardedBatches
from workbench.training.loop import Trainer, train
from workbench.tasks.schedule import lr_at
from workbench.training.train_state import TrainerState

__all__ = ["ShardedBatches", "Trainer", "TrainerState", "lr_at", "train"]
