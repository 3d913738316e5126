"""The rank side: what every launched process runs, and nothing of the caller's side.

rank.py is the entry point whichever launcher started the process; loop.py (Trainer, train) runs the
steps through the components beside it: parallel/ (where the model is made parallel), checkpoint.py
(DCP), logger.py (metrics rows), stop_vote.py (stop, signals), rank_watch.py (preemption flag,
heartbeat, hang watchdog), nonfinite.py (divergence, without host syncs), endings.py, breakdown.py
and verdicts.py (where the step time goes), monitor.py (devices), evaluation.py, batches.py (data
order), optim.py, accelerator.py (process group and device), session_summary.py (summary fields),
weights.py (the model back from a run directory), train_state.py. The signals a run reacts to are
utils/preemption.py's. Nothing is imported here: `python -m workbench.worker` loads the trainer only
when a rank starts training.
"""
