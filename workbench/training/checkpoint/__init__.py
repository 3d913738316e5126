"""Checkpoints: the full training state under checkpoints/step_<N>/, written atomically and
verified on resume.

checkpointer.py    Checkpointer (save, seal, resume) and TrainerState, the progress it carries
background.py      checkpoint_async: DCP's async_save, sealed by a thread once every rank wrote
failures.py        what a failed write leaves behind and the OSError it says
files.py           a checkpoint's files against its manifest (saving, resuming, load_model(step=N))
rank_state.py      each rank's rank_<r>.pt: its RNG states and the loss scaler's
resume.py          the checks a resume makes before and after loading
"""

from workbench.training.checkpoint.checkpointer import Checkpointer, TrainerState

__all__ = ["Checkpointer", "TrainerState"]
