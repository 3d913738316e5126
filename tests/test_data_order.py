"""The trainer's data order: sharded across ranks, reshuffled each epoch, resumable at any micro-batch."""

from __future__ import annotations

import os

import pytest
import torch
from collected_ids import brief
from torch.utils.data import TensorDataset

import workbench as wb
from workbench.training.batches import ShardedBatches

DATA = TensorDataset(torch.arange(100))


def ids(batches, n: int) -> list[list[int]]:
    return [next(batches)[0].tolist() for _ in range(n)]


def test_ranks_get_disjoint_shards_of_one_permutation() -> None:
    cfg = wb.RunConfig(micro_batch_size=5, seed=1)
    r0 = ids(ShardedBatches(DATA, cfg, rank=0, world=2, collate_fn=None).iterate(0), 10)
    r1 = ids(ShardedBatches(DATA, cfg, rank=1, world=2, collate_fn=None).iterate(0), 10)
    seen0, seen1 = {i for b in r0 for i in b}, {i for b in r1 for i in b}
    assert not seen0 & seen1 and seen0 | seen1 == set(range(100))


def test_each_epoch_is_a_new_shuffle_and_the_seed_fixes_it() -> None:
    cfg = wb.RunConfig(micro_batch_size=10, seed=7)
    shard = ShardedBatches(DATA, cfg, rank=0, world=1, collate_fn=None)
    assert shard.per_epoch == 10
    two_epochs = ids(shard.iterate(0), 20)
    assert sorted(i for b in two_epochs[:10] for i in b) == list(range(100))
    assert two_epochs[:10] != two_epochs[10:]
    assert ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(0), 20) == two_epochs
    assert (
        ids(ShardedBatches(DATA, cfg.replace(seed=8), 0, 1, None).iterate(0), 10) != two_epochs[:10]
    )


def test_starting_mid_epoch_continues_the_same_order() -> None:
    cfg = wb.RunConfig(micro_batch_size=10, seed=7)
    full = ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(0), 25)
    assert ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(13), 12) == full[13:]


def test_a_training_set_smaller_than_one_micro_batch_per_rank_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"micro_batch_size=64: the training set has 100 samples, 50 per rank over "
        r"2 rank\(s\), fewer than one micro-batch",
    ):
        ShardedBatches(DATA, wb.RunConfig(micro_batch_size=64), rank=0, world=2, collate_fn=None)


# DataLoader settings change how batches are loaded, never which: workers, persistence, prefetch and pinning
# (on CPU loader_options leaves pinning off, as PyTorch would) give the batches of the plain loader, across
# epochs and from a mid-epoch start.
LOADER_SETTINGS = [
    {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4, "pin_memory": True},
    {"num_workers": 2, "persistent_workers": False, "prefetch_factor": 1},
    {"num_workers": 1, "pin_memory": False},
]


@pytest.mark.parametrize("settings", LOADER_SETTINGS, ids=brief)
def test_loader_settings_give_the_same_batches(settings: dict) -> None:
    cfg = wb.RunConfig(micro_batch_size=10, seed=7)
    plain = ids(ShardedBatches(DATA, cfg, 0, 1, None).iterate(0), 25)
    tuned = cfg.replace(**settings)
    assert ids(ShardedBatches(DATA, tuned, 0, 1, None).iterate(0), 25) == plain
    assert ids(ShardedBatches(DATA, tuned, 0, 1, None).iterate(13), 12) == plain[13:]
    halves = [ids(ShardedBatches(DATA, tuned, r, 2, None).iterate(0), 8) for r in (0, 1)]
    assert halves == [ids(ShardedBatches(DATA, cfg, r, 2, None).iterate(0), 8) for r in (0, 1)]


class WorkerPids(torch.utils.data.Dataset):
    """Each sample says which process loaded it."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, os.getpid()


@pytest.mark.parametrize("persistent,expected", [(True, 2), (False, 6)])
def test_persistent_workers_serve_every_epoch(persistent: bool, expected: int) -> None:
    cfg = wb.RunConfig(micro_batch_size=5, seed=1, num_workers=2, persistent_workers=persistent)
    batches = ShardedBatches(WorkerPids(), cfg, 0, 1, None).iterate(0)
    # 3 epochs of 4 micro-batches
    pids = {pid for _ in range(12) for pid in next(batches)[1].tolist()}
    assert len(pids) == expected, "2 workers for the whole run, or 2 new ones each epoch"
