"""Once a step, before the update: do all ranks agree to go on? One tiny all-reduce carries rank 0's stop
request, any rank's preemption signal and whether any rank's loss was NaN or inf; it is started before the
last backward and waited for before the update, so it travels with the gradient all-reduce instead of adding
a round trip. Every rank stops on the same step, and a diverged step is never applied. A non-finite gradient
norm needs no vote: after the all-reduce (or the sharded norm's own) it is the same number on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..rundir import RunDir
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
    def __init__(self, accelerator: Accelerator, run: RunDir, guard: Guard) -> None:
        self.accelerator, self.run, self.guard = accelerator, run, guard
        self.rank = accelerator.process_index
        self.flags = torch.zeros(3, device=accelerator.device)
        self._pending: Any = None

    def start(self, step_loss: torch.Tensor) -> None:
        """Collective (every rank, once per step): this rank's flags go out, asynchronously."""
        flags = self.flags
        flags[0] = float(self.accelerator.is_main_process and self.run.stop_requested())
        flags[1] = float(self.guard.signal)
        flags[2] = (~torch.isfinite(step_loss)).float() * (self.rank + 1)
        if self.accelerator.num_processes > 1:
            self._pending = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)

    def finish(self, grad_norm: torch.Tensor | None) -> Verdict:
        """Wait for everyone's flags; `grad_norm` (None with fp16 scaling, whose overflows aren't divergence)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        stop, signal, bad_loss = self.flags.tolist()
        bad_grad = grad_norm is not None and not bool(torch.isfinite(grad_norm))
        return Verdict(stop=stop > 0, signal=int(signal), bad_loss_rank=int(bad_loss) - 1 if bad_loss else None,
                       bad_grad_norm=bad_grad)
