"""Step time of a traced step on a target, and of a whole layout.

- step.py: step_time(), the step op by op on its target, then scaled by what completed runs
  measured.
- cpu.py: a CPU target, against this machine's measured profile (machine/).
- gpu.py: a catalog GPU, from its datasheet and published efficiency.
- op_kinds.py: how an ATen op is classed for pricing (the machine profile's classes too).
- parallel.py: what tensor and pipeline parallelism add on top of each rank's step.
- learning.py: the correction learnt from completed runs.
"""
