"""Do all ranks agree to go on? Rank 0's stop request and any rank's preemption signal must end the run on the
same step everywhere, and a step whose loss or gradients are not finite must be applied nowhere.

Where the gradient norm is computed after the gradients are reduced (no fp16 loss scaling; with clipping off
too, at max_norm inf), it stands in for a per-step vote: it is the same number on every rank, and a rank whose
loss or gradients are not finite poisons the reduced gradients (a pipeline's last stage, whose loss exists only
after its backward, poisons its own), so the norm, summed over the stages, carries the news to everyone. Only
a non-finite norm, which ends the run, takes one more all-reduce, to name the rank whose loss it was. Stop
requests and signals wait for a vote every few steps, about every VOTE_EVERY_S seconds (the
interval is rank 0's, carried in the vote so every rank counts the same steps): a per-step collective, even a
tiny asynchronous one, cost this trainer more than all its other bookkeeping together.

With fp16 scaling, whose infinite gradients are overflows to skip, every step votes, with the non-finite loss
flags in the vote. A vote is one all-reduce, started before the last backward and waited for before the update.
It is a sum: each rank writes only its own slots, so a sum tells every rank's signal and loss apart. A
pipeline's loss exists only on its last stage, and only the last stage's ranks report it (logger.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.config import RunConfig
    from workbench.rundir import RunDir
    from workbench.training.guard import Guard
    from workbench.training.parallel import Strategy

VOTE_EVERY_S = 0.5
"""How long a stop request or a signal may wait for the next vote, roughly (at least one step)."""
MAX_VOTE_INTERVAL = 1000


def votes_every_step(cfg: RunConfig, strategy: Strategy) -> bool:
    """False where the gradient norm tells divergence: taken after the reduction (with clipping off too, at
    max_norm inf), and an inf in it isn't an fp16 overflow."""
    return strategy.scaler is not None


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
    """`every_step`: vote on every step, the loss flags included (see the module docstring for when)."""

    def __init__(self, accelerator: Accelerator, run: RunDir, guard: Guard, *, every_step: bool) -> None:
        self.accelerator, self.run, self.guard, self.every_step = accelerator, run, guard, every_step
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.device = accelerator.device
        # [stop (rank 0), next vote interval (rank 0), signal per rank..., non-finite loss per rank (every_step)...]
        self.flags = torch.zeros(2 + (2 if every_step else 1) * self.world, device=self.device)
        self._pending: Any = None
        self._voting = False
        self._bad_loss: Any = False
        """This rank's loss this step was not finite: a bool on CPU, a device tensor on a GPU (no host sync)."""
        self._until_vote = 0
        self._last_vote: tuple[float, int] | None = None  # rank 0: (time, step count) of the last vote
        self._steps = 0
        self.votes = 0
        """Votes taken (in this session)."""

    def start(self, step_loss: torch.Tensor) -> torch.Tensor | None:
        """Collective (every rank, once per step, before the last backward). Returns what to multiply the last
        micro-batch's loss by (NaN poisons a non-finite step's gradients), or None to leave it."""
        self._steps += 1
        poison = None
        if step_loss.device.type == "cpu":
            self._bad_loss = not math.isfinite(step_loss.item())
            if self._bad_loss and not self.every_step:
                poison = torch.tensor(math.nan)
        else:
            self._bad_loss = ~torch.isfinite(step_loss)
            if not self.every_step:
                poison = torch.where(self._bad_loss, math.nan, 1.0)
        if self.every_step or self._until_vote == 0:
            flags = self._votes()
            self._voting, self.votes = True, self.votes + 1
            if self.world > 1:
                self._pending = dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True)
        return poison

    def _votes(self) -> torch.Tensor:
        votes = [0.0] * len(self.flags)
        if self.accelerator.is_main_process:
            votes[0] = float(self.run.stop_requested())
            votes[1] = float(self._next_interval())
        if self.guard.signal:
            votes[2 + self.rank] = float(self.guard.signal)
        if not self.every_step:
            self.flags = torch.tensor(votes, device=self.device)
            return self.flags
        bad = 2 + self.world + self.rank
        if self.device.type == "cpu":  # a handful of Python floats, one tensor: cheaper than indexing one
            votes[bad] = float(self._bad_loss)
            self.flags = torch.tensor(votes)
        else:  # no host sync on a GPU: the loss check stays on the device
            self.flags.copy_(torch.tensor(votes), non_blocking=True)
            self.flags[bad] = self._bad_loss.float()
        return self.flags

    def _next_interval(self) -> int:
        """Rank 0: steps until the next vote, from the time steps took since the last one."""
        now = time.perf_counter()
        last, self._last_vote = self._last_vote, (now, self._steps)
        if last is None or self._steps == last[1]:
            return 1
        per_step = (now - last[0]) / (self._steps - last[1])
        return max(1, min(MAX_VOTE_INTERVAL, int(VOTE_EVERY_S / max(per_step, 1e-9))))

    def finish(self, grad_norm: torch.Tensor | None) -> Verdict:
        """Wait for everyone's flags; `grad_norm` (None with fp16 scaling, whose overflows aren't divergence)."""
        signal, stop, bad_ranks = 0, False, []
        if self._voting:
            if self._pending is not None:
                self._pending.wait()
            self._pending, self._voting = None, False
            values = self.flags.tolist()
            stop, self._until_vote = values[0] > 0.5, int(values[1]) - 1
            signal = int(max(values[2:2 + self.world], default=0))
            bad_ranks = [r for r, v in enumerate(values[2 + self.world:]) if v > 0.5]
        else:
            self._until_vote = max(0, self._until_vote - 1)
        if self.world == 1:
            bad_ranks = [0] if bool(self._bad_loss) else []
        bad_grad = grad_norm is not None and not math.isfinite(grad_norm.item())
        if bad_grad and not self.every_step and self.world > 1:
            bad_ranks = self._bad_loss_ranks()
        return Verdict(stop=stop, signal=signal, bad_loss_rank=bad_ranks[-1] if bad_ranks else None,
                       bad_grad_norm=bad_grad)

    def _bad_loss_ranks(self) -> list[int]:
        """Collective, only when the (agreed) gradient norm is not finite: whose loss was it?"""
        flags = torch.zeros(self.world, device=self.device)
        flags[self.rank] = float(bool(self._bad_loss))
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        return [r for r, v in enumerate(flags.tolist()) if v > 0.5]
