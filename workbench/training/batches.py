"""This rank's micro-batches in a fixed order that can start at any micro-batch (exact resume)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

if TYPE_CHECKING:
    from ..config import RunConfig


class ShardedBatches:
    """This rank's micro-batches in a fixed order (DistributedSampler: seed, new shuffle each epoch),
    startable at any micro-batch so a resumed run sees exactly the data an uninterrupted one would."""

    def __init__(self, dataset: Any, cfg: RunConfig, rank: int, world: int, collate_fn: Any) -> None:
        self.dataset, self.cfg, self.collate_fn = dataset, cfg, collate_fn
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                          seed=cfg.seed, drop_last=True)
        self.per_epoch = len(self.sampler) // cfg.micro_batch_size
        if self.per_epoch == 0:
            raise ValueError(f"micro_batch_size={cfg.micro_batch_size}: the training set has {len(dataset)} "
                             f"samples, {len(self.sampler)} per rank over {world} rank(s), fewer than one "
                             "micro-batch; lower micro_batch_size or num_processes")

    def epoch_of(self, micro_batch: int) -> int:
        return micro_batch // self.per_epoch

    def iterate(self, start: int) -> Iterator[Any]:
        epoch, offset = divmod(start, self.per_epoch)
        mbs = self.cfg.micro_batch_size
        while True:
            self.sampler.set_epoch(epoch)
            indices = list(self.sampler)[offset * mbs:self.per_epoch * mbs]
            # A DataLoader draws its workers' base seed from the global RNG unless given a generator; that
            # draw would shift dropout after a resume, which starts a fresh iterator mid-epoch.
            yield from DataLoader(self.dataset, batch_size=mbs, sampler=indices, drop_last=True,
                                  collate_fn=self.collate_fn, num_workers=self.cfg.num_workers,
                                  generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
            epoch, offset = epoch + 1, 0
