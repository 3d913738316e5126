"""Divergence, watched without host syncs: a non-finite loss or gradient norm, noted on the device
every step and read only at read points.

Reading a value on the host (`.item()`, `float(t)`, `bool(t)`) drains a GPU's queue: the host waits
for the device, then the device for the host. So each step only folds its loss and gradient norm
into two numbers kept on the device, the first step at which each was not finite (a few tiny device
operations, no wait). They are read where the loop waits anyway: a logging step (they ride in the
metrics all-gather, observe/metrics_log.py), and a step that evaluates or checkpoints without
logging (one all-gather of their own), so a checkpoint never holds a diverged state. Every rank
then sees every rank's numbers and ends the run 'diverged' at the same first bad step, naming the
rank whose loss it was. The steps between that step and the read point ran on the spoilt state in
memory; they are neither logged nor saved, and the run reports the steps before the bad one as its
trained steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

COLUMNS = 2
"""Per rank: the first step whose loss was not finite on that rank, the first whose gradient norm
was not (inf: none yet)."""


@dataclass(frozen=True)
class Divergence:
    """The first step that went bad, over all ranks, and why."""

    step: int
    reason: str


class NonFiniteWatch:
    """This rank's first non-finite loss and gradient norm, as steps, on the device."""

    def __init__(self, device: torch.device) -> None:
        self.first = torch.full((COLUMNS,), math.inf, dtype=torch.float64, device=device)
        self._finite = self.first.clone()  # what a finite value notes (inf): no fill per step
        self._no_norm = torch.zeros((), device=device)

    def note(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Step `step` (1-based) ended with this loss and gradient norm (None: no divergence sign,
        as fp16 scaling's overflows are not). Device operations only: nothing waits."""
        norm = self._no_norm if grad_norm is None else grad_norm.detach().float()
        values = torch.stack([loss.detach().float(), norm])
        # x * 0 is NaN exactly where x is NaN or inf: one operation, where isfinite takes four
        bad = (values * 0).isnan()
        self.first = torch.minimum(self.first, torch.where(bad, step, self._finite))

    def vector(self) -> torch.Tensor:
        """What rides in a read point's all-gather (COLUMNS float64 values on the device)."""
        return self.first

    def read(self, accelerator: Accelerator) -> Divergence | None:
        """Collective (every rank): a read point of its own, for a step that evaluates or
        checkpoints without logging. One all-gather, one read."""
        return judge(accelerator.gather(self.first.unsqueeze(0)).cpu())


def judge(gathered: torch.Tensor) -> Divergence | None:
    """From every rank's vector (ranks x COLUMNS, on the CPU): the first step that went bad, or
    None. At that step a non-finite loss is named with its rank (the highest, when several), else
    the gradient norm."""
    step = float(gathered.min())
    if math.isinf(step):
        return None
    ranks = [r for r, first_loss in enumerate(gathered[:, 0].tolist()) if first_loss == step]
    reason = (
        f"the loss was not finite (NaN or inf) on rank {ranks[-1]}"
        if ranks
        else "the gradient norm was not finite (NaN or inf)"
    )
    return Divergence(step=int(step), reason=reason)
