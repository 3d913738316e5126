"""A machine profile of round figures, standing in for this machine's measured one (estimator/machine/profile.py) where
a test's subject isn't this machine's speed: the estimate's memory against real runs, say. Measuring this 2-core
box as 4 or 8 ranks takes 10-20 s of both cores; the memory an estimate gives is the same whatever its time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from workbench.estimator.machine.probe import COLLECTIVES, KINDS
from workbench.estimator.machine.profile import MachineProfile


def made_up_profile(**changes: Any) -> MachineProfile:
    """A profile with round figures: two matmul sizes (the larger one faster), elementwise kinds at two sizes."""
    base = {
        "machine": {"cpu": "made up"},
        "ranks": 2,
        "threads": 1,
        "matmul": {"fp32": [[1e6, 1e10], [1e8, 4e10]], "bf16": [[1e6, 2e10], [1e8, 8e10]]},
        "attention": {"fp32": [[1e6, 5e9], [1e8, 1e10]]},
        "op_s": 1e-6,
        "step_op_s": 1e-5,
        "elementwise": {k: [[1e4, 1e-9], [1e7, 1e-10]] for k in KINDS},
        "batch": [1e-4, 1e-6],
        "dtensor_op_s": 2e-5,
        "collectives": {k: sized(1e-4, 1e9) for k in COLLECTIVES},
    }
    return MachineProfile(**{**base, **changes})


def sized(
    latency: float, bandwidth: float, sizes: tuple[float, ...] = (1e2, 1e4, 1e6)
) -> list[list[float]]:
    """A collective measured at `sizes` (bytes per call) as latency plus bytes over bandwidth."""
    return [[x, latency + x / bandwidth] for x in sizes]


@contextmanager
def stand_in_machine() -> Iterator[None]:
    """Estimates made inside price their step time on made_up_profile (for the ranks and threads asked) instead
    of measuring this machine."""
    from workbench.estimator.timing import step as timing

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            timing,
            "machine_profile",
            lambda ranks, threads, refresh=False: made_up_profile(ranks=ranks, threads=threads),
        )
        yield
