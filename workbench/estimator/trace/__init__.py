"""One training step traced under fake tensors on a fake world of the target's size: what a rank
would hold, compute and send, without a GPU and without the other ranks.

- step.py: StepTrace and trace_step, the trainer's own step run in a forked child, counted, then
  under PyTorch's memory tracker.
- pipeline.py: one pipeline stage's step, run in the order its schedule runs it.
- parts.py: what the two tracers share (fake model, fake batches, counters, StepTrace fields).
- fake_world.py: the fake process group, fake tensors, fake rank and the op and collective counter.
- held.py: the parameters, gradients and optimizer state every rank holds, from one rank's trace.
- ring.py: ring attention on the CPU kernels, for tracing context parallel.
- flops.py: FLOP formulas FlopCounterMode lacks (the CPU attention kernels).
- cache.py: traces already made, reused in memory; the child's imports paid once.
"""
