"""This machine, measured: the profile a CPU target's step time is priced against.

- profile.py: MachineProfile and measure(), run in short-lived children beside each other as the
  ranks will run.
- probe.py: what each child measures: matrix multiplies, per-op costs, elementwise kinds, gloo's
  collectives.
- reference.py: a small model's real training step, plain and in each layout family.
- cache.py: a profile measured once per machine and rank layout, in memory and on disk.
"""
