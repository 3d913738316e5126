"""Once a step, before the update: do all ranks agree to go on? One tiny all-reduce carries rank 0's stop
request, any rank's preemption signal and whether any rank's loss was NaN or inf; it is started before the
last backward and waited for before the update. On DDP the flags ride in the gradient all-reduce itself
(carrier.py); elsewhere they travel beside it, so neither adds a round trip. The vote is a sum: each rank
writes only its own slots (1 + 2 x world numbers), so a sum tells every rank's signal and loss apart. Every rank stops on the same step, and a diverged step is never applied. A non-finite gradient
norm needs no vote: after the all-reduce (or the sharded norm's own) it is the same number on every rank."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..rundir import RunDir
    from .carrier import GradientCarrier
    from .guard import Guard


@dataclass(frozen=True)
class Verdict:
    stop: bool = False
    """Rank 0 found a stop request (Run.stop(), the Stop button, a first Ctrl-C)."""
    signal: int = 0
    """A preemption signal some rank received (the largest signal number, when several)."""
    bad_loss_rank: int | None = None
    """A rank whose loss was NaN or inf (the highest such rank)."""
    bad_grad_norm: bool = False
    """The gradient norm was NaN or inf (it is the same on every rank)."""

    @property
    def nonfinite(self) -> bool:
        return self.bad_loss_rank is not None or self.bad_grad_norm

    @property
    def reason(self) -> str:
        if self.bad_loss_rank is not None:
            return f"the loss was not finite (NaN or inf) on rank {self.bad_loss_rank}"
        return "the gradient norm was not finite (NaN or inf)" if self.bad_grad_norm else ""

    @property
    def ends(self) -> bool:
        return self.stop or bool(self.signal) or self.nonfinite


class Agreement:
    def __init__(self, accelerator: Accelerator, run: RunDir, guard: Guard, carrier: GradientCarrier | None = None
                 ) -> None:
        self.accelerator, self.run, self.guard, self.carrier = accelerator, run, guard, carrier
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        # [stop (rank 0), signal per rank..., non-finite loss per rank...]
        self.flags = torch.zeros(1 + 2 * self.world, device=accelerator.device)
        self._pending: Any = None
        self._carried = False

    def start(self, step_loss: torch.Tensor) -> None:
        """Collective (every rank, once per step): this rank's flags go out, asynchronously."""
        votes = [0.0] * len(self.flags)
        if self.accelerator.is_main_process and self.run.stop_requested():
            votes[0] = 1.0
        if self.guard.signal:
            votes[1 + self.rank] = float(self.guard.signal)
        bad = 1 + self.world + self.rank
        if step_loss.device.type == "cpu":  # a handful of Python floats, one tensor: cheaper than indexing one
            votes[bad] = float(not math.isfinite(step_loss.item()))
            flags = self.flags = torch.tensor(votes)
        else:  # no host sync on a GPU: the loss check stays on the device
            flags = self.flags
            flags.copy_(torch.tensor(votes), non_blocking=True)
            flags[bad] = (~torch.isfinite(step_loss)).float()
        if self.world == 1:
            return
        if self.carrier is not None:
            self.carrier.carry(flags)
            self._carried = True
        else:
            self._pending = dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True)

    def finish(self, grad_norm: torch.Tensor | None) -> Verdict:
        """Wait for everyone's flags; `grad_norm` (None with fp16 scaling, whose overflows aren't divergence)."""
        votes = self.flags
        if self._carried:
            self._carried = False
            carried = self.carrier.carried() if self.carrier is not None else None
            if carried is None:
                raise RuntimeError("the gradient all-reduce did not carry the agreement flags (no backward through "
                                   "DDP this step?)")
            votes = carried
        elif self._pending is not None:
            self._pending.wait()
            self._pending = None
        values = votes.tolist()
        signals, bad = values[1:1 + self.world], values[1 + self.world:]
        bad_ranks = [r for r, v in enumerate(bad) if v > 0.5]
        bad_grad = grad_norm is not None and not math.isfinite(grad_norm.item())
        return Verdict(stop=values[0] > 0.5, signal=int(max(signals, default=0)),
                       bad_loss_rank=bad_ranks[-1] if bad_ranks else None, bad_grad_norm=bad_grad)
