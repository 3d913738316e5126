"""The rank side: what every launched process runs, and nothing of the caller's side.

rank.py is the entry point whichever launcher started the process; loop.py (Trainer, train) runs the
steps through the components beside it: parallel/ (where the model is made parallel), after_step.py
(logging, evaluation, checkpoints and the stop vote after an update), session_start_end.py (what a
session says as it starts and ends), checkpoint.py (DCP; with checkpoint_async.py,
checkpoint_files.py, checkpoint_failures.py, checkpoint_rank_state.py and checkpoint_resume.py),
logger.py (metrics rows), stop_vote.py (stop, signals), rank_watch.py (preemption flag, heartbeat,
hang watchdog), nonfinite.py (divergence, without host syncs), endings.py, breakdown.py and
verdicts.py (where the step time goes), monitor.py and device_samplers.py (devices), evaluation.py,
batches.py (data order), optim.py, accelerator.py (process group and device), session_summary.py
(summary fields), weights.py (the model back from a run directory), train_state.py. The signals a
run reacts to are utils/preemption.py's. Nothing is imported here: `python -m workbench.worker`
loads the trainer only when a rank starts training.
"""
