"""What reports on the training steps: where the time goes, what the devices and the memory do, and
where the numbers go (metrics rows, trackers, profiler traces). The Trainer (loop.py) builds them;
nothing here steers a step.

metrics_log.py     MetricsLogger: each logging window's row, agreed over all ranks in one gather
breakdown.py       the step-time breakdown (data, forward/backward, optimizer, communication, idle)
verdicts.py        the breakdown in words: input-bound, communication-bound, a straggler
monitor.py         the device monitor: utilisation, memory, power and idle GPUs, in a thread
device_samplers.py what the monitor samples with (NVML, or the CPU's load)
memory.py          one step under PyTorch's memory tracker, by category; a rank's peak memory
stage_memory.py    the same for a pipeline stage whose backward is split (pp > 1)
model_flops.py     model FLOPs utilisation: the task's FLOPs per sample over the device's peak
dtype_probe.py     the dtype a rank really computes in (proof that autocast is on)
profiling.py       torch.profiler over the steps profile_steps names
trackers.py        RunTrackers: the run's TensorBoard/MLflow, fed through accelerate
"""
