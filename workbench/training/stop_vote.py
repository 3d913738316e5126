"""The stop vote: do all ranks go on? Rank 0's stop request and any rank's preemption signal must
end the run on the same step everywhere.

They wait for a vote every few steps, about every VOTE_EVERY_S seconds of training steps (the
interval is rank 0's, carried in the vote so every rank counts the same steps): a per-step
collective, even a tiny asynchronous one, cost this trainer more than all its other bookkeeping
together. A checkpoint is the one long pause the schedule can't see coming, so every checkpoint the
run goes on from is followed by a vote of its own (`after_checkpoint`): a request or a signal that
came while it was written ends the run on it, with no step or checkpoint more, and one that comes
during the steps is voted on within about VOTE_EVERY_S, at worst at the next checkpoint's vote.
Either way at most one checkpoint is written after it, which is what makes a preemption fit
preempt_grace_s whatever checkpoint_every is (config/preflight.py warns when one checkpoint
doesn't). A vote is one all-reduce of host-side numbers over a gloo group of its own, CPU tensors
even on GPU ranks, started before the last backward and waited for before the update: reading its
result never waits for the device. It is a sum: each rank writes only its own slots, so a sum
tells every rank's signal apart. Divergence is not voted on: the device carries it to the next read
point (nonfinite.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from accelerate import Accelerator

    from workbench.rundir import RunDir
    from workbench.training.rank_watch import RankWatch

VOTE_EVERY_S = 0.5
"""How long a stop request or a signal may wait for the next vote, roughly (at least one step; or
the checkpoint being written, which a vote of its own follows)."""
MAX_VOTE_INTERVAL = 1000


@dataclass(frozen=True)
class VoteResult:
    """What the ranks agreed on at a vote (nothing, between votes)."""

    stop: bool = False
    """Rank 0 found a stop request (Run.stop(), the Stop button, a first Ctrl-C)."""
    signal: int = 0
    """A preemption signal some rank received (the largest signal number, when several)."""

    @property
    def ends(self) -> bool:
        return self.stop or bool(self.signal)


def vote_group(world: int, timeout_s: float) -> Any:
    """Collective (every rank, in the same order as any other group): a gloo group over all ranks,
    so a vote's all-reduce runs on the host whatever the training's backend; None for one rank."""
    if world == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


class StopVote:
    """Every rank votes every few steps: rank 0 its stop request, each rank its watch's preemption
    signal."""

    def __init__(
        self, accelerator: Accelerator, run: RunDir, watch: RankWatch, *, timeout_s: float
    ) -> None:
        self.accelerator, self.run, self.watch = accelerator, run, watch
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.group = vote_group(self.world, timeout_s)
        # [stop (rank 0), next vote interval (rank 0), signal per rank...]
        self.flags = torch.zeros(2 + self.world)
        self._pending: Any = None
        self._voting = False
        self._until_vote = 0
        self._last_vote: tuple[float, int] | None = None  # rank 0: (time, steps) at the last vote
        self._steps = 0
        self.votes = 0
        """Votes taken on the step schedule (in this session)."""
        self.checkpoint_votes = 0
        """Votes taken right after a checkpoint (in this session)."""

    def start(self) -> None:
        """Once per step on every rank, before the last backward: starts a vote when one is due
        (collective then)."""
        self._steps += 1
        if self._until_vote > 0:
            return
        self.flags = torch.tensor(self._votes())
        self._voting, self.votes = True, self.votes + 1
        if self.world > 1:
            self._pending = dist.all_reduce(
                self.flags, op=dist.ReduceOp.SUM, group=self.group, async_op=True
            )

    def _votes(self, *, scheduled: bool = True) -> list[float]:
        votes = [0.0] * len(self.flags)
        if self.accelerator.is_main_process:
            votes[0] = float(self.run.stop_requested())
            votes[1] = float(self._next_interval()) if scheduled else 0.0
        if self.watch.signal:
            votes[2 + self.rank] = float(self.watch.signal)
        return votes

    def after_checkpoint(self) -> VoteResult:
        """Collective (every rank, right after a checkpoint the run would go on from): a vote of its
        own, blocking, off the schedule, which it leaves as it was. The schedule's clock restarts
        here, so the checkpoint's time doesn't shorten the next interval."""
        flags = torch.tensor(self._votes(scheduled=False))
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.group)
        self.checkpoint_votes += 1
        if self.accelerator.is_main_process:
            self._last_vote = (time.perf_counter(), self._steps)
        return self._result(flags.tolist())

    @staticmethod
    def _result(values: list[float]) -> VoteResult:
        return VoteResult(stop=values[0] > 0.5, signal=int(max(values[2:], default=0)))

    def _next_interval(self) -> int:
        """Rank 0: steps until the next vote, from the time steps took since the last one."""
        now = time.perf_counter()
        last, self._last_vote = self._last_vote, (now, self._steps)
        if last is None or self._steps == last[1]:
            return 1
        per_step = (now - last[0]) / (self._steps - last[1])
        return max(1, min(MAX_VOTE_INTERVAL, int(VOTE_EVERY_S / max(per_step, 1e-9))))

    def finish(self) -> VoteResult:
        """Wait for everyone's votes, when one was started this step."""
        if not self._voting:
            self._until_vote = max(0, self._until_vote - 1)
            return VoteResult()
        if self._pending is not None:
            self._pending.wait()
        self._pending, self._voting = None, False
        values = self.flags.tolist()
        self._until_vote = int(values[1]) - 1
        return self._result(values)
