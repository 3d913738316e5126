"""The rank side: what every launched process runs, and nothing of the caller's side.

rank.py is the entry point whichever launcher started the process; loop.py holds the Trainer (its
recipe, the loop, what follows a step, the endings, the session's start and finish) and `train`.
Beside it, what the Trainer builds and calls:

parallel/        where the model is made parallel (one parallelize recipe, the strategies)
checkpoint/      checkpoints (DCP): save, seal, resume, the rank files, TrainerState
observe/         what reports on the steps: metrics rows, step-time breakdown and verdicts, device
                 monitor, memory, FLOPs utilisation, the compute dtype, profiler, trackers
accelerator.py   the process group and the rank's device (resolved once)
autobatch.py     micro_batch_size='auto': the size every rank fits, agreed
batches.py       the data order and this rank's share of it
compiling.py     torch.compile: what compiles, in which order, and what it cost and found
evaluation.py    the eval loop and its reduced means
nonfinite.py     divergence, noticed without host syncs
optim.py         the optimizer and the learning rate
rank_watch.py    preemption flag, heartbeat, hang watchdog
step.py          one optimizer step's micro-batches (shared with the estimator's trace)
stop_vote.py     the ranks' vote on stopping (stop requests, signals)
task_checks.py   one-off checks of what a Task gives the trainer
weights.py       the model back from a run directory; rank values; the weights digest

The signals a run reacts to are utils/preemption.py's. Nothing is imported here: `python -m
workbench.worker` loads the trainer only when a rank starts training.
"""
