"""DDP's gradient all-reduce carrying the step's agreement flags (agreement.py) in its smallest bucket, so that a
run on DDP votes on stopping and divergence without a collective of its own. A separate all-reduce, even an
asynchronous one, costs a wake-up of the communication thread per step and, issued during backward, queues
before the next bucket's; appended to a bucket the flags cost a few bytes on a message that goes anyway, and a
transient copy of that bucket (the smallest: every rank has the same buckets, so every rank picks the same)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class GradientCarrier:
    """The plain all-reduce comm hook (DDP's own numerics: divide by the world size, then sum), with the flags
    handed to `carry` appended to the smallest bucket of the previous step (the first bucket on the first step;
    DDP rebuilds its buckets after it); `carried()` gives their sum over the ranks afterwards."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._outgoing: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._sizes: dict[int, int] = {}
        """This step's bucket sizes so far (index: elements); the last step's when its first bucket comes."""
        self._carrier = 0

    def carry(self, flags: torch.Tensor) -> None:
        """Send `flags` with the gradients of the coming backward."""
        self._outgoing, self._result = flags, None

    def carried(self) -> torch.Tensor | None:
        """The flags summed over the ranks, once the backward that carried them has ended (None if none did)."""
        result, self._result = self._result, None
        return result

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
        # No annotations: DDP checks them, and this module's are strings (from __future__ import annotations).
        index = bucket.index()
        if index == 0 and self._sizes:  # a new step: carry in the smallest bucket of the last one
            self._carrier = min(self._sizes, key=lambda i: (self._sizes[i], i))
            self._sizes = {}
        self._sizes[index] = bucket.buffer().numel()
        flags = self._outgoing
        # The last bucket takes them if the chosen one doesn't come (the buckets were just rebuilt).
        if flags is None or (index != self._carrier and not bucket.is_last()):
            return default_hooks.allreduce_hook(state, bucket)
        self._outgoing = None
        buffer = bucket.buffer()
        n = buffer.numel()
        # DDP's default numerics (divide by the world size first, then sum); one callback for the split.
        joined = torch.cat([buffer, flags.to(buffer.dtype)]).div_(self.world)

        def split(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = fut.value()[0]
            # The votes are sums of small integers: exact again after rounding.
            self._result = (out[n:].float() * self.world).round()
            # Into DDP's own bucket: returning a view of the copy would keep the copy alive until the next step.
            return buffer.copy_(out[:n])

        return dist.all_reduce(joined, group=state, async_op=True).get_future().then(split)
