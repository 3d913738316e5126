"""This rank's micro-batches in a fixed order that can start at any micro-batch (exact resume)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

if TYPE_CHECKING:
    from workbench.config import RunConfig


def loader_options(cfg: RunConfig, device_type: str) -> dict[str, Any]:
    """DataLoader keyword arguments from RunConfig's loader settings ('auto' resolved for this
    device)."""
    workers = cfg.num_workers > 0
    options: dict[str, Any] = {
        "num_workers": cfg.num_workers,
        # Only a GPU gains from page-locked batches; on CPU PyTorch would warn and ignore it at
        # every epoch.
        "pin_memory": device_type == "cuda" and cfg.pin_memory in (True, "auto"),
        "persistent_workers": workers and cfg.persistent_workers in (True, "auto"),
    }
    if workers and cfg.prefetch_factor is not None:
        options["prefetch_factor"] = cfg.prefetch_factor
    return options


class _EpochIndices(Sampler[int]):
    """The indices of the current pass; a persistent DataLoader reads them anew each time it is
    iterated."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ShardedBatches:
    """This rank's micro-batches in a fixed order (DistributedSampler: seed, new shuffle each
    epoch), startable at any micro-batch so a resumed run sees exactly the data an uninterrupted one
    would."""

    def __init__(
        self,
        dataset: Any,
        cfg: RunConfig,
        rank: int,
        world: int,
        collate_fn: Any,
        device_type: str = "cpu",
    ) -> None:
        self.dataset, self.cfg, self.collate_fn = dataset, cfg, collate_fn
        self.options = loader_options(cfg, device_type)
        self.sampler = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        self.per_epoch = len(self.sampler) // cfg.micro_batch_size
        if self.per_epoch == 0:
            raise ValueError(
                f"micro_batch_size={cfg.micro_batch_size}: the training set has {len(dataset)} "
                f"samples, {len(self.sampler)} per rank over {world} rank(s), fewer than one "
                "micro-batch; lower micro_batch_size or num_processes"
            )

    def epoch_of(self, micro_batch: int) -> int:
        return micro_batch // self.per_epoch

    def iterate(self, start: int) -> Iterator[Any]:
        epoch, offset = divmod(start, self.per_epoch)
        mbs = self.cfg.micro_batch_size
        persistent = self.options["persistent_workers"]
        # With persistent workers one DataLoader (one set of workers) serves every epoch of this
        # iterator: its sampler is given each epoch's indices. Its workers are seeded once, from the
        # first epoch's generator, so a dataset that draws random numbers in __getitem__ may draw
        # others after a resume; the batches (which samples, in which order) are the same either
        # way. Otherwise a fresh DataLoader per epoch.
        indices = _EpochIndices()
        loader = self._loader(indices, epoch) if persistent else None
        while True:
            self.sampler.set_epoch(epoch)
            indices.indices = list(self.sampler)[offset * mbs : self.per_epoch * mbs]
            yield from loader if loader is not None else self._loader(indices, epoch)
            epoch, offset = epoch + 1, 0

    def _loader(self, indices: _EpochIndices, epoch: int) -> DataLoader:
        # A DataLoader draws its workers' base seed from the global RNG unless given a generator;
        # that draw would shift dropout after a resume, which starts a fresh iterator mid-epoch.
        return DataLoader(
            self.dataset,
            batch_size=self.cfg.micro_batch_size,
            sampler=indices,
            drop_last=True,
            collate_fn=self.collate_fn,
            generator=torch.Generator().manual_seed(self.cfg.seed + epoch),
            **self.options,
        )
